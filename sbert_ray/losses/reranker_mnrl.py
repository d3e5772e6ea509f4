"""A reranker's listwise objective: each query must score its positive above its hard negatives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import Triplet
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.models.cross_encoder import CrossEncoderModel
from sbert_ray.models.model_type import ModelType


class RerankerMNRLoss(EncoderLoss):
    """Cross-entropy over scale · sigmoid(logit) of (query, positive), (query, negative_1) .. (query, negative_n),
    the target being the positive: sentence-transformers' cross-encoder ``MultipleNegativesRankingLoss`` with
    ``num_negatives=0`` (hard negatives only: a reranker scores every pair it ranks, so the batch's other passages
    would cost a forward each). Columns are the anchor's pairs [positive, negative_1..n], each tokenised together;
    labels are ignored. ``scale`` is the inverse temperature of the softmax over the sigmoid scores."""

    model_type: ClassVar[ModelType] = "cross_encoder"
    record_types = (Triplet,)  # (anchor, positive, negative[_1..n])
    user_file_kind = "triplet"

    def __init__(self, encoder: CrossEncoderModel, scale: float = 10.0) -> None:
        super().__init__(encoder)
        self.scale = scale

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        if len(embeddings) < 2:
            raise ValueError(
                f"{type(self).__name__} expects a positive and hard negatives, got {len(embeddings)} column"
            )
        scores = torch.sigmoid(torch.stack(list(embeddings), dim=1)) * self.scale
        return F.cross_entropy(scores, torch.zeros(len(scores), dtype=torch.long, device=scores.device))
