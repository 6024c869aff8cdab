"""Tables and plots of a sweep, regenerated from its MLflow runs.

    python -m experiments report --parent <run id or name> [--out experiments/results] [--commit SHA]
    make report PARENT=seq_len

One row per grid point (its finished run, else its OOM record, else its latest attempt; runs of
an older grid or budget are left out) in ``<out>/<ablation>/report.md``, with ``runs.csv`` and
the plots beside it, all logged to the parent run (``report/``); README.md ("Ablations and
reports") lists what the report holds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import mlflow
import polars as pl
import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from experiments import plots
from experiments import runs as runs_
from experiments import ablation as _sweep_spec
from experiments.comparison import log_comparison
from pipeline.errors import ConfigError, command
from pipeline.tracking import REPO_ROOT, check_tracking, tracking_uri

THROUGHPUT = "perf/train_examples_per_s"


def ratios(df: pl.DataFrame, axes: list[str], series: str, baseline: str, mem: str) -> dict[str, dict[str, list]]:
    """Baseline over each other series value, matched on every other axis: throughput and memory."""
    others = [a for a in axes if a != series]
    rows = {(tuple(r[a] for a in others), r[series]): r for r in df.iter_rows(named=True)}
    out: dict[str, dict[str, list]] = {}
    for value in dict.fromkeys(df[series].to_list()):
        if value == baseline:
            continue
        cur = out.setdefault(f"{baseline} / {value}", {"x": [], "throughput": [], "memory": [], "key": [], "note": []})
        for key in dict.fromkeys(k for k, _ in rows):
            b, o = rows.get((key, baseline)), rows.get((key, value))
            if b is None or o is None:
                continue
            ok = b["status"] == "OK" and o["status"] == "OK"
            cur["key"].append(key)
            cur["x"].append(key[0] if key else "")
            cur["throughput"].append(_div(b.get(THROUGHPUT), o.get(THROUGHPUT)) if ok else None)
            cur["memory"].append(_div(o.get(mem), b.get(mem)) if ok else None)
            cur["note"].append("" if ok else f"{value} {o['status']}" if o["status"] != "OK" else f"{baseline} {b['status']}")
    return out


def _div(a, b):
    return a / b if a is not None and b else None


def _values(df: pl.DataFrame, col: str) -> list:
    """The column's distinct values that are set, in first-seen order."""
    return [v for v in dict.fromkeys(df[col].to_list()) if v]


def _distinct(df: pl.DataFrame, col: str) -> str:
    return ", ".join(f"`{v}`" for v in _values(df, col)) or "-"


def _environment(df: pl.DataFrame) -> tuple[pl.DataFrame, list[tuple[str, str]]]:
    """The runs whose tags describe the sweep (the finished ones, every run where none finished),
    and their data sets as (digest, directory name)."""
    ok = df.filter(pl.col("status") == "OK")
    env = ok if ok.height else df
    pairs = dict.fromkeys(zip(env["tag.data_digest"].to_list(), env["tag.data_dir"].to_list()))
    return env, [(d, Path(p).name if p else "?") for d, p in pairs if d]


