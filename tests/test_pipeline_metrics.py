"""Our ranking metrics against sklearn, accumulated over several uneven batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from pipeline.metrics import AUC, Calibration, LogLoss, NormalizedEntropy, binary_entropy, ranking_metrics


def _data(n: int = 3001):
    logits = torch.randn(n, dtype=torch.float32) * 2 - 1
    labels = torch.bernoulli(torch.sigmoid(logits + 0.3 * torch.randn(n)))
    return logits, labels


def _feed(metric, logits, labels, sizes=(1, 999, 7, 1500)):
    start = 0
    for size in (*sizes, len(labels)):
        metric.update(logits[start : start + size], labels[start : start + size])
        start += size
        if start >= len(labels):
            break
    return float(metric.compute())


def test_logloss_and_ne_match_sklearn():
    logits, labels = _data()
    p = torch.sigmoid(logits.double()).numpy()
    want = log_loss(labels.numpy(), p)
    assert _feed(LogLoss(), logits, labels) == pytest.approx(want, rel=1e-9)
    base_ctr = 0.3
    h = -(base_ctr * math.log(base_ctr) + (1 - base_ctr) * math.log(1 - base_ctr))
    assert binary_entropy(base_ctr) == pytest.approx(h)
    assert _feed(NormalizedEntropy(base_ctr), logits, labels) == pytest.approx(want / h, rel=1e-9)


def test_ne_of_the_base_rate_predictor_is_one():
    labels = torch.bernoulli(torch.full((20000,), 0.2))
    ctr = float(labels.mean())
    logits = torch.full_like(labels, math.log(ctr / (1 - ctr)))
    assert _feed(NormalizedEntropy(ctr), logits, labels) == pytest.approx(1.0, rel=1e-6)


def test_calibration_is_sum_of_predictions_over_sum_of_labels():
    logits, labels = _data()
    want = torch.sigmoid(logits.double()).sum().item() / labels.sum().item()
    assert _feed(Calibration(), logits, labels) == pytest.approx(want, rel=1e-9)


def test_auc_matches_sklearn_even_when_logits_look_like_probabilities():
    logits, labels = _data()
    want = roc_auc_score(labels.numpy(), logits.numpy())
    assert _feed(AUC(), logits, labels) == pytest.approx(want, abs=1e-6)
    # logits that all fall in [0, 1] must not be mistaken for probabilities
    small = logits.abs() / (logits.abs().max() + 1)
    assert _feed(AUC(), small, labels) == pytest.approx(roc_auc_score(labels.numpy(), small.numpy()), abs=1e-6)


@pytest.mark.parametrize("label", [0.0, 1.0])
def test_auc_of_a_single_class_is_nan_and_said(label, caplog):
    """A test split of one class has no AUC: never 0.0, which reads as a perfectly wrong ranker."""
    auc = AUC()
    auc.update(torch.randn(50), torch.full((50,), label))
    with caplog.at_level("WARNING", logger="pipeline.metrics"):
        assert math.isnan(float(auc.compute()))
    assert "AUC is undefined on 50 examples of a single class" in caplog.text


def test_ranking_metrics_set_and_bad_base_ctr():
    assert set(ranking_metrics(0.25)) == {"auc", "logloss", "ne", "calibration"}
    for bad in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError, match="base CTR"):
            NormalizedEntropy(bad)


def test_reset_starts_over():
    logits, labels = _data(100)
    m = LogLoss()
    m.update(logits * 10, 1 - labels)
    m.reset()
    m.update(logits, labels)
    assert float(m.compute()) == pytest.approx(log_loss(labels.numpy(), torch.sigmoid(logits.double()).numpy()))
    assert np.isfinite(float(m.compute()))


def test_running_mean_is_the_weighted_mean_and_never_checks_for_nan(monkeypatch):
    # RankerModule's training-loss mean: MeanMetric's NaN check syncs the GPU every step
    from pipeline.module import CumulativeMean

    def no_sync(*args, **kwargs):
        raise AssertionError("CumulativeMean.update must not inspect values (a device sync on CUDA)")

    monkeypatch.setattr(torch, "isnan", no_sync)
    monkeypatch.setattr(torch.Tensor, "any", no_sync)
    losses, sizes = [0.7, 0.5, 0.25], [512, 512, 100]
    mean = CumulativeMean()
    for loss, n in zip(losses, sizes):
        mean.update(torch.tensor(loss), weight=n)
    expected = sum(l * n for l, n in zip(losses, sizes)) / sum(sizes)
    assert float(mean.compute()) == pytest.approx(expected, rel=1e-6)
    mean.update(torch.tensor(float("nan")), weight=1)  # a NaN is kept (the module's flag reports it)
    assert math.isnan(float(mean.compute()))
