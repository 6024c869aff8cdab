"""One page of the committed results: experiments/results/REPORT.md.

    python -m experiments summary [--results experiments/results] [--out FILE]
    make summary [RESULTS=experiments/results]      # runs/REPORT.md, or the committed one

Reads committed JSON only (report.json, kernel benchmark results, profiles, reproductions); a
missing source is said, never skipped; rewritten only when its content changes (docs/experiments.md)."""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import sys
from collections import Counter
from pathlib import Path

from experiments import parser
from experiments.ablation import dataset_from, read
from experiments.bench.report import read_json
from experiments.runs import fmt
from pipeline.errors import command
from pipeline.runenv import REPO_ROOT

ABLATIONS = REPO_ROOT / "experiments" / "ablations"
KERNELS = "kernels/*/bench-*.json*"  # experiments.bench's result files; each GPU's report.md beside them
EXPECTED = ["seq_len", "sparsity", "batch_size", "compile", "auc_parity", "history_value", "model", "world"]
BEYOND = ["s2", "alure", "world_order", "world_order_converge", "order_peak"]  # listed once they have run
PAPER_CLAIMS = [  # (level, claim, how ours is measured, where)
    ("kernel", "up to 9x faster and 22x less memory than dense attention",
     "jagged flash attention vs materialised dense attention (`dense_torch`), headline shape", "kernels"),
    ("kernel", "3x faster and 53% less memory than dense flash attention",
     "jagged flash attention vs padded SDPA (`sdpa_padded_mask`), headline shape", "kernels"),
    ("model", "+10% QPS and -18% memory in production",
     "training examples/s and peak GPU memory of the jagged ranker vs the padded-SDPA ranker in `fit`", "batch_size"),
]
STRONGEST_PEER_MIN_SPEEDUP = 2.5  # the issue's jagged-vs-sdpa target, here against sdpa's fastest step


def kernel_targets(results: Path) -> list[list[str]]:
    """Target rows (target, status, measured, report) judged by experiments.bench's own function on
    each GPU's result files: for each target the last GPU's (by name) that measured it (PASS or MISS);
    where none did, the last one's row."""
    from experiments.bench.report import load_docs, merge_rows
    from experiments.bench.targets import evaluate

    rows: dict[str, list[str]] = {}
    for folder in sorted({p.parent for p in results.glob(KERNELS)}):
        docs = load_docs(str(folder))
        for slug in sorted({d["stamp"]["gpu_slug"] for d in docs}):
            mine = [d for d in docs if d["stamp"]["gpu_slug"] == slug]
            ceilings = next((d["ceilings"] for d in reversed(mine) if d.get("ceilings")), None)
            link = str((folder / "report.md").relative_to(results))
            for t in evaluate(merge_rows(mine), ceilings):
                row = [t["target"], t["status"], t["detail"], link]
                if t["target"] not in rows or row[1] in ("PASS", "MISS") or rows[row[0]][1] not in ("PASS", "MISS"):
                    rows[row[0]] = row
    return list(rows.values())


def reports(results: Path) -> dict[str, dict]:
    """Each ablation's newest report.json (``ablations/<name>/<device>/``), its folder as ``path``."""
    found: dict[str, dict] = {}
    for path in sorted(results.glob("ablations/*/*/report.json")):
        name, doc = path.parent.parent.name, {**read_json(path), "path": str(path.parent.relative_to(results))}
        if name not in found or doc.get("written", "") >= found[name].get("written", ""):
            found[name] = doc
    return found


