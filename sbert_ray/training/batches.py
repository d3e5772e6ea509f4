"""From records to the objective's inputs: which records a stage trains on, tokenisation (once), and collation.

What an objective accepts is declared by its loss class (see ``sbert_ray.losses.registry``): record types, the
user-file kind, the label field and which records it keeps.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from sbert_ray.config import ModelConfig, StageConfig
from sbert_ray.data.readers import load_records, read_user_file
from sbert_ray.data.records import TEXT_FIELDS, Records
from sbert_ray.data.sampler import SmartBatchSampler
from sbert_ray.losses.registry import OBJECTIVES
from sbert_ray.models import load_encoder
from sbert_ray.training.loop import MicroBatch

logger = logging.getLogger(__name__)
USER_FILE_SUFFIXES = (".csv", ".tsv", ".jsonl")
TOKENIZE_CHUNK = 10_000  # sentences per tokenizer call: bounds the Python lists of ids alive at once


def local_batch_size(stage: StageConfig, num_workers: int) -> int:
    """Examples per micro-batch on each worker: the global batch split over workers and accumulation steps."""
    return stage.batch_size // (num_workers * stage.grad_accum_steps)


def stage_steps(examples: int, stage: StageConfig, num_workers: int) -> tuple[int, int]:
    """(optimizer steps per epoch, optimizer steps the stage runs) for ``examples`` training examples: what the
    workers train, and what a run checks and reports beforehand."""
    batches = SmartBatchSampler.batches_per_rank(examples, local_batch_size(stage, num_workers), num_workers)
    per_epoch = batches // stage.grad_accum_steps
    total = stage.epochs * per_epoch
    return per_epoch, min(total, stage.max_steps) if stage.max_steps else total


def is_user_file(stage: StageConfig) -> bool:
    """The stage reads the user's own file (by its suffix, in any case: DATA.CSV too), not a registered dataset."""
    return Path(stage.dataset).suffix.lower() in USER_FILE_SUFFIXES


def load_training_records(stage: StageConfig, data_dir) -> Records:
    """A registered dataset by name, or the user's own csv/tsv/jsonl file read with ``stage.columns`` (its scores
    must lie in [0, score_max], the scale score targets are divided by)."""
    if is_user_file(stage):
        loss = OBJECTIVES[stage.objective]
        score_range = (0.0, stage.score_max) if loss.label_field == "score" else None
        records = read_user_file(
            stage.dataset, loss.user_file_kind, stage.columns, errors=stage.errors, score_range=score_range
        )
    else:
        records = load_records(stage.dataset, stage.split, data_dir, errors=stage.errors)
    if stage.limit and stage.limit < len(records):
        logger.info("%s: training on the first %d of %d examples (limit)", stage.dataset, stage.limit, len(records))
    return Records(records[: stage.limit], records.skipped, records.dropped) if stage.limit else records


def texts_and_labels(records: Sequence, stage: StageConfig) -> tuple[list[list[str]], torch.Tensor | None]:
    """Text columns (one list per siamese branch) and the label tensor the objective expects; raises ValueError
    when the records do not fit the objective."""
    loss = OBJECTIVES[stage.objective]
    wrong = next((r for r in records if not isinstance(r, loss.record_types)), None)
    if wrong is not None:
        names = ", ".join(t.__name__ for t in loss.record_types)
        raise ValueError(
            f"dataset {stage.dataset!r} gives {type(wrong).__name__} records; "
            f"objective {stage.objective!r} needs {names}"
        )
    kept = [r for r in records if loss.keeps(r)]
    if len(kept) < len(records):
        logger.info(
            "objective %s keeps %d of %d examples of %s", stage.objective, len(kept), len(records), stage.dataset
        )
    if not kept:
        raise ValueError(f"dataset {stage.dataset!r} split {stage.split!r} has no usable training examples")
    columns = [[getattr(r, name) for r in kept] for name in TEXT_FIELDS[type(kept[0])]]
    if loss.label_field == "label":
        return columns, torch.tensor([r.label for r in kept], dtype=torch.long)
    if loss.label_field == "score":  # targets in [0, 1], as the paper scales STSb's 0-5; checked once, here
        scores = torch.tensor([r.score for r in kept], dtype=torch.float) / stage.score_max
        if scores.min() < 0 or scores.max() > 1:
            raise ValueError(
                f"dataset {stage.dataset!r} has scores outside [0, score_max={stage.score_max}] "
                f"({float(scores.min()) * stage.score_max:g} to {float(scores.max()) * stage.score_max:g})"
            )
        return columns, scores
    return columns, None


