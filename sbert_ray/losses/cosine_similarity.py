"""Regression objective (SBERT section 3): mean-squared error between cos(u, v) and the gold score."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.nn import functional as F

from sbert_ray.losses.base import EncoderLoss


class CosineSimilarityLoss(EncoderLoss):
    """MSE(cos(u, v), score), with scores already scaled to [0, 1] by the caller (STSb: gold / 5)."""

    def compute_loss_from_embeddings(self, embeddings: Sequence[Tensor], labels: Tensor | None) -> Tensor:
        u, v = self._columns(embeddings, 2)
        scores = self._labels(labels).to(u.dtype)
        # Unscaled STS scores (0-5) would silently train towards impossible cosines, so fail loudly instead.
        if scores.numel() and (scores.min() < 0 or scores.max() > 1):
            raise ValueError("CosineSimilarityLoss expects scores scaled to [0, 1] (e.g. STSb gold / 5)")
        return F.mse_loss(F.cosine_similarity(u, v), scores)
