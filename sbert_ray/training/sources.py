"""Where a training stage's examples come from, read as a stream of Arrow tables of text columns and labels.

A source is a registered dataset (``stsb``, ``nli``, ...: local files or the Hub, read by ``data.readers``) or the
user's own data: one file, a folder or glob of shards, an object-storage prefix (``s3://bucket/shards/``) or a Hub
dataset's files (``hf://datasets/<owner>/<name>/<glob>``) of csv/tsv/jsonl/parquet files. Every table a source
yields has the columns ``text_0 .. text_{k-1}`` (one per siamese branch: e.g. anchor, positive, negative_1, ...)
and, when the objective has one, ``label`` (class index, or the score divided by the stage's ``score_max``). Only
the rows the objective trains on are kept.

One file is read by one task (``read_tables``), in tables of ``ROWS_PER_TABLE`` rows, so many shards read in
parallel across a cluster and no process ever holds more than a file's table at a time (parquet, read by row
group) or a csv/tsv/jsonl file's records (their readers check every row, naming its line).

A registered dataset is also read without pyarrow, as plain columns (``read_registered``: one training process
without Ray, on a machine that may have no pyarrow); pyarrow is imported inside the functions that read files or
make tables.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import itertools
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sbert_ray.config import ConfigError, StageConfig
from sbert_ray.data.hub import HUB_MIRROR_ENV
from sbert_ray.data.listing import is_hidden
from sbert_ray.data.prepared import Manifest, differences, prepared_settings, read_manifest
from sbert_ray.data.readers import load_records, read_user_file, user_file_columns
from sbert_ray.data.records import (
    NLI_LABEL_IDS,
    RECORD_TYPES,
    TEXT_FIELDS,
    DataError,
    Record,
    Records,
    lookup,
    parse_score,
)

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from sbert_ray.losses.base import EncoderLoss

FILE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".parquet")
HUB_PREFIX = "hf://datasets/"  # a Hub dataset's files: hf://datasets/<owner>/<name>/<path or glob>
ROWS_PER_TABLE = 8192  # rows per table a read task yields: Ray Data gathers them into blocks
GLOB_CHARS = "*?["
FOOTER_READERS = 32  # parquet footers a run's preflight reads at once


@dataclass(frozen=True)
class Source:
    """One dataset of a stage: ``spec`` as the config gives it, the files it is (none: a registered dataset), and
    its share of the stage's batches (``weight``)."""

    key: str  # the config key that names it, for messages: "stages.0.dataset", "stages.1.datasets.2"
    spec: str
    split: str
    files: tuple[str, ...]
    weight: float = 1.0
    columns: dict[str, str] | None = None
    rows: int | None = None  # its examples when counted before the cluster (a registered dataset, read on the driver)
    manifest: Manifest | None = None  # a prepared source's (``data.prepared``): its files are tokenised shards

    @property
    def name(self) -> str:
        """A short name for logs and MLflow metric names."""
        return Path(self.spec.rstrip("/")).name.replace("*", "x") or self.spec


def file_sources(source: Source) -> list[tuple[str | None, Source]]:
    """Each file of ``source`` (None: a registered dataset) with the source as a read task of that file needs it:
    that file alone, so each task's arguments stay the same size however many files the source has (not n tasks
    carrying n files each)."""
    if not source.files:
        return [(None, source)]
    return [(file, dataclasses.replace(source, files=(file,))) for file in source.files]


def is_path(spec: str) -> bool:
    """A path or URI of the user's data (a file with a data suffix, a folder, a glob or ``scheme://``), not the
    name of a registered dataset."""
    return (
        "://" in spec
        or Path(spec).suffix.lower() in FILE_SUFFIXES
        or any(c in spec for c in GLOB_CHARS)
        or Path(spec).expanduser().is_dir()
    )


def stage_sources(stage: StageConfig, index: int) -> list[Source]:
    """The stage's sources, their files listed (a missing or empty one is a ConfigError naming its key)."""
    if stage.datasets:
        entries = [
            (f"stages.{index}.datasets.{j}", d.name or d.path, d.split, d.weight, d.columns)
            for j, d in enumerate(stage.datasets)
        ]
    else:
        entries = [(f"stages.{index}.dataset", stage.dataset, stage.split, 1.0, stage.columns)]
    return [source_of(*entry) for entry in entries]


