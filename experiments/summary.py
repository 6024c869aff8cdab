"""One summary of the committed results: experiments/results/REPORT.md.

    python -m experiments summary [--results experiments/results] [--out REPORT.md]
    make summary

Reads only committed files (no MLflow, no GPU): the kernel benchmark tables
(``kernels-*.md``), every ablation report (``<ablation>/report.md`` and ``runs.csv``), the
one-step profiles (``profile_*.json``) and the ablation files themselves. It writes:

- the paper's claims next to ours, at kernel level and at model level;
- every PASS/MISS target of those reports, with its number and where it comes from; an ablation's
  targets as its file states them now, judged on its runs.csv by the report's own function (a
  target changed since the report was written is marked so);
- per ablation: run or not, device, commit, points by status, and whether the budget it ran with
  is the one its file states now (a report from an older budget is marked stale, not quoted as
  the result);
- model level against kernel level through the profile's attention share (Amdahl's bound).

A missing source is said, never skipped silently. Exit status 0, or 2 for a results folder that
does not exist.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import polars as pl
import yaml

from models.config import RENAMED_KEYS
from pipeline.tracking import REPO_ROOT

ABLATIONS = REPO_ROOT / "experiments" / "ablations"
EXPECTED = ["seq_len", "sparsity", "batch_size", "compile", "auc_parity", "history_value", "model"]
BEYOND = ["s2", "alure"]  # the seeds' other systems: listed once they have run
PAPER_CLAIMS = [  # (level, claim, how ours is measured, where)
    ("kernel", "up to 9x faster and 22x less memory than dense attention",
     "jagged flash attention vs materialised dense attention (`dense_torch`), headline shape", "kernels"),
    ("kernel", "3x faster and 53% less memory than dense flash attention",
     "jagged flash attention vs padded SDPA (`sdpa_padded_mask`), headline shape", "kernels"),
    ("model", "+10% QPS and -18% memory in production",
     "training examples/s and peak GPU memory of the jagged ranker vs the padded-SDPA ranker in `fit`",
     "batch_size"),
]


def _table_rows(md: str, heading: str) -> list[list[str]]:
    """The body rows of the first markdown table under `## heading`."""
    m = re.search(rf"^## {re.escape(heading)}\b.*?$(.*?)(?=^## |\Z)", md, re.M | re.S)
    if not m:
        return []
    rows = [ln for ln in m.group(1).splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in rows[2:]]


def _header_value(md: str, key: str) -> str | None:
    m = re.search(rf"^- {re.escape(key)}: (.*)$", md, re.M)
    return m.group(1).strip() if m else None


def kernel_targets(results: Path) -> list[list[str]]:
    """Target rows (target, status, measured, source file) over every kernels report: for each
    target the newest report (by file name) that measured it (PASS or MISS); where none did, the
    newest report's row. A partial run (one kind, one suite) so adds to the full ones before it
    instead of hiding their rows."""
    rows: dict[str, list[str]] = {}
    for path in sorted(results.glob("kernels-*.md")):
        for r in _table_rows(path.read_text(), "Targets"):  # also "## Targets (...)"
            if len(r) < 3:
                continue
            row = [r[0], r[1].strip("*"), r[2], path.name]
            if r[0] not in rows or row[1] in ("PASS", "MISS") or rows[r[0]][1] not in ("PASS", "MISS"):
                rows[r[0]] = row
    return list(rows.values())


def budget_state(name: str, md: str) -> str:
    """'current', or 'stale: ...' when the report's budget differs from the file's `set` now."""
    spec = yaml.safe_load((ABLATIONS / f"{name}.yaml").read_text()) or {}
    raw = _header_value(md, "budget and overrides of every run")
    if raw is None:
        return "unknown (no budget line)"
    ran = {RENAMED_KEYS.get(k, k): v for k, v in json.loads(raw.strip("`")).items()}  # reports of earlier versions
    now = spec.get("set") or {}
    differ = [f"{k}: ran {ran.get(k)!r}, file {v!r}" for k, v in now.items() if json.dumps(ran.get(k)) != json.dumps(v)]
    given = set(re.findall(r"--set ([\w.]+)=", md))  # the sweep command's own --set: not the file's budget
    differ += [f"{k}: ran {v!r}, file: not set" for k, v in ran.items() if k not in now and k not in given]
    return "current" if not differ else "stale: " + "; ".join(differ)


def current_targets(name: str, runs_csv: Path) -> list[list[str]] | None:
    """The ablation file's targets as they stand now, judged on the committed runs.csv by the
    report's own function (so a target changed since the report was written is judged as the file
    states it); None where runs.csv lacks what they need (the report's table is quoted then)."""
    from experiments.runs import memory_metric
    from experiments.report import targets_section

    spec = yaml.safe_load((ABLATIONS / f"{name}.yaml").read_text()) or {}
    rep = spec.get("report") or {}
    if not rep.get("targets"):
        return []
    if not runs_csv.is_file():
        return None
    header = pl.read_csv(runs_csv, n_rows=0).columns
    labels = {RENAMED_KEYS.get(k, k).split(".")[-1] for k in spec.get("grid") or {}} | {"status"}  # grid labels are text
    try:
        df = pl.read_csv(runs_csv, schema_overrides={c: pl.Utf8 for c in header if c in labels})
        return _table_rows("\n".join(targets_section(df, rep, memory_metric(df)[0])), "Targets")
    except (pl.exceptions.PolarsError, KeyError):  # columns of an older report
        return None


def ablation_status(results: Path) -> list[dict]:
    out = []
    for name in EXPECTED + BEYOND:
        report, csv = results / name / "report.md", results / name / "runs.csv"
        if not report.is_file():
            if name not in BEYOND:
                out.append({"name": name, "ran": False})
            continue
        md = report.read_text()
        runs = pl.read_csv(csv, infer_schema_length=0) if csv.is_file() else pl.DataFrame({"status": []})
        statuses = Counter(s.split(":")[0] for s in runs["status"].to_list())  # "FAILED: why" counts as FAILED
        counts = ", ".join(f"{n} {s}" for s, n in statuses.items())
        written, now = _table_rows(md, "Targets"), current_targets(name, csv)
        out.append({"name": name, "ran": True, "device": (_header_value(md, "device") or "?").split(";")[0].strip("`"),
                    "commit": _header_value(md, "git commit") or "?", "points": counts or "none",
                    "budget": budget_state(name, md), "targets": written if now is None else now,
                    "rejudged": now is not None and now != written, "md": md})
    return out


def profile_rows(results: Path) -> list[dict]:
    rows = []
    for path in sorted(results.glob("profile_*.json")):
        data = json.loads(path.read_text())
        for r in data.get("results", []):
            rows.append({"file": path.name, "device": data.get("device", "?"), "commit": str(data.get("commit", "?"))[:7],
                         **{k: r.get(k) for k in ("attention", "batch_size", "graph_step_ms", "attn_ms")},
                         "busy_ms": r.get("gpu_ms") or r.get("prof_step_ms")})
    return rows


def reproduce_rows(results: Path) -> list[dict]:
    """The `reproduce` results (experiments/results/reproduce/*.md): device and the stated result
    line (`**Result: ...**`)."""
    rows = []
    for path in sorted((results / "reproduce").glob("*.md")):
        md = path.read_text()
        result = re.search(r"\*\*Result: ([^*]+)\*\*", md)
        device = re.search(r"^- device: ([^;(\n]+)", md, re.M)
        rows.append({"file": f"reproduce/{path.name}", "device": device.group(1).strip() if device else "?",
                     "result": result.group(1).strip() if result else "no result line"})
    return rows


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def model_level(results: Path) -> list[str]:
    """Jagged vs sdpa ranker ratios from the batch_size ablation, AUC from auc_parity."""
    lines = []
    bs = results / "batch_size" / "runs.csv"
    if bs.is_file():
        df = pl.read_csv(bs, infer_schema_length=0).filter(pl.col("status") == "OK")
        lines += ["| batch | jagged ex/s | sdpa ex/s | speed ratio | jagged peak MB | sdpa peak MB | memory ratio |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for b in sorted({int(v) for v in df["batch_size"].to_list()}):
            get = {r["attention"]: r for r in df.filter(pl.col("batch_size") == str(b)).iter_rows(named=True)}
            if "jagged" not in get:
                continue
            j, s = get["jagged"], get.get("sdpa")
            jx, jm = float(j["perf/train_examples_per_s"]), float(j["mem/train_peak_allocated_mb"])
            sx = float(s["perf/train_examples_per_s"]) if s else None
            sm = float(s["mem/train_peak_allocated_mb"]) if s else None
            lines.append(f"| {b} | {jx:,.0f} | {_fmt(sx, ',.0f')} | {_fmt(sx and jx / sx)}x | {jm:,.0f} | "
                         f"{_fmt(sm, ',.0f')} | {_fmt(sm and jm / sm)}x |" + ("" if s else " sdpa: no finished run"))
    auc = results / "auc_parity" / "runs.csv"
    if auc.is_file():
        df = pl.read_csv(auc, infer_schema_length=0).filter(pl.col("status") == "OK") \
            .with_columns(pl.col("test/auc").cast(pl.Float64))
        lines += ["", "| attention | seeds | mean test AUC | std | min | max |", "|---|---:|---:|---:|---:|---:|"]
        for b, g in df.group_by("attention", maintain_order=True):
            a = g["test/auc"]
            lines.append(f"| {b[0]} | {a.len()} | {a.mean():.4f} | {_fmt(a.std(), '.4f')} | {a.min():.4f} | {a.max():.4f} |")
        said = re.search(r"^A run counts as converged.*: (\d+) of (\d+) runs did\.$",
                         (results / "auc_parity" / "report.md").read_text(), re.M)
        if said:
            lines += ["", f"Convergence ([auc_parity/report.md](auc_parity/report.md), validation AUC at every check): "
                      f"{said.group(1)} of {said.group(2)} runs converged."]
    return lines


def history_lines(results: Path) -> list[str]:
    """Do longer histories pay? history_value's test AUC per max_seq_len beside the oracle's AUC
    from the last k items (its report's oracle table), each with its gain over the shorter one."""
    md = results / "history_value" / "report.md"
    rows = _table_rows(md.read_text(), "Test AUC against the oracle") if md.is_file() else []
    rows = [r for r in rows if len(r) == 3 and r[0].isdigit()]
    if not rows:
        return ["No history_value results with the oracle's curve yet (`make experiment-history_value` on the GPU)."]
    num = [(int(k), _float(m), _float(o)) for k, m, o in rows]
    lines = ["From [history_value](history_value/report.md): the jagged ranker trained at each max_seq_len (one "
             "run each), beside the planted model's own AUC from the last k items (meta.json).", "",
             "| max_seq_len | model test AUC | gain over the shorter | oracle AUC, last k items | oracle gain |",
             "|---:|---:|---:|---:|---:|"]
    for i, (k, m, o) in enumerate(num):
        pm, po = (num[i - 1][1], num[i - 1][2]) if i else (None, None)
        lines.append(f"| {k} | {_fmt(m, '.4f')} | {_fmt(_diff(m, pm), '+.4f')} | {_fmt(o, '.4f')} | "
                     f"{_fmt(_diff(o, po), '+.4f')} |")
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
                     f"{_fmt(_diff(o, best_oracle), '+.4f')})")
        lines += ["", said + "."]
    return lines


def _float(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def model_ablation_lines(results: Path) -> list[str]:
    """Which parts of the ranker pay: the model ablation's test AUC per variant against the baseline."""
    csv = results / "model" / "runs.csv"
    if not csv.is_file():
        return ["No model ablation yet (`make experiment-model` on the GPU)."]
    df = pl.read_csv(csv, infer_schema_length=0)
    base = df.filter((pl.col("variant") == "baseline") & (pl.col("status") == "OK"))
    b = float(base["test/auc"][0]) if base.height else None
    lines = ["From [model](model/report.md): one change at a time from the paper preset's jagged ranker at "
             "max_seq_len 256 (one run each: a difference under the seed spread of "
             "[auc_parity](auc_parity/report.md) is not a finding).", "",
             "| variant | status | test AUC | against the baseline |", "|---|---|---:|---:|"]
    for r in df.iter_rows(named=True):
        a = _float(r["test/auc"] or "") if r["status"] == "OK" else None
        vs = "baseline" if r["variant"] == "baseline" else _fmt(_diff(a, b), "+.4f")
        lines.append(f"| {r['variant']} | {r['status']} | {_fmt(a, '.4f')} | {vs} |")
    return lines


STRONGEST_PEER_MIN_SPEEDUP = 2.5  # the issue's jagged-vs-sdpa target, here against sdpa's fastest step


def strongest_peers(results: Path) -> tuple[list[str], list[list[str]]]:
    """From the compile ablation: each layout at its fastest way of stepping (eager, torch.compile,
    CUDA graphs), and jagged's best against each peer's best: (markdown lines, target rows)."""
    path = results / "compile" / "runs.csv"
    if not path.is_file():
        return [], []
    df = pl.read_csv(path, infer_schema_length=0).filter(pl.col("status") == "OK").with_columns(
        pl.col("perf/train_examples_per_s").cast(pl.Float64), pl.col("mem/train_peak_allocated_mb").cast(pl.Float64))
    best = {a[0]: g.sort("perf/train_examples_per_s", descending=True).row(0, named=True)
            for a, g in df.group_by("attention", maintain_order=True)}
    if "jagged" not in best:
        return [], []
    j = best["jagged"]
    lines = ["", "Each layout at its fastest step from [compile](compile/report.md) (eager, `torch.compile` or CUDA "
             "graphs). A faster peer configuration is the one to beat. CUDA graphs remove host time, so they pay "
             "where the step waits on the host; `torch.compile` also fuses elementwise GPU work:", "",
             "| attention | fastest step | ex/s | peak MB | jagged's best / this |", "|---|---|---:|---:|---:|"]
    targets = []
    for name, r in best.items():
        ratio = j["perf/train_examples_per_s"] / r["perf/train_examples_per_s"]
        lines.append(f"| {name} | {r['step']} | {r['perf/train_examples_per_s']:,.0f} | "
                     f"{r['mem/train_peak_allocated_mb']:,.0f} | {ratio:.2f}x |")
        if name != "jagged":
            ok = ratio >= STRONGEST_PEER_MIN_SPEEDUP
            targets.append([f"jagged ({j['step']}) vs {name} at its fastest step ({r['step']}): "
                            f">= {STRONGEST_PEER_MIN_SPEEDUP}x", "PASS" if ok else "MISS",
                            f"train ex/s ratio {ratio:.2f}x ({j['perf/train_examples_per_s']:,.0f} vs "
                            f"{r['perf/train_examples_per_s']:,.0f})"])
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
        if not (j and s):
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
    kt = kernel_targets(results)
    abl = ablation_status(results)
    prof = profile_rows(results)
    out = ["# Jagged Flash Attention: the results in one page", "",
           f"_Written {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC} by `python -m experiments summary` from the "
           "committed files under experiments/results/ (each source below names its device, versions and commit)._",
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
                       f"serving: QPS in production is not measured here) | [batch_size](batch_size/report.md) |")
    out += ["", "## Model level: the jagged ranker against the padded-SDPA ranker in `fit`", "",
            "From [batch_size](batch_size/report.md) (throughput, memory; steady steps) and "
            "[auc_parity](auc_parity/report.md) (accuracy over seeds). Ratios: jagged / sdpa.", "",
            *(model_level(results) or ["No batch_size or auc_parity results yet."])]
    peer_lines, peer_targets = strongest_peers(results)
    out += peer_lines
    out += ["", "## Do longer histories pay?", "", *history_lines(results)]
    out += ["", "## Which parts of the ranker pay?", "", *model_ablation_lines(results)]
    out += ["", "## Every target, PASS or MISS", "", "| source | target | measured | result |", "|---|---|---|---|"]
    out += [f"| [{r[3]}]({r[3]}) | {r[0]} | {r[2]} | {r[1]} |" for r in kt]
    out += [f"| [compile](compile/report.md) | {t} | {m} | {v} |" for t, v, m in peer_targets]
    for a in abl:
        if not a["ran"]:
            continue
        tag = ("" if a["budget"] == "current" else " (stale budget)") + (" (targets as the file states them now)"
                                                                          if a["rejudged"] else "")
        out += [f"| [{a['name']}]({a['name']}/report.md){tag} | {r[0]}: {r[2]} | {r[1]} | {r[3]} |"
                for r in a["targets"] if len(r) >= 4]
    out += ["", "## The ablations", "", "| ablation | run on | commit | points | budget vs its file now |",
            "|---|---|---|---|---|"]
    for a in abl:
        if a["ran"]:
            out.append(f"| [{a['name']}]({a['name']}/report.md) | {a['device']} | {a['commit']} | {a['points']} | "
                       f"{a['budget']} |")
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
        out += ["From `experiments.profile` (`make profile`): the step replayed as a CUDA graph, the GPU-busy time "
                "of one step, and the attention kernels' time in it (forward and backward).", "",
                "| profile | device | batch | attention | graph step ms | GPU-busy ms | attention ms | attention share |",
                "|---|---|---:|---|---:|---:|---:|---:|"]
        out += [f"| {r['file']} | {r['device']} | {r['batch_size']} | {r['attention']} | {_fmt(r['graph_step_ms'])} | "
                f"{_fmt(r['busy_ms'])} | {_fmt(r['attn_ms'])} | {_fmt(r['attn_ms'] / r['busy_ms'], '.0%')} |"
                for r in prof]
        out += ["", *amdahl_lines(prof)]
    else:
        out.append("No profile yet: `make profile PRESET=paper` on the GPU.")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m experiments summary", description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(REPO_ROOT / "experiments" / "results"), help="the committed results folder")
    p.add_argument("--out", default=None, help="output file (default RESULTS/REPORT.md)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    results = Path(args.results)
    if not results.is_dir():
        print(f"error: no results folder {results}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else results / "REPORT.md"
    out.write_text(build(results))
    print(f"wrote {out}")
    return 0

