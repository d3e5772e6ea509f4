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

    With `symmetric` (sentence-transformers' MultipleNegativesSymmetricRankingLoss), each positive must also pick
    its own anchor among all anchors, and the loss is the mean of the two directions' cross-entropies; an anchor
    with the text of positive i's anchor is then masked the same way. `scale` is the inverse of the softmax's
    temperature (scale 20: temperature 0.05).
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
        symmetric: bool = False,
    ) -> None:
        super().__init__(encoder)
        self.scale = scale
        self.gather_across_workers = gather_across_workers
        self.mask_duplicates = mask_duplicates
        self.symmetric = symmetric

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
        masks = self.mask_duplicates and text_hashes is not None
        if masks and len(text_hashes) != len(embeddings):
            raise ValueError(f"text_hashes has {len(text_hashes)} columns for {len(embeddings)} columns of embeddings")
        anchors, positives = embeddings[:2]
        # The columns other rows rank, [batch, columns, dim], gathered across workers as one tensor: each row's
        # positive and negatives, and for the symmetric loss first its anchor. Their hashes alike, [batch, columns].
        first = 0 if self.symmetric else 1
        rows = torch.stack(list(embeddings[first:]), dim=1)
        hashes = torch.stack(list(text_hashes[first:]), dim=1) if masks else None
        ranked = slice(1 - first, None)  # of those, the positive and negatives
        offset = 0
        if self.gather_across_workers:
            rows, hashes, offset = gather_across_workers(rows, hashes)
        # Similarities and softmax in fp32 even under bf16/fp16 autocast: scaled by 20, bf16's 8-bit mantissa
        # would blur the differences between candidates that the ranking is about (float64 stays float64).
        dtype = torch.promote_types(anchors.dtype, torch.float32)
        with torch.autocast(anchors.device.type, enabled=False):
            rows = rows.to(dtype)
            targets = torch.arange(offset, offset + len(anchors), device=anchors.device)
            # All positives first, then all negatives, so anchor i's positive is candidate offset + i.
            candidates = rows[:, ranked].transpose(0, 1).flatten(0, 1)
            candidate_hashes = None if hashes is None else hashes[:, ranked].T.flatten()
            positive_hashes = text_hashes[1] if masks else None
            loss, self.masked_duplicates = self._ranking(
                anchors.to(dtype), candidates, targets, positive_hashes, candidate_hashes
            )
            if not self.symmetric:
                return loss
            # Positive i among every anchor, its own (offset + i) the target.
            own_anchor_hashes, anchor_hashes = (text_hashes[0], hashes[:, 0]) if masks else (None, None)
            backward, masked = self._ranking(positives.to(dtype), rows[:, 0], targets, own_anchor_hashes, anchor_hashes)
            if masked is not None:
                self.masked_duplicates = self.masked_duplicates + masked
            return (loss + backward) / 2

    def _ranking(
        self,
        queries: Tensor,
        candidates: Tensor,
        targets: Tensor,
        target_hashes: Tensor | None,
        candidate_hashes: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """Cross-entropy of each query's scaled cosines to the candidates, the target candidate being
        the right one; with hashes, a candidate other than the target whose text is the target's (the hash of row
        i's target text: ``target_hashes``) is left out of row i's softmax, and how many were is the second value."""
        scores = self.scale * F.normalize(queries, dim=-1) @ F.normalize(candidates, dim=-1).T
        if candidate_hashes is None:
            return F.cross_entropy(scores, targets), None
        candidate = torch.arange(len(candidate_hashes), device=scores.device)
        duplicates = (candidate_hashes == target_hashes[:, None]) & (candidate != targets[:, None])
        # -inf: the softmax gives it no weight and no gradient. On the device: no host sync.
        return F.cross_entropy(scores.masked_fill(duplicates, float("-inf")), targets), duplicates.sum()
