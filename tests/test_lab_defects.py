"""The lab's defects of issues 46 and 47, one test each: locks, names and paths read from a
tracking store, YAML, damaged stores and result files, the bench's exit status, a reader that
goes away, the console log of a sweep, zoomed plots and where files go."""

from __future__ import annotations

import gzip
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402
import torch  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from experiments import plots, proc, report, runs, summary, sweep  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from test_pipeline_cli import fresh_tracking_uri  # noqa: E402
from test_sweep import _uri_env, children, smoke_sweep, the_parent  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def smoke(tmp_path_factory):
    state = smoke_sweep(tmp_path_factory)
    mp = _uri_env(state.uri)
    yield state
    mp.undo()


def smoke_copy(smoke, tmp_path, monkeypatch) -> str:
    """The smoke sweep's store copied (tags changed here do not reach the other tests)."""
    (tmp_path / "mlflow.db").write_bytes(Path(smoke.uri.removeprefix("sqlite:///")).read_bytes())
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def test_one_sqlite_file_is_one_lock_whatever_the_uri_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    held = []
    for uri in ("sqlite:///x.db", "sqlite:///./x.db", f"sqlite:///{tmp_path}/../{tmp_path.name}/x.db"):
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        path = proc.lock_path("sweep-a", "ablations", "a")
        assert path.parent == tmp_path.resolve() and path.name.startswith("x.db.sweep-a-")
        if not held:
            held.append(proc.hold_lock(path, "a sweep of a"))
            continue
        with pytest.raises(ConfigError, match="a sweep of a is running already"):
            proc.hold_lock(path, "a sweep of a")
    held[0].close()


