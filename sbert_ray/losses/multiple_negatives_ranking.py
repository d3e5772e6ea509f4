"""In-batch negatives ranking (beyond the paper; Henderson et al. 2017): each anchor must pick its own
positive among all positives (and hard negatives) of the batch, under data parallelism the global batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import NLI_LABELS, LabelledPair, Pair, Record, Triplet
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.losses.gather import Gathered, gather_across_workers
from sbert_ray.models.encoder import SentenceEncoder

ENTAILMENT = NLI_LABELS.index("entailment")


class MultipleNegativesRankingLoss(EncoderLoss):
    """Cross-entropy over scale · cos(anchor_i, candidate_j), the target being anchor i's own positive.

    Columns are [anchor, positive, optional hard negatives...]; labels are ignored. With
    `gather_across_workers`, candidates come from every data-parallel worker (gathered with gradients), so
    each worker's loss is the mean over its own anchors against the global batch; DDP's gradient averaging
    then yields exactly the gradient of the mean loss over the global batch. Each worker's rows are padded to the
    training loop's bound on a worker's micro-batch (`expect_rows_per_worker`) and the padding is left out of
    every softmax, so the gather reads nothing to the host.

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
        self.rows_per_worker: int | None = None  # set by ``expect_rows_per_worker``: the gather's padding

    @classmethod
    def keeps(cls, record: Record) -> bool:
        """Of NLI pairs only the entailed ones are (anchor, positive) pairs."""
        return not isinstance(record, LabelledPair) or record.label == ENTAILMENT

    def expect_rows_per_worker(self, rows: int) -> None:
        self.rows_per_worker = rows

    def compute_loss_from_embeddings(
        self,
        embeddings: Sequence[Tensor],
        labels: Tensor | None = None,
        text_hashes: Sequence[Tensor] | None = None,
    ) -> Tensor:
        return self.ranking_loss(self.in_batch(embeddings, text_hashes))

    def in_batch(self, embeddings: Sequence[Tensor], text_hashes: Sequence[Tensor] | None = None) -> InBatch:
        """This worker's anchors and positives, and the columns other rows rank, [rows, columns, dim], gathered
        across workers (with `gather_across_workers`) as one tensor: each row's positive and negatives, and for the
        symmetric loss first its anchor. Their hashes alike, [rows, columns], when duplicates are masked."""
        if len(embeddings) < 2:
            raise ValueError(f"MultipleNegativesRankingLoss expects at least 2 columns, got {len(embeddings)}")
        masks = self.mask_duplicates and text_hashes is not None
        if masks and len(text_hashes) != len(embeddings):
            raise ValueError(f"text_hashes has {len(text_hashes)} columns for {len(embeddings)} columns of embeddings")
        first = 0 if self.symmetric else 1
        rows = torch.stack(list(embeddings[first:]), dim=1)
        hashes = torch.stack(list(text_hashes[first:]), dim=1) if masks else None
        if self.gather_across_workers:
            gathered = gather_across_workers(rows, hashes, self.rows_per_worker)
        else:
            gathered = Gathered(rows, hashes)
        own_hashes = (text_hashes[0], text_hashes[1]) if masks else None
        return InBatch(embeddings[0], embeddings[1], own_hashes, gathered)

    def ranking_loss(self, batch: InBatch) -> Tensor:
        """The mean over this worker's anchors of the cross-entropy of their own positives among the candidates
        (symmetric: the mean of that and the positives' of their own anchors among all anchors)."""
        # Similarities and softmax in fp32 even under bf16/fp16 autocast: scaled by 20, bf16's 8-bit mantissa
        # would blur the differences between candidates that the ranking is about (float64 stays float64).
        dtype = torch.promote_types(batch.anchors.dtype, torch.float32)
        with torch.autocast(batch.anchors.device.type, enabled=False):
            batch = batch.map(lambda embeddings: embeddings.to(dtype))
            anchor_hashes, positive_hashes = batch.own_hashes or (None, None)
            positives_at = 1 if self.symmetric else 0  # the gathered rows' positive column
            ranked = _candidates(batch.gathered, slice(positives_at, None))
            loss, self.masked_duplicates = self._ranking(batch.anchors, positive_hashes, ranked)
            if not self.symmetric:
                return loss
            # Positive i among every anchor, its own (offset + i) the target.
            anchors = _candidates(batch.gathered, slice(0, 1))
            backward, masked = self._ranking(batch.positives, anchor_hashes, anchors)
            if masked is not None:
                self.masked_duplicates = self.masked_duplicates + masked
            return (loss + backward) / 2

    def _ranking(
        self, queries: Tensor, target_hashes: Tensor | None, candidates: Gathered
    ) -> tuple[Tensor, Tensor | None]:
        """Cross-entropy of each query's scaled cosines to the candidates, query i's target being candidate
        ``candidates.offset + i``. Padding (``candidates.valid``) is left out of every softmax; with hashes, so is a
        candidate other than the target whose text is the target's (the hash of row i's target text:
        ``target_hashes``), and how many such duplicates were is the second value."""
        targets = torch.arange(candidates.offset, candidates.offset + len(queries), device=queries.device)
        scores = self.scale * F.normalize(queries, dim=-1) @ F.normalize(candidates.rows, dim=-1).T
        left_out = None if candidates.valid is None else ~candidates.valid  # the same for every query
        duplicates = None
        if candidates.hashes is not None:
            candidate = torch.arange(len(candidates.hashes), device=scores.device)
            duplicates = (candidates.hashes == target_hashes[:, None]) & (candidate != targets[:, None])
            if candidates.valid is not None:
                duplicates &= candidates.valid  # padding's zero hash is nobody's text
            left_out = duplicates if left_out is None else duplicates | left_out
        if left_out is not None:
            # -inf: the softmax gives it no weight and no gradient. On the device: no host sync.
            scores = scores.masked_fill(left_out, float("-inf"))
        return F.cross_entropy(scores, targets), None if duplicates is None else duplicates.sum()


@dataclasses.dataclass(frozen=True)
class InBatch:
    """What one forward ranks: this worker's anchors and positives, [batch, dim] each, their texts' hashes (None when
    duplicates are not masked), and every worker's rows of the ranked columns (``in_batch``)."""

    anchors: Tensor
    positives: Tensor
    own_hashes: tuple[Tensor, Tensor] | None
    gathered: Gathered

    def map(self, view: Callable[[Tensor], Tensor]) -> InBatch:
        """The same batch with ``view`` applied to every embedding (a dtype, MatryoshkaLoss's prefix): rows are
        independent, so viewing the gathered rows is gathering the viewed ones."""
        gathered = dataclasses.replace(self.gathered, rows=view(self.gathered.rows))
        return InBatch(view(self.anchors), view(self.positives), self.own_hashes, gathered)


def _candidates(gathered: Gathered, columns: slice) -> Gathered:
    """The gathered rows' ``columns`` as one list of candidates, column after column (all positives first, then
    all negatives), so that row i's first is still candidate offset + i."""

    def by_column(tensor: Tensor) -> Tensor:
        return tensor[:, columns].transpose(0, 1).flatten(0, 1)

    valid = gathered.valid
    return Gathered(
        by_column(gathered.rows),
        None if gathered.hashes is None else by_column(gathered.hashes),
        gathered.offset,
        None if valid is None else by_column(valid[:, None].expand(gathered.rows.shape[:2])),
    )
