"""PerfMonitor: only training steps are timed, whatever else the loop does; medians, warm-up."""

from __future__ import annotations

import csv
import io
import platform
import time

import numpy as np
import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers.logger import Logger

from models import RankerConfig
from pipeline.callbacks import PerfMonitor, settle_steps
from pipeline.data import RankerData
from pipeline.module import RankerModule, keep_heap
from test_pipeline_data import tiny_data_dir

SLOW_S = 1000.0  # what each slow hook adds to the monitor's clock
SLOW_MS = 1000.0 * SLOW_S  # a step time (ms) that holds one of them is longer than this


class _Memory(Logger):
    """Metrics and text artifacts kept in memory."""

    def __init__(self):
        super().__init__()
        self.metrics: dict[str, float] = {}
        self.texts: dict[str, str] = {}
        self.run_id = "memory"
        self.experiment = self

    name, version = "memory", "0"

    def log_metrics(self, metrics, step=None):
        self.metrics.update(metrics)

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def log_text(self, run_id, text, artifact_file):
        self.texts[artifact_file] = text


class _Clock:
    def __init__(self):
        self.offset = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.offset


class _SlowLoop(pl.Callback):
    """Everything but the training steps takes SLOW_S on the monitor's clock."""

    def __init__(self, clock: _Clock):
        self.clock = clock

    def _slow(self, *args, **kwargs):
        self.clock.offset += SLOW_S

    on_save_checkpoint = on_validation_start = on_validation_end = _slow
    on_train_epoch_start = on_train_epoch_end = _slow


def _fit(tmp_path, data, monitor: PerfMonitor, *callbacks, epochs=3, **module_kw):
    dm = RankerData(str(data), batch_size=32, max_seq_len=16, num_workers=0)
    cfg = RankerConfig(embed_dim=32, num_layers=1, mlp_dims=[16])
    module = RankerModule(cfg, data_spec=dm.spec, **module_kw)
    logger = _Memory()
    trainer = pl.Trainer(max_epochs=epochs, limit_train_batches=6, limit_val_batches=2, logger=logger,
                         callbacks=[monitor, *callbacks, pl.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True)],
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=dm)
    return logger


def test_only_training_steps_are_timed(tmp_path, tmp_path_factory):
    data = tiny_data_dir(tmp_path_factory)
    clock = _Clock()
    monitor = PerfMonitor(warmup_steps=2)
    monitor.clock = clock
    logger = _fit(tmp_path, data, monitor, _SlowLoop(clock))
    m = logger.metrics
    assert clock.offset >= 3 * 4 * SLOW_S  # the slow hooks did run, every epoch
    assert m["perf/steady_steps"] == 3 * 6 - 2
    assert 0 < m["perf/step_time_ms"] < SLOW_MS / 10  # no slow hook inside any step's time
    assert 0 < m["perf/step_time_median_ms"] <= m["perf/step_time_p90_ms"] < SLOW_MS / 10
    assert m["perf/train_examples_per_s"] == pytest.approx(32 * 1000 / m["perf/step_time_ms"], rel=1e-6)
    assert 0 < m["perf/host_step_ms"] and 0 < m["perf/host_gap_ms"] < SLOW_MS / 10
    rows = list(csv.DictReader(io.StringIO(logger.texts["perf/steps.csv"])))
    assert len(rows) == 18 and [int(r["epoch"]) for r in rows] == [0] * 6 + [1] * 6 + [2] * 6
    assert all(float(r["ms"]) < SLOW_MS / 10 for r in rows)
    assert sum(int(r["in_window"]) for r in rows) == 16
    # the last step of an epoch has no next step in the same stretch: no gap is recorded
    assert [r["host_gap_ms"] == "nan" for r in rows[:6]] == [False] * 5 + [True]


def test_cuda_graphs_fall_back_to_eager_on_cpu(tmp_path, tmp_path_factory, caplog):
    data = tiny_data_dir(tmp_path_factory)
    logger = _fit(tmp_path, data, PerfMonitor(warmup_steps=1), epochs=1, cuda_graphs=True)
    assert logger.metrics["perf/steady_steps"] == 5
    assert "model.cuda_graphs needs a CUDA device" in caplog.text


def test_settled_at_the_first_step_of_a_stable_stretch():
    steady = [10.0] * 30
    assert settle_steps(np.array(steady), 10.0) == 0
    slow_start = np.array([500.0, 300.0, 120.0, 40.0, 25.0, 12.0] + steady)
    k = settle_steps(slow_start, 10.0)
    # every 10-step rolling median from k on is within 10% of 10 ms; the one before is not
    assert all(abs(np.median(slow_start[j:j + 10]) - 10) <= 1 for j in range(k, len(slow_start) - 9))
    assert abs(np.median(slow_start[k - 1:k + 9]) - 10) > 1
    # a late relapse (e.g. a compilation at step 30) moves it past the relapse
    relapse = np.array(steady[:20] + [200.0] * 8 + steady)
    assert settle_steps(relapse, 10.0) > 20
    assert settle_steps(np.array([10.0, 50.0, 50.0]), 10.0) == 3  # never settles


def test_keep_heap_applies_where_the_c_library_is_glibc():
    """The heap thresholds are glibc's (mallopt); elsewhere keep_heap changes nothing and says so."""
    assert keep_heap() is (platform.libc_ver()[0] == "glibc")
