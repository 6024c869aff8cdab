"""Embedding gradients across processes: bytes sent, peak memory and step time of the three
``model.embedding_grad`` modes (dense, sparse, densify) on Gloo, CPU processes.

    python -m experiments ddp-bench --worlds 2 4 --out experiments/results    # a few minutes

Writes OUT/ddp/cpu/ddp-bench.{md,json} (tables, crossovers) and two plots. What a step is, the points
and what is measured (and the crossover it predicts): docs/experiments.md, "DDP measurements"."""

from __future__ import annotations

import json
import re
import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from data_gen.config import resolve_config
from data_gen.lengths import build_length_model
from data_gen.world import zipf_probs
from experiments import parser
from experiments.figures import finish, legend_outside
from pipeline.dist import gloo_worker
from pipeline.gradsync import EMBEDDING_GRADS, GradSync
from pipeline.optim import build_optimizer
from pipeline.runenv import device_name, git_commit

PRESETS = {"tiny": (20_000, 32, 64, 32), "small": (100_000, 32, 256, 64), "paper": (1_000_000, 128, 512, 1024)}
FRACTIONS = (0.01, 0.03, 0.1, 0.2, 0.35, 0.5, 0.7, 1.0)
SWEEP_TABLE = PRESETS["small"][:2]


def points(fractions=FRACTIONS) -> list[dict]:
    """Every measured configuration: the presets' points, then the sweep over fractions."""
    out = [{"kind": "preset", "name": name, "vocab": v, "dim": d, "batch": b, "max_seq_len": L}
           for name, (v, d, b, L) in PRESETS.items()]
    out += [{"kind": "sweep", "name": f"f={f:g}", "vocab": SWEEP_TABLE[0], "dim": SWEEP_TABLE[1], "fraction": f}
            for f in fractions]
    return out


class Lookups:
    """The ids one process looks up at each step of one point (deterministic per rank, step)."""

    def __init__(self, point: dict, rank: int):
        self.point, self.rank = point, rank
        if point["kind"] == "preset":
            self.lengths = build_length_model(resolve_config(point["name"]))
            cdf = np.cumsum(zipf_probs(point["vocab"], 1.0))
            self.cdf = cdf / cdf[-1]
            self.perm = np.random.default_rng(0).permutation(point["vocab"])  # popular ids scattered

    def __call__(self, step: int) -> torch.Tensor:
        p, rng = self.point, np.random.default_rng([self.rank, step, 17])
        if p["kind"] == "sweep":
            return torch.from_numpy(rng.choice(p["vocab"], int(p["fraction"] * p["vocab"]), replace=False))
        lengths = np.minimum(self.lengths.sample(rng, p["batch"]), p["max_seq_len"])
        n = int(lengths.sum()) + p["batch"]  # the history items and one candidate per example
        ranks = np.minimum(np.searchsorted(self.cdf, rng.random(n)), p["vocab"] - 1)
        return torch.from_numpy(self.perm[ranks])


def _proc_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _wchar() -> int:
    return int(re.search(r"wchar: (\d+)", Path("/proc/self/io").read_text()).group(1))