def source_of(key: str, spec: str, split: str, weight: float, columns: dict[str, str] | None) -> Source:
    """The source ``spec`` (``key`` names it in errors): a registered dataset, a folder ``sbert-ray prepare`` wrote
    (its manifest lists its shards) or other files."""
    if not is_path(spec):
        return Source(key, spec, split, (), weight, columns)
    try:
        manifest = read_manifest(_absolute(spec)) if _may_be_prepared(spec) else None
    except DataError as err:
        raise ConfigError(f"{key}: {err}") from None
    files = manifest.files if manifest else tuple(list_files(spec, key))
    return Source(key, spec, split, files, weight, columns, manifest=manifest)


def _may_be_prepared(spec: str) -> bool:
    """A folder or object storage prefix (a prepared source is one), not a file, a glob or a Hub dataset."""
    return not (
        spec.startswith(HUB_PREFIX) or any(c in spec for c in GLOB_CHARS) or Path(spec).suffix.lower() in FILE_SUFFIXES
    )


def _absolute(spec: str) -> str:
    return spec.rstrip("/") if "://" in spec else os.path.abspath(os.path.expanduser(spec))


def list_files(spec: str, key: str) -> list[str]:
    """The data files ``spec`` names, sorted: itself, a folder's (or prefix's) files with a data suffix, or a
    glob's matches; local or on any filesystem pyarrow opens (s3://, gs://, hdfs://)."""
    import pyarrow.fs as pafs

    filesystem, path = _filesystem(spec, key)
    pattern = next((i for i, c in enumerate(path) if c in GLOB_CHARS), None)
    if pattern is not None:
        base = path[: path.rfind("/", 0, pattern) + 1] or "."
        found = [f for f in _files_under(filesystem, base, key) if fnmatch.fnmatch(f, path)]
    else:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise ConfigError(f"{key}: {spec} does not exist")
        found = [path] if info.type == pafs.FileType.File else _files_under(filesystem, path, key)
    files = sorted(f for f in found if Path(f).suffix.lower() in FILE_SUFFIXES)
    if not files:
        raise ConfigError(f"{key}: {spec} holds no {'/'.join(FILE_SUFFIXES)} files")
    suffixes = {Path(f).suffix.lower() for f in files}
    if len(suffixes) > 1:
        raise ConfigError(f"{key}: {spec} mixes file types ({', '.join(sorted(suffixes))}); use one per source")
    if spec.startswith(HUB_PREFIX) and not os.environ.get(HUB_MIRROR_ENV):
        return ["hf://" + f for f in files]  # datasets/<owner>/<name>/...
    prefix = spec[: spec.index("://") + 3] if "://" in spec and not spec.startswith(HUB_PREFIX) else ""
    return [prefix + f for f in files]


def _filesystem(spec: str, key: str) -> tuple[pafs.FileSystem, str]:
    import pyarrow as pa
    import pyarrow.fs as pafs

    if "://" not in spec:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(spec))
    if spec.startswith(HUB_PREFIX):
        return _hub_filesystem(spec, key)
    try:
        return pafs.FileSystem.from_uri(spec.split("*")[0]) if "*" in spec else pafs.FileSystem.from_uri(spec)
    except (pa.ArrowInvalid, OSError) as err:
        raise ConfigError(f"{key}: cannot open {spec}: {err}") from None


def _hub_filesystem(spec: str, key: str) -> tuple[pafs.FileSystem, str]:
    """``hf://datasets/<owner>/<name>/<files>``: the Hub repository's files through huggingface_hub's filesystem,
    or with $SBERT_RAY_HUB_MIRROR its local copy ``<mirror>/<owner>/<name>/<files>``."""
    import pyarrow.fs as pafs

    repo_path = spec.removeprefix(HUB_PREFIX)
    mirror = os.environ.get(HUB_MIRROR_ENV)
    if mirror:
        return pafs.LocalFileSystem(), os.path.join(os.path.abspath(os.path.expanduser(mirror)), repo_path)
    from huggingface_hub import HfFileSystem

    return pafs.PyFileSystem(pafs.FSSpecHandler(HfFileSystem())), f"datasets/{repo_path}"


