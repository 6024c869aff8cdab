"""pipeline.dist: the throttled SIGTERM check of Lightning's training loop."""

from __future__ import annotations

import pytest
from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop

from pipeline.dist import throttle_sigterm_check


class _Loop:
    def __init__(self):
        self.checks = []

    def _broadcast_sigterm_tensor(self):
        self.checks.append(len(self.checks))


def test_lightnings_loop_still_has_the_per_step_check_that_is_throttled():
    # the private method this module wraps; if Lightning renames it, the throttle silently does
    # nothing and every multi-process step waits for the GPU again: this test says so first
    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))


@pytest.mark.parametrize("every", [1, 3, 50])
def test_the_check_runs_on_one_step_in_every(every):
    loop, calls = _Loop(), 0
    original = loop._broadcast_sigterm_tensor
    assert throttle_sigterm_check(loop, every) == (every > 1)
    ran = []
    loop.checks = ran
    for step in range(120):
        before = len(ran)
        loop._broadcast_sigterm_tensor()
        calls += len(ran) > before
    assert calls == -(-120 // every)  # steps 0, every, 2 every, ...: the same steps on every rank
    if every > 1:
        assert throttle_sigterm_check(loop, every)  # applied twice: still one check in `every`
        assert loop._broadcast_sigterm_tensor is not original


def test_a_loop_without_the_check_is_left_alone():
    loop = object.__new__(type("Other", (), {}))
    assert not throttle_sigterm_check(loop, 50)
