"""Rankers as plain ``nn.Module``s (no Lightning, no MLflow): see :class:`models.Ranker`."""

from models.config import BACKENDS, RankerConfig
from models.ranker import Ranker

__all__ = ["BACKENDS", "Ranker", "RankerConfig"]