def _files_under(filesystem: pafs.FileSystem, folder: str, key: str) -> list[str]:
    import pyarrow.fs as pafs

    try:
        infos = filesystem.get_file_info(pafs.FileSelector(folder.rstrip("/"), recursive=True))
    except (FileNotFoundError, OSError) as err:
        raise ConfigError(f"{key}: cannot list {folder}: {err}") from None
    return [i.path for i in infos if i.type == pafs.FileType.File and not is_hidden(i.path, folder)]


Read = tuple[str | None, tuple[int, ...] | None]  # a file (None: a registered dataset), its row groups in order


def pass_reads(source: Source, stage: StageConfig, key: tuple[int, int, int] | None) -> list[Read]:
    """The reads of one pass over ``source`` in their order: each file, with a prepared shard's row groups in the
    order they are read (None: as stored). The pass's ``key`` (stage seed, source index, pass number) seeds a
    permutation of the files and then, shard by shard, one of each prepared shard's row groups: a different order
    every pass, the same on every rerun, resume and world size. With ``shuffle_files: false``, or no key (a dataset
    read as it is, not a training pass), the listed order."""
    if not source.files:
        return [(None, None)]
    if not stage.shuffle_files or key is None:
        return [(file, None) for file in source.files]
    generator = np.random.default_rng(list(key))
    files = generator.permutation(len(source.files))
    shards = source.manifest.shards if source.manifest else None
    return [
        (source.files[i], tuple(generator.permutation(len(shards[i].row_groups)).tolist()) if shards else None)
        for i in files
    ]


def read_tables(source: Source, file: str | None, stage: StageConfig, data_dir) -> Iterator[pa.Table]:
    """One file of the source (``file``; None: the registered dataset), as tables of the objective's examples (a
    prepared source's shards are read by row group instead: ``read_prepared_groups``)."""
    if file is None:
        yield from (columns.to_arrow() for columns in read_registered(source, stage, data_dir))
    elif file.lower().endswith(".parquet"):
        yield from _parquet_tables(file, source, stage)
    elif "://" in file:  # a csv/tsv/jsonl object: its reader checks lines, so it reads a local copy
        with _local_copy(file) as path:
            yield from _file_tables(path, file, source, stage)
    else:
        yield from _file_tables(file, file, source, stage)


def read_registered(source: Source, stage: StageConfig, data_dir) -> Iterator[TextColumns]:
    """A registered dataset's examples for the objective, read without pyarrow (``data.readers``)."""
    records = load_records(source.spec, source.split, data_dir, errors=stage.errors)
    return record_columns(records, stage, source.spec)


def _file_tables(path: str, name: str, source: Source, stage: StageConfig) -> Iterator[pa.Table]:
    loss = _objective(stage)
    score_range = (0.0, stage.score_max) if loss.label_field == "score" else None
    try:
        kind, columns = loss.user_file_kind, source.columns or {}
        if loss.in_batch_negatives and columns.get("negative", "negative") not in user_file_columns(path):
            kind = "pair"  # (anchor, positive) pairs: the batch's other positives are the negatives
        records = read_user_file(path, kind, columns, errors=stage.errors, score_range=score_range)
    except DataError as err:
        raise DataError(str(err).replace(path, name, 1)) from None
    yield from (columns.to_arrow() for columns in record_columns(records, stage, name))


@dataclass(frozen=True)
class TextColumns:
    """Examples as plain columns: ``texts[k]`` the k-th text of every row (``text_<k>`` of a table), and the
    labels (class indices, or scores divided by the stage's ``score_max``) or None."""

    texts: list[list[str]]
    labels: np.ndarray | None

    @property
    def num_rows(self) -> int:
        return len(self.texts[0])

    def slice(self, offset: int, length: int) -> TextColumns:
        """Rows ``offset`` to ``offset + length``, as ``pa.Table.slice``."""
        end = offset + length
        labels = None if self.labels is None else self.labels[offset:end]
        return TextColumns([column[offset:end] for column in self.texts], labels)

    def to_arrow(self) -> pa.Table:
        import pyarrow as pa

        table = {f"text_{k}": pa.array(column, pa.string()) for k, column in enumerate(self.texts)}
        return pa.table(table if self.labels is None else {**table, "label": pa.array(self.labels)})


