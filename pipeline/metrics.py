"""Ranking metrics as torchmetrics ``Metric``s, all fed with logits: ``AUC``, ``LogLoss``,
``NormalizedEntropy`` (log loss / entropy of the TRAINING CTR: 1.0 is always predicting the base
rate) and ``Calibration`` (predicted / actual clicks). States are float64 sums reduced by summation
across processes."""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.classification import BinaryAUROC
from torchmetrics.utilities import dim_zero_cat

log = logging.getLogger(__name__)


class _Float64Sums(Metric):
    """A metric whose states are the float64 sums named in ``sums``, reduced by summation."""

    is_differentiable = False
    full_state_update = False
    sums: tuple[str, ...] = ()

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in self.sums:
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")


class LogLoss(_Float64Sums):
    higher_is_better = False
    sums = ("loss_sum", "count")

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """logits [N] (any float), target [N] in {0, 1}."""
        self.loss_sum += F.binary_cross_entropy_with_logits(logits.double(), target.double(), reduction="sum")
        self.count += target.numel()

    def compute(self) -> torch.Tensor:
        return self.loss_sum / self.count


def binary_entropy(p: float) -> float:
    """Entropy (nats) of a Bernoulli(p)."""
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


class NormalizedEntropy(LogLoss):
    def __init__(self, base_ctr: float, **kwargs) -> None:
        if not 0.0 < base_ctr < 1.0:
            raise ValueError(f"NormalizedEntropy needs a base CTR in (0, 1), got {base_ctr}")
        super().__init__(**kwargs)
        self.base_ctr = float(base_ctr)
        self.base_entropy = binary_entropy(self.base_ctr)

    def compute(self) -> torch.Tensor:
        return super().compute() / self.base_entropy


class Calibration(_Float64Sums):
    higher_is_better = None
    sums = ("pred_sum", "label_sum")

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        self.pred_sum += torch.sigmoid(logits.double()).sum()
        self.label_sum += target.double().sum()

    def compute(self) -> torch.Tensor:
        return self.pred_sum / self.label_sum  # inf (or nan) when there are no positives


class AUC(BinaryAUROC):
    """Exact ROC AUC fed with logits like the others (sigmoid applied here, never guessed).

    AUC is undefined when the labels hold one class only: NaN then, with a warning in the log
    (torchmetrics returns 0.0, which reads as a perfectly wrong ranker)."""

    def update(self, logits: torch.Tensor, target: torch.Tensor) -> None:  # type: ignore[override]
        super().update(torch.sigmoid(logits.float()), target.long())

    def compute(self) -> torch.Tensor:
        target = self.target  # a list of batches; one tensor once synchronised across processes
        if isinstance(target, list):
            target = dim_zero_cat(target) if target else torch.zeros(0)
        positives, n = int(target.sum()), target.numel()
        if 0 < positives < n:
            return super().compute()
        log.warning("AUC is undefined on %d examples of a single class (%d positive): logged as NaN", n, positives)
        return torch.tensor(float("nan"))


def ranking_metrics(base_ctr: float) -> dict[str, Metric]:
    """The evaluation set: auc, logloss, ne, calibration (all updated with logits, labels)."""
    return {
        "auc": AUC(),
        "logloss": LogLoss(),
        "ne": NormalizedEntropy(base_ctr),
        "calibration": Calibration(),
    }
