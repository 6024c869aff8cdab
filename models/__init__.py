"""Rankers as plain ``nn.Module``s (no Lightning, no MLflow): see :class:`models.Ranker`."""

from models.config import BACKENDS, RankerConfig, UserEmbeddingConfig, feature_width
from models.ranker import Ranker

__all__ = ["BACKENDS", "Ranker", "RankerConfig", "UserEmbeddingConfig", "feature_width"]
