"""Child processes of the drivers (sweep, reproduce): run and echo them, stop them, tie their
lives to ours (PR_SET_PDEATHSIG on Linux), locks that children share, and GPU/core slots.

A driver killed outright cannot stop its children itself: the kernel does it for us (see
docs/experiments.md, "Processes and locks").
"""

from __future__ import annotations

import codecs
import ctypes
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, TextIO

from pipeline.errors import ConfigError
from pipeline.runenv import REPO_ROOT

TAIL_BYTES = 64 * 1024
_ECHO_LOCK = threading.Lock()
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()  # looked up here: a forked child must not load libraries before exec


def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn: the child gets SIGTERM when the calling thread's process dies (Linux;
    None elsewhere, where a killed driver leaves its child running)."""
    if _PRCTL is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the line above: nobody will signal
            os._exit(1)

    return arm


def lock_path(name: str, *identity: str) -> Path:
    """The lock file of `name` (one per `identity`): beside the tracking URI's sqlite database,
    else in the temp directory (then exclusive per machine only)."""
    from pipeline.tracking import tracking_uri

    key = hashlib.sha256("\n".join(identity).encode()).hexdigest()[:12]
    file = f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{key}.lock"
    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):].split("?", 1)[0])
        return db.with_name(f"{db.name}.{file}")
    return Path(tempfile.gettempdir()) / file


def hold_lock(path: Path, what: str) -> TextIO:
    """An exclusive lock on `path`, held until the returned file is closed (or every process
    that inherited it has exited); ConfigError naming the holder if another process has it."""
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ConfigError(f"{what} is running already ({holder}; lock {path}): wait for it to end, "
                          f"or stop it (its runs are then recorded KILLED)") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}")
    f.flush()
    return f


def stream(cmd: list[str], env: dict[str, str], timeout_s: float | None, prefix: str = "",
           stop: threading.Event | None = None, pass_fds: tuple[int, ...] = ()) -> tuple[int, str, bool]:
    """Run `cmd`, echoing its output live; (exit status, last 64 KiB of output, timed out).

    prefix: put before every echoed line (concurrent runs). stop: set by another thread to end
    the run as a Ctrl-C would (SIGINT, then KeyboardInterrupt raised here). pass_fds: open
    files the child keeps (a lock it must hold for as long as it lives). The child gets SIGTERM
    when this process dies (:func:`die_with_parent`).
    """
    # its own process group: a timeout ends the run's loader workers too, not only the trainer
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, pass_fds=pass_fds, preexec_fn=die_with_parent())
    tail = bytearray()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def pump() -> None:
        pending = ""
        for chunk in iter(lambda: proc.stdout.read1(8192), b""):
            tail.extend(chunk)
            del tail[:-TAIL_BYTES]
            text = decoder.decode(chunk)
            if prefix:  # whole lines only, so that concurrent runs do not interleave mid-line
                pending += text.replace("\r", "\n")
                *lines, pending = pending.split("\n")
                text = "".join(f"{prefix}{ln}\n" for ln in lines)
            with _ECHO_LOCK:
                sys.stdout.write(text)
                sys.stdout.flush()
        if prefix and pending:
            with _ECHO_LOCK:
                sys.stdout.write(f"{prefix}{pending}\n")

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out, deadline = False, None if timeout_s is None else time.monotonic() + timeout_s
    try:
        # poll: a SIGINT that the OS hands to the reader thread reaches the main thread only
        # when it wakes up, and a blocking wait() would not wake before the child exits
        while proc.poll() is None:
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            if deadline is not None and time.monotonic() > deadline:
                timed_out = True
                _stop(proc, signal.SIGTERM, grace_s=30)
                break
            time.sleep(0.2)
    except BaseException:  # Ctrl-C: pass it on, and give the run time to record itself
        _stop(proc, signal.SIGINT, grace_s=60)
        raise
    reader.join(timeout=10)
    return proc.returncode, bytes(tail).decode("utf-8", errors="replace"), timed_out


def _stop(proc: subprocess.Popen, sig: int, grace_s: float) -> None:
    """Send `sig` to the child's process group; SIGKILL it if it is still there after grace_s."""
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def error_line(output: str) -> str:
    lines = [ln.strip() for ln in output.replace("\r", "\n").splitlines() if ln.strip()]
    for pattern in (r"^error: ", r"^[\w.]*(Error|Exception|Interrupt)\b"):
        hits = [ln for ln in lines if re.match(pattern, ln)]
        if hits:
            return hits[-1][:500]
    return (lines[-1] if lines else "no output")[:500]


def failure_line(rc: int, output: str) -> str:
    """Why a child that did not finish failed: a signal that ended it (a negative return code;
    SIGKILL from outside is, on Linux, most often the kernel's out-of-memory killer), else its
    error line."""
    if rc >= 0:
        return error_line(output)
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        name = f"signal {-rc}"
    hint = " (most often the kernel's out-of-memory killer: the host ran out of memory)" if -rc == signal.SIGKILL else ""
    return f"killed by {name}{hint}; its last line: {error_line(output)}"[:500]


def child_env(tags: dict[str, str]) -> dict[str, str]:
    """The child's environment: our tracking URI, the sweep tags (set by MLflow at run creation)."""
    from pipeline.tracking import tracking_uri

    env = {k: v for k, v in os.environ.items()
           if k not in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")}
    env.update(MLFLOW_TRACKING_URI=tracking_uri(), MLFLOW_RUN_CONTEXT=json.dumps(tags), PYTHONUNBUFFERED="1")
    return env


def sigterm_as_interrupt() -> None:
    """`timeout`, `kill` or a batch system end a driver like Ctrl-C: the run in flight is stopped
    (its loader workers too) and recorded KILLED, instead of living on as an orphan on the GPU."""

    def handler(signum, frame) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


class Slot:
    """One place a run can go under --gpus: a GPU (CUDA_VISIBLE_DEVICES), how many slots share it,
    and this slot's share of the CPU cores (taskset): runs on different GPUs share neither."""

    def __init__(self, gpu: str, sharing: int, cores: list[int]):
        self.gpu, self.sharing, self.cores = gpu, sharing, cores

    def pin(self, cmd: list[str]) -> list[str]:
        taskset = shutil.which("taskset")
        if not taskset or not self.cores:
            return cmd
        return [taskset, "-c", ",".join(map(str, self.cores)), *cmd]


def device_slots(gpus: str | None) -> list[Slot]:
    """--gpus "0,1" -> one run at a time on each of GPUs 0 and 1; "0,0,1,1" -> two on each.
    The cores this process may use are dealt out evenly, in blocks, one block per slot."""
    if not gpus:
        return []
    ids = [g.strip() for g in gpus.split(",")]
    if any(not g.isdigit() for g in ids):
        raise ConfigError(f"--gpus {gpus}: expected comma-separated GPU indices, e.g. 0,1 or 0,0,1,1")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per = len(cores) // len(ids)
    return [Slot(g, ids.count(g), cores[i * per:(i + 1) * per] if per else []) for i, g in enumerate(ids)]
