"""Result files (JSON, schema ``jagged-bench/1``) in; ``report.md``, ``report.json`` and the plots out.

``write_report(folder)`` keeps the newest row of each (kind, suite, shape, op, provider, mode)
over the folder's files, so runs of different suites add up to one report."""

from __future__ import annotations

import gzip
import json
import os

from experiments.bench.base import OURS, ceilings_of
from experiments.bench.floors import floor_table
from experiments.bench.stamp import stamp_line
from experiments.bench.targets import evaluate, geomean_table
from experiments.runs import table_lines
from pipeline.errors import ConfigError

SCHEMA = "jagged-bench/1"
MiB = 1 << 20
KIND_TITLES = {
    "attention": "Jagged self-attention",
    "dense_attention": "Target attention (jagged_dense_attention: Tq dense queries per sequence)",
    "ops": "Jagged ops (forward)",
}


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path) -> dict:
    """A result file's JSON object, gzipped (``.json.gz``, as the committed ones may be) or not;
    ConfigError naming the file when it is truncated or damaged."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        doc = json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
    except (OSError, EOFError, ValueError) as err:
        raise ConfigError(f"{path}: a damaged result file ({type(err).__name__}: {err})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: a damaged result file (not a JSON object)")
    return doc


def load_docs(folder: str, slug: str | None = None) -> list[dict]:
    """The result documents in `folder` (``*.json`` and ``*.json.gz``), of GPU `slug` or all, oldest first."""
    docs = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith((".json", ".json.gz")):
            continue
        doc = read_json(os.path.join(folder, name))
        if doc.get("schema") == SCHEMA and (slug is None or doc["stamp"]["gpu_slug"] == slug):
            doc["_file"] = name
            docs.append(doc)
    return sorted(docs, key=lambda d: d["stamp"]["date"])


def merge_rows(docs: list[dict]) -> list[dict]:
    """Newest row wins per (kind, suite, shape, op, provider, mode); docs come oldest first. A
    shape's placeholder (provider "*": a run's deadline skipped it) goes where a file measured it.
    A row carries its file's ceilings (``ceilings``), against which its rates are set."""
    merged: dict[tuple, dict] = {}
    for doc in docs:
        for r in doc["rows"]:  # each row keeps the ceilings measured in its own run
            merged[_row_key(r)] = dict(r, ceilings=doc["ceilings"]) if doc.get("ceilings") and "ceilings" not in r else r
    measured = {_row_key(r)[:3] for r in merged.values() if r["provider"] != "*"}
    return [r for r in merged.values() if r["provider"] != "*" or _row_key(r)[:3] not in measured]


def _row_key(r: dict) -> tuple:
    return r["kind"], r["suite"], r["shape_id"], r.get("op"), r["provider"], r["mode"]


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 100 else f"{x:.0f}"


def _short(status: str) -> str:
    return status.split(" (")[0] if status.startswith(("skipped", "unavailable")) else status


def _cell(r: dict | None, notes: dict, ceilings: dict) -> str:
    if r is None or r["status"] != "ok":
        if r is None or r["status"] == _short(r["status"]):
            return "" if r is None else r["status"]
        return f"{_short(r['status'])} [{notes.setdefault(r['status'], len(notes) + 1)}]"
    parts = [f"{_ms(r['ms'])} ms"]
    if r.get("peak_bytes") is not None:
        parts.append(f"{r['peak_bytes'] / MiB:.0f} MiB")
    if r["provider"] == OURS:
        ceilings = ceilings_of(r, ceilings)
        if r.get("tflops"):
            frac = f" ({r['tflops'] / ceilings['matmul_tflops']:.0%} mm)" if r.get("op") and ceilings.get("matmul_tflops") else ""
            parts.append(f"{r['tflops']:.0f} TF/s{frac}")
        if r.get("gbps"):
            frac = f" ({r['gbps'] / ceilings['copy_gbps']:.0%} copy)" if ceilings.get("copy_gbps") else ""
            parts.append(f"{r['gbps']:.0f} GB/s{frac}")
        return " / ".join(parts)
    rel = [f"{r['ours_speedup']:.3g}x"] if r.get("ours_speedup") else []
    if r.get("ours_mem_ratio"):
        rel.append(f"{r['ours_mem_ratio']:.3g}x mem")
    return " / ".join(parts) + (f" ({', '.join(rel)})" if rel else "")