def record_columns(records: Records, stage: StageConfig, where: str) -> Iterator[TextColumns]:
    """Records as columns of the examples the stage's objective trains on, ``ROWS_PER_TABLE`` rows at a time
    (``where`` names them in errors)."""
    loss = _objective(stage)
    if loss.label_field in TEACHER_COLUMNS:
        raise DataError(f"{where}: {_teacher_only_in_parquet(stage)}")
    wrong = next((r for r in records if not isinstance(r, loss.record_types)), None)
    if wrong is not None:
        names = ", ".join(t.__name__ for t in loss.record_types)
        raise DataError(f"{where} gives {type(wrong).__name__} records; objective {stage.objective!r} needs {names}")
    kept = (r for r in records if loss.keeps(r))
    while chunk := list(itertools.islice(kept, ROWS_PER_TABLE)):
        yield _records_columns(chunk, stage, where)


def _records_columns(records: list[Record], stage: StageConfig, where: str) -> TextColumns:
    texts = [[getattr(r, name) for r in records] for name in TEXT_FIELDS[type(records[0])]]
    label_field = _objective(stage).label_field
    if label_field == "label":
        return TextColumns(texts, np.array([r.label for r in records], dtype=np.int64))
    if label_field == "score":
        scores = np.array([r.score for r in records], dtype=np.float32) / stage.score_max
        if scores.min() < 0 or scores.max() > 1:
            raise DataError(f"{where}: scores outside [0, score_max={stage.score_max}]")
        return TextColumns(texts, scores)
    return TextColumns(texts, None)


def _parquet_tables(file: str, source: Source, stage: StageConfig) -> Iterator[pa.Table]:
    """A parquet file by row group, as ``_parquet_columns`` names its columns."""
    import pyarrow as pa

    parquet = _parquet_file(file, source.key)
    texts, labels = _parquet_columns(parquet, file, source, stage)
    first_row = 0
    batches = parquet.iter_batches(batch_size=ROWS_PER_TABLE, columns=[*texts, *labels])
    while (batch := _next_batch(batches, file)) is not None:
        table = {f"text_{i}": _texts(batch.column(name), file, name, first_row) for i, name in enumerate(texts)}
        if _objective(stage).label_field == "scores":
            table["label"] = _teacher_scores(batch, labels, file, first_row)
        elif _objective(stage).label_field == "vector":
            table["label"] = _teacher_vectors(batch.column(labels[0]), file, labels[0], first_row)
        elif labels:
            table["label"] = _labels(batch.column(labels[0]), file, labels[0], first_row, stage)
        first_row += batch.num_rows
        yield pa.table(table)


def read_prepared_groups(source: Source, file: str, groups: list[int]) -> pa.Table:
    """Row groups ``groups`` of a prepared shard, as they are, in that order (a corrupt one is a DataError naming
    the file)."""
    import pyarrow as pa

    parquet = _parquet_file(file, source.key)
    with _unreadable_parquet(file):
        return pa.concat_tables([parquet.read_row_group(group) for group in groups])


def _next_batch(batches: Iterator[pa.RecordBatch], file: str) -> pa.RecordBatch | None:
    """The next batch of a parquet file (None at its end); a corrupt page is a DataError naming the file."""
    with _unreadable_parquet(file):
        return next(batches, None)


class _FolderFilesystems:
    """One pyarrow filesystem per folder for many files of a source: building one for each file is ~18 ms of CPU
    (an S3 client each), most of a 2,000-shard preflight on object storage."""

    def __init__(self, key: str) -> None:
        self.key, self.folders = key, {}

    def __call__(self, file: str) -> tuple[pafs.FileSystem, str]:
        folder, name = file.rsplit("/", 1)
        if folder not in self.folders:  # two threads may both build it: the same filesystem either way
            self.folders[folder] = _filesystem(folder, self.key)
        filesystem, path = self.folders[folder]
        return filesystem, f"{path}/{name}"


def _parquet_file(file: str, key: str, filesystems: _FolderFilesystems | None = None) -> pq.ParquetFile:
    """The file opened and its footer read; a corrupt, truncated or empty file is a DataError naming it."""
    import pyarrow.parquet as pq

    filesystem, path = filesystems(file) if filesystems else _filesystem(file, key)
    with _unreadable_parquet(file):
        return pq.ParquetFile(filesystem.open_input_file(path))


