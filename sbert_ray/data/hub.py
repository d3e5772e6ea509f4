"""The Hugging Face Hub datasets a user with internet would load, as one small table.

Used when neither `--data-dir` nor `SBERT_RAY_DATA_DIR` is set. Scores are brought to the local scale
(STSb 0-5) and label ids are converted by class name to `NLI_LABELS` indices.

`SBERT_RAY_HUB_MIRROR=/dir` reads each dataset from `/dir/<owner>/<name>`, a copy of its Hub repository (e.g.
`huggingface-cli download --repo-type dataset mteb/sts12-sts --local-dir /dir/mteb/sts12-sts`), through the same
`datasets.load_dataset` call: for clusters without internet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from sbert_ray.data.records import (
    NLI_LABEL_IDS,
    RECORD_TYPES,
    DataError,
    Errors,
    Kind,
    Record,
    RecordCollector,
    Records,
    make_record,
)

_HUB_PROBE_TIMEOUT_S = 2.0
HUB_MIRROR_ENV = "SBERT_RAY_HUB_MIRROR"
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

# Each schema (files, configs, splits, columns, label names, score scale) was read from the repository's file
# listing and dataset card on huggingface.co; tests/test_hub.py rebuilds each layout and loads it.
HUB_SOURCES: dict[str, HubSource] = {
    # data/{train,validation,test}-00000-of-00001.parquet; sentence1, sentence2, score float = STSb score / 5
    # ("normalized to between 0 and 1", dataset card at ab7a5ac).
    "stsb": HubSource("sentence-transformers/stsb", "scored", _TRAIN_DEV_TEST, score_scale=5.0),
    # test.jsonl.gz only (revision 20a6d6f, pinned by MTEB's SICK-R task): all 9,927 SICK pairs (train + trial +
    # test) in one "test" split, so only "all" maps to it; score = SICK relatedness 1-5, as in the local files.
    "sickr": HubSource("mteb/sickr-sts", "scored", {"all": "test"}),
    # STS12-16: test.jsonl.gz (+ train.jsonl.gz for STS12) at the revisions MTEB pins (a0d554a for STS12), a
    # README with no configs; columns split, sentence1, sentence2, score 0-5 (MTEB's STS tasks, max_score 5).
    # No column names the sub-set (MTEB's 500-row samples mteb/llm-eval-sts12 / -sts13 keep exactly these four
    # columns), so per-subset numbers need local files.
    "sts12": HubSource("mteb/sts12-sts", "scored", {"train": "train", "test": "test"}),
    **{f"sts{year}": HubSource(f"mteb/sts{year}-sts", "scored", {"test": "test"}) for year in range(13, 17)},
    # README configs pair / pair-class / pair-score / triplet, each <config>/{train,dev,test}-*.parquet;
    # pair-class: premise, hypothesis, label ClassLabel (entailment, neutral, contradiction).
    "all-nli": HubSource(
        "sentence-transformers/all-nli",
        "labelled",
        {"train": "train", "dev": "dev", "test": "test"},
        config="pair-class",
        columns=_NLI_COLUMNS,
    ),
    # The Hub counterpart of the local nli-triplets (premise, entailed, contradicting hypothesis); the triplet
    # config: anchor, positive, negative.
    "nli-triplets": HubSource(
        "sentence-transformers/all-nli",
        "triplet",
        {"train": "train", "dev": "dev", "test": "test"},
        config="triplet",
    ),
    # Parquet since "Convert dataset to Parquet" (cdb5c3d): plain_text/{train,validation,test}-00000-of-00001.parquet;
    # premise, hypothesis, label ClassLabel (entailment, neutral, contradiction), -1 = no gold label.
    "snli": HubSource("stanfordnlp/snli", "labelled", _TRAIN_DEV_TEST, config="plain_text", columns=_NLI_COLUMNS),
    # Parquet since c4f4109: data/{train,validation_matched,validation_mismatched}-*.parquet, config default;
    # promptID, pairID, premise(+_binary_parse, _parse), hypothesis(+ the same), genre, label ClassLabel as SNLI.
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
    # README configs pair / triplet, triplet/{train,validation,test}-*.parquet: anchor, positive, negative.
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


def check_hub(name: str, split: str) -> str:
    """What `datasets.load_dataset` will read for `name`/`split` without a data directory, checked without
    reading rows: the mirror folder (which must hold the config and split), else the Hub id when the Hub answers
    or, in offline mode (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE), when the datasets cache holds a copy."""
    source, hub_split = hub_source(name, split)
    folder = mirror_folder(source.path, name)
    if folder:
        _check_split(folder, source, hub_split)
        return folder
    from datasets import config as datasets_config

    if not datasets_config.HF_HUB_OFFLINE and hub_reachable():
        return source.path
    if datasets_config.HF_HUB_OFFLINE:  # only then does datasets read its cache without retrying the Hub first
        try:
            _check_split(source.path, source, hub_split)
            return source.path
        except ConnectionError:
            pass
    raise DataError(
        f"{name!r} ({source.path}) needs the Hugging Face Hub, which is unreachable (or offline mode is set), and "
        "the datasets cache holds no copy (read in offline mode, HF_HUB_OFFLINE=1); pass --data-dir or set "
        f"SBERT_RAY_DATA_DIR to read local files, or set {HUB_MIRROR_ENV} to a local copy of the Hub datasets"
    )


def mirror_folder(repo: str, name: str) -> str | None:
    """The copy of the Hub repository ``repo`` (needed for ``name``) under SBERT_RAY_HUB_MIRROR; None when that is
    not set; a DataError when the mirror has no copy."""
    mirror = os.environ.get(HUB_MIRROR_ENV)
    if not mirror:
        return None
    folder = Path(mirror).expanduser() / repo
    if not folder.is_dir():
        raise DataError(f"{HUB_MIRROR_ENV}={mirror} has no copy of {repo} for {name!r} (expected {folder})")
    return str(folder)


def load_hub_table(repo: str, config: str | None, split: str, name: str):
    """One split of one config of the Hub dataset ``repo`` (or its mirror copy) as a ``datasets.Dataset``; a
    DataError naming the repository, config and split when it cannot be read."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    location = mirror_folder(repo, name)
    if location is None:
        from datasets import config as datasets_config

        if not (datasets_config.HF_HUB_OFFLINE or hub_reachable()):
            raise DataError(
                f"{name!r} ({repo}) needs the Hugging Face Hub, which is unreachable; set {HUB_MIRROR_ENV} to a "
                "local copy of the Hub datasets, or use a local BEIR folder (retrieval:<folder>)"
            )
        location = repo
    cache_dir = None if location == repo else mirror_cache_dir(Path(location))
    try:
        return load_dataset(location, config, split=split, cache_dir=cache_dir)
    except (ConnectionError, FileNotFoundError, ValueError, DatasetGenerationError) as error:
        raise DataError(f"{location} (config {config}, split {split}): {error}") from None