def _table(rows: list[dict], kind: str, suite: str, ceilings: dict) -> list[str]:
    sel = [r for r in rows if r["kind"] == kind and r["suite"] == suite]
    if not sel:
        return []
    providers = [OURS] + sorted({r["provider"] for r in sel if r["provider"] not in (OURS, "*")})
    ops = kind == "ops"
    key_cols = ["op", "B", "N", "D", "density"] if ops else ["B", "N", "H", "D", "density"]
    if kind == "dense_attention":
        key_cols.append("Tq")
    head = key_cols + ["mode"] + providers
    cells: dict[tuple, dict] = {}  # (op, shape, mode) -> provider -> row, in the rows' order
    for r in sel:
        cells.setdefault((r.get("op") or "", r["shape_id"], r["mode"]), {})[r["provider"]] = r
    notes: dict[str, int] = {}
    body = []
    for (op, _, mode), by in cells.items():
        vals = [op] * ops + [str(next(iter(by.values()))["shape"][c]) for c in key_cols if c != "op"]
        vals.append("fwd+bwd" if mode == "fwd_bwd" else mode)
        body.append(vals + ([by["*"]["status"]] + [""] * (len(providers) - 1) if "*" in by
                            else [_cell(by.get(p), notes, ceilings) for p in providers]))
    return [f"### {KIND_TITLES[kind]}: suite `{suite}`", "", *table_lines(head, body), "",
            *(f"[{n}] {status}  " for status, n in notes.items()), ""]


def _legend(ceilings: dict | None) -> list[str]:
    c = ceilings or {}
    ceil = (f"Ceilings measured in the newest run: device copy {c['copy_gbps']:.0f} GB/s (bytes read + written), "
            f"{c.get('matmul_dtype', '')} matmul {c['matmul_tflops']:.0f} TFLOP/s "
            f"({'x'.join(map(str, c.get('matmul_shape', [])))}); every rate below is set against the ceilings measured "
            "in its own run." if c.get("copy_gbps") else "Ceilings: not measured.")
    return [ceil, "", "Cells: median ms (`triton.testing.do_bench`, L2 flushed) / peak memory (the provider's inputs in its own "
        "layout, grad_out included for fwd+bwd, plus the peak allocated during one call) / for ours the useful rate "
        "(attention TFLOP/s count real tokens only: forward 4·H·D·ΣL², backward 2.5x; ops GB/s count the bytes the op "
        "must read and write). For a peer, `(a x, b x mem)` = the peer's time / ours and the peer's peak memory / ours: "
        "above 1 means ours is faster / smaller. fwd runs under `torch.no_grad`; fwd+bwd is forward + `backward(grad_out)` "
        "with the graph rebuilt each run. Every output was checked once against an fp32 reference before timing "
        "(FAILED: mismatch, not timed).", ""]


def graph_table(rows: list[dict]) -> list[str]:
    """Markdown: rows timed both ways (``--graph-ms``): ours and each peer by call (do_bench: host
    included where the host is the slower side) and by kernels alone (CUDA-graph replay)."""
    timed = [r for r in rows if r["status"] == "ok" and r.get("gpu_ms") is not None]
    key = lambda r: (r["kind"], r.get("op"), r["suite"], r["shape_id"], r["mode"])  # noqa: E731
    ours = {key(r): r for r in timed if r["provider"] == OURS}
    pairs = [(ours[key(r)], r) for r in timed if r["provider"] != OURS and key(r) in ours]
    if not pairs:
        return []
    lines = ["## Kernel time beside call time (`--graph-ms`)", "",
             "call: do_bench of the call (its host time shows where the host is slower than the GPU); kernels: the "
             "same call replayed as a CUDA graph (no host time, no launch gaps). Where the two speedups differ, the "
             "difference is host time.", "",
             "| kind | suite | shape | mode | peer | ours call / kernels ms | peer call / kernels ms | speedup by call "
             "| by kernels |", "|---|---|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| {p['kind']}{' ' + p['op'] if p.get('op') else ''} | {p['suite']} | {p['shape_id']} | {p['mode']} | "
              f"{p['provider']} | {_ms(o['ms'])} / {_ms(o['gpu_ms'])} | {_ms(p['ms'])} / {_ms(p['gpu_ms'])} | "
              f"{p['ms'] / o['ms']:.2f}x | {p['gpu_ms'] / o['gpu_ms']:.2f}x |"
              for o, p in sorted(pairs, key=lambda op: (*key(op[1])[:4], op[1]["provider"]))]
    return lines + [""]


