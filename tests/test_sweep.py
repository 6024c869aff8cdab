"""The sweep driver through the real `pipeline fit` processes, on tiny data, into a temp sqlite MLflow.

One smoke sweep per session (smoke.yaml's budgets, grid max_seq_len 16 / 24 / 0): 16 trains,
24 is made to raise a CUDA out-of-memory error inside training (a wrapper patches the training
step of the real CLI), 0 fails the CLI's pre-flight check before any MLflow run exists.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlflow
import pytest
import yaml
from mlflow.tracking import MlflowClient

from experiments import sweep
from experiments.ablation import load
from pipeline.errors import ConfigError
from pipeline.tracking import check_tracking

REPO = Path(__file__).resolve().parents[1]
ABLATIONS = REPO / "experiments" / "ablations"
WRAPPER = """\
import sys
sys.path.insert(0, {repo!r})
args = sys.argv[1:]
if "--data.max_seq_len" in args and args[args.index("--data.max_seq_len") + 1] == "24":
    import torch
    import pipeline.module
    def _oom(self, batch, batch_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected by the test)")
    pipeline.module.RankerModule.training_step = _oom
from pipeline.cli import main
main()
"""
_SESSION: dict = {}


def _uri_env(uri: str):
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", uri)
    mp.delenv("MLFLOW_RUN_ID", raising=False)
    # mlflow.set_tracking_uri is process-global: give the value back to the other tests afterwards
    mp.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", None, raising=False)
    return mp


def smoke_sweep(tmp_path_factory) -> SimpleNamespace:
    """Run the smoke sweep once per session; later callers get the same result."""
    if "smoke" in _SESSION:
        return _SESSION["smoke"]
    root = tmp_path_factory.mktemp("sweep")
    spec = yaml.safe_load((ABLATIONS / "smoke.yaml").read_text())
    spec["grid"] = {"model.ranker.attention": ["jagged"], "data.max_seq_len": [16, 24, 0]}
    spec["set"]["trainer.default_root_dir"] = str(root / "ckpt")
    abl = root / "smoke_test.yaml"
    abl.write_text(yaml.safe_dump(spec, sort_keys=False))
    (root / "wrapper.py").write_text(WRAPPER.format(repo=str(REPO)))
    state = SimpleNamespace(root=root, uri=f"sqlite:///{root}/mlflow.db", ablation=abl,
                            argv=[str(abl), "--data-root", str(root / "data")])
    mp = _uri_env(state.uri)
    mp.setattr(sweep, "FIT_COMMAND", (sys.executable, str(root / "wrapper.py"), "fit"))
    try:
        state.rc = sweep.main(state.argv)
    finally:
        mp.undo()
    _SESSION["smoke"] = state
    return state


@pytest.fixture
def smoke(tmp_path_factory):
    state = smoke_sweep(tmp_path_factory)
    mp = _uri_env(state.uri)
    mp.setattr(sweep, "FIT_COMMAND", (sys.executable, str(state.root / "wrapper.py"), "fit"))
    yield state
    mp.undo()


def children(uri: str, parent_id: str) -> dict[str, list]:
    client = MlflowClient(uri)
    parent = client.get_run(parent_id)
    out: dict[str, list] = {}
    for run in client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'"):
        out.setdefault(run.data.tags["sweep.point"], []).append(run)
    return out


def the_parent(uri: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("ablations")
    (parent,) = client.search_runs([exp.experiment_id], "tags.`sweep.role` = 'parent'")
    return parent


def test_shipped_ablations_expand():
    for path in sorted(ABLATIONS.glob("*.yaml")):
        abl = load(path, REPO / "data")
        assert abl.name == path.stem and abl.points, path.name
        assert len({p.name for p in abl.points}) == len(abl.points), f"{path.name}: point names repeat"
        # every point is the product of the axes' labels less the excluded ones, each with a data set
        product = math.prod(len({p.labels[a] for p in abl.points}) for a in abl.axes)
        excluded = sum(math.prod(len(v) if isinstance(v, list) else 1 for v in rule.values())
                       * math.prod(len({p.labels[a] for p in abl.points}) for a in abl.axes if a not in rule)
                       for rule in abl.raw.get("exclude") or [])  # the shipped files' entries do not overlap
        assert len(abl.points) == product - excluded, path.name
        assert all(p.dataset is not None and p.dataset.dir for p in abl.points), path.name
        assert path.read_text().startswith("#") and f"make experiment-{path.stem}" in path.read_text(), path.name
    sparsity = load(ABLATIONS / "sparsity.yaml", Path("/d"))
    dirs = {p.labels["fill"]: p.dataset for p in sparsity.points}
    assert {k: v.overrides["mean_len"] for k, v in dirs.items()} == {"0.10": 102.4, "0.25": 256, "0.50": 512, "0.75": 768}
    assert dirs["0.25"].dir == Path("/d/fill025") and dirs["0.25"].overrides["max_len"] == 1024
    assert all(p.overrides["data.max_seq_len"] == 1024 for p in sparsity.points)
    parity = load(ABLATIONS / "auc_parity.yaml", Path("/d"))  # the same data set as sparsity's fill 0.25
    assert {p.dataset.dir for p in parity.points} == {Path("/d/fill025_1m")}
    assert {p.dataset.overrides["mean_len"] for p in parity.points} == {256}
    assert sorted({p.overrides["seed_everything"] for p in parity.points}) == [0, 1, 2]
    # the accuracy ablations train until converged: early stopping on val/auc, the peak's weights tested
    for name in ("history_value", "model", "alure"):
        assert load(ABLATIONS / f"{name}.yaml", Path("/d")).configs[-1].name == "converge.yaml", name
    # the parity trains every layout the same steps: converge.yaml's cap and checkpoint, its stop dropped
    assert [c.name for c in parity.configs][-2:] == ["converge.yaml", "equal_steps.yaml"]
    equal = yaml.safe_load((REPO / "experiments" / "configs" / "equal_steps.yaml").read_text())["trainer"]
    assert set(equal) == {"callbacks"} and not any("EarlyStopping" in c["class_path"] for c in equal["callbacks"])
    converge = yaml.safe_load((REPO / "experiments" / "configs" / "converge.yaml").read_text())
    stop, bar = converge["trainer"]["callbacks"]
    assert stop["class_path"].endswith("EarlyStopping") and stop["init_args"]["monitor"] == "val/auc"
    # the list replaces paper.yaml's: its sync-sparing progress bar must be in it again
    paper = yaml.safe_load((REPO / "experiments" / "configs" / "paper.yaml").read_text())["trainer"]["callbacks"]
    assert all(c in converge["trainer"]["callbacks"] for c in paper), (paper, converge["trainer"]["callbacks"])
    assert all(c in equal["callbacks"] for c in paper), (paper, equal["callbacks"])
    assert converge["checkpoint"]["monitor"] == "val/auc" and converge["checkpoint"]["save_top_k"] == 1
    model = load(ABLATIONS / "model.yaml", REPO / "data")
    by = {p.labels["variant"]: p.overrides for p in model.points}
    assert by["no_target_attention"]["model.ranker.target_attention"] is False
    assert by["no_interaction"]["model.ranker.interaction"] is False


def test_config_hash_and_overrides(tmp_path):
    abl = load(ABLATIONS / "smoke.yaml", tmp_path, extra_set={"trainer.max_steps": 5})
    a, b = abl.points
    assert a.overrides["trainer.max_steps"] == 5 and a.name == "attention=jagged/max_seq_len=16"
    assert abl.config_hash(a, "d1") == abl.config_hash(a, "d1") != abl.config_hash(a, "d2")
    assert abl.config_hash(a, "d1") != abl.config_hash(b, "d1")
    plain = load(ABLATIONS / "smoke.yaml", tmp_path)
    assert plain.config_hash(plain.points[0], "d1") != abl.config_hash(a, "d1")  # --set changes the hash


def test_excluded_points_are_not_run(tmp_path):
    """`exclude` drops the points that match every axis of one of its entries, and only those."""
    spec = {"name": "x", "dataset": {"dir": str(tmp_path)}, "grid": {"model.ranker.attention": ["dense", "jagged", "s2"],
            "data.max_seq_len": [1024, 4096]},
            "exclude": [{"max_seq_len": "1024", "attention": ["jagged", "s2"]}, {"attention": "dense", "max_seq_len": 4096}]}
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    names = [p.name for p in load(path, tmp_path).points]
    assert names == ["attention=dense/max_seq_len=1024", "attention=jagged/max_seq_len=4096",
                     "attention=s2/max_seq_len=4096"]


@pytest.mark.parametrize("change, message", [
    ({"bogus": 1}, "unknown keys"),
    ({"configs": ["base", "nope"]}, "config files not found"),
    ({"report": {"x": "nope"}}, "not an axis"),
    ({"grid": {"f": {"a": {"dataset": {"preset": "tiny", "mean_len": 9}}}}}, "needs a `name`"),
    ({"set": {"data.data_dir": "x"}}, "not data.data_dir"),
    ({"grid": {}}, "non-empty"),
    ({"exclude": {"max_seq_len": "16"}}, "must be a list"),
    ({"exclude": [{"max_seq_len": "999"}]}, r"exclude\[0\]: max_seq_len=\['999'\] is not on the grid"),
    ({"exclude": [{"nope": "16"}]}, "is not on the grid"),
    ({"exclude": [{"max_seq_len": ["16", "32"]}]}, "`exclude` leaves no point of the grid to run"),
])
def test_bad_ablation_files(tmp_path, change, message):
    spec = {**yaml.safe_load((ABLATIONS / "smoke.yaml").read_text()), **change}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=message):
        load(path, tmp_path)


def test_failure_line_names_the_signal_that_ended_a_run():
    from experiments.proc import failure_line

    out = "Epoch 0:   0%|          | 0/9\n"
    assert failure_line(1, "x\nerror: bad\n") == "error: bad"
    killed = failure_line(-9, out)
    assert killed.startswith("killed by SIGKILL (most often the kernel's out-of-memory killer")
    assert killed.endswith("its last line: Epoch 0:   0%|          | 0/9")
    assert failure_line(-15, out).startswith("killed by SIGTERM; its last line")


def test_error_line():
    out = "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out of memory.\n"
    assert sweep.error_line(out).startswith("torch.OutOfMemoryError") and sweep._OOM.search(out)
    assert sweep.error_line("lots\nerror: data.max_seq_len must be > 0\n") == "error: data.max_seq_len must be > 0"


@pytest.mark.slow
def test_smoke_sweep_records_every_outcome(smoke):
    assert smoke.rc == 1  # one point failed: reported, not raised
    parent = the_parent(smoke.uri)
    assert parent.info.run_name == "smoke" and parent.info.status == "FAILED"
    assert json.loads(parent.data.tags["sweep.axes"]) == {"attention": ["jagged"], "max_seq_len": ["16", "24", "0"]}
    kids = children(smoke.uri, parent.info.run_id)
    assert sorted(kids) == ["attention=jagged/max_seq_len=0", "attention=jagged/max_seq_len=16", "attention=jagged/max_seq_len=24"]
    (ok,), (oom,), (bad,) = (kids[f"attention=jagged/max_seq_len={n}"] for n in (16, 24, 0))
    assert ok.info.status == "FINISHED" and ok.data.tags["status"] == "OK"
    assert ok.data.metrics["test/auc"] > 0 and ok.data.params["data.max_seq_len"] == "16"
    assert ok.data.tags["sweep.config_hash"] and ok.data.tags["data_digest"]
    assert oom.info.status == "FAILED" and oom.data.tags["status"] == "OOM"
    assert "out of memory" in oom.data.tags["sweep.error"]
    assert bad.info.status == "FAILED" and bad.data.tags["status"] == "FAILED"
    assert "max_seq_len must be > 0" in bad.data.tags["sweep.error"]
    client = MlflowClient(smoke.uri)
    assert {"summary.md", "summary.csv", "smoke_test.yaml"} <= {f.path for f in client.list_artifacts(parent.info.run_id)}
    assert "sweep/output_tail.txt" in {f.path for f in client.list_artifacts(oom.info.run_id, "sweep")}
    assert (smoke.root / "data" / "tiny" / "meta.json").is_file()  # generated on demand


@pytest.mark.slow
def test_rerun_skips_finished_and_oom_children(smoke, capsys):
    parent = the_parent(smoke.uri)
    before = children(smoke.uri, parent.info.run_id)
    assert sweep.main([*smoke.argv, "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "max_seq_len=16: skip (OK)" in plan and "max_seq_len=24: skip (OOM)" in plan
    assert "max_seq_len=0: run" in plan
    assert sweep.main(smoke.argv) == 1
    out = capsys.readouterr().out
    assert "skipped, already OK" in out and "skipped, already OOM" in out
    after = children(smoke.uri, parent.info.run_id)
    assert the_parent(smoke.uri).info.run_id == parent.info.run_id  # found by name, resumed
    assert {k: len(v) for k, v in after.items()} == {k: len(v) + k.endswith("=0") for k, v in before.items()}
    assert "not run" not in out and "FAILED" in out  # the summary covers the whole grid


def test_a_killed_run_longer_than_the_finished_ones_raises_the_estimate():
    """A point's need is its finished runs' median wall time, or the longest a killed run ran where
    that is longer (a run of a longer budget, cut by its call's limit): starting it on the old
    median would have it cut again."""
    def run(point, status, wall):
        return SimpleNamespace(data=SimpleNamespace(tags={"sweep.point": point, "status": status},
                                                    metrics={"sweep/process_wall_s": wall}),
                               info=SimpleNamespace(status="FINISHED", end_time=1, start_time=0))
    runs = [run("a", "OK", 100.0), run("a", "OK", 140.0), run("a", "KILLED", 250.0),
            run("b", "OK", 100.0), run("b", "KILLED", 60.0), run("c", "KILLED", 30.0), run("c", "KILLED", 45.0)]
    fake = SimpleNamespace(_previous={"h1": runs[:3], "h2": runs[3:]})
    assert sweep.Sweep.expected_seconds(fake) == {"a": 250.0, "b": 100.0, "c": 45.0}


@pytest.mark.slow
def test_a_point_its_earlier_runs_say_cannot_finish_by_end_s_is_not_started(smoke, tmp_path, monkeypatch, capsys):
    """--end-s: a point whose earlier runs (another code version here: --set changes the hash)
    took longer than what is left is not started. On a copy of the smoke sweep's store: a sweep
    records its grid's hashes on the parent, which the other tests' reports read."""
    shutil.copy(smoke.uri.removeprefix("sqlite:///"), tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    parent = the_parent(uri)
    before = children(uri, parent.info.run_id)
    (earlier,) = before["attention=jagged/max_seq_len=16"]
    process_s = earlier.data.metrics["sweep/process_wall_s"]  # start-up included: more than MLflow's span
    assert process_s > (earlier.info.end_time - earlier.info.start_time) / 1000
    end_s = process_s / 2
    argv = [*smoke.argv, "--set", "trainer.max_steps=2", "--where", "max_seq_len=16", "--end-s", str(end_s)]
    assert sweep.main(argv) == 1
    out = capsys.readouterr().out
    found = re.search(r"max_seq_len=16: not started \(its earlier runs needed (\d+) s, \d+ s are left before --end-s\)", out)
    assert found and int(found.group(1)) == round(process_s)
    after = children(uri, parent.info.run_id)
    assert {k: len(v) for k, v in after.items()} == {k: len(v) for k, v in before.items()}  # no run started


def test_accept_code_counts_a_finished_run_of_that_code_version_as_done(smoke, tmp_path, monkeypatch, capsys):
    """After a library change off the training path, --accept-code <the old version> keeps a point's
    finished run (not rerun, and its hash is the one the parent gives the report); without it the
    new code reruns the point. On a copy of the smoke sweep's store."""
    from experiments import ablation as _sweep_spec

    shutil.copy(smoke.uri.removeprefix("sqlite:///"), tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    parent = the_parent(uri)
    (earlier,) = children(uri, parent.info.run_id)["attention=jagged/max_seq_len=16"]
    monkeypatch.setattr(_sweep_spec, "code_version", lambda: "a later version")
    argv = [*smoke.argv, "--where", "max_seq_len=16"]
    assert sweep.main([*argv, "--dry-run"]) == 0
    assert "max_seq_len=16: run" in capsys.readouterr().out
    assert sweep.main([*argv, "--accept-code", "another version", "--accept-code", earlier.data.tags["sweep.code_version"]]) == 0
    assert "max_seq_len=16: skipped, already OK" in capsys.readouterr().out
    assert earlier.data.tags["sweep.config_hash"] in json.loads(the_parent(uri).data.tags["sweep.hashes"])
    assert len(children(uri, parent.info.run_id)["attention=jagged/max_seq_len=16"]) == 1


@pytest.mark.slow
def test_a_run_past_its_timeout_is_killed_and_recorded(smoke, tmp_path, monkeypatch, capsys):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    argv = [str(smoke.ablation), "--data-root", str(smoke.root / "data"), "--where", "max_seq_len=16", "--timeout", "2"]
    assert sweep.main(argv) == 1
    assert "KILLED" in capsys.readouterr().out
    (run,) = children(uri, the_parent(uri).info.run_id)["attention=jagged/max_seq_len=16"]
    assert run.info.status == "KILLED" and run.data.tags["status"] == "KILLED"
    assert run.data.tags["sweep.error"] == "timed out after 2 s"


@pytest.mark.slow
def test_parallel_runs_are_tagged_prefixed_and_flagged_in_the_report(smoke, tmp_path, monkeypatch, capsys):
    from experiments import runs as runs_
    from experiments.report import shared_device_note

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    argv = [str(smoke.ablation), "--data-root", str(smoke.root / "data"), "--where", "max_seq_len=16,0",
            "--parallel", "2"]
    assert sweep.main(argv) == 1  # max_seq_len=0 fails its pre-flight check, 16 trains
    out = capsys.readouterr().out
    assert "[attention=jagged/max_seq_len=16] " in out and "[attention=jagged/max_seq_len=0] " in out
    kids = children(uri, the_parent(uri).info.run_id)
    (ok,), (bad,) = kids["attention=jagged/max_seq_len=16"], kids["attention=jagged/max_seq_len=0"]
    assert ok.data.tags["status"] == "OK" and bad.data.tags["status"] == "FAILED"
    assert ok.data.tags["sweep.parallel"] == "2"
    df = runs_.runs_frame([ok, bad], ["attention", "max_seq_len"])
    (note,) = [ln for ln in shared_device_note(df) if ln]
    assert "2 of these runs shared the GPU" in note and "--parallel 2" in note
    alone = df.with_columns(parallel=df["parallel"].str.replace("2", "1"), concurrent=df["concurrent"].str.replace("2", "1"))
    assert shared_device_note(alone) == []


def test_parallel_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["x.yaml", "--parallel", "0"])
    assert "--parallel must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("targets, message", [
    ([{"vs": "sdpa", "at": {"max_seq_len": "999"}}], "no point of the grid has"),
    ([{"base": "flash", "vs": "jagged"}], "no point of the grid has .*'flash'"),  # a row's own base must be a series
    ([{"at": {"max_seq_len": "16"}}], "must be a mapping with `vs`"),
    ([{"vs": "jagged", "min_speedup": 2, "typo": 1}], "must be a mapping with `vs`"),
])
def test_bad_report_targets(tmp_path, targets, message):
    spec = yaml.safe_load((ABLATIONS / "smoke.yaml").read_text())
    spec["report"] = {"x": "max_seq_len", "series": "attention", "baseline": "jagged", "targets": targets}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=message):
        load(path, tmp_path / "data")