def header_lines(parent: Run, df: pl.DataFrame, commit: str | None, stop: str = "") -> list[str]:
    """The report's head; `stop`: early_stopping_words of the parent, '' for none."""
    tags = parent.data.tags
    name = tags.get("sweep.name", parent.info.run_name)
    counts = Counter(df["status"].to_list())
    commits = _distinct(df, "tag.git_commit")
    if commit and commits in ("-", "`unknown`"):
        commits = f"`{commit}` (given to the report; the runs recorded {commits})"
    env, data_sets = _environment(df)
    data = ", ".join(f"`{d}` ({folder})" for d, folder in data_sets)
    return [
        f"# Ablation `{name}`", "", tags.get("sweep.description", ""), "",
        f"- MLflow: parent run `{parent.info.run_id}` ({parent.info.status}), experiment id "
        f"`{parent.info.experiment_id}`; file `{tags.get('sweep.file', '?')}`; command `{tags.get('sweep.command', '?')}`",
        f"- points: {df.height} ({', '.join(f'{n} {s}' for s, n in counts.items())})",
        f"- device: {_distinct(env, 'tag.device')}; torch {_distinct(env, 'tag.torch_version')}, "
        f"triton {_distinct(env, 'tag.triton_version')}, CUDA {_distinct(env, 'tag.cuda_version')}, "
        f"Python {_distinct(env, 'tag.python_version')}, Lightning {_distinct(env, 'tag.lightning_version')}",
        f"- git commit: {commits}",
        f"- data digest: {data or '-'}",
        f"- budget and overrides of every run: `{tags.get('sweep.set', '{}')}`",
        *([f"- every run trains {stop}: the EarlyStopping callback of the ablation file's configs"]
          if stop else []),
        f"- written {dt.datetime.now().astimezone().isoformat(timespec='seconds')} by "
        f"`python -m experiments report --parent {name}`",
        "",
        "Throughput is over steady-state training steps (warm-up and validation excluded); tokens are "
        "real history items. Wall time is the whole run's process (start-up and data loading included).",
        *shared_device_note(env),
    ]


def plot_subtitle(parent: Run, df: pl.DataFrame, stop: str = "") -> str:
    """What every plot's numbers depend on: device, data, budget (`stop`: early_stopping_words), commit."""
    env, data_sets = _environment(df)
    device = ", ".join(_values(env, "tag.device")) or "?"
    data = ", ".join(f"{folder} ({d[:8]})" for d, folder in data_sets) or "?"
    commits = ", ".join(str(v)[:12] for v in _values(env, "tag.git_commit")) or "?"
    budget = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in json.loads(parent.data.tags.get("sweep.set") or "{}").items()
                       if any(w in k for w in ("max_steps", "limit_train", "max_epochs", "batch_size", "warmup")))
    budget = ", ".join(w for w in (stop, budget) if w)
    return f"{device} | data {data} | {budget or 'budget: see report.md'} | commit {commits}"


def early_stopping_words(parent: Run) -> str:
    """'until val/auc stops rising (at most 3 epochs)' where the ablation file's configs, as they are
    now, end runs by an EarlyStopping callback (the accuracy ablations' budget); '' otherwise."""
    try:
        configs = _sweep_spec.read(REPO_ROOT / parent.data.tags.get("sweep.file", "")).get("configs") or []
    except ConfigError:
        return ""
    trainer: dict = {}
    for name in configs:
        path = _sweep_spec.config_path(name)
        if path.is_file():
            trainer.update((yaml.safe_load(path.read_text()) or {}).get("trainer") or {})
    stops = [(c.get("init_args") or {}) for c in trainer.get("callbacks") or []
             if isinstance(c, dict) and str(c.get("class_path", "")).endswith("EarlyStopping")]
    if not stops:
        return ""
    epochs = json.loads(parent.data.tags.get("sweep.set") or "{}").get("trainer.max_epochs", trainer.get("max_epochs"))
    cap = f" (at most {epochs} epochs)" if epochs else ""
    return f"until {stops[0].get('monitor', 'the monitored metric')} stops rising{cap}"


def shared_device_note(df: pl.DataFrame) -> list[str]:
    """A warning when runs shared the device (`experiments.sweep --parallel`), a note when they ran
    at once on GPUs of their own (`--gpus 0,1`)."""
    shared = sorted({int(p) for p in df["parallel"].to_list() if p and int(p) > 1})
    alone = df.filter(pl.col("parallel") == "1") if "concurrent" in df.columns else None  # older runs.csv
    side = [] if alone is None else sorted({int(c) for c in alone["concurrent"].to_list() if c and int(c) > 1})
    lines = [] if not side else [
        "", f"{alone.filter(pl.col('concurrent') != '1').height} runs had a GPU to themselves while up to "
            f"{max(side)} runs went at once on different GPUs of one host (`experiments.sweep --gpus`), each "
            "pinned to its own share of the CPU cores."]
    if shared:
        lines += ["", f"**{df.filter(pl.col('parallel') != '1').height} of these runs shared the GPU with other runs "
                  f"(`--parallel {', '.join(map(str, shared))}`): their throughput and wall time are not "
                  "comparable with runs that had the device alone; peak memory is per process and accuracy "
                  "does not depend on it.**"]
    return lines