@contextlib.contextmanager
def _unreadable_parquet(file: str) -> Iterator[None]:
    """pyarrow's errors about a file's bytes (its message names no file) as a DataError naming ``file``."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"{file}: not a readable parquet file ({reason})") from None


def _parquet_columns(parquet: pq.ParquetFile, file: str, source: Source, stage: StageConfig) -> tuple[list, list]:
    """The file's text columns in the objective's order and its label columns: columns named as a user file's
    (``columns`` maps field -> column); for in-batch-negative and teacher-score objectives every ``negative_<n>``
    column is a further hard negative (mined n-tuples); for a teacher's embeddings a ``translation`` column, where
    there is one, is a second text. Label columns: none, the label's (a teacher's embeddings: ``vector``), or a
    teacher's scores, ``score_<field>`` for each text after the anchor (``score_positive``,
    ``score_negative[_<n>]``)."""
    loss = _objective(stage)
    record_type = RECORD_TYPES[loss.user_file_kind]
    names = parquet.schema_arrow.names
    mapping = source.columns or {}
    fields = list(TEXT_FIELDS[record_type])
    if record_type.__name__ == "Triplet" and "negative" not in mapping and "negative" not in names:
        fields = fields[:2] + sorted((n for n in names if n.startswith("negative_")), key=lambda n: int(n[9:]))
    if record_type.__name__ == "Sentence" and mapping.get("translation", "translation") in names:
        fields.append("translation")
    texts = [mapping.get(f, f) for f in fields]
    if loss.label_field == "scores":
        labels = [mapping.get(f"score_{f}", f"score_{f}") for f in fields[1:]]
    else:
        labels = [mapping.get(loss.label_field, loss.label_field)] if loss.label_field else []
    missing = [c for c in [*texts, *labels] if c not in names]
    if missing or len(texts) < min(2, len(TEXT_FIELDS[record_type])):  # a triplet without negatives
        raise DataError(f"{file}: no column {missing[0] if missing else 'negative_1'!r} (its columns: {names})")
    return texts, labels


def _checked_footer(file: str, source: Source, stage: StageConfig, filesystems: _FolderFilesystems) -> int:
    """The file's rows, from its footer, after what the footer can tell about them: the columns the objective
    needs are there and, where row groups carry statistics, no text is missing (the first such row is named)."""
    parquet = _parquet_file(file, source.key, filesystems)
    texts, _ = _parquet_columns(parquet, file, source, stage)
    metadata, first_row = parquet.metadata, 0
    positions = {metadata.schema.column(j).path: j for j in range(metadata.num_columns)}
    for group in range(metadata.num_row_groups):
        for name in texts:
            if _may_hold_blanks(metadata.row_group(group).column(positions[name]).statistics):
                with _unreadable_parquet(file):
                    column = parquet.read_row_group(group, columns=[name]).column(0)
                _texts(column, file, name, first_row)
        first_row += metadata.row_group(group).num_rows
    return metadata.num_rows


def _may_hold_blanks(statistics) -> bool:
    """Whether a row group's statistics of a text column leave room for a missing or blank text: nulls counted,
    or a least value that is empty or starts with white space (blank texts sort first). No statistics: the
    rows are checked as they are read."""
    if statistics is None:
        return False
    if statistics.has_null_count and statistics.null_count:
        return True
    if not statistics.has_min_max:
        return False
    least = statistics.min
    least = least.decode(errors="replace") if isinstance(least, bytes) else str(least)
    return not least or least[:1].isspace()


def _texts(column: pa.Array, file: str, name: str, first_row: int) -> pa.Array:
    """The column as text; a missing or blank text is refused as a user file's is, naming its row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = column.cast(pa.string())
    blank = pc.fill_null(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(column)), 0), True)
    if pc.any(blank).as_py():
        row = first_row + int(np.flatnonzero(blank.to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{file}, row {row + 1}: column {name!r} is empty")
    return column


def _labels(column: pa.Array, file: str, name: str, first_row: int, stage: StageConfig) -> pa.Array:
    """Class labels by NLI name or index; scores as numbers in [0, score_max], divided by it."""
    import pyarrow as pa

    label_field = _objective(stage).label_field
    values = column.to_pylist()
    try:
        for i, value in enumerate(values):
            if label_field == "label":
                values[i] = int(lookup(value, NLI_LABEL_IDS, name))
            else:
                values[i] = parse_score(value, name)
                if not 0 <= values[i] <= stage.score_max:
                    raise ValueError(f"{name} {values[i]:g} is outside [0, score_max={stage.score_max}]")
    except ValueError as err:
        raise DataError(f"{file}, row {first_row + i + 1}: {err}") from None
    if label_field == "label":
        return pa.array(values, pa.int64())
    return pa.array(np.asarray(values, dtype=np.float32) / stage.score_max)


def _teacher_scores(batch: pa.RecordBatch, columns: list[str], file: str, first_row: int) -> pa.Array:
    """A teacher's scores of each row's texts after the anchor, as one list of float32 per row (the label); a
    missing or non-finite score is refused, naming its row."""
    import pyarrow as pa

    scores = np.stack([batch.column(name).cast(pa.float64()).fill_null(np.nan).to_numpy() for name in columns], 1)
    bad = ~np.isfinite(scores)
    if bad.any():
        row, column = np.argwhere(bad)[0]
        raise DataError(f"{file}, row {first_row + row + 1}: column {columns[column]!r} is not a finite number")
    return pa.FixedSizeListArray.from_arrays(pa.array(scores.astype(np.float32).ravel()), len(columns))


def _teacher_vectors(column: pa.Array, file: str, name: str, first_row: int) -> pa.Array:
    """A teacher's embedding per row (a list column), as one list of float32 per row, all of one length (the label);
    a missing, differently sized or non-finite embedding is refused, naming its row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        raise DataError(f"{file}: column {name!r} holds {kind}, not lists of numbers (embeddings)")
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False)
    wrong = (lengths != lengths[0]) | (lengths == 0)
    if wrong.any():
        row = int(np.flatnonzero(wrong)[0])
        raise DataError(
            f"{file}, row {first_row + row + 1}: column {name!r} holds {_length(lengths[row])}, the file's row "
            f"{first_row + 1} {_length(lengths[0])}"
        )
    values = pc.list_flatten(column).cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
    bad = ~np.isfinite(values)
    if bad.any():
        row = int(np.flatnonzero(bad)[0]) // int(lengths[0])
        raise DataError(f"{file}, row {first_row + row + 1}: column {name!r} holds a value that is not a finite number")
    return pa.FixedSizeListArray.from_arrays(pa.array(values.astype(np.float32)), int(lengths[0]))


def _length(length: int) -> str:
    return "no embedding" if length == 0 else f"{length} values"


def teacher_dimension(source: Source, stage: StageConfig) -> int | None:
    """The size of the teacher's embeddings of an objective that trains on them (None for others, and for a
    registered dataset, which holds none): the length of the first row's ``vector`` in the source's first file,
    read before the cluster so that a teacher of another size than the model is refused then."""
    import pyarrow as pa

    if _objective(stage).label_field != "vector" or not source.files:
        return None
    file = source.files[0]
    if source.manifest is not None:  # the label column holds the vectors, all of one size (prepare read them)
        return _parquet_file(file, source.key).schema_arrow.field("label").type.list_size
    if not file.lower().endswith(".parquet"):
        raise DataError(f"{file}: {_teacher_only_in_parquet(stage)}")
    parquet = _parquet_file(file, source.key)
    _, (name,) = _parquet_columns(parquet, file, source, stage)
    kind = parquet.schema_arrow.field(name).type
    if pa.types.is_fixed_size_list(kind):
        return kind.list_size
    first = _next_batch(parquet.iter_batches(batch_size=1, columns=[name]), file)
    if first is None or first.num_rows == 0:
        raise DataError(f"{file}: no rows")
    return len(_teacher_vectors(first.column(0), file, name, 0)[0])


# What an objective that trains on a teacher's output reads from parquet files, by its label field.
TEACHER_COLUMNS = {
    "scores": "a teacher's scores, read from parquet files with columns score_positive and score_negative (or "
    "score_negative_1..n, one per negative_<n>)",
    "vector": "a teacher's embeddings, read from parquet files with a column text and the teacher's vector of it "
    "in a column vector (as sbert-ray encode writes them)",
}


def _teacher_only_in_parquet(stage: StageConfig) -> str:
    return f"objective {stage.objective!r} trains on {TEACHER_COLUMNS[_objective(stage).label_field]}"


class _local_copy:
    """A remote object copied to a local temporary file for the duration of a ``with``."""

    def __init__(self, uri: str):
        self.uri = uri

    def __enter__(self) -> str:
        import pyarrow.fs as pafs

        filesystem, path = pafs.FileSystem.from_uri(self.uri)
        handle, self.path = tempfile.mkstemp(suffix=Path(path).suffix)
        with os.fdopen(handle, "wb") as out, filesystem.open_input_stream(path) as stream:
            while chunk := stream.read(1 << 22):
                out.write(chunk)
        return self.path

    def __exit__(self, *exc) -> None:
        os.unlink(self.path)


def known_rows(source: Source, stage: StageConfig, data_dir) -> int | None:
    """The source's examples without the cluster: a registered dataset (small, local or from the Hub) read here,
    which also checks that its records suit the objective; user files from parquet footers when that is exact
    (parquet, an objective that keeps every row, no row skipped on errors), which also checks what footers tell
    (``_checked_footer``). None: only reading every row tells. A teacher's scores come from parquet files only, so
    an objective that trains on them refuses any other file here (so do those on a teacher's embeddings)."""
    if not source.files:
        return sum(columns.num_rows for columns in read_registered(source, stage, data_dir))
    if source.manifest is not None:
        return source.manifest.rows
    not_parquet = next((f for f in source.files if not f.lower().endswith(".parquet")), None)
    if _objective(stage).label_field in TEACHER_COLUMNS and not_parquet:
        raise DataError(f"{not_parquet}: {_teacher_only_in_parquet(stage)}")
    keeps_all = _objective(stage).keeps_every_record() and stage.errors == "raise"
    if not keeps_all or not_parquet:
        return None
    # Read at once (each footer is a small read or two, waiting on object storage's latency); summed in file order,
    # so a bad file is named as when read one after another.
    filesystems = _FolderFilesystems(source.key)
    with ThreadPoolExecutor(min(FOOTER_READERS, len(source.files))) as readers:
        footer = functools.partial(_checked_footer, source=source, stage=stage, filesystems=filesystems)
        return sum(readers.map(footer, source.files))


def reading(stage: StageConfig) -> dict:
    """How a source's rows become examples for the stage's objective: what a prepared source was read with, and a
    run that trains on it must read alike (its examples, texts and labels would differ otherwise). The input's
    column names are the prepared source's own (its manifest's ``input_columns``)."""
    loss = _objective(stage)
    return {
        "records": loss.user_file_kind,
        "label": loss.label_field,
        "keeps": "every record" if loss.keeps_every_record() else f"{stage.objective}'s",
        "score_max": stage.score_max if loss.label_field == "score" else None,
        "errors": stage.errors,
    }


def column_roles(stage: StageConfig, width: int) -> dict[str, str]:
    """``ids_<k>`` -> the input field whose texts it holds, for a source read with ``width`` text columns."""
    fields = list(TEXT_FIELDS[RECORD_TYPES[_objective(stage).user_file_kind]])
    if width > len(fields) and fields == ["text"]:  # a text's translation beside it
        fields.append("translation")
    elif width > len(fields):  # mined n-tuples: negative_1 .. negative_n
        fields = fields[:2] + [f"negative_{n}" for n in range(1, width - 1)]
    return {f"ids_{k}": fields[k] for k in range(width)}


def check_prepared(
    sources: list[Source], stage: StageConfig, tokenizer, max_seq_length: int, prompts: dict, joins_pairs: bool
) -> None:
    """Each prepared source was made with the run's tokenizer, ``max_seq_length``, prompts, tokenising of pairs
    (``joins_pairs``: the run's model is a reranker) and reading of the stage, or a ConfigError naming the source's
    key and every difference."""
    for source in sources:
        if source.manifest is None:
            continue
        settings = prepared_settings(tokenizer, max_seq_length, prompts, reading(stage), joins_pairs)
        found = differences(source.manifest, settings)
        if found:
            raise ConfigError(
                f"{source.key}: {source.spec} was prepared for another run: {'; '.join(found)}; prepare it again "
                "with this run's settings (sbert-ray prepare), or train on the raw source"
            )


def _objective(stage: StageConfig) -> type[EncoderLoss]:
    """The stage's loss class, which declares the records it trains on. Imported here, not with this module: Ray
    Train's controller and Ray Data's coordinators import this module to unpickle the stage datasets (their sources)
    and read nothing, so they need no torch."""
    from sbert_ray.losses.registry import OBJECTIVES

    return OBJECTIVES[stage.objective]
