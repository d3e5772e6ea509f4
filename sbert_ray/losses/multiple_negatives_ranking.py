"""In-batch negatives ranking (beyond the paper; Henderson et al. 2017): each anchor must pick its own
positive among all positives (and hard negatives) of the batch, under data parallelism the global batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import NLI_LABELS, LabelledPair, Pair, Record, Triplet
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.losses.gather import gather_across_workers
from sbert_ray.models.encoder import SentenceEncoder

ENTAILMENT = NLI_LABELS.index("entailment")


class MultipleNegativesRankingLoss(EncoderLoss):
    """Cross-entropy over scale · cos(anchor_i, candidate_j), the target being anchor i's own positive.

    Columns are [anchor, positive, optional hard negatives...]; labels are ignored. With
    `gather_across_workers`, candidates come from every data-parallel worker (gathered with gradients), so
    each worker's loss is the mean over its own anchors against the global batch; DDP's gradient averaging
    then yields exactly the gradient of the mean loss over the global batch.

    Given the texts' hashes (`text_hashes`, one int64 tensor per column) and with `mask_duplicates`, a candidate
    whose text is anchor i's positive, other than that positive itself (the same text as another row's positive
    or hard negative, on any worker), is left out of anchor i's softmax: it is the right answer, not a negative.
    `masked_duplicates` counts those left out in the last forward.
    """

    record_types = (Triplet, Pair, LabelledPair)  # (anchor, positive[, negative]), or NLI pairs
    user_file_kind = "triplet"
    in_batch_negatives = True

    def __init__(
        self,
        encoder: SentenceEncoder,
        scale: float = 20.0,
        gather_across_workers: bool = True,
        mask_duplicates: bool = True,
    ) -> None:
        super().__init__(encoder)
        self.scale = scale
        self.gather_across_workers = gather_across_workers
        self.mask_duplicates = mask_duplicates

    @classmethod
    def keeps(cls, record: Record) -> bool:
        """Of NLI pairs only the entailed ones are (anchor, positive) pairs."""
        return not isinstance(record, LabelledPair) or record.label == ENTAILMENT

    def compute_loss_from_embeddings(
        self,
        embeddings: Sequence[Tensor],
        labels: Tensor | None = None,
        text_hashes: Sequence[Tensor] | None = None,
    ) -> Tensor:
        if len(embeddings) < 2:
            raise ValueError(f"MultipleNegativesRankingLoss expects at least 2 columns, got {len(embeddings)}")
        anchors, *columns = embeddings
        candidates = torch.stack(columns, dim=1)  # [batch, columns, dim]: each row's positive and negatives
        masks = self.mask_duplicates and text_hashes is not None
        if masks and len(text_hashes) != len(embeddings):
            raise ValueError(f"text_hashes has {len(text_hashes)} columns for {len(embeddings)} columns of embeddings")
        hashes = torch.stack(list(text_hashes[1:]), dim=1) if masks else None  # [batch, columns], like candidates
        offset = 0
        if self.gather_across_workers:
            candidates, hashes, offset = gather_across_workers(candidates, hashes)
        # All positives first, then all negatives, so anchor i's positive is candidate offset + i.
        candidates = candidates.transpose(0, 1).flatten(0, 1)
        # Similarities and softmax in fp32 even under bf16/fp16 autocast: scaled by 20, bf16's 8-bit mantissa
        # would blur the differences between candidates that the ranking is about (float64 stays float64).
        dtype = torch.promote_types(anchors.dtype, torch.float32)
        with torch.autocast(anchors.device.type, enabled=False):
            scores = self.scale * F.normalize(anchors.to(dtype), dim=-1) @ F.normalize(candidates.to(dtype), dim=-1).T
            targets = torch.arange(offset, offset + len(anchors), device=anchors.device)
            self.masked_duplicates = None
            if hashes is not None:
                scores, self.masked_duplicates = _without_duplicates(
                    scores, targets, text_hashes[1], hashes.T.flatten()
                )
            return F.cross_entropy(scores, targets)


def _without_duplicates(
    scores: Tensor, targets: Tensor, positive_hashes: Tensor, candidate_hashes: Tensor
) -> tuple[Tensor, Tensor]:
    """`scores` with -inf where a candidate other than anchor i's target has the hash of anchor i's positive (the
    softmax then gives it no weight and no gradient), and how many those are. On the device: no host sync."""
    candidate = torch.arange(len(candidate_hashes), device=scores.device)
    duplicates = (candidate_hashes == positive_hashes[:, None]) & (candidate != targets[:, None])
    return scores.masked_fill(duplicates, float("-inf")), duplicates.sum()