def ratio_section(rat: dict[str, dict[str, list]], x: str) -> list[str]:
    if not any(r["x"] for r in rat.values()):  # only the baseline series ran (a --where subset): nothing to set against
        return []
    rows = [[name, xv, f"{runs_.fmt(t, '.2f')}x", f"{runs_.fmt(m, '.2f')}x", note] for name, r in rat.items()
            for xv, t, m, note in zip(r["x"], r["throughput"], r["memory"], r["note"])]
    return ["", "## Speed-up and memory saving of the baseline over the other series", "",
            *runs_.table_lines(["series", x, "train ex/s ratio", "peak memory ratio (other / baseline)", "note"], rows)]


def oracle_of(client: MlflowClient, df: pl.DataFrame) -> dict | None:
    """The test split's oracle figures from the meta.json logged by the first finished run."""
    for run_id in df.filter(pl.col("status") == "OK")["run_id"].to_list():
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = client.download_artifacts(run_id, "data/meta.json", tmp)
            except mlflow.exceptions.MlflowException:
                continue
            test = json.loads(Path(path).read_text())["splits"]["test"]
            return with_whole_window(test.get("oracle"), (test.get("length_stats") or {}).get("max"))
    return None


def with_whole_window(oracle: dict | None, longest: int | None) -> dict | None:
    """The oracle's figures plus ``longest_history`` (the split's longest history) and the window
    that holds it: from the last k >= that length, the planted logit sees every item, so its AUC
    is the full history's (p_true is the sigmoid of that logit)."""
    if not oracle or longest is None or "auc" not in oracle:
        return oracle
    return {f"auc_recent_{int(longest)}": oracle["auc"], **oracle, "longest_history": int(longest)}


def _holds_longest(oracle: dict, k) -> bool:
    """Whether the last k items hold the split's longest history (the oracle then sees every item)."""
    longest = oracle.get("longest_history")
    return longest is not None and str(k).isdigit() and int(k) >= longest


def oracle_at(oracle: dict, k) -> float | None:
    """The oracle's AUC from the last k items: meta.json's figure, or the full history's where k
    is at least the longest history."""
    value = oracle.get(f"auc_recent_{k}")
    return oracle.get("auc") if value is None and _holds_longest(oracle, k) else value


def oracle_section(df: pl.DataFrame, x: str, oracle: dict, series: list[str] = ()) -> list[str]:
    lines = ["", "## Test AUC against the oracle (the planted label model, meta.json)", "",
             f"Oracle: full history {oracle.get('auc', float('nan')):.4f}, no history "
             f"{oracle.get('auc_recent_0', float('nan')):.4f}.", "",
             *runs_.table_lines([*series, x, "model test AUC", f"oracle AUC from the last {x} items"],
                                [[*(row[s] for s in series), row[x], runs_.fmt(row.get("test/auc"), ".4f"),
                                  runs_.fmt(oracle_at(oracle, row[x]), ".4f")] for row in df.iter_rows(named=True)])]
    if any(_holds_longest(oracle, k) for k in df[x].to_list()):
        longest = oracle["longest_history"]
        lines += ["", f"The longest test history has {longest} items: from the last {longest} or more, the "
                  "oracle sees every item, and its AUC is the full history's."]
    return lines


