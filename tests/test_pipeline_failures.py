"""`pipeline fit` against a broken world: stalled or failing tracking servers, a fresh database
shared by concurrent fits, bad data, unwritable or full disks, missing drivers, SIGTERM.

Each failure must end in one line saying what is wrong (no traceback) and the exit status the
README promises: 2 before training, 1 for a failure during it, 143 for SIGTERM.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline.cli import main
from pipeline.errors import ConfigError
from pipeline.tracking import HTTP_BOUNDS
from test_pipeline_cli import all_runs, fit_args, fresh_tracking_uri, tracking  # noqa: F401 (a fixture)
from test_pipeline_data import tiny_data_dir

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
QUICK = ["--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "0",
         "--trainer.limit_test_batches", "1", "--mlflow.system_metrics", "false"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_data_dir(tmp_path_factory)


def fit_process(args: list[str], uri: str, timeout: float = 240, **env) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipeline", *args]
    full_env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(TESTS), **env}
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)


def one_line_error(stderr: str, *parts: str) -> str:
    """The `error: ...` line of stderr; there is no traceback."""
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("error: ")]
    for part in parts:
        assert part in line, (part, line)
    return line


# --- tracking servers that answer /health but not their API -------------------------------
class _Server(BaseHTTPRequestHandler):
    """`/health` is fine; the API hangs, fails with 500, or (mode "probe") answers only the
    pre-flight's experiments/search and hangs on everything else ("trickle": sends its reply to
    everything else a byte every half second, for ever; "trickle-all": to /health too)."""

    def do_GET(self) -> None:
        if self.path == "/health" and self.server.mode != "trickle-all":
            self._reply(200, b"OK")
        else:
            self._misbehave()

    def do_POST(self) -> None:
        if self.server.mode in ("probe", "trickle") and self.path.endswith("/experiments/search"):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._reply(200, json.dumps({"experiments": []}).encode())
        else:
            self._misbehave()

    def _misbehave(self) -> None:
        if self.server.mode == "500":
            self._reply(500, b'{"error_code": "INTERNAL_ERROR", "message": "database is down"}')
        elif self.server.mode.startswith("trickle"):  # every read gets a byte well within its timeout
            reply = b"HTTP/1.1 200 OK\r\nX-Trickle: " + b"a" * 100_000
            for i in range(len(reply)):
                if self.server.release.wait(0.5):
                    return
                try:
                    self.wfile.write(reply[i:i + 1])
                    self.wfile.flush()
                except OSError:
                    return
        else:
            self.server.release.wait(120)

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    servers = []

    def start(mode: str) -> str:
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
        srv.mode, srv.release, srv.daemon_threads = mode, threading.Event(), True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.release.set()
        srv.shutdown()
        srv.server_close()


@pytest.mark.slow
@pytest.mark.parametrize("mode, message", [("hang", "answers /health but not its API"),
                                           ("500", "answers /health but its API fails (POST")])
def test_a_server_whose_api_fails_is_refused_in_the_preflight(tiny, tmp_path, server, mode, message):
    uri = server(mode)
    t0 = time.monotonic()
    proc = fit_process(fit_args(tiny, tmp_path, *QUICK), uri, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    one_line_error(proc.stderr, uri, message)
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_every_tracking_call_is_bounded_and_ends_in_one_line(tiny, tmp_path, server):
    """The pre-flight passes, then the server stalls: MLflow's own calls give up (their bounds are
    the environment's: the test's short ones here) and the fit says which server failed."""
    uri = server("probe")
    proc = fit_process(fit_args(tiny, tmp_path, *QUICK), uri, timeout=120,
                       MLFLOW_HTTP_REQUEST_TIMEOUT="2", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    assert proc.returncode == 2, proc.stderr[-3000:]
    one_line_error(proc.stderr, "cannot start an MLflow run at", uri)


@pytest.mark.slow
def test_a_server_that_trickles_its_replies_is_given_up_on(tiny, tmp_path, server):
    """Each read of a reply is bounded (MLFLOW_HTTP_REQUEST_TIMEOUT), a byte every half second
    never trips that bound: the whole request must be bounded, or fit waits for ever."""
    uri = server("trickle")
    t0 = time.monotonic()
    proc = fit_process(fit_args(tiny, tmp_path, *QUICK), uri, timeout=240,
                       MLFLOW_HTTP_REQUEST_TIMEOUT="2", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    assert proc.returncode == 2, proc.stderr[-3000:]
    one_line_error(proc.stderr, "cannot start an MLflow run at", uri, "no complete reply within")
    assert time.monotonic() - t0 < 60


def test_a_preflight_whose_server_trickles_ends_within_its_limit(server, monkeypatch):
    from pipeline.tracking import check_tracking

    for key in HTTP_BOUNDS:  # recorded, so that what check_tracking sets is undone afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    uri = server("trickle-all")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="is unreachable .*no complete reply within 3 s"):
        check_tracking(uri, timeout_s=2.0)
    assert time.monotonic() - t0 < 10


def test_http_calls_get_bounds_unless_the_user_set_some(monkeypatch, server):
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    from pipeline.tracking import check_tracking

    for key in HTTP_BOUNDS:  # recorded, so that what check_tracking sets is undone afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")  # the user's choice wins
    check_tracking(server("probe"))
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() <= 30 and MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 5


@pytest.mark.parametrize("tool", ["report", "reproduce"])
def test_the_other_tools_check_the_server_first(server, monkeypatch, capsys, tool):
    import importlib

    for key in HTTP_BOUNDS:  # recorded, so that what check_tracking sets is undone afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    uri = server("500")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setattr("mlflow.tracking._tracking_service.utils._tracking_uri", None, raising=False)
    module = importlib.import_module(f"experiments.{tool}")
    args = ["--parent", "smoke"] if tool == "report" else ["--run", "0" * 32]
    assert module.main(args) == 2
    assert f"MLflow tracking server {uri} answers /health but its API fails" in capsys.readouterr().err


# --- a fresh sqlite database ---------------------------------------------------------------
@pytest.mark.slow
def test_concurrent_fits_on_a_fresh_database_all_succeed(tiny, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # no tables yet: the first users create them
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(TESTS)}
    procs = [subprocess.Popen([sys.executable, "-m", "pipeline",
                               *fit_args(tiny, tmp_path / f"fit{i}", *QUICK, "--mlflow.run_name", f"fit{i}",
                                         "--torch_num_threads", "1")],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for i in range(3)]
    errors = [p.communicate(timeout=400)[1] for p in procs]
    for p, err in zip(procs, errors):
        assert p.returncode == 0, err[-3000:]
    runs = all_runs(uri)
    assert sorted(runs) == ["fit0", "fit1", "fit2"]
    assert {r.info.status for r in runs.values()} == {"FINISHED"}


@pytest.mark.parametrize("error, calls", [("database is locked", 3), ("table experiments already exists", 3),
                                          ("unable to open database file", 1)])
def test_a_store_another_program_is_creating_is_waited_for(tmp_path, monkeypatch, error, calls):
    """`mlflow ui` on the same fresh file migrates it outside our lock: a race is retried, nothing else."""
    import sqlalchemy.exc

    from pipeline import tracking as store

    tries = []

    class Client:
        def __init__(self, uri):
            pass

        def search_experiments(self, max_results):
            tries.append(1)
            if len(tries) < 3:
                raise sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception(error))
            return []

    monkeypatch.setattr("mlflow.tracking.MlflowClient", Client)
    monkeypatch.setattr(store.time, "sleep", lambda s: None)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    if calls == 1:
        with pytest.raises(ConfigError, match="cannot open the tracking store: .*unable to open database file"):
            store.check_tracking(uri)
    else:
        store.check_tracking(uri)
    assert len(tries) == calls


# --- data, disks, drivers ------------------------------------------------------------------
def run_main(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr().err


def test_invalid_data_stops_fit_before_a_run_exists(tiny, tracking, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(tiny, data, ignore=shutil.ignore_patterns(".cache"))
    shard = data / "test" / "part-00000.parquet"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # the footer still reads: only the full check sees it
    shard.write_bytes(bytes(raw))
    code, err = run_main(fit_args(data, tmp_path, *QUICK), capsys)
    assert code == 2
    one_line_error(err, "invalid data set at", "sha256 differs", "data_gen validate")
    assert all_runs(tracking) == {}


def test_unwritable_output_directory_is_refused(tiny, tracking, tmp_path, capsys):
    code, err = run_main(fit_args(tiny, Path("/proc/no/such/dir"), *QUICK), capsys)
    assert code == 2
    one_line_error(err, "--trainer.default_root_dir /proc/no/such/dir: cannot write into /proc")
    assert all_runs(tracking) == {}


def test_a_full_disk_ends_in_one_line_and_a_failed_run(tiny, tracking, tmp_path, capsys, monkeypatch):
    from pytorch_lightning.callbacks import ModelCheckpoint

    def full(self, trainer, filepath):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ModelCheckpoint, "_save_checkpoint", full)
    code, err = run_main(fit_args(tiny, tmp_path, *QUICK, "--mlflow.run_name", "full"), capsys)
    assert code == 1
    one_line_error(err, "No space left on device")
    assert all_runs(tracking)["full"].info.status == "FAILED"


def test_a_missing_database_driver_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    pytest.importorskip("sqlalchemy")
    if any(_importable(m) for m in ("psycopg2", "psycopg")):
        pytest.skip("a PostgreSQL driver is installed")
    monkeypatch.setattr(sys, "argv", ["pipeline"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://user:secret@127.0.0.1:1/mlflow")
    code, err = run_main(fit_args(tiny, tmp_path, *QUICK), capsys)
    assert code == 2
    line = one_line_error(err, "database driver is not installed", "postgresql://user:***@")
    assert "secret" not in line


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --- signals -------------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_ends_fit_with_143_and_a_killed_run(tiny, tmp_path, tmp_path_factory):
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    args = fit_args(tiny, tmp_path, "--mlflow.run_name", "long", "--mlflow.system_metrics", "false",
                    "--trainer.max_epochs", "1000", "--trainer.limit_val_batches", "0")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(TESTS)}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    client, deadline = MlflowClient(uri), time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        runs = all_runs(uri)
        if "long" in runs and client.get_metric_history(runs["long"].info.run_id, "train/loss_step"):
            break
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()  # no training process outlives a failed test
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    assert all_runs(uri)["long"].info.status == "KILLED"


@pytest.mark.slow
def test_a_fit_whose_reader_goes_away_finishes_and_records_its_run(tiny, tmp_path, tmp_path_factory):
    """`pipeline fit ... | head -1`: the next print raised BrokenPipeError, the finished training
    was recorded FAILED with a traceback and exit 1."""
    uri = fresh_tracking_uri(tmp_path_factory, tmp_path)
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(TESTS)}
    args = fit_args(tiny, tmp_path, *QUICK, "--mlflow.run_name", "unread", "--torch_num_threads", "1")
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline()
        proc.stdout.close()
        assert proc.wait(timeout=240) == 0
    finally:
        proc.kill()  # no training process outlives a failed test
    run = all_runs(uri)["unread"]
    assert run.info.status == "FINISHED" and "test/auc" in run.data.metrics


def test_a_command_turns_a_config_error_into_one_line_and_status_2(capsys):
    """pipeline.errors.command: every pipeline command's main has this convention, wherever the
    ConfigError comes from; its own status passes through, other errors are not swallowed."""
    from pipeline.errors import ConfigError, command

    @command
    def main(argv=None):
        if argv == ["bad"]:
            raise ConfigError("no data set at x: run `make data` first")
        if argv == ["bug"]:
            raise KeyError("a bug")
        return 0 if argv is None else 1

    assert main() == 0 and main(["other"]) == 1
    assert main(["bad"]) == 2
    assert capsys.readouterr().err == "error: no data set at x: run `make data` first\n"
    with pytest.raises(KeyError):
        main(["bug"])
