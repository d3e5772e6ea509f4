"""From records to the objective's inputs: which records a stage trains on, tokenisation (once), and collation.

What an objective accepts is declared by its loss class (see ``sbert_ray.losses.registry``): record types, the
user-file kind, the label field and which records it keeps.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from sbert_ray.config import StageConfig
from sbert_ray.data.readers import load_records, read_user_file
from sbert_ray.data.records import TEXT_FIELDS, Records
from sbert_ray.data.sampler import SmartBatchSampler
from sbert_ray.losses.registry import OBJECTIVES

logger = logging.getLogger(__name__)
USER_FILE_SUFFIXES = (".csv", ".tsv", ".jsonl")


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
    return stage.dataset.endswith(USER_FILE_SUFFIXES)


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


class TokenizedColumns:
    """Every text column tokenised once up front; batches are padded per batch (smart batching)."""

    def __init__(self, columns: list[list[str]], labels: torch.Tensor | None, tokenizer, max_seq_length: int):
        self.tokenizer = tokenizer
        self.labels = labels
        self.encodings = [
            tokenizer(column, truncation=True, max_length=max_seq_length, return_attention_mask=False)["input_ids"]
            for column in columns
        ]
        self.texts = sum(len(column) for column in columns)
        self.truncated = sum(
            count_truncated(tokenizer, column, ids, max_seq_length)
            for column, ids in zip(columns, self.encodings, strict=True)
        )
        # An example is as long as its longest sentence: that is what sets the padded width of its batch.
        self.lengths = [max(lens) for lens in zip(*([len(ids) for ids in enc] for enc in self.encodings), strict=True)]

    def __len__(self) -> int:
        return len(self.lengths)

    def collate(self, indices: Sequence[int], device: torch.device) -> tuple[list[dict], torch.Tensor | None]:
        features = []
        for encoding in self.encodings:
            padded = self.tokenizer.pad({"input_ids": [encoding[i] for i in indices]}, return_tensors="pt")
            features.append({k: v.to(device) for k, v in padded.items()})
        labels = self.labels[list(indices)].to(device) if self.labels is not None else None
        return features, labels


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