@pytest.mark.parametrize("plant", [os.symlink, os.link])
def test_a_lock_planted_as_a_link_is_refused_and_its_target_kept(tmp_path, monkeypatch, plant):
    """A tracking store that is not a file: the lock lives in a private directory, and a link
    planted where the lock goes is refused, its target not truncated."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    path = proc.lock_path("sweep-a", "ablations", f"a-{plant.__name__}-{os.getpid()}")
    assert (path.parent.stat().st_mode & 0o777) == 0o700 and path.parent != Path("/tmp")
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    plant(victim, path)
    try:
        with pytest.raises(ConfigError, match="remove it"):
            proc.hold_lock(path, "a sweep of a")
    finally:
        path.unlink()
    assert victim.read_text() == "precious"


def test_a_quote_in_an_ablation_name_finds_its_parent(tmp_path, tmp_path_factory):
    client = MlflowClient(fresh_tracking_uri(tmp_path_factory, tmp_path))
    exp = client.create_experiment("ablations", artifact_location=str(tmp_path / "mlruns"))
    for name in ("it's", 'say "hi"', "it's"):
        newest = client.create_run(exp, run_name=name, tags={"sweep.role": "parent"})
    assert runs.find_parent(client, "it's", [exp]).info.run_id == newest.info.run_id  # the newest of that name
    assert runs.find_parent(client, 'say "hi"', [exp]).info.run_name == 'say "hi"'
    with pytest.raises(ConfigError, match="no sweep parent run"):
        runs.find_parent(client, "it", [exp])


@pytest.mark.slow
def test_report_never_replaces_a_fuller_report(smoke, tmp_path, monkeypatch):
    """After a subset rerun (here: the parent's grid hashes cut to one point), the report does not
    overwrite the folder whose report holds finished points this one lacks: it goes beside it, as
    partial-<commit>/, and names those points."""
    uri = smoke_copy(smoke, tmp_path, monkeypatch)
    client, parent = MlflowClient(uri), the_parent(uri)
    out = report.write_report(parent, tmp_path / "out", log=False)
    full = (out / "report.md").read_text()
    kids = [r for rs in children(uri, parent.info.run_id).values() for r in rs]
    others = [r.data.tags["sweep.config_hash"] for r in kids if r.data.tags["status"] != "OK"]
    client.set_tag(parent.info.run_id, "sweep.hashes", json.dumps(others))
    partial = report.write_report(client.get_run(parent.info.run_id), tmp_path / "out", "abcdef0123", log=False)
    assert partial == out / "partial-abcdef0" and (out / "report.md").read_text() == full
    whole = json.loads((out / "report.json").read_text())
    lacked = ["/".join(f"{a}={r[a]}" for a in whole["axes"]) for r in whole["rows"] if r["status"] == "OK"]
    assert lacked == ["attention=jagged/max_seq_len=16"]  # the one finished point of the smoke sweep
    assert ("A partial report: the whole one in the folder above has points this sweep has not run "
            "(attention=jagged/max_seq_len=16).") in (partial / "report.md").read_text()


@pytest.mark.slow
def test_the_report_folder_is_never_named_by_the_tracking_store(smoke, tmp_path, monkeypatch):
    uri = smoke_copy(smoke, tmp_path, monkeypatch)
    client, parent = MlflowClient(uri), the_parent(uri)
    for name in ("../../../escaped", str(tmp_path / "absolute")):
        client.set_tag(parent.info.run_id, "sweep.name", name)
        out = report.write_report(client.get_run(parent.info.run_id), tmp_path / "a" / "b" / "out", log=False)
        assert out.resolve().parent.parent == (tmp_path / "a" / "b" / "out" / "ablations").resolve()
        assert (out / "report.md").is_file()
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "absolute").exists()


@pytest.mark.slow
def test_end_s_counts_the_drivers_own_start_up(smoke, tmp_path, monkeypatch, capsys):
    """A driver that started 10,000 s ago (its imports, data generation: here faked) has no time
    left for a point that needs its earlier runs' wall time before --end-s 9,000."""
    import psutil

    uri = smoke_copy(smoke, tmp_path, monkeypatch)
    before = children(uri, the_parent(uri).info.run_id)
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: time.time() - 10_000)
    argv = [*smoke.argv, "--set", "trainer.max_steps=2", "--where", "max_seq_len=16", "--end-s", "9000"]
    assert sweep.main(argv) == 1
    assert "max_seq_len=16: not started (its earlier runs needed" in capsys.readouterr().out
    assert {k: len(v) for k, v in children(uri, the_parent(uri).info.run_id).items()} == \
        {k: len(v) for k, v in before.items()}


@pytest.mark.parametrize("text, where", [
    ('name: x\ngrid: {a: !!python/object/apply:os.system ["touch {marker}"]}\n', "line 2"),
    ("name: x\ngrid: [1, 2\n", "line 3"),
    ("- just\n- a list\n", "a mapping of keys"),
])
def test_a_bad_ablation_file_is_one_line_and_builds_nothing(tmp_path, capsys, text, where):
    marker = tmp_path / "marker"
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace("{marker}", str(marker)))
    assert sweep.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and where in err and "Traceback" not in err
    assert not marker.exists()


@pytest.mark.parametrize("value, where", [('!!python/object/apply:os.system ["touch {marker}"]', "python/object"),
                                          ("[1, 2", "line 1: expected ',' or ']'")])
def test_a_python_tag_or_bad_yaml_in_set_is_refused(tmp_path, capsys, value, where):
    marker = tmp_path / "marker"
    argv = [str(REPO / "experiments" / "ablations" / "smoke.yaml"), "--dry-run",
            "--set", "trainer.max_steps=" + value.replace("{marker}", str(marker))]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set trainer.max_steps=") and err.count("\n") == 1 and not marker.exists()
    assert where in err and "Traceback" not in err, err


