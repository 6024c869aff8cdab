"""What a user meets in MLflow: `make ui` serves from one process, and a sweep leaves a saved view
of its comparison (key columns, parent first, display precision) and links that open in the
model-training view. The browser walk itself: tests/ui_screenshots.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_make_ui_serves_from_one_process(tmp_path):
    """MLflow's default server is four workers and a job runner, each importing mlflow at once: on two
    cores it answered after about 30 s. `make ui` runs one process under the CLI's."""
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    make = subprocess.Popen(["make", "-s", "ui", "SETUP=none", f"PY={sys.executable}", f"PORT={port}"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 180:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).read()
                break
            except OSError:
                assert make.poll() is None, make.stdout.read().decode()[-2000:]
                time.sleep(0.2)
        else:
            pytest.fail("make ui did not answer within 180 s")
        pythons = [p for p in psutil.Process(make.pid).children(recursive=True) if "python" in p.name()]
        assert len(pythons) == 2, [" ".join(p.cmdline()) for p in pythons]  # mlflow's CLI and its one server
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(30)
    assert "click 'Model training'" in make.stdout.read().decode()
