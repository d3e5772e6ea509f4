"""Multiple-negatives ranking with gradient caching (GradCache, Gao et al. 2021): the global batch's in-batch
negatives at the memory cost of one mini-batch, with the same loss and gradients as the uncached loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from sbert_ray.losses.multiple_negatives_ranking import MultipleNegativesRankingLoss
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.padded_widths import bucketed_width, buckets_for, unpadded


class CachedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """MultipleNegativesRankingLoss whose encoder runs over `mini_batch_size` rows at a time.

    GradCache's three steps are what autograd does with each mini-batch wrapped in (non-reentrant) activation
    checkpointing: (1) the forward pass embeds every mini-batch and keeps only its embeddings, never its
    activations; (2) backward computes the loss's gradient w.r.t. all embeddings of the global batch (candidates
    gathered across workers exactly as the uncached loss does): the cache; (3) for each mini-batch in turn it
    re-runs the encoder, with the RNG state (dropout masks) and autocast state of step 1, and back-propagates
    that mini-batch's cached gradient. The engine finishes one mini-batch's backward before it re-runs the next
    (tests/test_losses.py checks the order), so activations of one mini-batch are alive at a time.

    Because this is one ordinary backward pass, each parameter's gradient is summed over the mini-batches before
    its gradient hook fires, once: DDP synchronises exactly as for the uncached loss, and the training loop's
    plain `loss.backward()`, `no_sync` accumulation and loss scaling all work unchanged. The same holds for the
    `symmetric` loss (sentence-transformers' CachedMultipleNegativesSymmetricRankingLoss): only the formula differs.
    """

    def __init__(
        self,
        encoder: SentenceEncoder,
        scale: float = 20.0,
        gather_across_workers: bool = True,
        mini_batch_size: int = 32,
        mask_duplicates: bool = True,
        symmetric: bool = False,
    ) -> None:
        super().__init__(
            encoder,
            scale=scale,
            gather_across_workers=gather_across_workers,
            mask_duplicates=mask_duplicates,
            symmetric=symmetric,
        )
        if mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be >= 1, got {mini_batch_size}")
        self.mini_batch_size = mini_batch_size

    def embed(
        self, features: Sequence[dict[str, Tensor]], used_widths: Sequence[np.ndarray] | None = None
    ) -> list[Tensor]:
        """``used_widths``: per column, the padded columns each row uses, known on the host (the collated batch's);
        without them they are read from the attention masks (one device-to-host read)."""
        if used_widths is None:
            used_widths = _used_widths([column["attention_mask"] for column in features])
        encoder = self.encoder
        cut = _MiniBatches(
            self.mini_batch_size, buckets_for(encoder.device, encoder.max_seq_length),
            encoder.tokenizer.padding_side == "left",
        )  # fmt: skip
        return [
            torch.cat(
                [
                    checkpoint(encoder, mini_batch, padded, use_reentrant=False)
                    for mini_batch, padded in cut(column, widths)
                ]
            )
            for column, widths in zip(features, used_widths, strict=True)
        ]


def _used_widths(masks: Sequence[Tensor]) -> list[np.ndarray]:
    """Per attention mask, the padded columns each row uses (its last attended column plus one; 0: none), all
    read to the host at once: one read per step, not one per column or mini-batch."""
    per_row = [(mask.bool() * torch.arange(1, mask.shape[1] + 1, device=mask.device)).amax(dim=1) for mask in masks]
    widths = np.asarray(torch.cat(per_row).tolist())
    return np.split(widths, np.cumsum([len(column) for column in per_row[:-1]]))


@dataclasses.dataclass(frozen=True)
class _MiniBatches:
    """How a padded column is cut into mini-batches: ``size`` rows, trimmed to a width from ``buckets`` (None:
    exact widths; see ``models.padded_widths``)."""

    size: int
    buckets: tuple[int, ...] | None
    pad_left: bool

    def __call__(self, features: dict[str, Tensor], used_widths: np.ndarray) -> Iterator[tuple[dict, bool]]:
        """Consecutive row slices of a padded batch without the padding columns at the end that none of their rows
        uses (``used_widths``: per row; padding is masked out anyway, and a mini-batch of short sentences should not
        pay for the batch's longest; a left-padded batch keeps its width), each with whether it has padding left."""
        rows, full = features["attention_mask"].shape
        for start in range(0, rows, self.size):
            used = used_widths[start : start + self.size]
            width = min(bucketed_width(int(used.max()), self.buckets), full)
            mini_batch = {name: tensor[start : start + self.size, :width] for name, tensor in features.items()}
            yield mini_batch, not unpadded(used, width, self.pad_left)