def targets_section(df: pl.DataFrame, spec: dict, mem: str) -> list[str]:
    """PASS/MISS of report.targets: the baseline series against another at one grid point."""
    targets, ser, base, seeds = spec.get("targets") or [], spec.get("series"), spec.get("baseline"), spec.get("seeds")
    if not targets:
        return []
    lines = ["", "## Targets", "", f"Each row compares {ser} `{base}` with another {ser} at one point of "
             "the grid (same data, budget and seed)" + (f"; every number is the mean over the `{seeds}` axis "
                                                       "(the runs of every seed must be OK)" if seeds else "") + ".",
             "", "| point | measured | target | result |", "|---|---|---|---|"]
    for t in targets:
        at = {a: str(v) for a, v in (t.get("at") or {}).items()}
        hits = [df.filter(pl.col(ser) == value, *(pl.col(a) == v for a, v in at.items()))
                for value in (base, str(t["vs"]))]
        b, o = (_mean_row(hit) if seeds else hit.row(0, named=True) if hit.height else None for hit in hits)
        where = ", ".join(f"{a}={v}" for a, v in at.items())
        point = f"{where}: {base} vs {t['vs']}" if where else f"{base} vs {t['vs']}"
        if b is None or o is None or b["status"] != "OK" or o["status"] != "OK":
            status = "missing" if b is None or o is None else f"{base} {b['status']}, {t['vs']} {o['status']}"
            lines.append(f"| {point} | - | - | NOT MEASURED ({status}) |")
            continue
        diff = None if b.get("test/auc") is None or o.get("test/auc") is None else abs(b["test/auc"] - o["test/auc"])
        checks = [("min_speedup", "train ex/s ratio", _div(b.get(THROUGHPUT), o.get(THROUGHPUT)), ">=", "x"),
                  ("max_memory_ratio", "peak memory ratio", _div(b.get(mem), o.get(mem)), "<=", "x"),
                  ("max_auc_diff", "test AUC absolute difference", diff, "<=", "")]
        for key, name, value, op, unit in (c for c in checks if c[0] in t):
            limit = t[key]
            ok = value is not None and (value >= limit if op == ">=" else value <= limit)
            lines.append(f"| {point} | {name} {runs_.fmt(value, '.4f' if not unit else '.2f')}{unit} | "
                         f"{op} {limit}{unit} | {'PASS' if ok else 'MISS'} |")
    return lines


def recovery_section(df: pl.DataFrame, x: str, spec: dict, mem: str, out: Path | None = None) -> list[str]:
    """report.recovery: the share of the AUC gain from `low` to `high` (labels of axis x) that each
    candidate recovers and its online cost, as the section says, and the offline encoder's cost
    (encoder.json beside the report)."""
    rec = spec.get("recovery")
    if not rec:
        return []
    rows = {r[x]: r for r in df.iter_rows(named=True)}
    low, high = rows.get(str(rec["low"])), rows.get(str(rec["high"]))
    lines = ["", "## Recovery of the long history's gain", "",
             f"Share of the test-AUC gain from `{rec['low']}` to `{rec['high']}` that each variant recovers, and its "
             f"online cost relative to `{rec['high']}` (time per training example, peak memory). Goal: share >= "
             f"{rec['min_share']} at cost ratios < {rec['max_cost_ratio']}.", ""]
    if not low or not high or low["status"] != "OK" or high["status"] != "OK":
        return lines + [f"NOT MEASURED: `{rec['low']}` or `{rec['high']}` did not finish."]
    gain = high["test/auc"] - low["test/auc"]
    lines += [f"AUC {rec['low']} {low['test/auc']:.4f}, {rec['high']} {high['test/auc']:.4f}: gain {gain:+.4f}.", "",
              f"| variant | test AUC | vs {rec['low']} | share of the gain | time per example vs high | memory vs high | result |",
              "|---|---|---|---|---|---|---|"]
    for name in rec["candidates"]:
        c = rows.get(str(name))
        if c is None or c["status"] != "OK":
            lines.append(f"| {name} | - | - | - | - | - | NOT MEASURED ({'missing' if c is None else c['status']}) |")
            continue
        share = (c["test/auc"] - low["test/auc"]) / gain if gain > 0 else None
        cost, memory = _div(high.get(THROUGHPUT), c.get(THROUGHPUT)), _div(c.get(mem), high.get(mem))
        ok = (share is not None and share >= rec["min_share"] and cost is not None and memory is not None
              and cost < rec["max_cost_ratio"] and memory < rec["max_cost_ratio"])
        lines.append(f"| {name} | {c['test/auc']:.4f} | {c['test/auc'] - low['test/auc']:+.4f} | {runs_.fmt(share, '.2f')} | "
                     f"{runs_.fmt(cost, '.2f')}x | {runs_.fmt(memory, '.2f')}x | {'PASS' if ok else 'MISS'} |")
    if gain <= 0:
        lines += ["", f"No gain from `{rec['low']}` to `{rec['high']}` at this budget: no share to recover."]
    if out is not None and (out / "encoder.json").is_file():
        e = json.loads((out / "encoder.json").read_text())
        r = e["results"]
        lines += ["", f"Encoder ({e['device']}, commit {str(e['commit'])[:12]}): {e['impressions']:,} impressions of "
                  f"days 1-{e['days_trained']}, histories up to {e['config']['max_seq_len']} items; "
                  f"{r['train/examples_per_s']:,.0f} examples/s, {r['train/seconds_per_day']:.1f} s per day of data, "
                  f"validation AUC {r['val/auc']:.4f}."]
    return lines