@dataclasses.dataclass(frozen=True)
class TokenizedColumn:
    """One text column's token ids, back to back: sentence i is ``ids[offsets[i]:offsets[i + 1]]``."""

    ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, one more than there are sentences

    @classmethod
    def tokenize(cls, sentences: Sequence[str], tokenizer, max_seq_length: int) -> tuple[TokenizedColumn, int]:
        """The column tokenised and truncated to ``max_seq_length``, and how many sentences were truncated."""
        ids, lengths, truncated = [], [], 0
        for start in range(0, len(sentences), TOKENIZE_CHUNK):
            batch = tokenizer(
                list(sentences[start : start + TOKENIZE_CHUNK]),
                truncation=True,
                max_length=max_seq_length,
                return_attention_mask=False,
                return_token_type_ids=False,
            )
            chunk = batch["input_ids"]
            ids.append(np.fromiter(itertools.chain.from_iterable(chunk), dtype=np.int32))
            lengths.append(np.fromiter(map(len, chunk), dtype=np.int64, count=len(chunk)))
            truncated += count_truncated(tokenizer, sentences[start : start + TOKENIZE_CHUNK], chunk, max_seq_length)
        offsets = np.zeros(len(sentences) + 1, dtype=np.int64)
        np.cumsum(np.concatenate(lengths), out=offsets[1:])
        return cls(np.concatenate(ids), offsets), truncated

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def pad(self, indices: np.ndarray, pad_token_id: int, pad_left: bool, pin: bool) -> torch.Tensor:
        """input_ids and attention_mask of these sentences, stacked [2, batch, longest], padded with numpy into one
        (pinned, with ``pin``) host buffer, as ``tokenizer.pad`` pads them."""
        starts, lengths = self.offsets[indices], self.offsets[indices + 1] - self.offsets[indices]
        width = int(lengths.max())
        buffer = torch.empty((2, len(indices), width), dtype=torch.long, pin_memory=pin)
        input_ids, attention_mask = buffer.numpy()
        positions = np.arange(width)
        filled = positions >= width - lengths[:, None] if pad_left else positions < lengths[:, None]
        # Source position of every real token, row after row: the order boolean indexing fills `filled`.
        first_of_row = np.repeat(np.cumsum(lengths) - lengths, lengths)
        source = np.repeat(starts, lengths) + np.arange(lengths.sum()) - first_of_row
        input_ids.fill(pad_token_id)
        input_ids[filled] = self.ids[source]
        np.copyto(attention_mask, filled)
        return buffer


