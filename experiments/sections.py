"""The sections of a sweep's report, computed from its grid's frame (experiments.runs): the
baseline's ratios, targets, seeds, convergence, recovery, the oracle's AUC and the loop traces.

    lines = targets_section(df, spec, "mem/train_peak_allocated_mb")   # markdown lines, [] if not asked

polars frames in, markdown lines (and the rows report.json keeps) out; no MLflow."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from experiments.runs import fmt, table_lines

if TYPE_CHECKING:
    import polars as pl
    from mlflow.tracking import MlflowClient


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
            shared = [name for name, r in ((baseline, b), (value, o)) if _shared_gpu(r)]
            why = "" if ok else f"{value} {o['status']}" if o["status"] != "OK" else f"{baseline} {b['status']}"
            cur["note"].append(why or (f"{' and '.join(shared)} shared the GPU: not comparable" if shared else ""))
    return out


def _div(a, b):
    return a / b if a is not None and b else None


def _shared_gpu(run: dict) -> bool:  # run at once with others: its examples/s says nothing of its speed
    return str(run.get("parallel") or "1") != "1"


def _where(df: pl.DataFrame, **equal) -> pl.DataFrame:
    """The rows whose columns equal the given values (every row for none)."""
    return df.filter(**equal) if equal else df


def ratio_section(rat: dict[str, dict[str, list]], x: str) -> list[str]:
    if not any(r["x"] for r in rat.values()):  # only the baseline series ran (a --where subset): nothing to set against
        return []
    rows = [[name, xv, f"{fmt(t, '.2f')}x", f"{fmt(m, '.2f')}x", note] for name, r in rat.items()
            for xv, t, m, note in zip(r["x"], r["throughput"], r["memory"], r["note"])]
    return ["", "## Speed-up and memory saving of the baseline over the other series", "",
            *table_lines(["series", x, "train ex/s ratio", "peak memory ratio (other / baseline)", "note"], rows)]


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


def oracle_section(df: pl.DataFrame, x: str, oracle: dict, series: list[str] = (), window: int | None = None,
                   terms: dict | None = None) -> list[str]:
    """Each run's test AUC beside the oracle's from the last `window` items (None: the run's x), the share of
    the gap from the oracle with no history to that one which the run closes, and `terms` (meta.json's
    oracle_terms) at those windows: each planted term's AUC alone and the logit's without it."""
    none = oracle.get("auc_recent_0")
    rows = []
    for row in df.iter_rows(named=True):
        seen, auc = oracle_at(oracle, row[x] if window is None else window), row.get("test/auc")
        closed = None if None in (seen, auc, none) or seen <= none else (auc - none) / (seen - none)
        rows.append([*(row[s] for s in series), row[x], fmt(auc, ".4f"), fmt(seen, ".4f"), fmt(closed, ".0%")])
    lines = ["", "## Test AUC against the oracle (the planted label model, meta.json)", "",
             f"Oracle: full history {oracle.get('auc', float('nan')):.4f}, no history "
             f"{oracle.get('auc_recent_0', float('nan')):.4f}.", "",
             *table_lines([*series, x, "model test AUC", f"oracle AUC from the last {window or x} items",
                           "gap closed (no history -> oracle)"], rows)]
    windows = [window] if window else df[x].to_list()  # the oracle's windows the section reads
    if any(_holds_longest(oracle, k) for k in windows):
        longest = oracle["longest_history"]
        lines += ["", f"The longest test history has {longest} items: from the last {longest} or more, the "
                  "oracle sees every item, and its AUC is the full history's."]
    def term_at(t: dict, kind: str, k: str) -> float | None:  # from the last k items, or all where k holds them all
        return t.get(f"{kind}_{k}", t.get(f"{kind}_full") if _holds_longest(oracle, k) else None)
    if ks := [k for k in dict.fromkeys(map(str, windows))
              if any(term_at(t, "alone", k) is not None for t in (terms or {}).values())]:
        head = [(kind, k) for kind in ("alone", "without") for k in ks]
        rows = [[term, *(fmt(term_at(t, kind, k), ".4f") for kind, k in head)] for term, t in terms.items()]
        lines += ["", f"Each planted term's oracle AUC from the last {window or x} items: the term alone, and the "
                  "planted logit without it (meta.json).", "", *table_lines(["term", *map(" ".join, head)], rows)]
    return lines


def target_rows(df: pl.DataFrame, spec: dict, mem: str) -> list[list[str]]:
    """report.targets judged, `base` (default report.baseline) vs `vs`: [point, measured, target, verdict]."""
    ser, base, seeds = spec.get("series"), spec.get("baseline"), spec.get("seeds")
    rows = []
    for t in spec.get("targets") or []:
        at, name = {a: str(v) for a, v in (t.get("at") or {}).items()}, str(t.get("base", base))
        hits = [_where(df, **{ser: value}, **at) for value in (name, str(t["vs"]))]
        if seeds:  # the seeds both series ran: a seed only one of them has would weigh on its mean alone
            hits = [h.filter(h[seeds].is_in(hits[1 - i][seeds].to_list())) for i, h in enumerate(hits)]
        b, o = (_mean_row(hit) if seeds else hit.row(0, named=True) if hit.height else None for hit in hits)
        where = ", ".join(f"{a}={v}" for a, v in at.items())
        point = f"{where}: {name} vs {t['vs']}" if where else f"{name} vs {t['vs']}"
        if b is None or o is None or b["status"] != "OK" or o["status"] != "OK":
            status = "missing" if b is None or o is None else f"{name} {b['status']}, {t['vs']} {o['status']}"
            rows.append([point, "-", "-", f"NOT MEASURED ({status})"])
            continue
        diff = None if b.get("test/auc") is None or o.get("test/auc") is None else abs(b["test/auc"] - o["test/auc"])
        checks = [("min_speedup", "train ex/s ratio", _div(b.get(THROUGHPUT), o.get(THROUGHPUT)), ">=", "x"),
                  ("max_memory_ratio", "peak memory ratio", _div(b.get(mem), o.get(mem)), "<=", "x"),
                  ("max_auc_diff", "test AUC absolute difference", diff, "<=", "")]
        for key, name, value, op, unit in (c for c in checks if c[0] in t):
            limit = t[key]
            ok = value is not None and (value >= limit if op == ">=" else value <= limit)
            shared = key == "min_speedup" and (_shared_gpu(b) or _shared_gpu(o))  # peak memory is each process's own
            rows.append([point, f"{name} {fmt(value, '.4f' if not unit else '.2f')}{unit}", f"{op} {limit}{unit}",
                         "NOT COMPARABLE (a run shared the GPU)" if shared else "PASS" if ok else "MISS"])
        if "min_auc_drop" in t:  # what removing a part costs: the limit, and beyond 2 std of the seeds' drops
            drops = _seed_drops(*hits, seeds)
            drop, spread = statistics.fmean(drops), 2 * statistics.stdev(drops) if len(drops) > 1 else 0.0
            rows.append([point, f"test AUC drop {drop:.4f} (2 std of the {len(drops)} seeds' drops {spread:.4f})",
                         f">= {t['min_auc_drop']}, beyond 2 std", "PASS" if drop >= t["min_auc_drop"] and drop > spread
                         else "MISS"])
    return rows


def _seed_drops(base: pl.DataFrame, other: pl.DataFrame, seeds: str | None) -> list[float]:
    """The baseline's test AUC minus the other's, seed by seed (the first rows' without a seeds axis)."""
    if not seeds:
        return [base["test/auc"][0] - other["test/auc"][0]]
    both = base.select(seeds, "test/auc").join(other.select(seeds, "test/auc"), on=seeds, suffix="_other")
    return (both["test/auc"] - both["test/auc_other"]).to_list()


def targets_section(df: pl.DataFrame, spec: dict, mem: str) -> list[str]:
    """PASS/MISS of report.targets: the baseline series against another at one grid point."""
    if not spec.get("targets"):
        return []
    ser, base, seeds = spec.get("series"), spec.get("baseline"), spec.get("seeds")
    mean = f"; every number is the mean over the `{seeds}` values both ran (the runs of every one must be OK)"
    return ["", "## Targets", "", f"Each row compares the first {ser} (`{base}` unless it names another) with "
            f"another {ser} at one point of the grid (same data, budget and seed){mean if seeds else ''}.",
            "", *table_lines(["point", "measured", "target", "result"], target_rows(df, spec, mem))]


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
        lines.append(f"| {name} | {c['test/auc']:.4f} | {c['test/auc'] - low['test/auc']:+.4f} | {fmt(share, '.2f')} | "
                     f"{fmt(cost, '.2f')}x | {fmt(memory, '.2f')}x | {'PASS' if ok else 'MISS'} |")
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
    row = {"status": next((s for s in runs["status"].to_list() if s != "OK"), "OK"),
           "parallel": max(runs["parallel"].to_list(), key=int) if "parallel" in runs.columns else "1"}
    for col in (THROUGHPUT, "test/auc", "mem/train_peak_allocated_mb", "mem/peak_rss_mb"):
        row[col] = runs[col].mean() if col in runs.columns and runs[col].null_count() < runs.height else None
    return row


def seeds_section(df: pl.DataFrame, seeds: str | None, series: list[str]) -> list[str]:
    """Test AUC over the seeds axis per point of the other axes: is a gap between attention layouts more
    than the run-to-run noise of one layout?"""
    if not seeds:
        return []
    ok = _where(df, status="OK")
    keys = [a for a in series if a != seeds]
    rows = []
    for key in dict.fromkeys(tuple(r[k] for k in keys) for r in ok.iter_rows(named=True)):
        auc = _where(ok, **dict(zip(keys, key)))["test/auc"].drop_nulls()
        std = auc.std() if auc.len() > 1 else None
        rows.append([*key, auc.len(), *(fmt(v, ".4f") for v in (auc.mean(), std, auc.min(), auc.max()))])
    return ["", f"## Test AUC over seeds (`{seeds}`)", "",
            *table_lines([*keys, "runs", "mean", "std", "min", "max"], rows)]


def convergence_rows(client: MlflowClient, df: pl.DataFrame, axes: list[str], tol: float) -> list[list[str]]:
    """Validation AUC at each check of every finished run that validated more than once: [axis
    labels..., last interval, curve, change, tested at step, verdict] per run (the rule:
    :func:`convergence_lines`' text)."""
    ok = _where(df, status="OK")
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
    return rows


def convergence_lines(rows: list[list[str]], axes: list[str], tol: float) -> list[str]:
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
            *table_lines([*axes, "last interval (steps)", "val AUC (last checks)", "change", "tested at step",
                                "verdict"], rows)]


def profile_section(out_root: Path, pattern: str | None) -> list[str]:
    """The loop traces (``loop_summary.json`` of ``pipeline fit --perf.trace_steps``, one per
    attention layout, the newest per layout) matching `pattern` under the results root: where a
    training step's time goes, so the throughput ratios can be read against it."""
    if not pattern:
        return []
    by: dict[str, tuple[Path, dict]] = {}
    for path in sorted(out_root.glob(pattern), key=lambda p: p.stat().st_mtime):
        trace = json.loads(path.read_text())
        by[trace.get("attention") or path.parent.name] = (path, trace)
    head = ["", "## Where a training step's time goes (the training loop's trace per attention layout)", ""]
    if not by:
        return [*head, f"No trace matching `{pattern}` under `{out_root.name}/` yet: run `make profile` "
                "with the ablation's preset on the same GPU."]
    lines = [*head, "From " + ", ".join(f"[`{p.relative_to(out_root)}`](../../../{p.relative_to(out_root)})"
                                        for p, _ in by.values()) + " (device, commit and batch in each).", "",
             "| attention | step ms | device busy ms | attention ms (fwd + bwd) | rest of the step ms | attention share |",
             "|---|---:|---:|---:|---:|---:|"]
    steps = {a: (t["wall_ms_per_step"], t.get("attention_ms_per_step")) for a, (_, t) in by.items()}
    for a, (_, t) in by.items():
        step, attn = steps[a]
        lines.append(f"| {a} | {step:.2f} | {fmt(t.get('device_busy_ms_per_step'), '.2f')} | "
                     f"{fmt(attn, '.2f')} | {fmt(attn and step - attn, '.2f')} | "
                     f"{fmt(t.get('attention_share'), '.3f')} |")
    j = steps.pop("jagged", (None, None))
    for other, o in (steps.items() if None not in j else []):
        if o[1] is None:
            continue
        lines.append(
            f"\n- {other} -> jagged: the step goes from {o[0]:.2f} to {j[0]:.2f} ms ({_div(o[0], j[0]):.2f}x); "
            f"attention from {o[1]:.2f} to {j[1]:.2f} ms, the rest of the step (embeddings, projections and FFN on "
            f"padded rows for {other}, on real rows for jagged; interaction, MLP, optimizer) from "
            f"{o[0] - o[1]:.2f} to {j[0] - j[1]:.2f} ms. With attention free, the step could at best be "
            f"{_div(o[0], j[0] - j[1]):.2f}x faster than {other}'s.")
    return lines
