"""CoSENT (Su 2022): a ranking loss on scored pairs. Every two pairs whose gold scores are ordered should have
their similarities in the same order; only the order of the scores matters, not their scale."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import ScoredPair, TopicPair
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.models.encoder import SentenceEncoder


class CoSENTLoss(EncoderLoss):
    """log(1 + Σ_{score_i > score_j} exp(scale · (sim_j − sim_i))) over the batch's pairs, sim = cos(u, v).

    Columns are [sentence1, sentence2]; the label is the pair's score (scaled by score_max, which keeps its order).
    """

    record_types = (ScoredPair, TopicPair)
    user_file_kind = "scored"
    label_field = "score"

    def __init__(self, encoder: SentenceEncoder, scale: float = 20.0) -> None:
        super().__init__(encoder)
        self.scale = scale

    def similarity(self, u: Tensor, v: Tensor) -> Tensor:
        return F.cosine_similarity(u, v)

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        u, v = self._columns(embeddings, 2)
        scores = self._labels(labels)
        # In fp32 even under bf16/fp16 autocast, as MNRL's softmax: scaled by 20, bf16 would blur the differences.
        dtype = torch.promote_types(u.dtype, torch.float32)
        with torch.autocast(u.device.type, enabled=False):
            similarities = self.scale * self.similarity(u.to(dtype), v.to(dtype))
            differences = similarities[None, :] - similarities[:, None]  # [i, j]: sim_j − sim_i
            ranked_above = scores[:, None] > scores[None, :]  # pair i should be more similar than pair j
            return torch.logsumexp(torch.cat([differences.new_zeros(1), differences[ranked_above]]), dim=0)
