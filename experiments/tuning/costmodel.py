"""A measured cost model of launch configs: held-out-shape evaluation, report and table export.

    python -m experiments costmodel eval|export|report --data sweep.parquet [--out ...] [--folds 0]

Per family: a power law in the shape for the log of its best time plus a random forest on each
config's log slowdown against it (``LogModel``), evaluated on whole shapes held out. Features and
why a forest: docs/tuning.md, "Launch configs from a measured cost model: the method"."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from experiments import parser
from experiments.tuning.families import (AUTOTUNE, DTYPES, ENERGY_SLACK, FLAGS, TUNABLE, WITH_PROGRAMS, SweepShape,
                                         complete, config_id, hand_config, programs, valid)
from pipeline.errors import ConfigError, command

SHAPE_COLS = ("B", "N", "L", "H", "D", "Tq", "T")


def load(path: str | Path) -> list[dict]:
    """Rows of the sweep Parquet (all statuses), config parsed into a dict."""
    import polars as pl

    if not Path(path).is_file():
        raise SystemExit(f"error: {path}: no such sweep file (run python -m experiments config-sweep first)")
    rows = pl.read_parquet(path).to_dicts()
    for r in rows:
        r["cfg"] = complete(r.get("family", ""), json.loads(r["config"]))
        if r.get("energy_src") != "counter":  # sampled power x time (sweeps before the energy counter): not used
            r["energy_j"] = math.nan
    return rows


def shape_of(r: dict) -> SweepShape:
    return SweepShape(r["B"], r["N"], r["fill"], r["H"], r["D"], r["dtype"], r["Tq"])


def feature_names(family: str) -> list[str]:
    tiles = [k for k in TUNABLE[family] if k.startswith(("BLOCK", "SMALL", "M_KV", "N_KV"))]
    return ([f"log2 {k}" for k in SHAPE_COLS] + ["fill", "dtype bytes"]
            + [k if k in FLAGS else f"log2 {k}" for k in TUNABLE[family]] + [f"log2 L/{k}" for k in tiles]
            + ["log2 T*H*D"] + (["log2 programs"] if family in WITH_PROGRAMS else []))


def features(family: str, shape: dict, cfg: dict) -> list[float]:
    """One row of features; `shape` has B, N, L, H, D, Tq, T, dtype (see feature_names)."""
    lg = lambda x: math.log2(max(float(x), 1.0))  # noqa: E731
    tiles = [k for k in TUNABLE[family] if k.startswith(("BLOCK", "SMALL", "M_KV", "N_KV"))]
    return ([lg(shape[k]) for k in SHAPE_COLS] + [shape["L"] / max(shape["N"], 1), DTYPES[shape["dtype"]].itemsize]
            + [float(cfg[k]) if k in FLAGS else lg(cfg[k]) for k in TUNABLE[family]]
            + [lg(shape["L"]) - lg(cfg[k]) for k in tiles]
            + [lg(shape["T"]) + lg(shape["H"]) + lg(shape["D"])]
            + ([lg(programs(family, int(shape["B"]), int(shape["H"]), cfg))] if family in WITH_PROGRAMS else []))


N_SHAPE_FEATURES = len(SHAPE_COLS) + 2  # the leading columns of features(): shape only


class LogModel:
    """log target = a least-squares power law in the shape features for the log of the shape's best
    value + a random forest over all features for each row's log ratio to that best (the pick
    within a shape rests on the forest alone). `groups` names each row's shape."""

    def __init__(self, seed: int = 0):
        from sklearn.ensemble import RandomForestRegressor
        from sklearn.linear_model import Ridge

        self.lin = Ridge(alpha=1e-3)
        self.forest = RandomForestRegressor(n_estimators=200, min_samples_leaf=1, max_features=1.0,
                                            random_state=seed, n_jobs=-1)

    def fit(self, X: np.ndarray, y: np.ndarray, groups: list) -> "LogModel":
        best: dict = {}
        for g, v in zip(groups, y):
            best[g] = min(best.get(g, math.inf), v)
        y_best = np.array([best[g] for g in groups])
        self.lin.fit(X[:, :N_SHAPE_FEATURES], y_best)
        self.forest.fit(X, y - y_best)
        return self

    def predict(self, X: np.ndarray) -> np.ndarray:
        return self.lin.predict(X[:, :N_SHAPE_FEATURES]) + self.forest.predict(X)

    @property
    def feature_importances_(self) -> np.ndarray:
        return self.forest.feature_importances_