def render_markdown(docs: list[dict], rows: list[dict]) -> str:
    st = docs[-1]["stamp"]
    ceilings = next((d.get("ceilings") for d in reversed(docs) if d.get("ceilings")), None)
    out = [f"# Kernel benchmarks on {st['gpu']}", "", f"_{stamp_line(st)}_", ""]
    out += ["Regenerate: `make bench SUITE=<suite>` on the GPU machine (or `python -m experiments bench all --suite <suite>`, "
            "into experiments/results/kernels/<gpu>/); `python -m experiments bench report` rebuilds this file, report.json "
            "and the plots from the JSON files.", ""]
    out += table_lines(["result file", "kinds", "suites", "GPU", "torch", "triton", "CUDA", "commit", "date",
                        "launch table"],
                       [[d["_file"], *(", ".join(d.get("config", {}).get(k, [])) for k in ("kinds", "suites")),
                         *(d["stamp"][k] for k in ("gpu", "torch", "triton", "cuda", "commit", "date")),
                         d["stamp"].get("launch_table", "not recorded")] for d in docs])
    if len({d["stamp"].get("launch_table") for d in docs}) > 1:
        out += ["", "**Note:** these results ran with different launch configs (see the launch table column)."]
    if len({d["stamp"]["commit"] for d in docs}) > 1:
        out += ["", "**Note:** these results come from more than one commit (see the table above)."]
    out += [""] + _legend(ceilings)
    out += ["## Targets", "", *table_lines(["target", "status", "measured"], [
        [t["target"], f"**{t['status']}**", t["detail"]] for t in evaluate(rows, ceilings)])]
    out += ["", "## Geometric-mean speedup of ours over each peer (peer time / ours)", ""]
    out += table_lines(["kind", "op", "suite", "mode", "peer", "geomean", "shapes"], [
        [*(g[k] for k in ("kind", "op", "suite", "mode", "peer")), f"{g['geomean']:.2f}x", g["n"]]
        for g in geomean_table(rows)]) + [""]
    out += floor_table(rows, ceilings or {}, docs[-1].get("config", {}).get("dtype", ""))
    out += graph_table(rows)
    suites = sorted({r["suite"] for r in rows}, key=lambda s: ("paper", "recsys", "long", "smoke").index(s))
    for kind in KIND_TITLES:
        for suite in suites:
            out += _table(rows, kind, suite, ceilings or {})
    return "\n".join(out) + "\n"


def write_report(folder: str, slug: str | None = None) -> list[str]:
    """report.md, report.json (stamp, targets, geometric means) and the plots of `folder`'s result
    files of GPU `slug` (default: the newest file's GPU; a folder holds one GPU's results)."""
    from experiments.bench.plots import write_plots

    docs = load_docs(folder, slug)
    if not docs:
        return []
    slug = docs[-1]["stamp"]["gpu_slug"]
    docs = [d for d in docs if d["stamp"]["gpu_slug"] == slug]
    rows = merge_rows(docs)
    ceilings = next((d.get("ceilings") for d in reversed(docs) if d.get("ceilings")), None) or {}
    stamp = combined_stamp(docs)
    path = os.path.join(folder, "report.md")
    with open(path, "w") as f:
        f.write(render_markdown(docs, rows))
    write_json(os.path.join(folder, "report.json"), {"stamp": stamp, "files": [d["_file"] for d in docs],
                                                     "targets": evaluate(rows, ceilings),
                                                     "geomeans": geomean_table(rows)})
    return [path, os.path.join(folder, "report.json"), *write_plots(rows, stamp, folder, ceilings.get("copy_gbps"))]


def combined_stamp(docs: list[dict]) -> dict:
    """One stamp for plots of rows merged from several result files: the newest file's, except
    that a field on which the files that still give a row differ (commit, versions, launch
    table, the day) lists every value, oldest first, instead of naming only the newest file's."""
    seen, kept = set(), []
    for doc in reversed(docs):  # a file all of whose rows newer files replaced is left out
        keys = {_row_key(r) for r in doc["rows"]}
        if not keys <= seen:
            kept.insert(0, doc)
        seen |= keys
    docs = kept or docs[-1:]
    stamp = dict(docs[-1]["stamp"])
    for key in ("commit", "torch", "triton", "cuda", "launch_table", "date"):
        values = list(dict.fromkeys(str(d["stamp"].get(key) or "none") for d in docs))
        if len(values) > 1:
            stamp[key] = " + ".join(dict.fromkeys(v[:10] for v in values) if key == "date" else values)
    return stamp
