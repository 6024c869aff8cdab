"""An ablation file (``experiments/ablations/*.yaml``), parsed: the grid expanded into points,
each with its overrides, data set and config hash.

    abl = load("experiments/ablations/seq_len.yaml", Path("data"), extra_set={"trainer.max_steps": 50})

The file format (every key, datasets, targets, recovery) is described in docs/experiments.md."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import itertools
import json
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import ConfigError
from pipeline.runenv import REPO_ROOT, files_digest

CONFIGS = REPO_ROOT / "experiments" / "configs"
DEFAULT_EXPERIMENT = "ablations"
_TOP_KEYS = {"name", "description", "experiment", "configs", "dataset", "set", "timeout_s", "grid", "exclude", "report"}
_REPORT_KEYS = {"x", "series", "baseline", "oracle", "targets", "profile", "seeds", "converged_within", "recovery",
                "pareto"}
_TARGET_KEYS = {"at", "base", "vs", "min_speedup", "max_memory_ratio", "max_auc_diff", "min_auc_drop"}
CODE_PACKAGES = ("data_gen", "kernels", "models", "pipeline")  # what a fit runs


@functools.lru_cache(maxsize=None)
def code_version(root: Path = REPO_ROOT) -> str:
    """sha256 (16 hex digits) over the paths and bytes of the packages' Python files: unlike a commit
    id it covers uncommitted edits, is the same without .git and ignores documentation-only commits."""
    paths = [path for package in CODE_PACKAGES for path in sorted((root / package).rglob("*.py"))]
    return files_digest(paths, root).hexdigest()[:16]


@dataclass
class Dataset:
    """Where a run's data lives and, for generated data, how to make it."""

    dir: Path
    preset: str | None = None
    seed: int | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def meta_path(self) -> Path:
        return self.dir / "meta.json"

    def digest(self) -> str | None:
        if not self.meta_path.is_file():
            return None
        return str(json.loads(self.meta_path.read_text()).get("digest", "")) or None

    def generate_command(self) -> list[str]:
        cmd = [sys.executable, "-m", "data_gen", "generate", "--preset", str(self.preset), "--out", str(self.dir)]
        if self.seed is not None:
            cmd += ["--seed", str(self.seed)]
        for key, value in self.overrides.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        return cmd

    def ensure(self) -> str:
        """The data's digest; generates the data set first if it is absent."""
        if self.preset is None:
            if not self.meta_path.is_file():
                from data_gen.config import generate_hint

                raise ConfigError(f"no data set at {self.dir} (no meta.json): generate it with "
                                  f"{generate_hint(str(self.dir))}")
        elif self.meta_path.is_file():
            self._check_matches()
        else:
            print(f"--- generating {self.dir}: {' '.join(self.generate_command()[1:])}", flush=True)
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            if subprocess.run(self.generate_command(), cwd=REPO_ROOT).returncode != 0:
                raise ConfigError(f"generating {self.dir} failed (see the output above)")
        digest = self.digest()
        if digest is None:
            raise ConfigError(f"{self.meta_path} has no digest")
        return digest

    def changed(self, have: dict[str, Any]) -> dict[str, Any]:
        """The generator settings (config order) of the recipe resolved now that `have`, a meta.json config, differs in."""
        from data_gen.config import ConfigError as DataConfigError, resolve_config

        try:
            want = resolve_config(self.preset, self.overrides).to_dict()
        except DataConfigError as err:
            raise ConfigError(f"dataset {self.dir}: {err}") from None
        return {k: v for k, v in want.items() if k in have and json.dumps(have[k]) != json.dumps(v)}

    def _check_matches(self) -> None:
        meta = json.loads(self.meta_path.read_text())
        have = meta.get("config", {})
        diff = dict(sorted(self.changed(have).items()))
        seed_diff = self.seed is not None and meta.get("seed") != self.seed
        if diff or seed_diff:
            what = ", ".join(f"{k}={have[k]!r} (want {v!r})" for k, v in diff.items()) or f"seed={meta.get('seed')}"
            raise ConfigError(f"{self.dir} exists but was generated with other settings: {what}; "
                              f"delete it or give the dataset another name")


