"""A corpus to embed: the rows of one text, CSV, TSV, JSONL or parquet file, numbered as they are read, or the
distinct sentences of a registered dataset.

A row's ``id`` is its 0-based position in the input: for a text file its non-blank lines (one sentence each; blank
lines are not rows, as everywhere in this project), for CSV/TSV the records after the header line, for JSONL the
non-blank lines, for parquet the rows, for a dataset its distinct sentences in first-seen order. Files are read as
a stream of pyarrow tables (id, text), so a corpus of any size is never held in memory at once. ``open_corpus``
checks what can be checked cheaply (the file is there and readable, has the column and a first row) before any
work; a bad row further on is a ``DataError`` naming the file and line (or row) when the stream reaches it.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq

from sbert_ray.data.readers import check_available, load_records
from sbert_ray.data.records import TEXT_FIELDS, DataError

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".parquet")
CORPUS_SUFFIXES = (".txt", *TABLE_SUFFIXES)
DEFAULT_COLUMN = "text"
SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string())])


@dataclasses.dataclass(frozen=True)
class CorpusFile:
    path: Path
    column: str | None  # the text column of a table; None for a text file

    def rows(self) -> Iterator[tuple[int, str]]:
        """(id, text) of every row, in file order."""
        suffix = self.path.suffix.lower()
        if suffix == ".txt":
            texts = (text for _, text in _lines(self.path) if text.strip())
        elif suffix == ".jsonl":
            lines = (numbered for numbered in _lines(self.path) if numbered[1].strip())
            texts = (_json_text(self.path, number, line, self.column) for number, line in lines)
        elif suffix == ".parquet":
            texts = _parquet_texts(self.path, self.column)
        else:
            texts = _table_texts(self.path, self.column)
        return enumerate(texts)

    def tables(self, rows_per_table: int) -> Iterator[pa.Table]:
        return _tables(self.rows(), rows_per_table)


@dataclasses.dataclass(frozen=True)
class CorpusDataset:
    name: str
    split: str
    data_dir: str | None

    def sentences(self) -> list[str]:
        """Every distinct text field of the split's records, in first-seen order."""
        records = load_records(self.name, self.split, self.data_dir)
        fields = TEXT_FIELDS[type(records[0])] if records else ()
        return list(dict.fromkeys(getattr(record, field) for record in records for field in fields))

    def tables(self, rows_per_table: int) -> Iterator[pa.Table]:
        return _tables(enumerate(self.sentences()), rows_per_table)


Corpus = CorpusFile | CorpusDataset


def open_corpus(spec: str, column: str | None = None, data_dir: str | os.PathLike | None = None) -> Corpus:
    """``spec`` is a file (by its suffix, or because it exists) or a registered dataset ``name[:split]`` (split
    "test" by default). Checked here, before any work: a DataError names the file (or dataset) and what is wrong."""
    path = Path(spec).expanduser()
    if path.suffix.lower() in CORPUS_SUFFIXES or path.exists():
        return _check_file(path.resolve(), column)
    if column is not None:
        raise DataError(f"{spec}: --column applies to table files ({', '.join(TABLE_SUFFIXES)}), not datasets")
    name, _, split = spec.partition(":")
    corpus = CorpusDataset(name, split or "test", str(data_dir) if data_dir else None)
    check_available(corpus.name, corpus.split, data_dir)
    return corpus


def _check_file(path: Path, column: str | None) -> CorpusFile:
    suffix = path.suffix.lower()
    if suffix not in CORPUS_SUFFIXES:
        raise DataError(f"{path}: unsupported file type {suffix!r} (use {', '.join(CORPUS_SUFFIXES)})")
    if suffix == ".txt" and column is not None:
        raise DataError(f"{path}: a text file has one sentence per line and no columns; --column is for tables")
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        raise DataError(f"{path}: is a directory, not a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror})") from None
    corpus = CorpusFile(path, None if suffix == ".txt" else column or DEFAULT_COLUMN)
    if next(corpus.rows(), None) is None:  # reads up to the first row only
        raise DataError(f"{path}: no rows to embed (an empty file, a header only, or blank lines only)")
    return corpus


def _tables(rows: Iterable[tuple[int, str]], rows_per_table: int) -> Iterator[pa.Table]:
    rows = iter(rows)
    while chunk := list(itertools.islice(rows, rows_per_table)):
        ids, texts = zip(*chunk, strict=True)
        yield pa.table([pa.array(ids, pa.int64()), pa.array(texts, pa.string())], schema=SCHEMA)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without its LF or CRLF) of a UTF-8 file; a byte that is not UTF-8 names its line."""
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}, line {number}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            yield number, line.removesuffix("\n").removesuffix("\r")


def _json_text(path: Path, number: int, line: str, column: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}, line {number}: invalid JSON ({err.msg})") from None
    if not isinstance(row, dict) or column not in row:
        found = f"keys {sorted(row)}" if isinstance(row, dict) else f"a JSON {type(row).__name__}"
        raise DataError(f"{path}, line {number}: no {column!r} field ({found})")
    if not isinstance(row[column], str):
        raise DataError(f"{path}, line {number}: {column!r} is {type(row[column]).__name__}, not text")
    return row[column]


def _table_texts(path: Path, column: str) -> Iterator[str]:
    """The column of a CSV (RFC-4180 quoting, values may span lines) or TSV (TAB, no quoting) file, streamed."""
    tsv = path.suffix.lower() == ".tsv"
    parse = (
        pa_csv.ParseOptions(delimiter="\t", quote_char=False) if tsv else pa_csv.ParseOptions(newlines_in_values=True)
    )
    convert = pa_csv.ConvertOptions(include_columns=[column], column_types={column: pa.string()})
    try:
        with open(path, encoding="utf-8-sig", newline="") as file:
            header = next(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE) if tsv else csv.reader(file), [])
    except UnicodeDecodeError:
        raise DataError(f"{path}, line 1: not UTF-8 text") from None
    if not header:
        return
    if column not in header:
        raise DataError(f"{path}, line 1: no column {column!r} (columns: {header})")
    try:
        for batch in pa_csv.open_csv(path, parse_options=parse, convert_options=convert):
            yield from batch.column(0).to_pylist()
    except pa.ArrowInvalid as err:  # a row with the wrong number of fields, text that is not UTF-8
        raise DataError(f"{path}: {err}") from None


def _parquet_texts(path: Path, column: str) -> Iterator[str]:
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    schema = file.schema_arrow
    if column not in schema.names:
        raise DataError(f"{path}: no column {column!r} (columns: {schema.names})")
    if not pa.types.is_string(schema.field(column).type) and not pa.types.is_large_string(schema.field(column).type):
        raise DataError(f"{path}: column {column!r} holds {schema.field(column).type}, not text")
    row = 0
    for batch in file.iter_batches(columns=[column]):
        texts = batch.column(0)
        if texts.null_count:
            first = texts.is_null().to_pylist().index(True)
            raise DataError(f"{path}, row {row + first}: {column!r} is null, not text")
        yield from texts.to_pylist()
        row += len(texts)
