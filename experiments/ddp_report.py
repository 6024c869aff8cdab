"""The report of :mod:`experiments.ddp_bench`: tables, crossovers and plots (matplotlib, Agg)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from experiments.figures import finish, legend_outside  # noqa: E402
from pipeline.gradsync import EMBEDDING_GRADS  # noqa: E402
from pipeline.runenv import device_name, git_commit  # noqa: E402

_MB = 2**20
_COLOURS = {"dense": "tab:blue", "sparse": "tab:orange", "densify": "tab:green"}


def predicted_crossover(dim: int, world: int) -> float:
    """The touched fraction above which sparse sends more bytes than dense (ring algorithms,
    fp32 values and int64 indices): (W - 1) f V (4 D + 8) = 2 (W - 1) / W x 4 V D."""
    return 2 * 4 * dim / (world * (4 * dim + 8))


def crossing(xs: list[float], sparse: list[float], dense: list[float]) -> float | None:
    """The first x (ascending xs) from which sparse costs at least as much as dense, linear
    between the points; xs[0] if it does from the start, None if it never does."""
    d = [s - t for s, t in zip(sparse, dense)]
    if d and d[0] >= 0:
        return xs[0]
    for i in range(1, len(d)):
        if d[i - 1] < 0 <= d[i]:
            return xs[i - 1] + (xs[i] - xs[i - 1]) * -d[i - 1] / (d[i] - d[i - 1])
    return None


def _subtitle() -> str:
    return (f"{device_name()} · torch {torch.__version__} · Gloo over loopback, 1 thread per process · "
            f"commit {git_commit()[:12]}")


def _sweep(rows: list[dict], world: int, mode: str) -> list[dict]:
    return sorted((r for r in rows if r["kind"] == "sweep" and r["world"] == world and r["mode"] == mode),
                  key=lambda r: r["fraction"])


def crossovers(rows: list[dict]) -> list[dict]:
    """Per world size: predicted and measured (bytes, step time) crossover of dense and sparse."""
    out = []
    for world in sorted({r["world"] for r in rows}):
        dense, sparse = _sweep(rows, world, "dense"), _sweep(rows, world, "sparse")
        if not dense or len(dense) != len(sparse):
            continue
        xs = [r["touched"] for r in dense]
        out.append({"world": world, "predicted": predicted_crossover(dense[0]["dim"], world),
                    "bytes": crossing(xs, [r["sent_measured"] for r in sparse], [r["sent_measured"] for r in dense]),
                    "time": crossing(xs, [r["step_ms"] for r in sparse], [r["step_ms"] for r in dense])})
    return out


def _fmt(x: float | None, span: tuple[float, float]) -> str:
    return f"> {span[1]:.2f} (not within the sweep)" if x is None else f"{x:.2f}"


def plot_sweep(rows: list[dict], cross: list[dict], path: Path) -> None:
    worlds = [c["world"] for c in cross]
    fig, axes = plt.subplots(2, len(worlds), figsize=(5.5 * len(worlds), 7.5), squeeze=False)
    for col, c in enumerate(cross):
        for mode in EMBEDDING_GRADS:
            sw = _sweep(rows, c["world"], mode)
            xs = [r["touched"] for r in sw]
            axes[0][col].plot(xs, [r["sent_measured"] / _MB for r in sw], "o-", color=_COLOURS[mode], label=mode)
            axes[0][col].plot(xs, [r["sent_predicted"] / _MB for r in sw], "--", color=_COLOURS[mode], alpha=0.6,
                              label=f"{mode} (predicted)")
            axes[1][col].plot(xs, [r["step_ms"] for r in sw], "o-", color=_COLOURS[mode], label=mode)
        for row, (what, unit) in enumerate((("bytes", "MiB sent per process and step"), ("time", "step time (ms)"))):
            ax = axes[row][col]
            ax.axvline(c["predicted"], color="k", ls=":", label="predicted crossover (bytes)")
            if c[what] is not None:
                ax.axvline(c[what], color="grey", label=f"measured crossover ({what})")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("fraction of the table's rows a process looks up per step")
            ax.set_ylabel(unit)
            ax.set_title(f"{c['world']} processes")
            ax.grid(True, alpha=0.3)
    legend_outside(axes[0][-1], 8)
    legend_outside(axes[1][-1], 8)
    finish(fig, path, f"Embedding gradients across processes: {SWEEP_NAME}", _subtitle())


SWEEP_NAME = "100k x 32 table, distinct ids per process"


def plot_presets(rows: list[dict], path: Path) -> None:
    pts = [r for r in rows if r["kind"] == "preset"]
    groups = sorted({(r["name"], r["world"]) for r in pts}, key=lambda g: (g[1], list(_PRESET_ORDER).index(g[0])))
    metrics = (("step_ms", "step time (ms)"), ("sent_measured", "MiB sent per process and step"),
               ("peak_mb", "peak memory a step adds (MiB)"))
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    width = 0.27
    for ax, (key, label) in zip(axes, metrics):
        for i, mode in enumerate(EMBEDDING_GRADS):
            vals = [next((r[key] for r in pts if (r["name"], r["world"]) == g and r["mode"] == mode), 0.0)
                    for g in groups]
            vals = [v / _MB for v in vals] if key == "sent_measured" else vals
            ax.bar([j + (i - 1) * width for j in range(len(groups))], vals, width, color=_COLOURS[mode], label=mode)
        ax.set_xticks(range(len(groups)), [f"{n}\nW={w}" for n, w in groups])
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    legend_outside(axes[-1], 8)
    finish(fig, path, "Embedding gradients at the presets' tables and batches", _subtitle())


_PRESET_ORDER = ("tiny", "small", "paper")


def _preset_table(rows: list[dict]) -> list[str]:
    lines = ["| preset (table, batch/process) | W | mode | rows touched/process | MiB sent/step: predicted "
             "| measured | step ms | of which averaging ms | peak step memory MiB |", "|" + " --- |" * 9]
    pts = sorted((r for r in rows if r["kind"] == "preset"),
                 key=lambda r: (_PRESET_ORDER.index(r["name"]), r["world"], EMBEDDING_GRADS.index(r["mode"])))
    for r in pts:
        lines.append(f"| {r['name']} ({r['vocab']:,} x {r['dim']}, {r['batch']}) | {r['world']} | {r['mode']} "
                     f"| {r['touched']:.1%} | {r['sent_predicted'] / _MB:.2f} | {r['sent_measured'] / _MB:.2f} "
                     f"| {r['step_ms']:.1f} | {r['sync_ms']:.1f} | {r['peak_mb']:.0f} |")
    return lines


def _sweep_table(rows: list[dict]) -> list[str]:
    lines = ["| W | touched | step ms: dense | sparse | densify | MiB sent: dense | sparse | densify |",
             "|" + " --- |" * 8]
    for world in sorted({r["world"] for r in rows if r["kind"] == "sweep"}):
        by_mode = {m: _sweep(rows, world, m) for m in EMBEDDING_GRADS}
        for i, r in enumerate(by_mode["dense"]):
            ms = " | ".join(f"{by_mode[m][i]['step_ms']:.1f}" for m in EMBEDDING_GRADS)
            mb = " | ".join(f"{by_mode[m][i]['sent_measured'] / _MB:.2f}" for m in EMBEDDING_GRADS)
            lines.append(f"| {world} | {r['touched']:.0%} | {ms} | {mb} |")
    return lines


def _reading(rows: list[dict], cross: list[dict]) -> list[str]:
    """What the numbers say, computed from them."""
    ratios = [r["sent_measured"] / r["sent_predicted"] for r in rows if r["sent_predicted"] > 0]
    out = [f"- Bytes: Gloo's sends are the ring algorithms' bytes (measured / predicted "
           f"{min(ratios):.4f} to {max(ratios):.4f} over every row), so the byte crossover lands on the "
           f"prediction: " + ", ".join(f"W={c['world']}: {c['bytes'] or float('nan'):.2f} vs {c['predicted']:.2f}"
                                         for c in cross) + "."]
    for world in sorted({r["world"] for r in rows if r["kind"] == "preset" and r["name"] == "paper"}):
        p = {r["mode"]: r for r in rows if r["kind"] == "preset" and r["name"] == "paper" and r["world"] == world}
        if set(p) == set(EMBEDDING_GRADS):
            out.append(f"- Paper table, W={world}: a process touches {p['sparse']['touched']:.1%} of the rows; "
                       f"sparse sends {p['dense']['sent_measured'] / p['sparse']['sent_measured']:.0f}x fewer bytes "
                       f"than dense, steps {p['dense']['step_ms'] / p['sparse']['step_ms']:.2f}x faster and adds "
                       f"{p['sparse']['peak_mb']:.0f} MiB at its peak against {p['dense']['peak_mb']:.0f} MiB; densify "
                       f"sends dense's bytes and steps {p['densify']['step_ms'] / p['dense']['step_ms']:.2f}x dense's time.")
    out.append("- Time: sparse loses well before its bytes do (" + ", ".join(
        f"W={c['world']}: {c['time']:.2f}" if c["time"] is not None else f"W={c['world']}: never" for c in cross)
        + "): its cost grows with the rows gathered, which are coalesced (sorted) and applied row by row, "
        "while Gloo over loopback moves bytes at memory speed. On GPUs the sort is fast next to the link, "
        "so the time crossover should sit nearer the byte one: a GPU run measures where.")
    out.append("- The processes share 2 CPU cores (4 processes oversubscribe them): step times carry that noise, "
               "the byte counts do not; the peak memory of the small tables is within the allocator's noise.")
    return out


def write_report(rows: list[dict], out: Path, command: str, seconds: float) -> str:
    """ddp-bench.md, .json and the two plots under `out`; returns the markdown."""
    cross = crossovers(rows)
    (out / "ddp-bench.json").write_text(json.dumps(rows, indent=1))
    if cross:
        plot_sweep(rows, cross, out / "ddp-bench-crossover.png")
    if any(r["kind"] == "preset" for r in rows):
        plot_presets(rows, out / "ddp-bench-presets.png")
    fracs = [r["touched"] for r in rows if r["kind"] == "sweep"]
    span = (min(fracs), max(fracs)) if fracs else (0.0, 1.0)
    cross_lines = ["| W | predicted from bytes (2·4D / (W·(4D+8))) | measured: bytes | measured: step time |",
                   "| --- | --- | --- | --- |"]
    cross_lines += [f"| {c['world']} | {c['predicted']:.2f} | {_fmt(c['bytes'], span)} | {_fmt(c['time'], span)} |"
                    for c in cross]
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = "\n".join([
        "# Dense, sparse and densified embedding gradients across processes (CPU, Gloo)", "",
        f"{_subtitle()}; {stamp}; {seconds:.0f} s in all. Method: docs/experiments.md (DDP measurements).", "",
        "## Crossover: the touched fraction above which dense is cheaper", "", *cross_lines, "",
        *_reading(rows, cross), "",
        "![crossover](ddp-bench-crossover.png)", "",
        "## The presets' tables and batches", "", *_preset_table(rows), "",
        "![presets](ddp-bench-presets.png)", "",
        f"## The sweep ({SWEEP_NAME})", "", *_sweep_table(rows), "",
        "    " + command, ""])
    (out / "ddp-bench.md").write_text(text)
    return text