def _mean_row(runs: pl.DataFrame) -> dict | None:
    """One row standing for several seeds of a point: metric means; status OK only if all are."""
    if runs.height == 0:
        return None
    row = {"status": next((s for s in runs["status"].to_list() if s != "OK"), "OK")}
    for col in (THROUGHPUT, "test/auc", "mem/train_peak_allocated_mb", "mem/peak_rss_mb"):
        row[col] = runs[col].mean() if col in runs.columns and runs[col].null_count() < runs.height else None
    return row


def seeds_section(df: pl.DataFrame, seeds: str | None, series: list[str]) -> list[str]:
    """Test AUC over the seeds axis per point of the other axes: is a gap between attention layouts more
    than the run-to-run noise of one layout?"""
    if not seeds:
        return []
    ok = df.filter(pl.col("status") == "OK")
    keys = [a for a in series if a != seeds]
    rows = []
    for key in dict.fromkeys(tuple(r[k] for k in keys) for r in ok.iter_rows(named=True)):
        match = pl.all_horizontal([pl.col(k) == v for k, v in zip(keys, key)]) if keys else pl.lit(True)
        auc = ok.filter(match)["test/auc"].drop_nulls()
        std = auc.std() if auc.len() > 1 else None
        rows.append([*key, auc.len(), *(runs_.fmt(v, ".4f") for v in (auc.mean(), std, auc.min(), auc.max()))])
    return ["", f"## Test AUC over seeds (`{seeds}`)", "",
            *runs_.table_lines([*keys, "runs", "mean", "std", "min", "max"], rows)]


