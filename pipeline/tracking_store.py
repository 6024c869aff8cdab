"""MLflow's tracking store: where runs go, the pre-flight check that they can be recorded there,
and HTTP requests that end.

``tracking_uri()``: ``MLFLOW_TRACKING_URI``, else ``sqlite:///<repo>/mlflow.db`` (what ``make ui``
serves); :func:`check_tracking` raises a ConfigError, saying what to do, before anything trains if
runs cannot be recorded there. Why the checks look as they do: docs/training.md#tracking.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
HTTP_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",  # seconds per request
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",  # 1 s, then 2 s between the tries
}
API_PROBE = "/api/2.0/mlflow/experiments/search"
_RACE_RETRIES = 10  # one second apart
_FIX = "unset MLFLOW_TRACKING_URI to use the local sqlite database, or start the server (`make ui`)"


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{REPO_ROOT / 'mlflow.db'}"


def shown(uri: str) -> str:
    """The URI without a password (``scheme://user:***@host``)."""
    return re.sub(r"(://[^:/@]+):[^@/]*@", r"\1:***@", uri)


def check_tracking(uri: str, timeout_s: float = 5.0) -> None:
    """Raise ConfigError, saying what to do, if runs cannot be recorded at `uri`."""
    if uri.startswith(("http://", "https://")):
        for key, value in HTTP_BOUNDS.items():
            os.environ.setdefault(key, value)
        _bound_whole_requests()
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
    import logging

    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating initial MLflow database tables"
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


def within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or TimeoutError once `seconds` have passed: a socket timeout bounds
    each read, not a reply that trickles in a byte at a time (fn then goes on in a daemon thread,
    its result dropped)."""
    box: dict = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
            box["error"] = err

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"no complete reply within {seconds:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _bound_whole_requests() -> None:
    """Every HTTP request MLflow makes ends within its tries' timeouts and backoff (HTTP_BOUNDS)."""
    from mlflow.utils import rest_utils

    send = rest_utils._get_http_response_with_retries
    if getattr(send, "bounded", False):
        return

    def bounded(method, url, max_retries, backoff_factor, backoff_jitter, *args, **kwargs):
        tries, timeout = max_retries + 1, kwargs.get("timeout") or 120
        limit = tries * timeout + (backoff_factor + backoff_jitter) * 2 ** max_retries
        return within(limit, send, method, url, max_retries, backoff_factor, backoff_jitter, *args, **kwargs)

    bounded.bounded = True
    rest_utils._get_http_response_with_retries = bounded


def _read_reply(request, timeout_s: float, parse=None):
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status}")
        return parse(resp) if parse else resp.read()


def _check_server(base: str, timeout_s: float) -> None:
    try:
        within(timeout_s + 1, _read_reply, base + "/health", timeout_s)
    except (OSError, urllib.error.URLError) as err:
        raise ConfigError(f"MLflow tracking server {shown(base)} is unreachable ({err}): {_FIX}") from None
    request = urllib.request.Request(base + API_PROBE, data=json.dumps({"max_results": 1}).encode(),
                                     headers={"Content-Type": "application/json", **_auth_headers()})
    try:
        within(timeout_s + 1, _read_reply, request, timeout_s, json.load)
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