@pytest.mark.slow
def test_sigterm_stops_the_run_in_flight_and_records_it(smoke, tmp_path):
    """`timeout`/`kill` end a sweep like Ctrl-C: no orphaned training process, the run KILLED."""
    import signal
    import subprocess

    import psutil

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    argv = [str(smoke.ablation), "--data-root", str(smoke.root / "data"), "--where", "max_seq_len=16",
            "--set", "trainer.limit_train_batches=100000", "--set", "trainer.max_epochs=100"]  # long enough
    check_tracking(uri)  # the store's tables exist before this test and the sweep both open it
    proc = subprocess.Popen([sys.executable, "-m", "experiments", "sweep", *argv], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client, running = MlflowClient(uri), _running_child(proc, uri, 120)
    training = [p for p in psutil.Process(proc.pid).children(recursive=True) if "fit" in " ".join(p.cmdline())]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:]
    assert "interrupted" in out
    gone, alive = psutil.wait_procs(training, timeout=30)
    assert not alive
    run = client.get_run(running[0].info.run_id)
    assert run.info.status == "KILLED" and run.data.tags["status"] == "KILLED"
    assert the_parent(uri).info.status == "KILLED"


def test_the_point_hash_follows_the_code(tmp_path, monkeypatch):
    """A point that FINISHED with other code is not "already OK": the hash covers the packages."""
    from experiments import ablation as _sweep_spec

    for package in _sweep_spec.CODE_PACKAGES:
        (tmp_path / package / "sub").mkdir(parents=True)
        (tmp_path / package / "sub" / "m.py").write_text("x = 1\n")
    first = _sweep_spec.code_version(tmp_path)
    assert _sweep_spec.code_version(tmp_path) == first  # same files, same version
    (tmp_path / "models" / "sub" / "m.py").write_text("x = 2\n")  # uncommitted or not: its bytes count
    _sweep_spec.code_version.cache_clear()
    assert _sweep_spec.code_version(tmp_path) != first
    abl = load(ABLATIONS / "smoke.yaml", tmp_path)
    monkeypatch.setattr(_sweep_spec, "code_version", lambda: "before")
    before = abl.config_hash(abl.points[0], "d1")
    monkeypatch.setattr(_sweep_spec, "code_version", lambda: "after")
    assert abl.config_hash(abl.points[0], "d1") != before