@dataclass
class Point:
    """One run of the grid."""

    labels: dict[str, str]  # axis -> label of the value
    overrides: dict[str, Any]  # dotted config key -> value
    dataset: Dataset

    @property
    def name(self) -> str:
        return "/".join(f"{axis}={label}" for axis, label in self.labels.items())


@dataclass
class Ablation:
    name: str
    path: Path
    description: str
    experiment: str
    configs: list[Path]
    timeout_s: float | None
    report: dict[str, Any]
    axes: list[str]
    points: list[Point]
    raw: dict[str, Any]

    def run_name(self, point: Point) -> str:
        """A child run's MLflow name, its place in the grid first so that children sort in grid
        order: "2 jagged" (one axis: the label), "03 max_seq_len=1024/attention=sdpa" (several)."""
        label = next(iter(point.labels.values())) if len(self.axes) == 1 else point.name
        return f"{self.points.index(point) + 1:0{len(str(len(self.points)))}d} {label}"

    def config_hash(self, point: Point, digest: str | None, code: str | None = None) -> str:
        """Same configs, overrides, data digest and code -> same hash (comments and order do not
        count): a point is done only if it ran with this code (:func:`code_version`, or `code`)."""
        configs = [yaml_of(p.read_text(), str(p)) or {} for p in self.configs]
        d = point.dataset  # data not made yet: its recipe stands in for its digest
        data = digest or {"dir": str(d.dir), "preset": d.preset, "seed": d.seed, "overrides": d.overrides}
        blob = json.dumps({"configs": configs, "set": point.overrides, "data": data, "code": code or code_version()},
                          sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def dataset_from(spec: Any, data_root: Path, where: str) -> Dataset:
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: a dataset is a mapping ({{dir: PATH}} or {{preset: P, ...}}), got {spec!r}")
    spec = dict(spec)
    if "dir" in spec:
        if len(spec) != 1:
            raise ConfigError(f"{where}: a {{dir: ...}} dataset takes no other keys, got {sorted(spec)}")
        return Dataset(dir=(REPO_ROOT / str(spec["dir"])).resolve())
    preset = spec.pop("preset", None)
    if preset is None:
        raise ConfigError(f"{where}: a dataset needs `preset` (tiny|small|paper) or `dir`")
    name, seed = spec.pop("name", None), spec.pop("seed", None)
    if spec and name is None:
        raise ConfigError(f"{where}: a dataset with data_gen overrides ({sorted(spec)}) needs a `name`")
    return Dataset(dir=(data_root / str(name or preset)).resolve(), preset=str(preset),
                   seed=None if seed is None else int(seed), overrides=spec)


def _axes(grid: Any) -> list[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    """[(axis, [(label, overrides)])] in file order."""
    if not isinstance(grid, dict) or not grid:
        raise ConfigError("`grid` must be a non-empty mapping of axes")
    axes = []
    for key, values in grid.items():
        if isinstance(values, list):  # a key axis
            axis = str(key).split(".")[-1]
            points = [(_label(v), {str(key): v}) for v in values]
        elif isinstance(values, dict):  # a named axis
            axis = str(key)
            points = []
            for label, over in values.items():
                if not isinstance(over, dict):
                    raise ConfigError(f"grid.{key}.{label}: a named value is a mapping of overrides, got {over!r}")
                points.append((_label(label), dict(over)))
        else:
            raise ConfigError(f"grid.{key}: a list of values or a mapping label -> overrides, got {values!r}")
        if not points:
            raise ConfigError(f"grid.{key} has no values")
        if axis in (a for a, _ in axes):
            raise ConfigError(f"grid: two axes are named {axis!r}")
        axes.append((axis, points))
    return axes


def _label(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)


def parse_set(items: list[str]) -> dict[str, Any]:
    """``key=value`` strings (values read as YAML) -> overrides."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value (e.g. trainer.max_steps=50)")
        out[key.strip()] = yaml_of(value, f"--set {item}")
    return out


def yaml_of(text: str, where: str) -> Any:
    """`text` read as YAML (safe_load: no tag builds an object); a syntax error or a tag such as
    !!python/object is a one-line ConfigError naming `where` and the line."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f", line {mark.line + 1}" if mark else ""
        raise ConfigError(" ".join(f"{where}{at}: {getattr(err, 'problem', None) or err}".split())) from None


def config_path(name: str) -> Path:
    """experiments/configs/<name>.yaml of an ablation file's `configs` entry (`name` or `name.yaml`)."""
    return CONFIGS / (name if str(name).endswith(".yaml") else f"{name}.yaml")


def read(path: str | Path) -> dict[str, Any]:
    """An ablation file's mapping, not yet checked; ConfigError when there is no such file."""
    path = Path(path)
    if not path.is_file():
        known = sorted(p.stem for p in (REPO_ROOT / "experiments" / "ablations").glob("*.yaml"))
        raise ConfigError(f"no ablation file {path}; the shipped ones: {', '.join(known)}")
    raw = yaml_of(path.read_text(), str(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: an ablation file is a mapping of keys (name, grid, ...), got {type(raw).__name__}")
    return raw


def load(path: str | Path, data_root: Path, data_dir: str | None = None,
         extra_set: dict[str, Any] | None = None) -> Ablation:
    """Parse and expand an ablation file; raises ConfigError saying what is wrong. `extra_set`
    (``--set``): a top-level key of the file (``name``, ``configs``, ``grid``, ...) replaces the
    file's; any other key overrides the fit config of every point."""
    top, fit = split_set(extra_set or {})
    return expand({**read(path), **top}, Path(path), data_root, data_dir, fit)


def split_set(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--set`` overrides -> (top-level keys of the ablation file, fit overrides)."""
    return {k: v for k, v in extra.items() if k in _TOP_KEYS}, {k: v for k, v in extra.items() if k not in _TOP_KEYS}


def expand(raw: dict[str, Any], path: Path, data_root: Path, data_dir: str | None = None,
           extra_set: dict[str, Any] | None = None) -> Ablation:
    """An ablation's mapping (as read from `path`, perhaps edited) checked and expanded."""
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    if not raw.get("name"):
        raise ConfigError(f"{path}: `name` is required")
    configs = [config_path(c) for c in raw.get("configs", ["base"])]
    missing = [str(c) for c in configs if not c.is_file()]
    if missing:
        raise ConfigError(f"{path}: config files not found: {', '.join(missing)}")
    default = Dataset(dir=Path(data_dir).resolve()) if data_dir else None
    if default is None:
        default = dataset_from(raw["dataset"], data_root, "dataset") if "dataset" in raw else \
            Dataset(dir=(REPO_ROOT / "data" / "small").resolve(), preset="small")
    report = dict(raw.get("report") or {})
    if set(report) - _REPORT_KEYS:
        raise ConfigError(f"{path}: unknown report keys {sorted(set(report) - _REPORT_KEYS)}")
    axes = _axes(raw.get("grid"))
    excluded = _exclusions(path, raw.get("exclude"), axes)
    points = []
    for combo in itertools.product(*(vals for _, vals in axes)):
        if any(all(label in rule[axis] for (axis, _), (label, _) in zip(axes, combo) if axis in rule)
               for rule in excluded):
            continue
        labels, over, dataset = {}, dict(raw.get("set") or {}), default
        for (axis, _), (label, point_over) in zip(axes, combo):
            labels[axis] = label
            point_over = dict(point_over)
            if "dataset" in point_over:
                dataset = dataset_from(point_over.pop("dataset"), data_root, f"grid.{axis}.{label}.dataset")
            over.update(point_over)
        over.update(extra_set or {})  # --set wins over the file
        if "data.data_dir" in over:
            raise ConfigError(f"{path}: set the data with `dataset` (or --data), not data.data_dir")
        points.append(Point(labels, over, dataset))
    if not points:
        raise ConfigError(f"{path}: `exclude` leaves no point of the grid to run")
    names = [axis for axis, _ in axes]
    for key in ("x", "series", "seeds"):
        if report.get(key) and report[key] not in names:
            raise ConfigError(f"{path}: report.{key} {report[key]!r} is not an axis ({names})")
    _check_targets(path, report, points)
    _check_recovery(path, report, points)
    return Ablation(name=str(raw["name"]), path=path.resolve(), description=str(raw.get("description", "")),
                    experiment=str(raw.get("experiment", DEFAULT_EXPERIMENT)), configs=configs,
                    timeout_s=raw.get("timeout_s"), report=report, axes=names, points=points, raw=raw)


def _exclusions(path: Path, raw: Any, axes: list) -> list[dict[str, set[str]]]:
    """`exclude`, checked: a list of {axis: label or [labels]}, every axis and label of the grid."""
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(r, dict) and r for r in raw):
        raise ConfigError(f"{path}: `exclude` must be a list of mappings {{axis: label or [labels]}}")
    labels = {axis: {label for label, _ in vals} for axis, vals in axes}
    rules = []
    for i, rule in enumerate(raw):
        checked = {}
        for axis, want in rule.items():
            want = {str(w) for w in (want if isinstance(want, list) else [want])}
            if axis not in labels or want - labels[axis]:
                raise ConfigError(f"{path}: exclude[{i}]: {axis}={sorted(want)} is not on the grid "
                                  f"(axes and labels: { {a: sorted(v) for a, v in labels.items()} })")
            checked[axis] = want
        rules.append(checked)
    return rules


def _check_recovery(path: Path, report: dict, points: list[Point]) -> None:
    """report.recovery names labels of the x axis: low, high and candidates, with both limits."""
    rec = report.get("recovery")
    if rec is None:
        return
    keys = {"low", "high", "candidates", "min_share", "max_cost_ratio"}
    if not isinstance(rec, dict) or set(rec) != keys or not isinstance(rec["candidates"], list):
        raise ConfigError(f"{path}: report.recovery needs exactly {sorted(keys)} (candidates a list)")
    x = report.get("x")
    labels = {p.labels.get(x) for p in points}
    for name in [rec["low"], rec["high"], *rec["candidates"]]:
        if str(name) not in labels:
            raise ConfigError(f"{path}: report.recovery names {name!r}, not a label of the x axis {x!r}")


def _check_targets(path: Path, report: dict, points: list) -> None:
    """report.targets: [{at: {axis: label}, base: <series label>, vs: <series label>, min_speedup, max_memory_ratio,
    max_auc_diff, min_auc_drop}]: `base` (default: the baseline series) against `vs` at one point of the other axes."""
    targets = report.get("targets") or []
    if targets and not (report.get("series") and report.get("baseline")):
        raise ConfigError(f"{path}: report.targets needs report.series and report.baseline")
    for i, t in enumerate(targets):
        where = f"{path}: report.targets[{i}]"
        if not isinstance(t, dict) or set(t) - _TARGET_KEYS or "vs" not in t:
            raise ConfigError(f"{where} must be a mapping with `vs` and some of {sorted(_TARGET_KEYS - {'vs'})}")
        for at in ({**(t.get("at") or {}), report["series"]: str(t[k])} for k in ("vs", "base") if k in t):
            if not any(all(p.labels.get(a) == str(v) for a, v in at.items()) for p in points):
                raise ConfigError(f"{where}: no point of the grid has {at}")


def cli_value(value: Any) -> str:
    """A config value as one `--key value` argument that jsonargparse reads back the same."""
    return value if isinstance(value, str) else json.dumps(value)


# ---- would `pipeline fit` accept a point's arguments? ---------------------------------------------
_PARSER = None  # the fit CLI's parser, built once per process (a second or so)


class _Parsed(Exception):
    pass


def _parser():
    global _PARSER
    if _PARSER is None:
        from pipeline.cli import RankerCLI

        class ParseOnly(RankerCLI):
            def parse_arguments(self, parser, args) -> None:
                global _PARSER
                _PARSER = parser
                raise _Parsed

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # LightningCLI warns about args beside sys.argv
                ParseOnly(args=["fit"], run=True)
        except _Parsed:
            pass
    return _PARSER


def fit_args_error(args: list[str]) -> str | None:
    """None if ``python -m pipeline fit`` would accept `args` (what follows ``fit``), else its parser's
    error: a grid value of the wrong type or an unknown key is the ablation file's error, found
    before any run starts. Only the parser is asked (types, keys, config files), not the data."""
    from jsonargparse import ArgumentError

    parser = _parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(["fit", *args])
    except ArgumentError as error:  # the fit parser raises its errors (exit_on_error=False)
        return "error: " + " ".join(str(error).split())[:500]
    except SystemExit:
        lines = [ln.strip() for ln in err.getvalue().splitlines() if ln.strip()]
        found = [ln for ln in lines if ln.startswith("error:")] or lines[-1:] or ["rejected by the fit parser"]
        return found[0][:500]
    return None
