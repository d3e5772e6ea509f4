"""From records to the objective: which records each objective trains on, tokenisation (once), and collation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from sbert_ray.config import StageConfig
from sbert_ray.data.readers import load_records, read_user_file
from sbert_ray.data.records import NLI_LABELS, LabelledPair, ScoredPair, TopicPair, Triplet
from sbert_ray.losses import CosineSimilarityLoss, MultipleNegativesRankingLoss, SoftmaxLoss, TripletLoss

# The record types each objective accepts. Multiple-negatives ranking takes triplets (anchor, positive,
# hard negative) or NLI pairs, of which it keeps the entailed ones as (anchor, positive).
OBJECTIVE_RECORDS: dict[str, tuple[type, ...]] = {
    "softmax": (LabelledPair,),
    "regression": (ScoredPair, TopicPair),
    "triplet": (Triplet,),
    "mnrl": (Triplet, LabelledPair),
}
ENTAILMENT = NLI_LABELS.index("entailment")
USER_FILE_SUFFIXES = (".csv", ".tsv", ".jsonl")
USER_FILE_KIND = {"softmax": "labelled", "regression": "scored", "triplet": "triplet", "mnrl": "triplet"}


def load_training_records(stage: StageConfig, data_dir) -> list:
    """A registered dataset by name, or the user's own csv/tsv/jsonl file read with ``stage.columns``."""
    if stage.dataset.endswith(USER_FILE_SUFFIXES):
        records = read_user_file(stage.dataset, USER_FILE_KIND[stage.objective], stage.columns)
    else:
        records = load_records(stage.dataset, stage.split, data_dir)
    return records[: stage.limit] if stage.limit else records


def build_objective(stage: StageConfig, encoder: nn.Module) -> nn.Module:
    """The loss module owns the encoder (and the softmax head), so DDP wraps it whole."""
    if stage.objective == "softmax":
        return SoftmaxLoss(encoder, num_labels=len(NLI_LABELS), concat=tuple(stage.concat))
    if stage.objective == "regression":
        return CosineSimilarityLoss(encoder)
    if stage.objective == "triplet":
        return TripletLoss(encoder, distance=stage.triplet_distance, margin=stage.triplet_margin)
    return MultipleNegativesRankingLoss(encoder, scale=stage.mnrl_scale)


def texts_and_labels(records: Sequence, stage: StageConfig) -> tuple[list[list[str]], torch.Tensor | None]:
    """Text columns (one list per siamese branch) and the label tensor the objective expects."""
    accepted = OBJECTIVE_RECORDS[stage.objective]
    wrong = next((r for r in records if not isinstance(r, accepted)), None)
    if wrong is not None:
        names = ", ".join(t.__name__ for t in accepted)
        raise ValueError(
            f"dataset {stage.dataset!r} gives {type(wrong).__name__} records; "
            f"objective {stage.objective!r} needs {names}"
        )
    if stage.objective == "mnrl" and records and isinstance(records[0], LabelledPair):
        records = [r for r in records if r.label == ENTAILMENT]
    if not records:
        raise ValueError(f"dataset {stage.dataset!r} split {stage.split!r} has no usable training examples")
    if isinstance(records[0], Triplet):
        return [
            [r.anchor for r in records],
            [r.positive for r in records],
            [r.negative for r in records],
        ], None
    columns = [[r.sentence1 for r in records], [r.sentence2 for r in records]]
    if stage.objective == "softmax":
        return columns, torch.tensor([r.label for r in records], dtype=torch.long)
    if stage.objective == "regression":  # cosine regression targets in [0, 1], as the paper scales STSb
        return columns, torch.tensor([r.score / stage.score_max for r in records], dtype=torch.float)
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