def measure(point: dict, mode: str, rank: int, steps: int, warmup: int) -> dict:
    """One process's medians over `steps` timed steps (after `warmup`) of one point and mode."""
    torch.manual_seed(0)
    table = torch.nn.Embedding(point["vocab"], point["dim"], sparse=mode != "dense")
    head = torch.nn.Parameter(torch.randn(point["dim"]) / point["dim"] ** 0.5)
    params = [table.weight, head]
    opt = build_optimizer("sgd", params, table.weight, lr=0.01, weight_decay=0.0, betas=(0.9, 0.98), fused=None)
    sync = GradSync(mode, table.weight, params, manual_table=True)
    lookups = Lookups(point, rank)
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident memory starts again here
    base = _proc_kib("VmRSS")
    rows = []
    for step in range(warmup + steps):
        ids = lookups(step)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        (table(ids) @ head).square().mean().backward()
        t1, w0, predicted = time.perf_counter(), _wchar(), sync.sent_bytes
        sync(all_grads=True)
        t2, w1 = time.perf_counter(), _wchar()
        opt.step()
        t3 = time.perf_counter()
        rows.append((t3 - t0, t2 - t1, w1 - w0, sync.sent_bytes - predicted, ids.unique().numel()))
    r = np.array(rows[warmup:], dtype=np.float64)
    return {"step_ms": 1e3 * np.median(r[:, 0]), "sync_ms": 1e3 * np.median(r[:, 1]),
            "sent_measured": float(np.median(r[:, 2])), "sent_predicted": float(np.median(r[:, 3])),
            "touched": float(r[:, 4].mean() / point["vocab"]), "peak_mb": (_proc_kib("VmHWM") - base) / 1024}


def _worker(rank: int, world: int, store: str, todo: list[dict], steps: int, warmup: int, out: str) -> None:
    torch.set_num_threads(1)
    with gloo_worker(rank, world, store):
        for point in todo:
            for mode in EMBEDDING_GRADS:
                mine = measure(point, mode, rank, steps, warmup)
                every = [None] * world
                dist.all_gather_object(every, mine)
                if rank == 0:
                    with open(out, "a") as f:
                        f.write(json.dumps({**point, "mode": mode, "world": world, **combine(every)}) + "\n")


def combine(ranks: list[dict]) -> dict:
    """One row from every process's: the slowest step, the mean bytes, the largest memory."""
    return {"step_ms": max(r["step_ms"] for r in ranks), "sync_ms": max(r["sync_ms"] for r in ranks),
            "sent_measured": float(np.mean([r["sent_measured"] for r in ranks])),
            "sent_predicted": float(np.mean([r["sent_predicted"] for r in ranks])),
            "touched": float(np.mean([r["touched"] for r in ranks])), "peak_mb": max(r["peak_mb"] for r in ranks)}


def run(worlds: list[int], steps: int, warmup: int, todo: list[dict]) -> list[dict]:
    """Measure every point for each world size (one set of processes per world size)."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.jsonl"
        for world in worlds:
            t0 = time.perf_counter()
            store = str(Path(tmp) / f"rendezvous-{world}")
            mp.start_processes(_worker, args=(world, store, todo, steps, warmup, str(rows)), nprocs=world,
                               start_method="spawn")
            print(f"world size {world}: {time.perf_counter() - t0:.0f} s", flush=True)
        return [json.loads(line) for line in rows.read_text().splitlines()]


# ---- the report: tables, crossovers and plots ------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # only where a plot is drawn

    return plt


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
    plt = _pyplot()
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
    plt = _pyplot()
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
        *_reading(rows, cross), "", "![crossover](ddp-bench-crossover.png)", "",
        "## The presets' tables and batches", "", *_preset_table(rows), "", "![presets](ddp-bench-presets.png)", "",
        f"## The sweep ({SWEEP_NAME})", "", *_sweep_table(rows), "",
        "    " + command, ""])
    (out / "ddp-bench.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = parser("ddp-bench", __doc__)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="numbers of processes")
    p.add_argument("--steps", type=int, default=3, help="timed steps per point and mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--presets", nargs="*", default=list(PRESETS), help="which preset points (none: only the sweep)")
    p.add_argument("--fractions", type=float, nargs="*", default=list(FRACTIONS), help="the sweep's fractions")
    p.add_argument("--out", default="runs", help="results root of OUT/ddp/cpu/")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    todo = [pt for pt in points(args.fractions) if pt["kind"] == "sweep" or pt["name"] in args.presets]
    out = Path(args.out) / "ddp" / "cpu"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = run(args.worlds, args.steps, args.warmup, todo)
    command = shlex.join(["python", "-m", "experiments", "ddp-bench", *argv])
    print(write_report(rows, out, command, time.perf_counter() - t0))

