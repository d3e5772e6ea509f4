"""A reranker's pointwise objective: each (query, passage) pair's logit against its relevance in [0, 1]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import ScoredPair
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.models.model_type import ModelType


class RerankerBCELoss(EncoderLoss):
    """Binary cross-entropy of sigmoid(logit) against the pair's score divided by the stage's ``score_max`` (labels
    of 0 and 1: ``score_max: 1``; STSb's 0-5: the default 5), the mean over the batch: sentence-transformers'
    cross-encoder ``BinaryCrossEntropyLoss`` (no activation, no ``pos_weight``). The one column is the pair,
    tokenised together; its "embedding" is the reranker's logit."""

    model_type: ClassVar[ModelType] = "cross_encoder"
    record_types = (ScoredPair,)
    user_file_kind = "scored"
    label_field = "score"

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        (logits,) = self._columns(embeddings, 1)
        return F.binary_cross_entropy_with_logits(logits, self._labels(labels).to(logits.dtype))