def test_report_on_a_damaged_store_is_one_line(tmp_path, tmp_path_factory, monkeypatch, capsys):
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    client = MlflowClient(uri)
    exp = client.create_experiment("ablations", artifact_location=str(tmp_path / "mlruns"))
    client.create_run(exp, run_name="x", tags={"sweep.role": "parent"})
    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        page_size = con.execute("pragma page_size").fetchone()[0]
        (root,) = con.execute("select rootpage from sqlite_master where name = 'runs'").fetchone()
    with open(db, "r+b") as f:  # the runs table's pages, garbled: the experiments still read
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * page_size)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    capsys.readouterr()  # the set-up's own output (MLflow creating the session's template store)
    assert report.main(["--parent", "x", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: the tracking store {uri} cannot be read") and err.count("\n") == 1


@pytest.mark.parametrize("damaged", ["ablations/x/cpu/report.json", "kernels/x/bench-all-paper.json.gz",
                                     "training/x/profile-b512.json"])
def test_summary_names_a_damaged_result_file(tmp_path, capsys, damaged):
    path = tmp_path / damaged
    path.parent.mkdir(parents=True)
    whole = json.dumps({"schema": "jagged-bench/1", "rows": [{"status": "OK"}] * 50}).encode()
    path.write_bytes(gzip.compress(whole)[:40] if damaged.endswith(".gz") else whole[:-30])
    assert summary.main(["--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: a damaged result file") and err.count("\n") == 1


def test_summary_writes_under_runs_unless_told_where(tmp_path, monkeypatch, capsys):
    """The committed REPORT.md is rewritten only when the results folder is named; elsewhere its
    links point back into the results folder."""
    results = tmp_path / "experiments" / "results"
    (results / "training" / "x").mkdir(parents=True)
    (results / "training" / "x" / "reproduce.json").write_text(json.dumps({"device": "X", "result": "REPRODUCED"}))
    monkeypatch.setattr(summary, "REPO_ROOT", tmp_path)
    assert summary.main([]) == 0
    assert not (results / "REPORT.md").exists()
    assert "[reproduce](../experiments/results/training/x/reproduce.json)" in (tmp_path / "runs" / "REPORT.md").read_text()
    assert summary.main(["--results", str(results)]) == 0
    assert "[reproduce](training/x/reproduce.json)" in (results / "REPORT.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_bench_on_cuda_without_cuda_is_one_line(tmp_path, capsys):
    from experiments.bench.cli import main

    assert main(["ops", "--suite", "smoke", "--device", "cuda", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda: no CUDA device") and err.count("\n") == 1


def test_the_bench_fails_when_ours_fails_on_a_row(tmp_path, monkeypatch, capsys):
    import kernels
    from experiments.bench.cli import main

    def broken(*args, **kwargs):
        raise RuntimeError("a broken kernel")

    monkeypatch.setattr(kernels, "jagged_softmax", broken)
    argv = ["ops", "--suite", "smoke", "--device", "cpu", "--out", str(tmp_path), "--warmup", "0", "--rep", "1",
            "--max-shapes", "1", "--providers", "torch_padded", "--no-report"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "error: ours error: RuntimeError at ops jagged_softmax smoke" in err and "a broken kernel" in err
    assert json.loads((tmp_path / "bench-ops-smoke.json").read_text())["rows"]  # the rows are kept


def test_a_sweeps_console_leaves_out_library_chatter_and_its_log_keeps_it(tmp_path, capsys):
    lines = ["Seed set to 0", "GPU available: False, used: False", "TPU available: False, using: 0 TPU cores",
             "  | Name  | Type   | Params | Mode", "0 | model | Ranker | 666 K  | train", "666 K     Trainable params",
             "2026/01/01 00:00:00 INFO mlflow.system_metrics.system_metrics_monitor: Started monitoring.",
             "Validation DataLoader 0:  50%|#####     | 2/4", "/x.py:1: UserWarning: the learning rate is NaN",
             "  warnings.warn(", "Epoch 0: 100%|##########| 8/8 [00:01<00:00, loss=0.64]",
             "        test/auc            0.5984"]
    child = [sys.executable, "-c", f"print({chr(10).join(lines)!r})"]
    with open(tmp_path / "run.log", "wb") as log:
        rc, _, _ = proc.stream(child, dict(os.environ), 60, log=log, quiet=True)
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines() == ["/x.py:1: UserWarning: the learning rate is NaN",
                                "Epoch 0: 100%|##########| 8/8 [00:01<00:00, loss=0.64]",
                                "        test/auc            0.5984"]
    assert (tmp_path / "run.log").read_text().splitlines() == lines


@pytest.mark.slow
def test_a_sweep_whose_reader_goes_away_finishes_and_records_its_run(smoke, tmp_path):
    """`... | head -1`: the driver's stdout breaks after its first line; the run still finishes OK,
    the sweep ends normally, and its artifacts go beside the store, not into the checkout."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "experiments", "sweep", *smoke.argv, "--where", "max_seq_len=16"]
    driver = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        driver.stdout.readline()
        driver.stdout.close()
        assert driver.wait(timeout=600) == 0
    finally:
        driver.kill()  # no sweep outlives a failed test (its runs follow it: PR_SET_PDEATHSIG)
    (run,) = children(uri, the_parent(uri).info.run_id)["attention=jagged/max_seq_len=16"]
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "OK"
    logged = {f.path for f in MlflowClient(uri).list_artifacts(run.info.run_id, "sweep")}
    assert any(p.endswith(".log") for p in logged)
    for store, root in ((uri, tmp_path), (smoke.uri, smoke.root)):  # the session's sweep ran in the checkout
        assert MlflowClient(store).get_experiment_by_name("ablations").artifact_location.endswith(f"{root}/mlruns")


def test_the_auc_axis_says_when_it_is_zoomed(tmp_path, monkeypatch):
    import polars as pl

    figs = []
    monkeypatch.setattr(plots.plt, "close", lambda fig: figs.append(fig))
    df = pl.DataFrame({"x": ["64", "256"], "status": ["OK", "OK"], "test/auc": [0.701, 0.712]})
    plots.line_plot(df, "x", ["64", "256"], [], "test/auc", "test AUC", "Test AUC", tmp_path / "a.png", baseline=0.5)
    ax = figs[-1].axes[0]
    assert "zoomed: the axis starts at 0.7" in ax.get_ylabel() and "not 0.5" in ax.get_ylabel()
    assert "one run per point: no seed spread" in figs[-1]._suptitle.get_text()
    df = pl.DataFrame({"x": ["64", "256"], "status": ["OK", "OK"], "test/auc": [0.2, 0.9]})
    plots.line_plot(df, "x", ["64", "256"], [], "test/auc", "test AUC", "Test AUC", tmp_path / "b.png", baseline=0.5)
    assert figs[-1].axes[0].get_ylabel() == "test AUC"


_WRITES = re.compile(r"--(?:out|results|perf\.trace_dir) +'?([^' ]+)")


@pytest.mark.parametrize("target", ["experiment", "report", "bench", "costmodel", "profile", "config-sweep", "data",
                                    "user-embeddings"])
def test_a_make_target_writes_only_where_git_ignores_unless_told_where(target):
    """`make report PARENT=main-small` wrote an untracked folder under experiments/results/: every
    place a target writes by default is git-ignored (RESULTS=experiments/results names the committed one)."""
    dry = subprocess.run(["make", "-n", target, "SETUP=none", "PY=python3", "PARENT=x"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    paths = [p.replace("<gpu>", "h100-80gb-hbm3").replace("$a", "jagged") for p in _WRITES.findall(dry)]
    assert paths, dry
    for path in paths:
        probe = subprocess.run(["git", "check-ignore", "-q", "--no-index", f"{path}/report.md"], cwd=REPO)
        assert probe.returncode == 0, f"make {target} writes into {path}, which git does not ignore"
    told = subprocess.run(["make", "-n", target, "SETUP=none", "PY=python3", "PARENT=x", "RESULTS=elsewhere"],
                          cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert target in ("data", "user-embeddings", "config-sweep") or "elsewhere" in told
