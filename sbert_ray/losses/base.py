"""The siamese pattern every objective shares: one encoder (tied weights) embeds each column of a batch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from torch import Tensor, nn

from sbert_ray.models.encoder import SentenceEncoder


class EncoderLoss(nn.Module, ABC):
    """A loss that owns the encoder, so wrapping the loss in DDP also syncs heads such as SoftmaxLoss's.

    `forward(features, labels)` takes one tokenized dict per column (e.g. [sentence1, sentence2]) and
    `compute_loss_from_embeddings` applies the paper's formula to the resulting sentence embeddings.
    """

    def __init__(self, encoder: SentenceEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, features: Sequence[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        return self.compute_loss_from_embeddings([self.encoder(column) for column in features], labels)

    @abstractmethod
    def compute_loss_from_embeddings(self, embeddings: Sequence[Tensor], labels: Tensor | None) -> Tensor:
        """The scalar loss for one embedding tensor [batch, dim] per column."""

    def _columns(self, embeddings: Sequence[Tensor], expected: int) -> Sequence[Tensor]:
        if len(embeddings) != expected:
            raise ValueError(f"{type(self).__name__} expects {expected} columns, got {len(embeddings)}")
        return embeddings

    def _labels(self, labels: Tensor | None) -> Tensor:
        if labels is None:
            raise ValueError(f"{type(self).__name__} needs labels")
        return labels