class FamilyModel:
    """Runtime (and energy) forests of one family plus the configs it may pick from."""

    def __init__(self, family: str, rows: list[dict], seed: int = 0):
        ok = [r for r in rows if r["status"] == "ok" and math.isfinite(r["ms"]) and r["ms"] > 0]
        if not ok:
            raise ValueError(f"{family}: no ok rows to fit")
        self.family = family
        X = np.array([features(family, r, r["cfg"]) for r in ok])
        self.time = LogModel(seed).fit(X, np.log(np.array([r["ms"] for r in ok])), [r["shape_id"] for r in ok])
        en = [r for r in ok if r.get("energy_j") is not None and math.isfinite(r["energy_j"]) and r["energy_j"] > 0]
        self.energy = None
        if len(en) >= 4:
            Xe = np.array([features(family, r, r["cfg"]) for r in en])
            self.energy = LogModel(seed).fit(Xe, np.log(np.array([r["energy_j"] for r in en])),
                                             [r["shape_id"] for r in en])
        self.configs = {config_id(r["cfg"]): r["cfg"] for r in ok}
        self.fewest_programs = (min(programs(family, r["B"], r["H"], r["cfg"]) for r in ok)
                                if family in WITH_PROGRAMS else 0)
        # a config that failed (out of resources, mismatch) at some D and dtype stays out there
        self.banned = {(r["D"], r["dtype"], config_id(r["cfg"])) for r in rows if r["status"] != "ok"}

    def beyond_sweep(self, shape: dict, cfg: dict) -> bool:
        """Would `cfg` launch fewer programs on `shape` than any row the model was fitted on? There
        the forest extrapolates: it never saw the few-program regime (docs/tuning.md)."""
        return (self.family in WITH_PROGRAMS
                and programs(self.family, int(shape["B"]), int(shape["H"]), cfg) < self.fewest_programs)

    def candidates(self, shape: dict) -> list[dict]:
        s = SweepShape(shape["B"], shape["N"], shape.get("fill", 0.0), shape["H"], shape["D"], shape["dtype"], shape["Tq"])
        return [c for cid, c in self.configs.items()
                if (shape["D"], shape["dtype"], cid) not in self.banned and valid(self.family, c, s)]

    def predict(self, shape: dict, cfgs: list[dict]) -> tuple[np.ndarray, np.ndarray | None]:
        """Predicted ms and J per call of each config on `shape`."""
        X = np.array([features(self.family, shape, c) for c in cfgs])
        ms = np.exp(self.time.predict(X))
        return ms, (np.exp(self.energy.predict(X)) if self.energy is not None else None)

    def predict_ms(self, queries: list[tuple[dict, list[dict]]]) -> list[np.ndarray]:
        """Predicted ms per call of each query's configs on its shape, in one forest call."""
        X = np.array([features(self.family, shape, c) for shape, cfgs in queries for c in cfgs])
        ms = np.exp(self.time.predict(X))
        return np.split(ms, np.cumsum([len(cfgs) for _, cfgs in queries])[:-1])

    def pick(self, shape: dict, cfgs: list[dict] | None = None) -> dict:
        """{'fastest': cfg, 'pred_ms', 'frugal': cfg (least energy within 5% of the fastest)}."""
        cfgs = cfgs if cfgs is not None else self.candidates(shape)
        ms, en = self.predict(shape, cfgs)
        i = int(np.argmin(ms))
        out = {"fastest": cfgs[i], "pred_ms": float(ms[i]), "frugal": cfgs[i]}
        if en is not None:
            near = [j for j in range(len(cfgs)) if ms[j] <= ENERGY_SLACK * ms[i]]
            out["frugal"] = cfgs[min(near, key=lambda j: en[j])]
        return out


def by_family(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["family"], []).append(r)
    return out


def fit(rows: list[dict], seed: int = 0) -> dict[str, FamilyModel]:
    return {f: FamilyModel(f, rs, seed) for f, rs in by_family(rows).items()
            if any(r["status"] == "ok" for r in rs)}


