"""Child processes of the drivers (sweep, reproduce): run and echo them, stop them, tie their
lives to ours (PR_SET_PDEATHSIG on Linux), locks that children share, and GPU/core slots.

A driver killed outright cannot stop its children itself: the kernel does it for us (see
docs/experiments.md, "Sweeps")."""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable, TextIO

from pipeline.errors import ConfigError
from pipeline.runenv import REPO_ROOT

TAIL_BYTES = 64 * 1024
_ECHO_LOCK = threading.Lock()
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


try:  # looked up here: a forked child must not load libraries before exec
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _PRCTL = None


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


def safe_name(text: str) -> str:
    """`text` as one file-name part: [A-Za-z0-9_.-] only, no leading dot (a name read from a
    tracking store or a file never climbs out of its folder)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(text)).lstrip(".") or "_"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a sqlite:/// URI, resolved (one file, one name), else None."""
    return Path(uri[len("sqlite:///"):].split("?", 1)[0]).resolve() if uri.startswith("sqlite:///") else None


def lock_path(name: str, *identity: str) -> Path:
    """The lock file of `name` (one per `identity` and tracking store): beside the sqlite database,
    else in a private directory of this user (then exclusive per machine only)."""
    from pipeline.tracking import tracking_uri

    uri = tracking_uri()
    db = sqlite_file(uri)
    key = hashlib.sha256("\n".join([str(db or uri), *identity]).encode()).hexdigest()[:12]
    file = f"{safe_name(name)}-{key}.lock"
    if db is not None:
        return db.with_name(f"{db.name}.{file}")
    folder = Path(tempfile.gettempdir()) / f"jagged-locks-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{folder} is not a private directory of this user: remove it")
    return folder / file


def hold_lock(path: Path, what: str) -> TextIO:
    """An exclusive lock on `path`, held until the returned file is closed (or every process that inherited
    it has exited); ConfigError naming the holder if another process has it. The file is opened without
    following a link and never truncated: a planted link or a hard link to another file is refused."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise ConfigError(f"lock {path}: {err.strerror} (a symbolic link there is refused): remove it") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.getuid():
        os.close(fd)
        raise ConfigError(f"lock {path} is not a plain file of this user (another link to it?): remove it")
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = f.read().strip() or "unknown"
        f.close()
        raise ConfigError(f"{what} is running already ({holder}; lock {path}): wait for it to end, "
                          f"or stop it (its runs are then recorded KILLED)") from None
    os.pwrite(fd, f"pid {os.getpid()}".ljust(31).encode() + b"\n", 0)  # fixed width: no truncation
    return f


# a fit's library chatter, left out of a driver's console (its log file keeps every line)
_CHATTER = re.compile("|".join((
    r"Seed set to \d+$", r"\d{4}/\d\d/\d\d \d\d:\d\d:\d\d INFO mlflow", r"(GPU|TPU|HPU) available:",
    r"LOCAL_RANK: \d", r"You are using a CUDA device", r"\S* ?Tip: ", r"\| Name +\| Type", r"-{20,}$",
    r"\d+ +\| \w+ +\| \w+", r"[\d.]+ *[KMGT]? +(Trainable|Non-trainable|Total) params",
    r"[\d.]+ +Total estimated model params", r"\d+ +Modules in (train|eval) mode",
    r"(Training|Validation|Testing)( DataLoader \d+)?: ", r"warnings\.warn\(", r"$")))


def chatter(line: str) -> bool:
    return bool(_CHATTER.match(line.replace("\x1b[A", "").strip()))


def stream(cmd: list[str], env: dict[str, str], timeout_s: float | None, prefix: str = "",
           stop: threading.Event | None = None, pass_fds: tuple[int, ...] = (), log: BinaryIO | None = None,
           quiet: bool = False) -> tuple[int, str, bool]:
    """Run `cmd`, echoing its output live; (exit status, last 64 KiB of output, timed out).

    prefix: put before every echoed line (concurrent runs). stop: set by another thread to end
    the run as a Ctrl-C would (SIGINT, then KeyboardInterrupt raised here). pass_fds: open
    files the child keeps (a lock it must hold for as long as it lives). log: gets every byte;
    quiet: the echo leaves out :func:`chatter`. The child gets SIGTERM when this process dies
    (:func:`die_with_parent`); an echo nobody reads any more is dropped, the output still drained."""
    # its own process group: a timeout ends the run's loader workers too, not only the trainer
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, pass_fds=pass_fds, preexec_fn=die_with_parent())
    tail = bytearray()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def echo(parts: list[str]) -> None:  # whole lines: concurrent runs do not interleave mid-line
        text = "".join(prefix + p.replace("\r", "\n") if prefix else p for p in parts if not (quiet and chatter(p)))
        with _ECHO_LOCK, contextlib.suppress(OSError, ValueError):
            sys.stdout.write(text)
            sys.stdout.flush()

    def pump() -> None:
        pending = ""
        for chunk in iter(lambda: proc.stdout.read1(8192), b""):
            tail.extend(chunk)
            del tail[:-TAIL_BYTES]
            if log is not None:
                log.write(chunk)
            *parts, pending = re.split(r"(?<=[\r\n])", pending + decoder.decode(chunk))
            echo(parts)
        echo([pending + "\n"] if pending else [])

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


@dataclasses.dataclass
class Slot:
    """One place a run can go under --gpus: a GPU (CUDA_VISIBLE_DEVICES), how many slots share it,
    and this slot's share of the CPU cores (taskset): runs on different GPUs share neither."""

    gpu: str
    sharing: int
    cores: list[int]

    def pin(self, cmd: list[str]) -> list[str]:
        taskset = shutil.which("taskset")
        return [taskset, "-c", ",".join(map(str, self.cores)), *cmd] if taskset and self.cores else cmd


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
