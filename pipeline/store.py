"""Where runs are recorded, checked before anything trains: :func:`check_tracking`.

- An http(s) server must answer ``/health`` *and* its REST API (a server whose database is
  stuck answers the first and hangs on the second), each within a few seconds.
- Every later HTTP call MLflow makes is bounded (:data:`HTTP_BOUNDS`): MLflow's own defaults
  wait 120 s per request and retry 7 times with exponential backoff, minutes of silence
  against a stalled server. Values already in the environment win; child processes inherit.
- A sqlite database is created (tables migrated, default experiment) by one process at a time,
  under an exclusive lock on ``<db>.lock`` beside it: MLflow creates it on first use without
  any lock, and several processes starting on a fresh file race in its migrations. A process
  outside that lock (``mlflow ui``) that is migrating or writing it is waited for, up to 10 s.
- Any other database URI is opened once, so that a missing driver or an unreachable database
  is one line, not a traceback.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.errors import ConfigError

HTTP_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",  # seconds per request
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # 1 s, then 2 s between the tries
}
API_PROBE = "/api/2.0/mlflow/experiments/search"
_RACE_RETRIES = 10  # one second apart
_FIX = "unset MLFLOW_TRACKING_URI to use the local sqlite database, or start the server (`make ui`)"


def shown(uri: str) -> str:
    """The URI without a password (``scheme://user:***@host``)."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", uri)


def check_tracking(uri: str, timeout_s: float = 5.0) -> None:
    """Raise ConfigError, saying what to do, if runs cannot be recorded at `uri`."""
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_BOUNDS.items():
            os.environ.setdefault(key, value)
        _check_server(uri.rstrip("/"), timeout_s)
    elif uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):].split("?", 1)[0])
        if not db.parent.is_dir() or not os.access(db.parent, os.W_OK):
            raise ConfigError(f"MLFLOW_TRACKING_URI={uri}: directory {db.parent} does not exist or is not writable")
        with open(db.with_name(db.name + ".lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
            open_store(uri)
    elif uri.startswith("file:") or "://" not in uri:
        raise ConfigError(
            f"MLFLOW_TRACKING_URI={uri}: MLflow's file store is not supported here; "
            f"use sqlite:///<absolute path>/mlflow.db or an http:// server"
        )
    else:
        open_store(uri)


def open_store(uri: str) -> None:
    """Open the database store at `uri` once (creating its tables if it is new)."""
    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        for attempt in range(_RACE_RETRIES + 1):
            try:
                MlflowClient(uri).search_experiments(max_results=1)
                break
            except (MlflowException, sqlalchemy.exc.SQLAlchemyError) as err:
                if attempt == _RACE_RETRIES or not _lost_race(uri, err):
                    raise
                time.sleep(1.0)
    except ImportError as err:
        raise ConfigError(f"MLFLOW_TRACKING_URI={shown(uri)}: its database driver is not installed ({err}); "
                          f"install it (e.g. `pip install psycopg2-binary` or `pymysql`) or use sqlite:///...") from None
    except (MlflowException, sqlalchemy.exc.SQLAlchemyError, OSError) as err:
        raise ConfigError(f"MLFLOW_TRACKING_URI={shown(uri)}: cannot open the tracking store: "
                          f"{first_line(err)}") from None


def _lost_race(uri: str, err: BaseException) -> bool:
    """A sqlite store another process (not under our lock: ``mlflow ui``, a notebook) is
    creating or writing at this moment: worth a retry, not an error."""
    text = str(err).lower()
    return uri.startswith("sqlite:") and ("already exists" in text or "database is locked" in text)


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return (text.splitlines()[0] if text else type(err).__name__)[:300]


def _check_server(base: str, timeout_s: float) -> None:
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout_s) as resp:
            if resp.status != 200:
                raise OSError(f"HTTP {resp.status}")
    except (OSError, urllib.error.URLError) as err:
        raise ConfigError(f"MLflow tracking server {shown(base)} is unreachable ({err}): {_FIX}") from None
    request = urllib.request.Request(base + API_PROBE, data=json.dumps({"max_results": 1}).encode(),
                                     headers={"Content-Type": "application/json", **_auth_headers()})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            json.load(resp)
    except urllib.error.HTTPError as err:
        raise ConfigError(f"MLflow tracking server {shown(base)} answers /health but its API fails "
                          f"(POST {API_PROBE}: HTTP {err.code} {err.reason}); check the server's log") from None
    except (OSError, ValueError) as err:  # a timeout, a reset connection, a body that is not JSON
        raise ConfigError(f"MLflow tracking server {shown(base)} answers /health but not its API "
                          f"(POST {API_PROBE}: {err or type(err).__name__}, limit {timeout_s:g} s); "
                          f"check the server's log and its database") from None


def _auth_headers() -> dict[str, str]:
    """The credentials MLflow itself would send (token, or user and password)."""
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    return {}