def _shape_dict(r: dict) -> dict:
    return {k: r[k] for k in (*SHAPE_COLS, "dtype", "fill")}


def eval_family(family: str, rows: list[dict], folds: int = 0, seed: int = 0, hand_fn=hand_config) -> dict:
    """Leave-shapes-out evaluation of one family (folds 0: one per shape), with per-shape records and
    the held-out predictions for the report."""
    from sklearn.metrics import r2_score
    from sklearn.model_selection import GroupKFold

    shapes = sorted({r["shape_id"] for r in rows})
    if len(shapes) < 2:
        return {"family": family, "n_shapes": len(shapes), "skipped": "fewer than 2 shapes"}
    groups = np.array([r["shape_id"] for r in rows])
    pred_rows, per_shape = [], []
    n_splits = min(folds, len(shapes)) if folds > 0 else len(shapes)
    for tr, te in GroupKFold(n_splits=n_splits).split(rows, groups=groups):
        model = FamilyModel(family, [rows[i] for i in tr], seed)
        test = [rows[i] for i in te]
        ok = [r for r in test if r["status"] == "ok"]
        if ok:
            X = np.array([features(family, r, r["cfg"]) for r in ok])
            p = model.time.predict(X)
            pe = model.energy.predict(X) if model.energy is not None else [math.nan] * len(ok)
            pred_rows += [{"shape_id": r["shape_id"], "ms": r["ms"], "pred_ms": float(np.exp(a)),
                           "energy_j": r.get("energy_j", math.nan), "pred_energy_j": float(np.exp(b))}
                          for r, a, b in zip(ok, p, pe)]
        for sid in sorted({r["shape_id"] for r in test}):
            per_shape.append(_shape_record(model, [r for r in test if r["shape_id"] == sid], hand_fn))
    y = np.log([p["ms"] for p in pred_rows])
    yp = np.log([p["pred_ms"] for p in pred_rows])
    err = np.abs(yp - y)
    ye = [(p["energy_j"], p["pred_energy_j"]) for p in pred_rows
          if p["energy_j"] is not None and math.isfinite(p["energy_j"]) and math.isfinite(p["pred_energy_j"])]
    return {
        "family": family, "n_shapes": len(shapes), "n_rows": len(pred_rows),
        "r2_log_ms": float(r2_score(y, yp)) if len(y) > 1 else math.nan,
        "median_err_pct": float(100 * (math.exp(np.median(err)) - 1)),
        "worst_err_pct": float(100 * (math.exp(err.max()) - 1)),
        "r2_log_energy": (float(r2_score(np.log([a for a, _ in ye]), np.log([b for _, b in ye])))
                          if len(ye) > 1 else math.nan),
        "shapes": per_shape, "predictions": pred_rows,
    }


# the margins by which a measured (a swept shape) or predicted (an unswept one) config must beat
# the hand rule's to replace it in the table: above the timing noise, and none for predictions
# (a wider one made the held-out worst cases worse: docs/tuning.md, "Switch margins in the export")
SWITCH_MEASURED = 1.03
SWITCH_PREDICTED = 1.0


def keeps_hand(hand_ms: float, other_ms: float, margin: float) -> bool:
    """The export's switch rule: the hand config stays unless it is more than `margin` times the
    other config's (measured or predicted) time."""
    return hand_ms <= margin * other_ms