def convergence_section(client: MlflowClient, df: pl.DataFrame, axes: list[str], tol: float) -> list[str]:
    """Validation AUC at each check of every finished run that validated more than once, and
    whether it converged (the rule: the section's text)."""
    ok = df.filter(pl.col("status") == "OK")
    rows = []
    for r in ok.iter_rows(named=True):
        hist = sorted(client.get_metric_history(r["run_id"], "val/auc"), key=lambda m: m.step)
        if len(hist) < 2:
            continue
        last, prev = hist[-1].value, hist[-2].value
        gain = last - max(m.value for m in hist[:-1])  # over the best earlier check
        verdict = "rising" if gain > tol else "past its peak" if gain < -tol else "flat"
        tested = r.get("test/weights_step")
        curve = " → ".join(f"{m.value:.4f}" for m in hist[-4:])
        rows.append([*(str(r[a]) for a in axes), f"{hist[-2].step}-{hist[-1].step}", curve,
                     f"{last - prev:+.4f}", "-" if tested is None or math.isnan(tested) else f"{tested:.0f}", verdict])
    if not rows:
        return []
    done = sum(row[-1] != "rising" for row in rows)
    return ["", "## Convergence (validation AUC at each check)", "",
            f"A run counts as converged when its last validation check did not raise the best validation AUC so "
            f"far by more than {tol} (flat: within {tol} of that best; past its peak: below it by more; early "
            f"stopping on val/auc ends a run either way); "
            f"`tested at step` is the step whose weights the test metrics are of (the best checkpoint's where the "
            f"run kept one, named by its optimizer step; Lightning logs a validation at its own batch count, "
            f"which can be one less; `-`: the final weights of a run that did not log it): {done} of {len(rows)} "
            f"runs did.", "",
            *runs_.table_lines([*axes, "last interval (steps)", "val AUC (last checks)", "change", "tested at step",
                                "verdict"], rows)]


def profile_section(out_root: Path, pattern: str | None) -> list[str]:
    """The newest `experiments.profile` result matching pattern (under the results root): where a
    training step's time goes per attention layout, so the throughput ratios can be read against it."""
    if not pattern:
        return []
    found = sorted(out_root.glob(pattern), key=lambda p: p.stat().st_mtime)
    head = ["", "## Where a training step's time goes (one-step profile per attention layout)", ""]
    if not found:
        return [*head, f"No profile matching `{pattern}` under `{out_root.name}/` yet: run `make profile` "
                "with the ablation's preset on the same GPU."]
    md, js = found[-1], found[-1].with_suffix(".json")
    lines = [*head, f"From [`{md.name}`](../{md.name}) (its header states the device, commit and batch)."]
    if not js.is_file():
        return lines
    rows = json.loads(js.read_text())["results"]
    lines += ["", "| attention | step ms | host ms (launch side) | GPU busy ms | attention ms (fwd + bwd) | "
                  "rest of the step ms | attention share |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['attention']} | {r['step_ms']:.2f} | {runs_.fmt(r.get('host_ms'), '.2f')} | "
                     f"{runs_.fmt(r.get('gpu_ms'), '.2f')} | {r['attn_ms']:.2f} | "
                     f"{r['prof_step_ms'] - r['attn_ms']:.2f} | {r['share']:.3f} |")
    by = {r["attention"]: r for r in rows}
    j = by.pop("jagged", None)
    for other, o in (by.items() if j else []):
        lines.append(
            f"\n- {other} -> jagged: the profiled step goes from {o['prof_step_ms']:.2f} to "
            f"{j['prof_step_ms']:.2f} ms ({_div(o['prof_step_ms'], j['prof_step_ms']):.2f}x); attention from "
            f"{o['attn_ms']:.2f} to {j['attn_ms']:.2f} ms, the rest of the step (embeddings, projections and FFN on "
            f"padded rows for {other}, on real rows for jagged; interaction, MLP, optimizer) from "
            f"{o['prof_step_ms'] - o['attn_ms']:.2f} to {j['prof_step_ms'] - j['attn_ms']:.2f} ms. With attention "
            f"free, the step could at best be {_div(o['prof_step_ms'], j['prof_step_ms'] - j['attn_ms']):.2f}x "
            f"faster than {other}'s.")
    return lines