def budget_state(name: str, doc: dict) -> str:
    """'current', or 'stale: ...' when the report's budget differs from the file's `set` now, or its data's
    generator settings (report.json `data`, the runs' meta.json config) from the file's dataset resolved now."""
    if doc.get("budget") is None:
        return "unknown (no budget)"
    ran, spec = doc["budget"], read(ABLATIONS / f"{name}.yaml")
    now, ds = spec.get("set") or {}, spec.get("dataset") or {}
    differ = [f"{k}: ran {ran.get(k)!r}, file {v!r}" for k, v in now.items() if json.dumps(ran.get(k)) != json.dumps(v)]
    words = shlex.split(doc.get("command") or "")
    given = {w.split("=", 1)[0] for before, w in zip(["", *words], words) if before == "--set"}  # the command's own
    given |= {w[len("--set="):].split("=", 1)[0] for w in words if w.startswith("--set=")}
    differ += [f"{k}: ran {v!r}, file: not set" for k, v in ran.items() if k not in now and k not in given]
    if "preset" in ds and doc.get("data"):
        if keys := list(dataset_from(ds, REPO_ROOT / "data", f"{name}: dataset").changed(doc["data"])):
            differ.append(f"data: {len(keys)} generator settings ({', '.join(keys[:4])}{', ...' * (len(keys) > 4)})")
    return "current" if not differ else "stale: " + "; ".join(differ)


def current_targets(name: str, doc: dict) -> list[list[str]] | None:
    """The ablation file's targets as they stand now, judged on the report's rows by the report's
    own function (a target changed since the report was written is judged as the file states it);
    None where the rows lack what they need (the report's own targets are quoted then)."""
    import polars as pl

    from experiments.runs import memory_metric
    from experiments.sections import target_rows

    spec = read(ABLATIONS / f"{name}.yaml")
    rep = spec.get("report") or {}
    if not rep.get("targets"):
        return []
    labels = {str(k).split(".")[-1] for k in spec.get("grid") or {}} | {"status"}  # grid labels are text
    try:
        df = pl.DataFrame(doc.get("rows") or [], infer_schema_length=None)
        df = df.with_columns(pl.col(c).cast(pl.Utf8) for c in df.columns if c in labels)
        return target_rows(df, rep, memory_metric(df)[0])
    except (pl.exceptions.PolarsError, KeyError):  # rows of an older report
        return None


def ablation_status(results: Path, found: dict[str, dict] | None = None) -> list[dict]:
    found, out = reports(results) if found is None else found, []
    for name in EXPECTED + BEYOND:
        doc = found.get(name)
        if doc is None:
            if name not in BEYOND:
                out.append({"name": name, "ran": False})
            continue
        statuses = Counter(str(r["status"]).split(":")[0] for r in doc.get("rows") or [])  # "FAILED: why": FAILED
        written, now = doc.get("targets") or [], current_targets(name, doc)
        out.append({"name": name, "ran": True, "link": f"{doc['path']}/report.md",
                    "device": ", ".join(doc.get("device") or []) or "?",
                    "commit": ", ".join(f"`{c}`" for c in doc.get("commit") or []) or "?",
                    "points": ", ".join(f"{n} {s}" for s, n in statuses.items()) or "none",
                    "budget": budget_state(name, doc), "targets": written if now is None else now,
                    "rejudged": now is not None and now != written})
    return out


def profile_rows(results: Path) -> list[dict]:
    """Per profile and attention layout: device, batch, commit, step, GPU-busy and attention ms. A
    profile is a file of the one-step profiler (``training/<device>/profile*.json``) or a folder of
    loop traces, one per layout (``training/<device>/profile*/<attention>/loop_summary.json``)."""
    rows = []
    for path in sorted(results.glob("training/*/profile*.json")):
        data = read_json(path)
        rows += [{"file": str(path.relative_to(results)), "device": data.get("device", "?"),
                  "commit": str(data.get("commit", "?"))[:7],
                  **{k: r.get(k) for k in ("attention", "batch_size", "graph_step_ms", "attn_ms")},
                  "busy_ms": r.get("gpu_ms") or r.get("prof_step_ms")} for r in data.get("results", [])]
    for path in sorted(results.glob("training/*/profile*/*/loop_summary.json")):
        t = read_json(path)
        rows.append({"file": str(path.parent.parent.relative_to(results)), "device": t.get("device_name", "?"),
                     "commit": str(t.get("commit", "?"))[:7], "attention": t.get("attention") or path.parent.name,
                     "batch_size": t.get("batch_size"), "graph_step_ms": None, "attn_ms": t.get("attention_ms_per_step"),
                     "busy_ms": t.get("device_busy_ms_per_step") or t.get("wall_ms_per_step")})
    return rows


