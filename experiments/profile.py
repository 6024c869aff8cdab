"""``python -m experiments profile --config base.yaml --config <preset>.yaml [--attention ...] [--key value]``.

A profile of training steps per attention layout: how much of a step is attention. Each layout's
ranker, AdamW and one real batch are built by the training CLI's parser (no trainer, no MLflow
run); ``--warmup`` steps, then ``--steps`` timed steps and the same again under ``torch.profiler``.
Attention is the time inside the ``attention/self`` and ``attention/target`` ``record_function``
ranges (forward) plus the autograd nodes of their ops (backward): GPU kernel time on a GPU, wall
time on CPU. README.md ("Ablations and reports") and the written file say more.

    python -m experiments profile --config experiments/configs/base.yaml \
        --config experiments/configs/paper.yaml --data.data_dir data/paper
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kernels.launch_table import device_slug
from pipeline.runenv import device_name, git_commit
from models.config import ATTENTIONS
from pipeline.cli import RankerCLI
from experiments.runs import fmt
from pipeline.errors import command
from pipeline.cuda_graphs import GraphedTrainStep, token_capacities
from pipeline.module import autocast_dtype

ATTENTION_RANGES = ("attention/self", "attention/target")
_STEP_RANGE = "profile/step"
_BACKWARD_SCOPE = 1  # at::RecordScope::BACKWARD_FUNCTION


class _BuildCLI(RankerCLI):
    """The training CLI's parser and classes without a trainer or an MLflow run."""

    def instantiate_trainer(self, **kwargs):
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(module, opt, batch: dict, amp) -> None:
    """One eager step as training runs it: forward + loss, backward, the gradients as the
    optimizer takes them (``model.embedding_grad``), optimizer step."""
    opt.zero_grad(set_to_none=True)
    with amp:
        loss = module.compute_loss(batch)
    loss.backward()
    module.grad_sync(all_grads=False)
    opt.step()


def graphed_step_ms(module, opt, batch: dict, cfg, device, steps: int) -> float:
    """Back-to-back time of the step that ``model.cuda_graphs`` trains with (the batch in one
    bucket of its own size: forward and backward replayed, then the AdamW step), in ms."""
    params = [p for p in module.parameters() if p.requires_grad]
    graphs = GraphedTrainStep(module._graph_loss, params, token_capacities([batch["n_tokens"]], 1),
                              int(batch["label"].shape[0]), module.data_spec_n_dense, int(batch["max_seq_len"]),
                              device, autocast_dtype(cfg.trainer.precision))
    graphs.capture()
    for _ in range(3):
        graphs(batch)
        opt.step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        graphs(batch)
        opt.step()
    _sync(device)
    for p in params:
        p.grad = None
    return 1e3 * (time.perf_counter() - t0) / steps


def _descendants(evt):
    for ch in evt.cpu_children:
        yield ch
        yield from _descendants(ch)


def _has_ancestor(evt, chosen: set[int]) -> bool:
    p = evt.cpu_parent
    while p is not None:
        if id(p) in chosen:
            return True
        p = p.cpu_parent
    return False


def attention_times(events, cuda: bool) -> dict:
    """Microseconds inside attention (forward ranges, linked backward nodes) and per step."""
    t = (lambda e: e.device_time_total) if cuda else (lambda e: e.cpu_time_total)
    cpu_events = [e for e in events if e.device_type.name == "CPU"]
    ranges = [e for e in cpu_events if e.name in ATTENTION_RANGES]
    fwd = {name: sum(t(e) for e in ranges if e.name == name) for name in ATTENTION_RANGES}
    links = {(d.sequence_nr, d.thread) for r in ranges for d in _descendants(r) if d.sequence_nr >= 0}
    bwd_events = [
        e for e in cpu_events
        if getattr(e, "scope", 0) == _BACKWARD_SCOPE
        and e.fwd_thread is not None and (e.sequence_nr, e.fwd_thread) in links
    ]
    chosen = {id(e) for e in bwd_events}
    top = [e for e in bwd_events if not _has_ancestor(e, chosen)]  # no double counting of nesting
    steps = [e for e in cpu_events if e.name == _STEP_RANGE]
    return {
        "fwd_self": fwd["attention/self"], "fwd_target": fwd["attention/target"],
        "bwd": sum(t(e) for e in top), "bwd_ops": sorted({e.name.split(": ")[-1] for e in top}),
        "step_wall": [e.cpu_time_total for e in steps], "ranges": len(ranges),
    }