def write_report(parent: Run, out_root: Path, commit: str | None = None, log: bool = True) -> Path:
    """Write report.md, runs.csv and the plots under out_root/<ablation>/; returns that folder."""
    client = MlflowClient(tracking_uri())
    axes = runs_.parent_axes(parent)
    df = runs_.grid_frame(parent, json.loads(parent.data.tags.get("sweep.hashes") or "[]") or None)
    if df.height == 0:
        raise ConfigError(f"parent run {parent.info.run_id} has no child runs of its current grid")
    spec = json.loads(parent.data.tags.get("sweep.report") or "{}")
    names = list(axes)
    x = spec.get("x") or names[-1]
    series = [a for a in names if a != x]
    order = axes.get(x, [])
    name = parent.data.tags.get("sweep.name", parent.info.run_name)
    out = out_root / name
    out.mkdir(parents=True, exist_ok=True)
    mem, mem_label = runs_.memory_metric(df)
    header, rows = runs_.summary_rows(df, names)
    stop = early_stopping_words(parent)
    lines = [*header_lines(parent, df, commit, stop), "", "## Runs", "", runs_.markdown_table(header, rows)]
    sub, seeds = plot_subtitle(parent, df, stop), spec.get("seeds")
    made = [
        plots.line_plot(df, x, order, series, THROUGHPUT, "training examples/s (steady steps)", "Training throughput",
                        out / "throughput.png", subtitle=sub, seeds=seeds),
        plots.line_plot(df, x, order, series, mem, mem_label, "Peak memory", out / "memory.png", subtitle=sub,
                        seeds=seeds),
    ]
    base, ser = spec.get("baseline"), spec.get("series")
    rat: dict = {}
    ratio_axes = [x, *(a for a in names if a not in (x, ser))]
    if base and ser in names and base in df[ser].to_list():
        rat = ratios(df, ratio_axes, ser, base, mem)
        lines += ratio_section(rat, x)
        if x not in (ser, seeds):  # no x to draw the ratios against: the series alone, or seeds (table only)
            made.append(plots.ratio_plot(rat, x, order, f"{base} against the other {ser} values",
                                         out / "speedup.png", baseline=base, subtitle=sub))
    lines += seeds_section(df, seeds, names)
    lines += convergence_section(client, df, names, float(spec.get("converged_within", 0.002)))
    lines += targets_section(df, spec, mem)
    lines += recovery_section(df, x, spec, mem, out)
    lines += profile_section(out_root, spec.get("profile"))
    oracle = oracle_of(client, df) if spec.get("oracle") else None
    if oracle:
        lines += oracle_section(df, x, oracle, series)
    made.append(plots.line_plot(df, x, order, series, "test/auc", "test AUC", "Test AUC", out / "auc.png",
                                oracle=oracle, subtitle=sub, seeds=seeds))
    if spec.get("pareto"):
        made.append(plots.pareto_plot(df, x, names, THROUGHPUT, out / "pareto.png", oracle, subtitle=sub))
    made = [p for p in made if p is not None]
    lines += ["", "## Plots", "", *(f"![{p.stem}]({p.name})" for p in made)]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    df.write_csv(out / "runs.csv")
    if log:
        for path in [out / "report.md", out / "runs.csv", *made]:
            client.log_artifact(parent.info.run_id, str(path), artifact_path="report")
        title = f"{name}: {parent.data.tags.get('sweep.description', '')}"
        log_comparison(client, parent, df, names, ser if ser in names else None, rat,
                       [a for a in ratio_axes if a != ser], (header, rows), title.strip().rstrip(":"))
    return out


@command
def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m experiments report", description=__doc__.split("\n")[0])
    p.add_argument("--parent", required=True, help="the sweep's parent run: id or name (the ablation's name)")
    p.add_argument("--out", default=str(REPO_ROOT / "experiments" / "results"), help="results root")
    p.add_argument("--commit", default=None, help="git commit to state when the runs recorded 'unknown'")
    p.add_argument("--no-log", action="store_true", help="do not log the files to the parent run")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    mlflow.set_tracking_uri(tracking_uri())
    check_tracking(tracking_uri())
    parent = runs_.find_parent(MlflowClient(tracking_uri()), args.parent)
    out = write_report(parent, Path(args.out), args.commit, log=not args.no_log)
    print((out / "report.md").read_text())
    print(f"written to {out}/ and logged to parent run {parent.info.run_id} (artifacts: report/)"
          if not args.no_log else f"written to {out}/")
    return 0

