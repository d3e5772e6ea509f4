"""Regression objective (SBERT section 3): mean-squared error between cos(u, v) and the gold score."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import ScoredPair, TopicPair
from sbert_ray.losses.base import EncoderLoss


class CosineSimilarityLoss(EncoderLoss):
    """MSE(cos(u, v), score), with scores already scaled to [0, 1] (STSb: gold / 5; the training data pipeline
    scales by the stage's score_max and checks the range once, so the step itself never syncs with the host)."""

    record_types = (ScoredPair, TopicPair)
    user_file_kind = "scored"
    label_field = "score"

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        u, v = self._columns(embeddings, 2)
        return F.mse_loss(F.cosine_similarity(u, v), self._labels(labels).to(u.dtype))
