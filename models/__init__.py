"""Rankers as plain ``nn.Module``s (no Lightning, no MLflow): see :class:`models.Ranker`."""

from models.config import ATTENTIONS, RankerConfig, UserEmbeddingConfig, feature_width
from models.ranker import Ranker

__all__ = ["ATTENTIONS", "Ranker", "RankerConfig", "UserEmbeddingConfig", "feature_width"]
