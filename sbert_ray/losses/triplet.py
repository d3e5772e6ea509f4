"""Triplet objective (SBERT section 3): max(‖a−p‖ − ‖a−n‖ + ε, 0), Euclidean distance and ε = 1 in the paper."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import Triplet
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.models.encoder import SentenceEncoder

Distance = Literal["euclidean", "manhattan", "cosine"]
DISTANCES: dict[Distance, Callable[[Tensor, Tensor], Tensor]] = {
    "euclidean": lambda x, y: torch.linalg.vector_norm(x - y, ord=2, dim=-1),
    "manhattan": lambda x, y: torch.linalg.vector_norm(x - y, ord=1, dim=-1),
    "cosine": lambda x, y: 1 - F.cosine_similarity(x, y),
}


class TripletLoss(EncoderLoss):
    """Hinge on the anchor's distance to the positive versus the negative, averaged over the batch.

    Columns are [anchor, positive, negative]; labels are ignored. The margin defaults to the paper's 1
    (sentence-transformers defaults to 5).
    """

    record_types = (Triplet,)
    user_file_kind = "triplet"

    def __init__(self, encoder: SentenceEncoder, distance: Distance = "euclidean", margin: float = 1.0) -> None:
        super().__init__(encoder)
        if distance not in DISTANCES:
            raise ValueError(f"unknown triplet distance {distance!r}; expected one of {list(DISTANCES)}")
        self.distance = distance
        self.margin = margin

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None = None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        anchor, positive, negative = self._columns(embeddings, 3)
        distance = DISTANCES[self.distance]
        return F.relu(distance(anchor, positive) - distance(anchor, negative) + self.margin).mean()
