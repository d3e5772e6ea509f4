"""The Hugging Face Hub datasets a user with internet would load, as one small table.

Used when neither `--data-dir` nor `SBERT_RAY_DATA_DIR` is set. Scores are brought to the local scale
(STSb 0-5) and label ids are converted by class name to `NLI_LABELS` indices.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlparse

from sbert_ray.data.records import (
    NLI_LABEL_IDS,
    DataError,
    Errors,
    Kind,
    Record,
    RecordCollector,
    Records,
    make_record,
)

_HUB_PROBE_TIMEOUT_S = 2.0
_TRAIN_DEV_TEST = {"train": "train", "dev": "validation", "test": "test"}


@dataclass(frozen=True)
class HubSource:
    path: str
    kind: Kind
    splits: Mapping[str, str]  # our split name -> Hub split name
    config: str | None = None
    columns: Mapping[str, str] = field(default_factory=dict)  # record field -> Hub column, if named otherwise
    score_scale: float = 1.0  # Hub score * score_scale = the score on our (local files') scale


_NLI_COLUMNS = {"sentence1": "premise", "sentence2": "hypothesis"}

HUB_SOURCES: dict[str, HubSource] = {
    # sentence-transformers/stsb stores score / 5.
    "stsb": HubSource("sentence-transformers/stsb", "scored", _TRAIN_DEV_TEST, score_scale=5.0),
    # MTEB keeps all 9,927 SICK pairs (train + trial + test) in one "test" split, so only "all" maps to it.
    "sickr": HubSource("mteb/sickr-sts", "scored", {"all": "test"}),
    "sts12": HubSource("mteb/sts12-sts", "scored", {"train": "train", "test": "test"}),
    **{f"sts{year}": HubSource(f"mteb/sts{year}-sts", "scored", {"test": "test"}) for year in range(13, 17)},
    "all-nli": HubSource(
        "sentence-transformers/all-nli",
        "labelled",
        {"train": "train", "dev": "dev", "test": "test"},
        config="pair-class",
        columns=_NLI_COLUMNS,
    ),
    # The Hub counterpart of the local nli-triplets (premise, entailed, contradicting hypothesis).
    "nli-triplets": HubSource(
        "sentence-transformers/all-nli",
        "triplet",
        {"train": "train", "dev": "dev", "test": "test"},
        config="triplet",
        columns={"anchor": "anchor", "positive": "positive", "negative": "negative"},
    ),
    "snli": HubSource("stanfordnlp/snli", "labelled", _TRAIN_DEV_TEST, columns=_NLI_COLUMNS),
    "mnli": HubSource(
        "nyu-mll/multi_nli",
        "labelled",
        {
            "train": "train",
            "dev_matched": "validation_matched",
            "dev_mismatched": "validation_mismatched",
        },
        columns=_NLI_COLUMNS,
    ),
    "wikisec": HubSource("sentence-transformers/wikipedia-sections", "triplet", _TRAIN_DEV_TEST, config="triplet"),
}


def hub_source(name: str, split: str) -> tuple[HubSource, str]:
    """The table entry and Hub split for one of our dataset names, or a DataError saying what exists."""
    if name not in HUB_SOURCES:
        raise DataError(
            f"dataset {name!r} has no Hugging Face Hub source (Hub names: {', '.join(HUB_SOURCES)}); "
            "pass --data-dir or set SBERT_RAY_DATA_DIR to read it from local files"
        )
    source = HUB_SOURCES[name]
    if split not in source.splits:
        raise DataError(f"{source.path} ({name}) has no split {split!r}; choose one of {', '.join(source.splits)}")
    return source, source.splits[split]


def load_hub(name: str, split: str, errors: Errors = "raise") -> Records:
    source, hub_split = hub_source(name, split)
    from datasets import load_dataset  # heavy import, only needed on this path

    try:
        dataset = load_dataset(source.path, source.config, split=hub_split)
    except ConnectionError as err:  # offline: say how to use local files instead of a network traceback
        raise DataError(f"{err}; to read {name!r} from local files pass --data-dir or set SBERT_RAY_DATA_DIR") from None
    values = None
    if source.kind == "labelled":
        label_column = source.columns.get("label", "label")
        # Class ids -> our indices by name; -1 ("no gold label", SNLI) is dropped below.
        names = dataset.features[label_column].names
        values = {index: NLI_LABEL_IDS[name] for index, name in enumerate(names)}
    collector = RecordCollector(f"{source.path}[{hub_split}]", errors, unit="row")
    for index, row in enumerate(dataset):
        if values is not None and row[label_column] == -1:
            collector.drop("label -1 (no gold label)")
            continue
        collector.add(index, _hub_record, source, row, values)
    return collector.finish()


def _hub_record(source: HubSource, row: Mapping[str, object], values: Mapping[object, int] | None) -> Record:
    record = make_record(source.kind, row, source.columns, values)
    if source.score_scale == 1.0:
        return record
    return dataclasses.replace(record, score=record.score * source.score_scale)


def hub_reachable() -> bool:
    """False when HF_HUB_OFFLINE is set or a quick TCP connect to the Hub endpoint fails."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}:
        return False
    return _probe(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))


@functools.cache  # one probe per endpoint and process: a cluster job should not wait on every load
def _probe(endpoint: str) -> bool:
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=_HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False
