"""Matryoshka representation learning (Kusupati et al. 2022): any objective trained at several embedding sizes at
once, so that the first k values of an embedding are a good embedding on their own."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
from torch import Tensor
from torch.nn import functional as F

from sbert_ray.losses.base import EncoderLoss
from sbert_ray.losses.multiple_negatives_ranking import MultipleNegativesRankingLoss

logger = logging.getLogger(__name__)


class MatryoshkaLoss(EncoderLoss):
    """The weighted sum of the wrapped loss's formula over prefixes of the embeddings.

    Embeddings are computed once, by the wrapped loss (so a cached loss still embeds in mini-batches); its
    `compute_loss_from_embeddings` then sees e[:, :d] for each d in `matryoshka_dims`, which is what a model saved
    with `truncate_dim=d` encodes. A prefix is L2-normalised again when the encoder normalises its output, so the
    formula sees unit vectors at every size iff it does at full size. (sentence-transformers' MatryoshkaLoss
    normalises every prefix whatever the model: the same for cosine-based losses, but for a Euclidean triplet
    loss on an unnormalised model it changes even the full-size term.) SoftmaxLoss gets one classifier per size.
    An in-batch-negative loss gathers the full-width rows across workers once per step, and every size ranks
    prefixes of them: one gather, not one per size.
    """

    def __init__(
        self,
        loss: EncoderLoss,
        matryoshka_dims: Sequence[int],
        matryoshka_weights: Sequence[float] | None = None,
    ) -> None:
        super().__init__(loss.encoder)
        full = loss.encoder.embedding_dim
        dims, weights = list(matryoshka_dims), list(matryoshka_weights or [1.0] * len(matryoshka_dims))
        if not dims or len(set(dims)) != len(dims) or any(not 0 < d <= full for d in dims):
            raise ValueError(f"matryoshka_dims must be distinct sizes in 1..{full} (the model's), got {dims}")
        if len(weights) != len(dims):
            raise ValueError(f"matryoshka_weights needs one weight per size in {dims}, got {weights}")
        if full not in dims:
            logger.warning("matryoshka_dims %s leaves out the model's full size %d: it is not trained", dims, full)
        loss.prepare_for_dims(dims)
        self.loss = loss
        self.matryoshka_dims, self.matryoshka_weights = dims, weights

    def embed(
        self, features: Sequence[dict[str, Tensor]], used_widths: Sequence[np.ndarray] | None = None
    ) -> list[Tensor]:
        return self.loss.embed(features, used_widths)

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        if isinstance(self.loss, MultipleNegativesRankingLoss):
            # Gathered across workers once, at full width: each size ranks its prefixes of the same rows.
            batch = self.loss.in_batch(embeddings, text_hashes)
            losses = [self.loss.ranking_loss(batch.map(partial(self._prefix, dim=dim))) for dim in self.matryoshka_dims]
        else:
            losses = [
                self.loss.compute_loss_from_embeddings([self._prefix(e, dim) for e in embeddings], labels, text_hashes)
                for dim in self.matryoshka_dims
            ]
        return sum(weight * loss for weight, loss in zip(self.matryoshka_weights, losses, strict=True))

    def expect_rows_per_worker(self, rows: int) -> None:
        self.loss.expect_rows_per_worker(rows)

    @property
    def masked_duplicates(self) -> Tensor | None:
        """The wrapped loss's count (the same at every size: duplicates are texts, not embeddings)."""
        return self.loss.masked_duplicates

    def _prefix(self, embedding: Tensor, dim: int) -> Tensor:
        """The first ``dim`` values of each embedding (the last axis: gathered rows are [rows, columns, dim])."""
        prefix = embedding[..., :dim]
        return F.normalize(prefix, p=2, dim=-1) if self.encoder.normalize else prefix

    # The state is the wrapped loss's, under its own names: a checkpoint's objective head holds the wrapped
    # loss's parameters once (not a second copy of the encoder under "loss.encoder.").
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.loss.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.loss.load_state_dict(state_dict, strict=strict, assign=assign)