def reproduce_rows(results: Path) -> list[dict]:
    """The `reproduce` results (``training/<device>/reproduce*.json``, written by its --out): device
    and verdict, linked to the document beside it where there is one."""
    rows = []
    for path in sorted(results.glob("training/*/reproduce*.json")):
        doc, md = read_json(path), path.with_suffix(".md")
        rows.append({"file": str((md if md.is_file() else path).relative_to(results)),
                     "device": doc.get("device", "?"), "result": doc.get("result", "no result")})
    return rows


def _ok(doc: dict | None) -> list[dict]:
    return [r for r in (doc or {}).get("rows") or [] if r["status"] == "OK"]


def model_level(found: dict[str, dict]) -> list[str]:
    """Jagged vs sdpa ranker ratios from the batch_size ablation, AUC from auc_parity."""
    lines = []
    if "batch_size" in found:
        ok = _ok(found["batch_size"])
        lines += ["| batch | jagged ex/s | sdpa ex/s | speed ratio | jagged peak MB | sdpa peak MB | memory ratio |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for b in sorted({int(r["batch_size"]) for r in ok}):
            get = {r["attention"]: r for r in ok if int(r["batch_size"]) == b}
            if "jagged" not in get:
                continue
            j, s = get["jagged"], get.get("sdpa")
            jx, jm = j["perf/train_examples_per_s"], j["mem/train_peak_allocated_mb"]
            sx, sm = (s["perf/train_examples_per_s"], s["mem/train_peak_allocated_mb"]) if s else (None, None)
            lines.append(f"| {b} | {jx:,.0f} | {fmt(sx, ',.0f')} | {fmt(sx and jx / sx)}x | {jm:,.0f} | "
                         f"{fmt(sm, ',.0f')} | {fmt(sm and jm / sm)}x |" + ("" if s else " sdpa: no finished run"))
    if "auc_parity" in found:
        doc = found["auc_parity"]
        lines += ["", "| attention | seeds | mean test AUC | std | min | max |", "|---|---:|---:|---:|---:|---:|"]
        for attention in dict.fromkeys(r["attention"] for r in _ok(doc)):
            a = [r["test/auc"] for r in _ok(doc) if r["attention"] == attention and r["test/auc"] is not None]
            std = statistics.stdev(a) if len(a) > 1 else None
            lines.append(f"| {attention} | {len(a)} | {statistics.mean(a):.4f} | {fmt(std, '.4f')} | {min(a):.4f} | "
                         f"{max(a):.4f} |")
        if doc.get("converged"):
            lines += ["", f"Convergence ([auc_parity/report.md]({doc['path']}/report.md), validation AUC at every check): "
                      f"{doc['converged'][0]} of {doc['converged'][1]} runs converged."]
    return lines


def history_lines(found: dict[str, dict]) -> list[str]:
    """Do longer histories pay? history_value's test AUC per max_seq_len beside the oracle's AUC
    from the last k items (the report's oracle), each with its gain over the shorter one."""
    from experiments.sections import oracle_at

    doc = found.get("history_value") or {}
    if not doc.get("oracle"):
        return ["No history_value results with the oracle's curve yet (`make experiment-history_value` on the GPU)."]
    rows = [r for r in doc["rows"] if str(r["max_seq_len"]).isdigit()]
    aucs = {k: [r["test/auc"] for r in rows if r["max_seq_len"] == k and r.get("test/auc") is not None]
            for k in dict.fromkeys(r["max_seq_len"] for r in rows)}  # max_seq_len -> each finished seed's test AUC
    num = [(int(k), statistics.fmean(a) if a else None, oracle_at(doc["oracle"], k)) for k, a in aucs.items()]
    lines = [f"From [history_value]({doc['path']}/report.md): the jagged ranker trained at each max_seq_len (the "
             "mean over its seeds), beside the planted model's own AUC from the last k items (meta.json).", "",
             "| max_seq_len | model test AUC | gain over the shorter | oracle AUC, last k items | oracle gain |",
             "|---:|---:|---:|---:|---:|"]
    for i, (k, m, o) in enumerate(num):
        pm, po = (num[i - 1][1], num[i - 1][2]) if i else (None, None)
        lines.append(f"| {k} | {fmt(m, '.4f')} | {fmt(_diff(m, pm), '+.4f')} | {fmt(o, '.4f')} | "
                     f"{fmt(_diff(o, po), '+.4f')} |")
    ran = [r for r in num if r[1] is not None]
    if ran:
        best_k, best, best_oracle = max(ran, key=lambda r: r[1])
        longer = [r for r in ran if r[0] > best_k]
        said = (f"The model's test AUC is highest at max_seq_len {best_k} ({best:.4f}), "
                f"{best - ran[0][1]:+.4f} over {ran[0][0]}")
        if longer:
            k, m, o = longer[-1]
            said += (f"; at {k} it is {m - best:+.4f} against that: on this data and budget, history beyond "
                     f"{best_k} items did not raise the model's AUC (the oracle's own gain there: "
                     f"{fmt(_diff(o, best_oracle), '+.4f')})")
        lines += ["", said + "."]
    return lines


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def model_ablation_lines(found: dict[str, dict]) -> list[str]:
    """Which parts of the ranker pay: the mean test AUC over seeds per variant against the baseline's,
    from order_peak or world_order (the paper preset's world, at the peak or one pass) where run, else model."""
    name = next((n for n in ("order_peak", "world_order") if n in found), "model")
    if (doc := found.get(name)) is None:
        return ["No model ablation yet (`make experiment-world_order` on the GPU)."]
    runs: dict[str, list[tuple]] = {}  # variant -> (seed, test AUC) per run
    for r in _ok(doc):
        runs.setdefault(r["variant"], []).append((r.get("seed_everything"), r["test/auc"]))
    mean = {v: sum(a for _, a in rs) / len(rs) for v, rs in runs.items()}
    base = {seed: a for seed, a in runs.get("baseline", []) if seed is not None}
    lines = [f"From [{name}]({doc['path']}/report.md): each variant of the grid (its settings in the report) "
             "at max_seq_len 256, the mean test AUC over its runs (seeds; their spread in the report), and "
             "the mean of its difference to the baseline over the seeds both ran.",
             "", "| variant | runs | mean test AUC | against the baseline |", "|---|---:|---:|---:|"]
    for v, m in mean.items():
        paired = [a - base[seed] for seed, a in runs[v] if seed in base]
        diff = sum(paired) / len(paired) if paired else _diff(m, mean.get("baseline"))
        lines.append(f"| {v} | {len(runs[v])} | {m:.4f} | {'baseline' if v == 'baseline' else fmt(diff, '+.4f')} |")
    return lines


def strongest_peers(found: dict[str, dict]) -> tuple[list[str], list[list[str]]]:
    """From the compile ablation: each layout at its fastest way of stepping (eager, torch.compile,
    CUDA graphs), and jagged's best against each peer's best: (markdown lines, target rows)."""
    x = "perf/train_examples_per_s"
    best: dict[str, dict] = {}
    for r in _ok(found.get("compile")):
        if r["attention"] not in best or r[x] > best[r["attention"]][x]:
            best[r["attention"]] = r
    if "jagged" not in best:
        return [], []
    j, link = best["jagged"], f"{found['compile']['path']}/report.md"
    lines = ["", f"Each layout at its fastest step from [compile]({link}) (eager, `torch.compile` or CUDA "
             "graphs). A faster peer configuration is the one to beat. CUDA graphs remove host time, so they pay "
             "where the step waits on the host; `torch.compile` also fuses elementwise GPU work:", "",
             "| attention | fastest step | ex/s | peak MB | jagged's best / this |", "|---|---|---:|---:|---:|"]
    targets = []
    for name, r in best.items():
        ratio = j[x] / r[x]
        lines.append(f"| {name} | {r['step']} | {r[x]:,.0f} | {r['mem/train_peak_allocated_mb']:,.0f} | {ratio:.2f}x |")
        if name != "jagged":
            targets.append([f"jagged ({j['step']}) vs {name} at its fastest step ({r['step']}): "
                            f">= {STRONGEST_PEER_MIN_SPEEDUP}x", "PASS" if ratio >= STRONGEST_PEER_MIN_SPEEDUP else "MISS",
                            f"train ex/s ratio {ratio:.2f}x ({j[x]:,.0f} vs {r[x]:,.0f})", link])
    return lines, targets


def amdahl_lines(prof: list[dict]) -> list[str]:
    """Per profile: attention's share of the GPU time of a step per attention layout, and what that bounds.
    GPU-busy time is the denominator: `fit` replays the step as CUDA graphs, so the GPU's work,
    not the host's, sets the step time (the profile's graph step agrees with it)."""
    lines = []
    by_file: dict[str, dict[str, dict]] = {}
    for r in prof:
        by_file.setdefault(r["file"], {})[r["attention"]] = r
    for file, rows in by_file.items():
        j, s = rows.get("jagged"), rows.get("sdpa")
        if not (j and s and j["attn_ms"] and s["attn_ms"]):
            continue
        rest_j, rest_s = j["busy_ms"] - j["attn_ms"], s["busy_ms"] - s["attn_ms"]
        lines.append(
            f"- `{file}` ({j['device']}, batch {j['batch_size']}): attention is {s['attn_ms'] / s['busy_ms']:.0%} of "
            f"the sdpa ranker's GPU time per step ({s['attn_ms']:.1f} of {s['busy_ms']:.1f} ms) and "
            f"{j['attn_ms'] / j['busy_ms']:.0%} of the jagged one's ({j['attn_ms']:.1f} of {j['busy_ms']:.1f} ms). "
            f"Attention alone got {s['attn_ms'] / j['attn_ms']:.1f}x faster, the rest of the step "
            f"{rest_s / rest_j:.1f}x (padded rows no longer embedded, projected, normalised and fed through the "
            f"FFN), the whole step {s['busy_ms'] / j['busy_ms']:.1f}x. Of the {s['busy_ms'] - j['busy_ms']:.1f} ms "
            f"saved per step, {s['attn_ms'] - j['attn_ms']:.1f} ms are in attention and {rest_s - rest_j:.1f} ms "
            f"outside it. With attention free the jagged step could be at most "
            f"{j['busy_ms'] / rest_j:.2f}x faster than it is: what is left is embeddings, projections, FFN, "
            f"the item table's optimizer step.")
    return lines


def build(results: Path) -> str:
    found = reports(results)
    kt, abl, prof = kernel_targets(results), ablation_status(results, found), profile_rows(results)
    link = {name: f"{found[name]['path'] if name in found else f'ablations/{name}'}/report.md"
            for name in ("batch_size", "auc_parity")}
    out = ["# Jagged Flash Attention: the results in one page", "",
           "_Written by `python -m experiments summary` from the committed files under experiments/results/ (each "
           "source below names its device, versions and commit)._",
           "", "## The paper's claims next to ours", "",
           "| level | paper | ours: what is measured | ours: result | source |", "|---|---|---|---|---|"]
    for level, claim, how, where in PAPER_CLAIMS:
        if where == "kernels":
            key = "dense_torch" if "dense attention" in claim else "sdpa_padded_mask"
            hits = [r for r in kt if r[0].startswith("headline") and key in r[0]]
            res = "; ".join(f"{'fwd+bwd' if 'fwd_bwd' in r[0] else 'fwd'} {r[1]}: {r[2]}" for r in hits) or "not measured"
            files = sorted({r[3] for r in hits})
            out.append(f"| {level} | {claim} | {how} | {res} | {', '.join(f'[{f}]({f})' for f in files) or 'none'} |")
        else:
            out.append(f"| {level} | {claim} | {how} | see the model-level table below (training, not "
                       f"serving: QPS in production is not measured here) | [batch_size]({link['batch_size']}) |")
    out += ["", "## Model level: the jagged ranker against the padded-SDPA ranker in `fit`", "",
            f"From [batch_size]({link['batch_size']}) (throughput, memory; steady steps) and "
            f"[auc_parity]({link['auc_parity']}) (accuracy over seeds). Ratios: jagged / sdpa.", "",
            *(model_level(found) or ["No batch_size or auc_parity results yet."])]
    peer_lines, peer_targets = strongest_peers(found)
    out += peer_lines
    out += ["", "## Do longer histories pay?", "", *history_lines(found)]
    out += ["", "## Which parts of the ranker pay?", "", *model_ablation_lines(found)]
    out += ["", "## Every target, PASS or MISS", "", "| source | target | measured | result |", "|---|---|---|---|"]
    out += [f"| [{r[3]}]({r[3]}) | {r[0]} | {r[2]} | {r[1]} |" for r in kt]
    out += [f"| [compile]({src}) | {t} | {m} | {v} |" for t, v, m, src in peer_targets]
    for a in abl:
        if not a["ran"]:
            continue
        tag = ("" if a["budget"] == "current" else " (stale)") + (" (targets as the file states them now)"
                                                                          if a["rejudged"] else "")
        out += [f"| [{a['name']}]({a['link']}){tag} | {r[0]}: {r[2]} | {r[1]} | {r[3]} |"
                for r in a["targets"] if len(r) >= 4]
    out += ["", "## The ablations", "", "| ablation | run on | commit | points | budget and data vs its file now |",
            "|---|---|---|---|---|"]
    for a in abl:
        if a["ran"]:
            out.append(f"| [{a['name']}]({a['link']}) | {a['device']} | {a['commit']} | {a['points']} | {a['budget']} |")
        else:
            out.append(f"| {a['name']} | NOT RUN | - | - | `make experiment-{a['name']}` on the GPU |")
    batches = sorted({int(r["batch_size"]) for r in prof if r.get("batch_size")})
    out.append(f"| profile | {', '.join(sorted({r['device'] for r in prof}))} | "
               f"{', '.join(sorted({r['commit'] for r in prof}))} | batch {', '.join(map(str, batches))} | "
               "one step per attention layout (below) |" if prof else
               "| profile | NOT RUN | - | - | `make profile PRESET=paper` on the GPU |")
    for r in reproduce_rows(results) or [None]:
        out.append(f"| [reproduce]({r['file']}) | {r['device']} | - | one run | {r['result']} |" if r else
                   "| reproduce | NOT RUN | - | - | `PARTS=reproduce bash experiments/gpu/ablations.sh` on the GPU |")
    out += ["", "## Why model level is not kernel level: attention's share of a training step", ""]
    if prof:
        out += ["From the committed profiles (`make profile`: the training loop's trace; the `profile*.json` files: "
                "the one-step profiler that preceded it, with the step replayed as a CUDA graph): the GPU-busy time "
                "of one step and the attention kernels' time in it (forward and backward).", "",
                "| profile | device | batch | attention | graph step ms | GPU-busy ms | attention ms | attention share |",
                "|---|---|---:|---|---:|---:|---:|---:|"]
        out += [f"| {r['file']} | {r['device']} | {r['batch_size']} | {r['attention']} | {fmt(r['graph_step_ms'])} | "
                f"{fmt(r['busy_ms'])} | {fmt(r['attn_ms'])} | {fmt(r['attn_ms'] and r['attn_ms'] / r['busy_ms'], '.0%')} |"
                for r in prof]
        out += ["", *amdahl_lines(prof)]
    else:
        out.append("No profile yet: `make profile PRESET=paper` on the GPU.")
    return "\n".join(out) + "\n"


@command
def main(argv: list[str] | None = None) -> int:
    p = parser("summary", __doc__)
    p.add_argument("--results", default=None, help="the results folder to read (default: experiments/results)")
    p.add_argument("--out", default=None, help="output file (default RESULTS/REPORT.md where --results is given, "
                                               "else runs/REPORT.md)")
    args = p.parse_args(argv)
    results = Path(args.results or REPO_ROOT / "experiments" / "results")
    if not results.is_dir():
        print(f"error: no results folder {results}", file=sys.stderr)
        return 2
    out = Path(args.out or (results if args.results else REPO_ROOT / "runs") / "REPORT.md")
    rel = os.path.relpath(results.resolve(), out.resolve().parent)  # the page's links, seen from its folder
    text = re.sub(r"\]\((?![a-z]+:|#|/)", f"]({rel}/", build(results)) if rel != "." else build(results)
    if out.is_file() and out.read_text() == text:
        print(f"{out} is up to date")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0