def test_a_grid_value_the_fit_refuses_is_not_runnable(tmp_path, monkeypatch, capsys):
    spec = yaml.safe_load((ABLATIONS / "smoke.yaml").read_text())
    spec["grid"] = {"model.ranker.attention": ["jagged"], "data.max_seq_len": [16, "sixteen"]}
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mp = _uri_env(uri)
    try:
        argv = [str(path), "--data-root", str(tmp_path / "data")]
        assert sweep.main([*argv, "--dry-run"]) == 2
        out, err = capsys.readouterr()
        assert "max_seq_len=16: run" in out
        assert 'max_seq_len=sixteen: INVALID (error: Parser key "data.max_seq_len"' in out
        assert "would be refused by `pipeline fit`" in err
        assert sweep.main(argv) == 2  # nothing runs: not even the valid point, no data is made
        assert "max_seq_len=sixteen" in capsys.readouterr().err
        assert MlflowClient(uri).get_experiment_by_name("ablations") is None
        assert not (tmp_path / "data").exists()
    finally:
        mp.undo()


def _running_child(proc, uri: str, timeout_s: float) -> list:
    """The sweep's training runs once one is RUNNING in MLflow (fails the test if none starts)."""
    client, deadline, running = MlflowClient(uri), time.monotonic() + timeout_s, []
    while not running and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        exp = client.get_experiment_by_name("ablations")
        if exp is not None:
            running = [r for r in client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'")
                       if r.data.tags.get("sweep.role") != "parent"]
    if not running:
        if proc.poll() is None:
            proc.kill()
        pytest.fail(f"the training run never started (sweep exit status {proc.wait()}):\n"
                    f"{proc.stdout.read()[-3000:]}")
    return running


