"""How a command stops on SIGTERM (or Ctrl-C), in one process or several, and never hangs.

``tracking.run_command`` runs every command inside :func:`handling_signals`: SIGTERM only sets a
flag (it raises at once only in one process outside a trainer), and a watchdog thread ends the
process ``GRACE_S`` after a signal, or ``PEER_GRACE_S`` after a local peer process died, if it has
not ended by then. :class:`StopOnSignal`, a callback of every trainer of the pipeline, stops every
rank at the same batch. Why it looks like this: docs/training.md#stopping-a-run.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies.launchers import subprocess_script
from pytorch_lightning.utilities.exceptions import SIGTERMException

from pipeline.dist import all_reduce, world_size
from pipeline.errors import outliving_readers

CHECK_EVERY = 50  # batches between two agreements of the ranks (one all-reduce and one host sync each)
GRACE_S = 30.0  # after SIGTERM or SIGINT: the time to stop cleanly before the watchdog ends the process
PEER_GRACE_S = 15.0  # after a local peer process died: the time for the error to reach this one


class _State:
    requested = False  # a SIGTERM reached this process, or the ranks agreed to stop
    trainer: pl.Trainer | None = None  # the running trainer (its launcher holds the local peer processes)
    watchdog: _Watchdog | None = None


_state = _State()


def _on_sigterm(signum, frame) -> None:
    _state.requested = True
    # inside a trainer Lightning's handler is the one installed (it calls this one): StopOnSignal
    # stops at the end of the batch; with peers, raising here would leave them in a collective
    if signal.getsignal(signal.SIGTERM) is _on_sigterm and world_size() == 1:
        raise SIGTERMException()


def _flag_only(signum, frame) -> None:
    # replaces Lightning's SIGTERM notifier, which broadcasts from inside the handler on this
    # rank alone (a collective no other rank matches) and forwards the signal to the local ranks
    _state.requested = True


def _no_observer(child_processes) -> None:
    # replaces Lightning's observer of the ranks it launches, which SIGKILLs this process as soon
    # as one of them exits non-zero (143 at an agreed stop, while this one still ends its MLflow
    # run): exit -9 and the run left RUNNING. The watchdog watches the local peers instead.
    return None


def _no_broadcast() -> None:
    # replaces Lightning's per-step broadcast of rank 0's flag (and its .item(), a host sync per step)
    return None


class StopOnSignal(pl.Callback):
    """Stops the trainer at the end of a batch once a SIGTERM reached any rank: every `every`
    batches each rank contributes its flag to one all-reduce (MAX), so all ranks raise
    SIGTERMException at the same batch (one process: the flag is read after every batch)."""

    def __init__(self, every: int = CHECK_EVERY):
        self.every, self._batches = every, 0

    def setup(self, trainer, pl_module, stage) -> None:
        _state.trainer = trainer
        trainer._signal_connector._sigterm_notifier_fn = _flag_only  # before the trainer registers it
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = _no_broadcast

    def _check(self, trainer, pl_module, *args) -> None:
        self._batches += 1
        if world_size() == 1:
            stop = _state.requested
        elif self._batches % self.every == 0:  # the same batches on every rank: they step in lockstep
            flag = torch.tensor([int(_state.requested)], device=pl_module.device)
            stop = bool(all_reduce(flag, "max").item())
        else:
            return
        if stop:
            _state.requested = True
            if _state.watchdog is not None:
                _state.watchdog.arm(signal.SIGTERM)
            raise SIGTERMException()

    on_train_batch_end = on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _check

    def on_exception(self, trainer, pl_module, exception) -> None:
        # a rank that fails alone leaves its peers in a collective it never joins, and Lightning's
        # teardown or NCCL's may then wait on them: the watchdog ends it if the error does not
        if world_size() > 1 and not isinstance(exception, (SIGTERMException, KeyboardInterrupt)) \
                and _state.watchdog is not None:
            _state.watchdog.fail(f"error: this process failed ({type(exception).__name__}) and did not end within "
                                 f"{PEER_GRACE_S:g} s; ended it")


class _Watchdog(threading.Thread):
    """Learns of SIGTERM and SIGINT through the signal wakeup fd (while the main thread is blocked
    in a collective, Python runs no handler) and of dead local peers by polling; once a deadline
    passes it calls `force_end(exit status, run status, message)`, which must not return."""

    def __init__(self, force_end: Callable[[int, str, str], None]):
        super().__init__(name="stop-watchdog", daemon=True)
        self.force_end = force_end
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.finished = threading.Event()
        self.lock = threading.Lock()
        self.deadline: tuple[float, int, str, str] | None = None
        self.parent = os.getppid()
        self.launched = int(os.environ.get("LOCAL_RANK", 0)) > 0  # started by a launcher: its parent is a peer

    def arm(self, signum: int) -> None:
        if self.deadline is None:
            name, code = ("SIGINT", 130) if signum == signal.SIGINT else ("SIGTERM", 143)
            self.deadline = (time.monotonic() + GRACE_S, code, "KILLED",
                             f"stopped by {name}: the run did not stop within {GRACE_S:g} s (another process "
                             f"of the run is stopped or stuck); ended it")

    def fail(self, message: str) -> None:
        """This process failed while others may wait for it in a collective: end it, FAILED, if
        it has not ended within PEER_GRACE_S."""
        if self.deadline is None:
            self.deadline = (time.monotonic() + PEER_GRACE_S, 1, "FAILED", message)

    def _peer_died(self) -> str | None:
        if self.launched and os.getppid() != self.parent:
            return f"the process that started this one ({self.parent}) is gone"
        launcher = getattr(getattr(_state.trainer, "strategy", None), "launcher", None)
        for proc in getattr(launcher, "procs", None) or ():
            code = proc.poll()
            if code not in (None, 0):
                return f"process {proc.pid} of the distributed run died (exit status {code})"
        return None

    def run(self) -> None:
        while not self.finished.is_set():
            if select.select([self.reader], [], [], 1.0)[0]:
                for signum in self.reader.recv(64):
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        self.arm(signum)
            if self.deadline is None and (dead := self._peer_died()):
                status = ("KILLED", 143) if _state.requested else ("FAILED", 1)
                self.deadline = (time.monotonic() + PEER_GRACE_S, status[1], status[0], f"error: {dead}; ended the run")
            if self.deadline is not None and time.monotonic() >= self.deadline[0]:
                with self.lock:
                    if not self.finished.is_set():
                        self.force_end(*self.deadline[1:])

    def stop(self) -> None:
        with self.lock:
            self.finished.set()
        with contextlib.suppress(OSError):  # wake its select() now rather than at its next 1 s timeout
            self.writer.send(b"\0")
        self.join()
        self.reader.close()
        self.writer.close()


@contextlib.contextmanager
def handling_signals(force_end: Callable[[int, str, str], None]) -> Iterator[None]:
    """SIGTERM sets the flag (see the module docstring) and the watchdog runs while the block does,
    in place of Lightning's process observer; the previous handler and wakeup fd come back afterwards. `force_end` must end the process.
    A reader of stdout or stderr that goes away does not end it (:func:`~pipeline.errors.outliving_readers`)."""
    _state.requested = False
    watchdog = _Watchdog(force_end)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    previous_fd = signal.set_wakeup_fd(watchdog.writer.fileno(), warn_on_full_buffer=False)
    _state.watchdog = watchdog
    observer = subprocess_script._launch_process_observer
    subprocess_script._launch_process_observer = _no_observer
    watchdog.start()
    try:
        with outliving_readers():
            yield
    finally:
        watchdog.stop()
        _state.watchdog = _state.trainer = None
        subprocess_script._launch_process_observer = observer
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGTERM, previous)


def kill_peers() -> None:
    """SIGKILL the local processes this one launched (Lightning's DDP launcher), if any."""
    launcher = getattr(getattr(_state.trainer, "strategy", None), "launcher", None)
    for proc in getattr(launcher, "procs", None) or ():
        with contextlib.suppress(OSError):
            proc.kill()


def flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
