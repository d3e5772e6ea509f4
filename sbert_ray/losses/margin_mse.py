"""MarginMSE (Hofstätter et al. 2020): distil a teacher's scores into a bi-encoder through score margins, which
frees the student from the teacher's scale: only how far the positive is ahead of each negative is matched."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import Triplet
from sbert_ray.losses.base import EncoderLoss


class MarginMSELoss(EncoderLoss):
    """MSE(q·p − q·n_k, t_p − t_nk), averaged over the batch and the n negatives.

    Columns are [query, positive, negative_1..n]; the labels are the teacher's scores [t_p, t_n1..t_nn] per row
    (the source's ``score_positive``, ``score_negative_1..n`` columns). Dot-product similarity, as the paper's and
    sentence-transformers' default: a teacher's margins are logits, not bounded like a cosine's.
    """

    record_types = (Triplet,)
    user_file_kind = "triplet"
    label_field = "scores"

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        student, teacher = student_scores(self, embeddings), self._labels(labels).to(embeddings[0].dtype)
        return F.mse_loss(student[:, :1] - student[:, 1:], teacher[:, :1] - teacher[:, 1:])


def student_scores(loss: EncoderLoss, embeddings: Sequence[Tensor]) -> Tensor:
    """[batch, 1 + n]: the query's dot product with its positive and each of its n negatives."""
    if len(embeddings) < 3:
        raise ValueError(
            f"{type(loss).__name__} expects a query, a positive and negatives, got {len(embeddings)} columns"
        )
    query, *candidates = embeddings
    return (query[:, None, :] * torch.stack(candidates, dim=1)).sum(-1)