def _shape_record(model: FamilyModel, rows: list[dict], hand_fn) -> dict:
    """Slowdowns on one held-out shape: model pick, hand rule, autotune; energy of the picks."""
    ok = {config_id(r["cfg"]): r for r in rows if r["status"] == "ok"}
    status = {config_id(r["cfg"]): r["status"] for r in rows}
    r0 = rows[0]
    rec = {"shape_id": r0["shape_id"], "n_configs": len(rows), "n_ok": len(ok)}
    if not ok:
        return rec | {"model": math.nan, "hand": math.nan, "autotune": math.nan}
    best = min(ok.values(), key=lambda r: r["ms"])
    rec["best_ms"], rec["best_config"] = best["ms"], best["config_id"]
    # the model chooses among the configs that were tried on this shape (it never saw their times)
    cands = [c for c in model.candidates(_shape_dict(r0)) if config_id(c) in status] or [r["cfg"] for r in rows]
    pick = model.pick(_shape_dict(r0), cands)
    chosen = ok.get(config_id(pick["fastest"]))
    rec["model_config"] = config_id(pick["fastest"])
    rec["model"] = chosen["ms"] / best["ms"] if chosen else math.inf  # a pick that failed here
    hand_cfg = hand_fn(r0["family"], shape_of(r0))
    hand = ok.get(config_id(hand_cfg))
    rec["hand"] = hand["ms"] / best["ms"] if hand else math.nan
    # what the exported table gives an unswept shape (export_entries' rule)
    pred_hand = float(model.predict(_shape_dict(r0), [hand_cfg])[0][0])
    keep = (keeps_hand(pred_hand, pick["pred_ms"], SWITCH_PREDICTED)
            or model.beyond_sweep(_shape_dict(r0), pick["fastest"]))
    table_cfg = hand_cfg if keep else pick["fastest"]
    rec["table_config"] = config_id(table_cfg)
    table = ok.get(rec["table_config"])
    rec["table"] = (table["ms"] / best["ms"] if table else
                    math.inf if rec["table_config"] in status else math.nan)  # failed here / not tried
    at = [ok[config_id(c)] for c in AUTOTUNE.get(r0["family"], []) if config_id(c) in ok]
    rec["autotune"] = min(r["ms"] for r in at) / best["ms"] if at else math.nan
    rec["autotune_cost_s"] = sum((r["compile_s"] or 0) + (r["bench_s"] or 0) for r in at) if at else math.nan
    _energy(rec, ok, best, pick)
    return rec


def _energy(rec: dict, ok: dict, best: dict, pick: dict) -> None:
    """Measured energy of the fastest vs the energy-aware configs (oracle and model's)."""
    if not (best.get("energy_j") is not None and math.isfinite(best["energy_j"])):
        return
    near = [r for r in ok.values() if r["ms"] <= ENERGY_SLACK * best["ms"] and math.isfinite(r["energy_j"])]
    frugal = min(near, key=lambda r: r["energy_j"])
    rec |= {"fastest_energy_j": best["energy_j"], "frugal_energy_j": frugal["energy_j"],
            "frugal_ms": frugal["ms"], "frugal_config": frugal["config_id"]}
    m_fast, m_frugal = ok.get(config_id(pick["fastest"])), ok.get(config_id(pick["frugal"]))
    if m_fast and m_frugal:
        rec |= {"model_energy_j": m_fast["energy_j"], "model_frugal_energy_j": m_frugal["energy_j"],
                "model_frugal_ms": m_frugal["ms"]}


METHODS = ("model", "table", "hand", "autotune")  # table: the exported rule (model pick past the switch margin)


def summarize(ev: dict) -> dict:
    """Median / worst / geometric-mean slowdowns per method over the held-out shapes."""
    out = {}
    for m in METHODS:
        v = [s[m] for s in ev.get("shapes", []) if m in s and not math.isnan(s[m])]
        fin = [x for x in v if math.isfinite(x)]
        out[m] = {"n": len(v), "median": float(np.median(v)) if v else math.nan,
                  "worst": float(max(v)) if v else math.nan,
                  "geomean": float(math.exp(np.mean(np.log(fin)))) if fin else math.nan}
    cost = [s["autotune_cost_s"] for s in ev.get("shapes", []) if math.isfinite(s.get("autotune_cost_s", math.nan))]
    out["autotune_cost_s_per_shape"] = float(np.median(cost)) if cost else math.nan
    fe = [(s["fastest_energy_j"], s["frugal_energy_j"]) for s in ev.get("shapes", []) if "frugal_energy_j" in s]
    out["energy_saving_pct"] = float(100 * np.median([1 - b / a for a, b in fe])) if fe else math.nan
    out["meets_target"] = bool(out["model"]["n"] and out["model"]["median"] <= 1.05 and out["model"]["worst"] <= 1.15)
    out["verdict"] = "not judged" if not out["model"]["n"] else "met" if out["meets_target"] else "missed"
    return out


def judged_shapes(judge_on: str):
    """Which held-out shapes the summary counts: all, or ('new') for the families of
    RETUNED_ON_SMALL only those outside the small grid, where their hand rules are out of sample."""
    if judge_on == "all":
        return lambda family, shape_id: True
    from experiments.tuning import families

    small = {f: {s.id for s in families.grid(f, "small")} for f in families.RETUNED_ON_SMALL}
    return lambda family, shape_id: shape_id not in small.get(family, ())


