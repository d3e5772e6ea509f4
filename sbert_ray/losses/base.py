"""The siamese pattern every objective shares: one encoder (tied weights) embeds each column of a batch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from sbert_ray.data.records import Kind, Record
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.model_type import ModelType
from sbert_ray.models.padded_widths import unpadded


class EncoderLoss(nn.Module, ABC):
    """A loss that owns the encoder, so wrapping the loss in DDP also syncs heads such as SoftmaxLoss's.

    `forward(features, labels, text_hashes, used_widths)` takes one tokenized dict per column (e.g. [sentence1,
    sentence2]), `embed`s each, and `compute_loss_from_embeddings` applies the paper's formula to the resulting
    sentence embeddings. `text_hashes` (optional: one int64 tensor [batch] per column, a hash of each text) lets an
    in-batch-negative loss tell a duplicate of an anchor's positive from a true negative; the others ignore it.
    `used_widths` (optional: per column, the padded columns each row uses, on the host) lets a cached loss cut
    its mini-batches' padding without reading the attention mask back from the device.

    Each objective also declares what it trains on (read by the registry in `losses/registry.py` and by the
    training data pipeline): the record types it accepts, how a user's own file is read for it, and which
    record field, if any, becomes the label tensor. Keyword arguments after `encoder` are the objective's
    settings (a stage's `loss:` mapping), checked against their annotations when a config is loaded.
    """

    # A bi-encoder (``SentenceEncoder``: each column embedded alone) or a reranker (``CrossEncoderModel``: each
    # column a (query, passage) pair tokenised together, its "embedding" the pair's logit); ``model.type`` must agree.
    model_type: ClassVar[ModelType] = "bi_encoder"
    record_types: ClassVar[tuple[type[Record], ...]]
    user_file_kind: ClassVar[Kind]
    # "label" (class index), "score" (scaled to [0, 1] by score_max), "scores" (a teacher's, as they are: per row
    # [score_positive, score_negative_1..n], from a parquet source's columns of those names) or "vector" (a teacher's
    # embedding of the row's text, from a parquet source's list column of that name, as sbert-ray encode writes it)
    label_field: ClassVar[str | None] = None
    in_batch_negatives: ClassVar[bool] = False  # the batch's other examples are negatives: duplicates hurt
    # Trainable parameters beside the encoder's (softmax's classifier): FSDP, which shards the encoder only, refuses it.
    has_head: ClassVar[bool] = False
    # Candidates the last forward left out of the negatives as duplicates of an anchor's positive (a tensor on the
    # device, so reading it is the reader's host sync); None where that forward masked nothing.
    masked_duplicates: Tensor | None = None

    def __init__(self, encoder: SentenceEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    @classmethod
    def keeps(cls, record: Record) -> bool:
        """Whether a record is a training example for this objective (MNRL keeps only entailed NLI pairs)."""
        return True

    @classmethod
    def keeps_every_record(cls) -> bool:
        """True when ``keeps`` is this class's, which drops no record (so a file's row count is its examples)."""
        return cls.keeps.__func__ is EncoderLoss.keeps.__func__

    def forward(
        self,
        features: Sequence[dict[str, Tensor]],
        labels: Tensor | None = None,
        text_hashes: Sequence[Tensor] | None = None,
        used_widths: Sequence[np.ndarray] | None = None,
    ) -> Tensor:
        return self.compute_loss_from_embeddings(self.embed(features, used_widths), labels, text_hashes)

    def embed(
        self, features: Sequence[dict[str, Tensor]], used_widths: Sequence[np.ndarray] | None = None
    ) -> list[Tensor]:
        """One embedding tensor [batch, dim] per column, from a single encoder forward over all columns: each
        column padded to the widest, stacked, the result split back. One pass over [columns * batch, width] runs
        larger matrix products (and the encoder's fixed per-call work once) for a little padding, which the
        attention mask hides; smart batching groups examples by their longest sentence, so the columns of a batch
        are of similar width. (A cached loss embeds in mini-batches instead, cut to ``used_widths``.)"""
        pad_left = self.encoder.tokenizer.padding_side == "left"
        width = max(column["input_ids"].shape[1] for column in features)
        # Host-side: no row of any column padded (then the encoder leaves the attention mask out, ``models.encoder``)
        padded = used_widths is None or not all(unpadded(w, width, pad_left) for w in used_widths)
        if len(features) == 1:
            return [self.encoder(features[0], padded)]
        pad_id = self.encoder.tokenizer.pad_token_id or 0
        # On the tokenizer's padding side: a left-padded row (a decoder's) keeps its last token in the last column.
        sides = (1, 0) if pad_left else (0, 1)
        stacked = {
            name: torch.cat(
                [
                    F.pad(
                        column[name],
                        tuple(side * (width - column[name].shape[1]) for side in sides),
                        value=pad_id if name == "input_ids" else 0,
                    )
                    for column in features
                ]
            )
            for name in features[0]
        }
        return list(self.encoder(stacked, padded).split([column["input_ids"].shape[0] for column in features]))

    @abstractmethod
    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        """The scalar loss for one embedding tensor [batch, dim] per column (and, if given, one hash tensor
        [batch] per column, which only in-batch-negative losses read)."""

    def prepare_for_dims(self, dims: Sequence[int]) -> None:
        """MatryoshkaLoss calls this with every embedding size the formula will see; a loss whose parameters
        depend on that size (SoftmaxLoss's classifier) creates them here, before the optimizer is built."""

    def expect_rows_per_worker(self, rows: int) -> None:
        """The training loop's bound on any worker's micro-batch (``BatchSplit.largest_micro_batch``), known on every
        rank without communication: a loss that gathers rows across workers pads to it instead of reading every
        worker's count to the host; the others need nothing."""

    def _columns(self, embeddings: Sequence[Tensor], expected: int) -> Sequence[Tensor]:
        if len(embeddings) != expected:
            raise ValueError(f"{type(self).__name__} expects {expected} columns, got {len(embeddings)}")
        return embeddings

    def _labels(self, labels: Tensor | None) -> Tensor:
        if labels is None:
            raise ValueError(f"{type(self).__name__} needs labels")
        return labels