def _sweep_process(smoke, uri: str, *extra: str):
    import subprocess

    check_tracking(uri)  # created once here, not by whichever of the test and the sweeps is first
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    argv = [str(smoke.ablation), "--data-root", str(smoke.root / "data"), "--where", "max_seq_len=16", *extra]
    return subprocess.Popen([sys.executable, "-m", "experiments", "sweep", *argv], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_identical_sweeps_started_together_run_each_point_once(smoke, tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    procs = [_sweep_process(smoke, uri) for _ in range(2)]
    outs = [p.communicate(timeout=400)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes in ([0, 0], [0, 2]), outs
    if codes == [0, 2]:  # the later one found the lock; else it started after the first had ended
        (refused,) = [o for p, o in zip(procs, outs) if p.returncode == 2]
        assert "a sweep of smoke is running already (pid" in refused
    kids = children(uri, the_parent(uri).info.run_id)
    assert {k: len(v) for k, v in kids.items()} == {"attention=jagged/max_seq_len=16": 1}


@pytest.mark.slow
def test_a_sweep_killed_outright_takes_its_run_with_it(smoke, tmp_path):
    """SIGKILL leaves the sweep no time to stop its run: the kernel does (the fit then records it)."""
    import psutil

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = _sweep_process(smoke, uri, "--set", "trainer.limit_train_batches=100000", "--set",
                          "trainer.max_epochs=100")
    client, running = MlflowClient(uri), _running_child(proc, uri, 180)
    training = [p for p in psutil.Process(proc.pid).children(recursive=True) if "fit" in " ".join(p.cmdline())]
    assert training
    proc.kill()
    proc.communicate(timeout=60)
    gone, alive = psutil.wait_procs(training, timeout=90)
    for p in alive:  # do not leave an orphan behind a failing test
        p.kill()
    assert not alive, "the training process outlived its sweep"
    run = client.get_run(running[0].info.run_id)
    assert run.info.status == "KILLED", (  # where the fit was when it ended, should this fail
        f"{len(run.data.params)} params, metrics {sorted(run.data.metrics)}, "
        f"steps {[m.step for m in client.get_metric_history(run.info.run_id, 'train/loss')][-3:]}")


def test_gpus_and_parallel_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["x.yaml", "--parallel", "2", "--gpus", "0,1"])
    assert "not both" in capsys.readouterr().err


def test_device_slots_deal_gpus_and_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    two = sweep.device_slots("0,1")
    assert [(s.gpu, s.sharing, s.cores) for s in two] == [("0", 1, [0, 1, 2, 3]), ("1", 1, [4, 5, 6, 7])]
    four = sweep.device_slots("0,0,1,1")
    assert [s.sharing for s in four] == [2, 2, 2, 2] and sorted(c for s in four for c in s.cores) == list(range(8))
    assert sweep.device_slots(None) == []
    with pytest.raises(ConfigError, match="GPU indices"):
        sweep.device_slots("0,cuda:1")


@pytest.mark.slow
def test_gpus_give_each_concurrent_run_its_device_and_cores(smoke, tmp_path, monkeypatch):
    """--gpus 0,1: two points at once, each run told its own GPU and pinned to its own cores;
    tagged as not sharing a device, and the report says they ran side by side."""
    from experiments import runs as runs_
    from experiments.report import shared_device_note

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    seen, lock = [], __import__("threading").Lock()

    def fake_stream(cmd, env, timeout_s, prefix="", stop=None, pass_fds=(), **echo):
        with lock:
            seen.append((env["CUDA_VISIBLE_DEVICES"], cmd[:3] if "taskset" in cmd[0] else None))
        return 1, "error: injected by the test", False

    monkeypatch.setattr(sweep, "stream", fake_stream)
    argv = [str(smoke.ablation), "--data-root", str(smoke.root / "data"), "--where", "max_seq_len=16,24",
            "--gpus", "0,1"]
    assert sweep.main(argv) == 1
    assert len(seen) == 2 and {gpu for gpu, _ in seen} <= {"0", "1"}
    if __import__("shutil").which("taskset"):
        assert {tuple(c[1:]) for _, c in seen if c} <= {("-c", "0,1"), ("-c", "2,3")}
    kids = [r for runs in children(uri, the_parent(uri).info.run_id).values() for r in runs]
    assert {r.data.tags["sweep.parallel"] for r in kids} == {"1"}
    assert {r.data.tags["sweep.concurrent_runs"] for r in kids} == {"2"}
    df = runs_.runs_frame(kids, ["attention", "max_seq_len"])
    note = " ".join(shared_device_note(df))
    assert "on different GPUs" in note and "shared the GPU" not in note


def test_a_runs_table_from_before_the_concurrent_column_still_gets_the_shared_gpu_warning():
    import polars as pl

    from experiments.report import shared_device_note

    old = pl.DataFrame({"status": ["OK", "OK"], "parallel": ["2", "2"]})  # a runs.csv written before --gpus
    (note,) = [ln for ln in shared_device_note(old) if ln]
    assert "2 of these runs shared the GPU" in note and "--parallel 2" in note
    assert shared_device_note(old.with_columns(parallel=pl.lit("1"))) == []


LAB_VERBS = ("sweep", "report", "summary", "reproduce", "ddp-bench", "balance", "loader-bench")


def test_every_lab_verb_answers_help_without_the_heavy_imports():
    """`python -m experiments <verb> --help` parses before it imports MLflow, Lightning or matplotlib."""
    import subprocess

    code = ("import sys, runpy\n"
            f"for verb in {LAB_VERBS!r}:\n"
            "    sys.argv = ['experiments', verb, '--help']\n"
            "    try:\n"
            "        runpy.run_module('experiments', run_name='__main__', alter_sys=True)\n"
            "    except SystemExit as exit:\n"
            "        assert exit.code in (0, None), (verb, exit.code)\n"
            "    heavy = [m for m in ('mlflow', 'pytorch_lightning', 'matplotlib') if m in sys.modules]\n"
            "    assert not heavy, (verb, heavy)\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    for verb in LAB_VERBS:
        assert f"python -m experiments {verb}" in proc.stdout, verb  # each printed its own usage