def evaluate(rows: list[dict], folds: int = 0, seed: int = 0, hand_fn=hand_config,
             judge_on: str = "all") -> dict[str, dict]:
    """Leave-shapes-out evaluation of every family; the summaries count the held-out shapes that
    `judge_on` selects (judged_shapes), every shape still trains the folds it is not held out of."""
    judged = judged_shapes(judge_on)
    res = {}
    for fam, rs in by_family(rows).items():
        ev = eval_family(fam, rs, folds, seed, hand_fn)
        ev["judge_on"], ev["folds"] = judge_on, folds
        ev["shapes"] = [s for s in ev.get("shapes", []) if judged(fam, s["shape_id"])]
        ev["summary"] = summarize(ev)
        res[fam] = ev
        s = ev["summary"]
        print(f"  {fam:<18} {ev['n_shapes']:3d} shapes  R2 {ev.get('r2_log_ms', math.nan):6.3f}  "
              f"err med {ev.get('median_err_pct', math.nan):5.1f}% worst {ev.get('worst_err_pct', math.nan):6.1f}%  "
              f"slowdown model {s['model']['median']:.3f}/{s['model']['worst']:.3f}  "
              f"table {s['table']['median']:.3f}/{s['table']['worst']:.3f}  "
              f"hand {s['hand']['median']:.3f}/{s['hand']['worst']:.3f}  "
              f"autotune {s['autotune']['median']:.3f} ({s['autotune_cost_s_per_shape']:.1f} s/shape)  "
              f"target {s['verdict']}", flush=True)
    return res


# ---- command line -------------------------------------------------------------------------


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    return [_json_safe(v) for v in x] if isinstance(x, (list, tuple)) else x


def parse_args(argv=None) -> argparse.Namespace:
    p = parser("costmodel", __doc__)
    p.add_argument("what", choices=("eval", "export", "report"))
    p.add_argument("--data", required=True, help="the sweep's Parquet file")
    p.add_argument("--out", default=None, help="eval: JSON file; export: table file (default runs/tuning/<gpu>/"
                   "launch-table.json; kernels/configs/<gpu>.json is read); report: folder (runs/tuning/<gpu>)")
    p.add_argument("--families", default=None, help="comma-separated subset of the data's families")
    p.add_argument("--folds", type=int, default=0, help="GroupKFold splits over shapes (0: one per shape)")
    p.add_argument("--judge-on", default="all", choices=("all", "new"),
                   help="new: the families retuned on the small grid count held-out shapes outside it only")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.folds == 1 or args.folds < 0:
        p.error("--folds must be 0 (one per shape) or at least 2")
    if not Path(args.data).is_file():
        p.error(f"--data {args.data}: no such file (run python -m experiments config-sweep first)")
    return args


@command
def main(argv=None) -> int:
    args = parse_args(argv)
    rows, fams = load(args.data), set(filter(None, (args.families or "").split(",")))
    if fams - {r["family"] for r in rows}:
        raise ConfigError(f"families {sorted(fams - {r['family'] for r in rows})} not in {args.data} "
                          f"(it has {sorted({r['family'] for r in rows})})")
    rows = [r for r in rows if not fams or r["family"] in fams]
    if not any(r["status"] == "ok" for r in rows):
        raise ConfigError(f"{args.data} has no ok rows")
    print(f"{len(rows)} rows, {len({r['shape_id'] for r in rows})} shapes, "
          f"{len({r['family'] for r in rows})} families from {args.data}", flush=True)
    if args.what == "eval":
        res = evaluate(rows, args.folds, args.seed, judge_on=args.judge_on)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(_json_safe(res), indent=1))
            print(f"-> {args.out}")
    elif args.what == "export":
        from experiments.tuning.table import export

        export(rows, fit(rows, args.seed), args.out or "runs/tuning/<gpu>/launch-table.json")
    else:
        from experiments.tuning.costmodel_report import write_report

        for p in write_report(rows, args.out or "runs/tuning/<gpu>", args.folds, args.seed, args.judge_on):
            print(f"-> {p}")
    return 0