def top_ops(prof, cuda: bool, n: int) -> list[tuple[str, float]]:
    """The n ops with the most self time (GPU kernel time on CUDA), in us per profiled run."""
    skip = {*ATTENTION_RANGES, _STEP_RANGE}
    key = (lambda a: a.self_device_time_total) if cuda else (lambda a: a.self_cpu_time_total)
    avgs = [  # host-side ops; on CUDA each with the kernel time it launched (not the kernels again)
        a for a in prof.key_averages()
        if a.device_type.name == "CPU" and a.key not in skip and not a.key.startswith("ProfilerStep")
    ]
    avgs.sort(key=key, reverse=True)
    return [(a.key, key(a)) for a in avgs[:n] if key(a) > 0]


def profile_layout(attention: str, configs: list[str], extra: list[str], steps: int, warmup: int,
                   batches: dict, n_top: int) -> dict:
    args = [a for c in configs for a in ("--config", c)] + extra + ["--model.ranker.attention", attention]
    cli = _BuildCLI(args=args, run=False)  # as `python -m pipeline fit <args>` would build them
    module, dm, cfg = cli.model, cli.datamodule, cli.config
    accel = str(cfg.trainer.accelerator)
    device = torch.device("cuda" if torch.cuda.is_available() and accel in ("auto", "gpu", "cuda") else "cpu")
    key = (str(dm.data_dir), dm.batch_size, dm.max_seq_len, dm.seed)
    if key not in batches:  # every layout reads the same batch: the first of epoch 0
        dm.setup("fit")
        batches[key] = next(iter(dm.train_dataloader()))
    batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batches[key].items()}
    module = module.to(device).train()
    if module.compile_model:  # record_function ranges do not survive torch.compile
        print(f"note: {attention}: model.compile_model is ignored; the eager step is profiled", file=sys.stderr)
        module.compile_model = False
    opt = module.configure_optimizers()
    dtype = autocast_dtype(cfg.trainer.precision)
    amp = torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        train_step(module, opt, batch, amp)
    _sync(device)
    plain, launch = [], []
    for _ in range(steps):  # step time without the profiler's overhead
        t0 = time.perf_counter()
        train_step(module, opt, batch, amp)
        t1 = time.perf_counter()  # the host is done: what is left is the GPU's queue
        _sync(device)
        plain.append(time.perf_counter() - t0)
        launch.append(t1 - t0)
    t0 = time.perf_counter()
    for _ in range(steps):  # back to back, as training runs: host and GPU overlap
        train_step(module, opt, batch, amp)
    _sync(device)
    chained_s = (time.perf_counter() - t0) / steps
    graph_ms = graphed_step_ms(module, opt, batch, cfg, device, steps) if module.cuda_graphs and cuda else None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(_STEP_RANGE):
                train_step(module, opt, batch, amp)
                _sync(device)
    events = prof.events()
    times = attention_times(events, cuda)
    if times["ranges"] == 0:
        raise RuntimeError("no attention/* ranges in the profile: models/attention.py lost its record_function")
    if times["fwd_self"] + times["fwd_target"] <= 0:
        print(f"warning: {attention}: no {'GPU kernel' if cuda else 'CPU'} time inside the attention ranges",
              file=sys.stderr)
    step_us = sum(times["step_wall"]) / max(len(times["step_wall"]), 1)
    attn_us = (times["fwd_self"] + times["fwd_target"] + times["bwd"]) / steps
    gpu_ms = sum(  # every kernel, memcpy and memset once (the device-side events)
        e.self_device_time_total for e in events
        if e.device_type.name != "CPU" and not getattr(e, "is_user_annotation", False)
    ) / steps / 1e3 if cuda else None
    return {
        "attention": attention, "device": str(device), "precision": str(cfg.trainer.precision),
        "batch_size": dm.batch_size, "max_seq_len": dm.max_seq_len, "n_tokens": int(batch["n_tokens"]),
        "step_ms": 1e3 * sorted(plain)[len(plain) // 2], "prof_step_ms": step_us / 1e3,
        "chained_step_ms": 1e3 * chained_s, "host_ms": 1e3 * sorted(launch)[len(launch) // 2],
        "graph_step_ms": graph_ms, "gpu_ms": gpu_ms,
        "attn_fwd_self_ms": times["fwd_self"] / steps / 1e3, "attn_fwd_target_ms": times["fwd_target"] / steps / 1e3,
        "attn_bwd_ms": times["bwd"] / steps / 1e3, "attn_ms": attn_us / 1e3,
        "share": attn_us / step_us if step_us > 0 else float("nan"),
        "bwd_ops": times["bwd_ops"],
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "top": [(name, us / steps / 1e3) for name, us in top_ops(prof, cuda, n_top)],
    }


def markdown(results: list[dict], args, extra: list[str]) -> str:
    try:
        import triton
        triton_v = triton.__version__
    except ImportError:
        triton_v = "none"
    r0 = results[0]
    cuda = r0["device"].startswith("cuda")
    unit = "GPU kernel time" if cuda else "CPU wall time"
    columns = [("step ms", "step_ms"), ("back-to-back step ms", "chained_step_ms"), ("host ms", "host_ms"),
               ("profiled step ms", "prof_step_ms"),
               *([("GPU busy ms", "gpu_ms"), ("CUDA-graph step ms", "graph_step_ms")] if cuda else []),
               ("attn fwd self ms", "attn_fwd_self_ms"), ("attn fwd target ms", "attn_fwd_target_ms"),
               ("attn bwd ms", "attn_bwd_ms"), ("attn ms", "attn_ms"), ("attn share", "share"),
               *([("peak GB", "peak_mem_gb")] if cuda else [])]
    lines = [
        "# One-step profile per attention layout: the share of attention in step time",
        "",
        f"- device: {device_name()}; torch {torch.__version__}; triton {triton_v}; "
        f"python {platform.python_version()}",
        f"- commit: {git_commit()}; date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- configs: {' '.join(args.config)}" + (f"; overrides: {' '.join(extra)}" if extra else ""),
        f"- batch: {r0['batch_size']} examples, max_seq_len {r0['max_seq_len']}, {r0['n_tokens']} history "
        f"items (fill {r0['n_tokens'] / (r0['batch_size'] * r0['max_seq_len']):.2f}); precision {r0['precision'] if r0['precision'] != 'None' else '32 (default)'}; "
        f"{args.warmup} warm-up steps, {args.steps} timed and {args.steps} profiled steps on the same batch",
        "",
        "| attention | " + " | ".join(title for title, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
        *("| " + " | ".join([r["attention"], *(fmt(r.get(key), ".3f" if key == "share" else ".2f")
                                              for _, key in columns)]) + " |" for r in results),
        "",
        f"What was measured: step ms is the median wall time of a training step (forward, BCE loss, "
        f"backward, AdamW step; synchronised) without the profiler; back-to-back step ms is the mean "
        f"over steps run without a sync in between, as training runs them; host ms is the median time "
        f"until the step's Python returns (launch side). Host ms close to the back-to-back time while "
        f"the GPU is busy for less means the step is bound by the host, not the GPU. CUDA-graph step ms "
        f"(with model.cuda_graphs) is the back-to-back time of the step replayed as a CUDA graph, "
        f"the batch in a bucket of its own size, plus the AdamW step. The other columns "
        f"come from the profiled steps, per step. Attention is {unit} inside the `attention/self` (all encoder layers) "
        f"and `attention/target` record_function ranges (forward), plus the backward autograd nodes "
        f"of the ops in those ranges, linked by the profiler's (sequence_nr, forward thread); "
        f"projections and FFN are not attention. attn share = attn ms / profiled step ms.",
        "",
        "Top ops by self " + ("GPU kernel time" if cuda else "CPU time") + " (ms per step):",
        "",
    ]
    for r in results:
        ops = "; ".join(f"`{name}` {ms:.2f}" for name, ms in r["top"])
        lines.append(f"- {r['attention']}: {ops}")
        lines.append(f"  - attention backward nodes: {', '.join(r['bwd_ops']) or 'none'}")
    return "\n".join(lines) + "\n"


@command
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m experiments profile", description=__doc__.split("\n")[0],
                                epilog="Any other --key value goes to the training CLI (e.g. --data.data_dir data/paper).")
    p.add_argument("--config", action="append", required=True, help="a training config (repeatable, in order)")
    p.add_argument("--attention", "--backends", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS,
                   help="the attention layouts to profile (--backends: the old name)")
    p.add_argument("--steps", type=int, default=3, help="timed and profiled steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (Triton autotuning, caches)")
    p.add_argument("--top", type=int, default=6, help="ops listed per layout")
    p.add_argument("--out", default=None,
                   help="markdown file (default: experiments/results/profile_<preset>_<device>.md)")
    args, extra = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.steps <= 0 or args.warmup < 0:
        p.error("--steps must be > 0 and --warmup >= 0")
    out = Path(args.out or f"experiments/results/profile_{Path(args.config[-1]).stem}_{device_slug()}.md")
    warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step logs; no trainer here
    warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")  # our own argv
    batches: dict = {}
    results = []
    for attention in args.attention:
        print(f"profiling {attention} ...", file=sys.stderr, flush=True)
        results.append(profile_layout(attention, args.config, extra, args.steps, args.warmup, batches, args.top))
    text = markdown(results, args, extra)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({  # for experiments.report's profile section
        "device": device_name(), "commit": git_commit(), "torch": torch.__version__, "configs": args.config,
        "overrides": extra, "results": results}, indent=1, default=str) + "\n")
    print(f"written {out} and {out.with_suffix('.json').name}", file=sys.stderr)
    return 0