@dataclasses.dataclass(frozen=True)
class TokenizedColumns:
    """A stage's examples tokenised once for the whole cluster: compact numpy arrays that a worker reads zero-copy
    from Ray's object store, padded per batch (smart batching) when collated."""

    columns: list[TokenizedColumn]  # one per siamese branch
    lengths: np.ndarray  # int64, per example: its longest sentence, which sets the padded width of its batch
    labels: np.ndarray | None  # int64 class labels, float32 scaled scores, or None
    pad_token_id: int
    pad_left: bool
    texts: int  # over all columns
    truncated: int  # of those, cut to max_seq_length

    @classmethod
    def tokenize(
        cls, columns: list[list[str]], labels: torch.Tensor | None, tokenizer, max_seq_length: int
    ) -> TokenizedColumns:
        tokenized = [TokenizedColumn.tokenize(column, tokenizer, max_seq_length) for column in columns]
        return cls(
            columns=[column for column, _ in tokenized],
            lengths=np.max([column.lengths for column, _ in tokenized], axis=0),
            labels=None if labels is None else labels.numpy(),
            pad_token_id=tokenizer.pad_token_id,
            pad_left=tokenizer.padding_side == "left",
            texts=sum(len(column) for column in columns),
            truncated=sum(truncated for _, truncated in tokenized),
        )

    def __len__(self) -> int:
        return len(self.lengths)

    def collate(self, indices: Sequence[int], device: torch.device) -> tuple[list[dict], torch.Tensor | None]:
        """The batch's features per column and its labels on ``device``; on CUDA from pinned host memory, copied
        without blocking the host."""
        index = np.asarray(indices, dtype=np.int64)
        pin = device.type == "cuda"
        features = []
        for column in self.columns:
            input_ids, attention_mask = column.pad(index, self.pad_token_id, self.pad_left, pin).to(
                device, non_blocking=True
            )
            features.append({"input_ids": input_ids, "attention_mask": attention_mask})
        if self.labels is None:
            return features, None
        labels = torch.from_numpy(self.labels[index])
        return features, (labels.pin_memory() if pin else labels).to(device, non_blocking=True)


def epoch_batches(
    data: TokenizedColumns, sampler: SmartBatchSampler, per_epoch: int, epoch: int, position: int, device: torch.device
) -> Iterator[MicroBatch]:
    """This worker's micro-batches from ``position`` of ``epoch`` on, epoch after epoch, without end: each epoch's
    first ``per_epoch`` batches of the sampler (whole optimizer steps), collated on ``device`` as they are taken."""
    while True:
        sampler.set_epoch(epoch, start_batch=position)
        for taken, indices in enumerate(itertools.islice(sampler, per_epoch - position), start=position + 1):
            features, labels = data.collate(indices, device)
            yield MicroBatch(features, labels, len(indices), epoch, taken)
        epoch, position = epoch + 1, 0


def tokenize_stage(
    model: ModelConfig, columns: list[list[str]], labels: torch.Tensor | None
) -> tuple[TokenizedColumns, int]:
    """A stage's examples tokenised with the model's tokenizer, and apart from them how many texts were truncated,
    which a caller can read without fetching the arrays."""
    encoder = load_encoder(**dataclasses.asdict(model))  # its tokenizer (the same for every seed)
    data = TokenizedColumns.tokenize(columns, labels, encoder.tokenizer, encoder.max_seq_length)
    return data, data.truncated


def count_truncated(tokenizer, texts: Sequence[str], input_ids: Sequence[Sequence[int]], max_length: int) -> int:
    """How many of ``texts`` lost tokens when tokenised to ``input_ids`` with ``max_length``. Only those that came
    out exactly max_length long can have, so only they are tokenised again, in full."""
    full_length = [texts[i] for i, ids in enumerate(input_ids) if len(ids) >= max_length]
    if not full_length:
        return 0
    lengths = tokenizer(full_length, return_attention_mask=False, verbose=False)["input_ids"]
    return sum(len(ids) > max_length for ids in lengths)


def log_coverage(stage_index: int, data: TokenizedColumns, sampler: SmartBatchSampler, batches_per_epoch: int) -> None:
    """One line per stage on what training will not see: texts cut to max_seq_length, and the examples of an
    epoch whose micro-batches are left over after the last whole optimizer step (gradient accumulation)."""
    unseen = sampler.unseen(batches_per_epoch)
    if data.truncated or unseen:
        logger.warning(
            "stage %d: %d of %d texts truncated to max_seq_length; %d of %d examples of epoch 0 fall in "
            "micro-batches left over after the last whole optimizer step",
            stage_index,
            data.truncated,
            data.texts,
            unseen,
            len(data),
        )
