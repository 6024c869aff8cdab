"""The launch table from a fitted cost model: an entry per swept shape and per shape of a denser grid.

``export(rows, models, out)`` writes kernels/configs/<gpu>.json (``python -m experiments costmodel
export``); the switch rule (SWITCH_MEASURED, SWITCH_PREDICTED) and why: docs/tuning.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from experiments.bench.targets import geomean
from experiments.tuning.costmodel import (SWITCH_MEASURED, SWITCH_PREDICTED, FamilyModel, _shape_dict, by_family,
                                          keeps_hand, shape_of)
from experiments.tuning.families import MODULE_DICTS, SweepShape, config_id, hand_config

MIN_EXPORT_SHAPES = 3  # fewer swept shapes: the family keeps its hand rule (no entries at all)


def _mean_length(B: int, N: int, fill: float) -> float:
    from experiments.bench.suites import make_lengths

    return float(make_lengths(B, N, fill, 0).double().mean())


def dense_grid(family: str, rows: list[dict]) -> list[dict]:
    """Unseen shapes around the swept ones: N in powers of two 64..8192, fills 0.1..0.75, B so
    that B*N is 2^18 or 2^20 padded tokens, for each swept (H, D, Tq, dtype)."""
    kinds = sorted({(r["H"], r["D"], r["Tq"], r["dtype"]) for r in rows})
    Ns = [1 << e for e in range(6, 14)]  # 64 .. 8192
    out = []
    for (H, D, Tq, dtype) in kinds:
        for N in Ns:
            for tokens in (1 << 18, 1 << 20):
                B = max(1, tokens // N)
                for fill in (0.1, 0.25, 0.5, 0.75):
                    L = _mean_length(B, N, fill)
                    out.append(dict(B=B, N=N, L=L, H=H, D=D, Tq=Tq, T=L * B, dtype=dtype, fill=fill))
    return out


def table_shape(family: str, shape: dict) -> dict:
    """The features the launchers look up for a shape (``_launch_configs.FAMILIES``), B, N and L in
    their power-of-two buckets: an entry keyed by an exact L would never be their exact match."""
    from kernels._launch_configs import FAMILIES, p2

    vals = dict(shape, B=p2(int(shape["B"])), N=p2(int(shape["N"])), L=p2(max(1, int(shape["L"]))),
                K=shape["D"], M=shape["D"], causal=0)
    return {k: (vals[k] if k == "dtype" else int(vals[k])) for k in FAMILIES[family]}


def _measured_entry(family: str, shape: dict, group: list[list[dict]], hand_fn) -> dict:
    """The entry of one table key from the swept shapes in its bucket (each a list of its rows):
    the config with the least geometric-mean time over them (each time against its shape's best),
    or 'hand' (each shape's own hand rule) where the hand configs' geometric mean is within
    SWITCH_MEASURED of it. ms, best_ms, hand_ms: geometric means over the shapes."""
    times = [{r["config_id"]: r["ms"] for r in rows} for rows in group]
    best = [min(t.values()) for t in times]
    common = set.intersection(*(set(t) for t in times))
    score = {c: geomean([t[c] / b for t, b in zip(times, best)]) for c in common}
    pick = min(score, key=score.get)
    hand_ids = [config_id(hand_fn(family, shape_of(rows[0]))) for rows in group]
    has_hand = all(h in t for h, t in zip(hand_ids, times))
    hand_score = geomean([t[h] / b for h, t, b in zip(hand_ids, times, best)]) if has_hand else math.inf
    keep = has_hand and keeps_hand(hand_score, score[pick], SWITCH_MEASURED)
    chosen = hand_ids if keep else [pick] * len(group)
    cfg = next(r["cfg"] for r in group[0] if r["config_id"] == chosen[0])
    entry = {"family": family, "shape": shape, "config": cfg, "source": "hand" if keep else "measured",
             "ms": round(geomean([t[c] for t, c in zip(times, chosen)]), 5), "best_ms": round(geomean(best), 5),
             "hand_ms": round(geomean([t[h] for h, t in zip(hand_ids, times)]), 5) if has_hand else None}
    if len(group) > 1:
        entry["swept_shapes"] = sorted(rows[0]["shape_id"] for rows in group)
    return entry


def export_entries(rows: list[dict], models: dict[str, FamilyModel], unseen: bool = True,
                   hand_fn=hand_config) -> list[dict]:
    """Measured best per table key of the swept shapes ('measured', or 'hand' where the hand rule's
    config is within SWITCH_MEASURED of it; _measured_entry), then the model's pick for the dense
    grid's shapes that no swept shape already covers ('predicted', or 'hand' within
    SWITCH_PREDICTED, or where the pick would launch fewer programs than any swept row of the family
    did: 'beyond_sweep', docs/tuning.md). A family swept on fewer than MIN_EXPORT_SHAPES shapes
    gets no entry: the table's nearest-entry fallback would hand one shape's best config to every
    shape of the family, where the hand rule is the safer guess."""
    entries, seen = [], set()
    for fam, rs in by_family(rows).items():
        if fam in MODULE_DICTS:
            print(f"  {fam}: its launcher reads kernels/{MODULE_DICTS[fam][0]}.py's dict, not the table: "
                  "no entries", flush=True)
            continue
        ok = [r for r in rs if r["status"] == "ok"]
        shape_ids = sorted({r["shape_id"] for r in ok})
        if len(shape_ids) < MIN_EXPORT_SHAPES:
            print(f"  {fam}: {len(shape_ids)} swept shape(s), under {MIN_EXPORT_SHAPES}: "
                  "not in the table (hand rule)", flush=True)
            continue
        buckets: dict[str, list[list[dict]]] = {}  # swept shapes by the table key the launchers ask for
        for sid in shape_ids:
            on_shape = [r for r in ok if r["shape_id"] == sid]
            buckets.setdefault(json.dumps([fam, table_shape(fam, _shape_dict(on_shape[0]))], sort_keys=True),
                               []).append(on_shape)
        for k, group in buckets.items():
            entries.append(_measured_entry(fam, json.loads(k)[1], group, hand_fn))
            seen.add(k)
        if not unseen or fam not in models:
            continue
        todo = []  # (table shape, shape, candidates and last the hand rule's config)
        for sh in dense_grid(fam, ok):
            shape = table_shape(fam, sh)
            k = json.dumps([fam, shape], sort_keys=True)
            if k in seen:
                continue
            seen.add(k)
            hand_cfg = hand_fn(fam, SweepShape(sh["B"], sh["N"], sh["fill"], sh["H"], sh["D"], sh["dtype"], sh["Tq"]))
            todo.append((shape, sh, [*models[fam].candidates(sh), hand_cfg]))
        predicted = models[fam].predict_ms([(sh, cfgs) for _, sh, cfgs in todo]) if todo else []
        for (shape, sh, cfgs), ms in zip(todo, predicted):
            i = int(np.argmin(ms[:-1])) if len(ms) > 1 else 0
            keep = len(ms) == 1 or keeps_hand(ms[-1], ms[i], SWITCH_PREDICTED)  # no candidate: the hand rule
            beyond = not keep and models[fam].beyond_sweep(sh, cfgs[i])
            entries.append({"family": fam, "shape": shape, "config": cfgs[-1] if keep or beyond else cfgs[i],
                            "source": "hand" if keep or beyond else "predicted", "pred_ms": round(float(ms[i]), 5),
                            "pred_hand_ms": round(float(ms[-1]), 5)} | ({"beyond_sweep": True} if beyond else {}))
    return entries


def export(rows: list[dict], models: dict[str, FamilyModel], out: str | None, hand_fn=hand_config) -> Path:
    from kernels.launch_table import CONFIG_DIR, write_table

    r0 = rows[0]
    meta = {k: r0[k] for k in ("gpu", "gpu_slug", "torch", "triton", "cuda")}
    meta["commit"] = ", ".join(sorted({str(r["commit"]) for r in rows}))  # the sweep's rows may span commits
    meta["model"] = ("power law for the shape's best + RandomForestRegressor(200) on log(ms / best), per family "
                     "(experiments/tuning/costmodel.py)")
    path = Path(out.replace("<gpu>", r0["gpu_slug"])) if out else CONFIG_DIR / f"{r0['gpu_slug']}.json"
    entries = export_entries(rows, models, hand_fn=hand_fn)
    write_table(path, entries, meta)
    n = {src: sum(e["source"] == src for e in entries) for src in ("measured", "predicted", "hand")}
    beyond = sum(bool(e.get("beyond_sweep")) for e in entries)
    print(f"{len(entries)} entries ({n['measured']} measured, {n['predicted']} predicted picks; {n['hand']} keep "
          f"the hand rule: {n['hand'] - beyond} no clear gain, {beyond} picks beyond the sweep's program counts) "
          f"-> {path}", flush=True)
    return path