def _check_split(location: str, source: HubSource, hub_split: str) -> None:
    """The config and split exist at `location` (a ConnectionError when the Hub is needed and not cached)."""
    from datasets import load_dataset_builder

    try:
        builder = load_dataset_builder(location, source.config)
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"{location}: {error}") from None
    splits = {str(split) for split in [*(builder.config.data_files or {}), *(builder.info.splits or {})]}
    if hub_split not in splits:
        raise DataError(f"{location} has no split {hub_split!r} (splits: {', '.join(sorted(splits))})")


def load_hub(name: str, split: str, errors: Errors = "raise") -> Records:
    """All records of one Hub dataset split (or its mirror copy), with the columns and labels checked first."""
    location = check_hub(name, split)
    source, hub_split = hub_source(name, split)
    from datasets import load_dataset  # heavy import, only needed on this path
    from datasets.exceptions import DatasetGenerationError

    where = f"{location}[{hub_split}]"
    cache_dir = None if location == source.path else mirror_cache_dir(Path(location))
    try:
        dataset = load_dataset(location, source.config, split=hub_split, cache_dir=cache_dir)
    except (ConnectionError, ValueError, DatasetGenerationError) as error:  # say which dataset and what to do
        raise DataError(
            f"{where}: {error}; to read {name!r} from local files pass --data-dir or set SBERT_RAY_DATA_DIR"
        ) from None
    wanted = [source.columns.get(f.name, f.name) for f in dataclasses.fields(RECORD_TYPES[source.kind])]
    missing = [column for column in wanted if column not in dataset.column_names]
    if missing:
        raise DataError(f"{where}: no column {', '.join(missing)} (columns: {', '.join(dataset.column_names)})")
    values = _label_ids(dataset, source, where) if source.kind == "labelled" else None
    label_column = source.columns.get("label", "label")
    collector = RecordCollector(where, errors, unit="row")
    for index, row in enumerate(dataset):
        if values is not None and row[label_column] == -1:
            collector.drop("label -1 (no gold label)")
            continue
        collector.add(index, _hub_record, source, row, values)
    return collector.finish()


def mirror_cache_dir(*folders: Path) -> str:
    """A datasets cache of the mirror copies' own, named after their files' paths, sizes and times: datasets keys
    a local folder's cache by the folder's name and config alone (huggingface/datasets#2956), so without this an
    updated copy, or another owner's repository of the same name, would be served from a stale cache."""
    from datasets import config as datasets_config

    stamps = []
    for folder in folders:
        files = sorted(path for path in folder.rglob("*") if path.is_file())
        stamp = [(str(path.relative_to(folder)), path.stat().st_size, path.stat().st_mtime_ns) for path in files]
        stamps.append((str(folder.resolve()), stamp))
    digest = hashlib.sha256(repr(stamps[0] if len(stamps) == 1 else stamps).encode()).hexdigest()[:16]
    return str(Path(datasets_config.HF_DATASETS_CACHE) / "sbert-ray-hub-mirror" / digest)


@contextlib.contextmanager
def mirror_copies_cached_apart(folders: Sequence[Path]) -> Iterator[None]:
    """datasets' default cache set to the copies' own (``mirror_cache_dir``) while they are read, for loaders that
    pass no ``cache_dir`` (mteb's retrieval loader), which would otherwise serve an updated copy from a stale
    cache. datasets reads ``config.HF_DATASETS_CACHE`` at each load, so setting it there is enough."""
    if not folders:
        yield
        return
    from datasets import config as datasets_config

    default, datasets_config.HF_DATASETS_CACHE = datasets_config.HF_DATASETS_CACHE, Path(mirror_cache_dir(*folders))
    try:
        yield
    finally:
        datasets_config.HF_DATASETS_CACHE = default


def _label_ids(dataset, source: HubSource, where: str) -> dict[object, int]:
    """Hub class ids -> our indices, by class name (the Hub orders them entailment, neutral, contradiction)."""
    label_column = source.columns.get("label", "label")
    names = getattr(dataset.features[label_column], "names", None)
    if names is None or not set(names) <= set(NLI_LABEL_IDS):
        raise DataError(f"{where}: {label_column!r} must be a ClassLabel over {sorted(NLI_LABEL_IDS)}, got {names}")
    return {index: NLI_LABEL_IDS[name] for index, name in enumerate(names)}


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
