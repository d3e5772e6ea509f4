"""A corpus to embed: the rows of text, CSV, TSV, JSONL or parquet files (one file, a folder or glob of shards, on
local disk or object storage such as ``s3://``), or the distinct sentences of a registered dataset.

A row is identified by its file's ``key`` (its path under the folder, prefix or glob it was found in; a single
file's own name; ``NAME-SPLIT`` for a dataset) and its ``id``, the 0-based position in that file: for a text file
its non-blank lines (one sentence each; blank lines are not rows, as everywhere in this project), for CSV/TSV the
records after the header line, for JSONL the non-blank lines, for parquet the rows, for a dataset its distinct
sentences in first-seen order. Files are read as streams of pyarrow tables (id, text), so a corpus of any size is
never held in memory at once. ``open_corpus`` checks what can be checked cheaply (every file is there and
readable, has the column and a first row) before any work; a bad row further on is a ``DataError`` naming the file
and line (or row) when the stream reaches it.
"""

from __future__ import annotations

import csv
import dataclasses
import fnmatch
import io
import itertools
import json
import os
import posixpath
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json
import pyarrow.parquet as pq
from pyarrow import fs

from sbert_ray.data.listing import is_hidden
from sbert_ray.data.readers import check_available, load_records
from sbert_ray.data.records import TEXT_FIELDS, DataError

TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".parquet")
TABLE_CHARACTERS = 32 * 2**20  # text per table read from a file: 32 Mi characters, ~32-128 MB of UTF-8
CORPUS_SUFFIXES = (".txt", *TABLE_SUFFIXES)
DEFAULT_COLUMN = "text"
SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string())])
GLOB_CHARACTERS = "*?["


@dataclasses.dataclass(frozen=True)
class CorpusFile:
    uri: str  # a local absolute path or an object storage URI (s3://bucket/key)
    key: str  # its path under the folder, prefix or glob it was found in: names its output
    column: str | None  # the text column of a table; None for a text file

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.uri)[1].lower()

    def rows(self) -> Iterator[tuple[int, str]]:
        """(id, text) of every row, in file order."""
        if self.suffix == ".txt":
            texts = (text for _, text in _lines(self.uri) if text.strip())
        elif self.suffix == ".jsonl":
            lines = (numbered for numbered in _lines(self.uri) if numbered[1].strip())
            texts = (_json_text(self.uri, number, line, self.column) for number, line in lines)
        elif self.suffix == ".parquet":
            texts = _parquet_texts(self.uri, self.column)
        else:
            texts = _table_texts(self.uri, self.column)
        return enumerate(texts)

    def tables(self, rows_per_table: int) -> Iterator[pa.Table]:
        return _tables(self.rows(), rows_per_table)

    def whole_rows(self, rows_per_table: int, row_column: str) -> Iterator[pa.Table]:
        """Every column of a table file's rows, ``rows_per_table`` at a time, each row's ``id`` first in
        ``row_column``; the text column as text, a null naming its row (``encode --keep-columns``)."""
        row = 0
        for table in table_rows(self.uri, rows_per_table):
            table = checked_text_column(table, self.column, self.uri, row)
            table = table.add_column(0, row_column, pa.array(range(row, row + table.num_rows), pa.int64()))
            row += table.num_rows
            yield table


@dataclasses.dataclass(frozen=True)
class CorpusDataset:
    name: str
    split: str
    data_dir: str | None

    @property
    def key(self) -> str:
        return f"{self.name}-{self.split}"

    def sentences(self) -> list[str]:
        """Every distinct text field of the split's records, in first-seen order."""
        records = load_records(self.name, self.split, self.data_dir)
        fields = TEXT_FIELDS[type(records[0])] if records else ()
        return list(dict.fromkeys(getattr(record, field) for record in records for field in fields))

    def tables(self, rows_per_table: int) -> Iterator[pa.Table]:
        return _tables(enumerate(self.sentences()), rows_per_table)


CorpusSource = CorpusFile | CorpusDataset


def open_corpus(spec: str, column: str | None = None, data_dir: str | os.PathLike | None = None) -> list[CorpusSource]:
    """The sources of ``spec``: a file (by its suffix, or because it exists), a folder or object storage prefix (every
    corpus file under it), a glob of files (``shards/*.jsonl``, ``s3://bucket/corpus/part-*.parquet``), or a
    registered dataset ``name[:split]`` (split "test" by default). Checked here, before any work: a DataError names
    the file (or dataset) and what is wrong."""
    if "://" in spec or any(c in spec for c in GLOB_CHARACTERS) or _is_local_file_or_folder(spec):
        return [_check_file(file) for file in corpus_files(spec, column)]
    if column is not None:
        raise DataError(f"{spec}: --column applies to table files ({', '.join(TABLE_SUFFIXES)}), not datasets")
    name, _, split = spec.partition(":")
    corpus = CorpusDataset(name, split or "test", str(data_dir) if data_dir else None)
    check_available(corpus.name, corpus.split, data_dir)
    return [corpus]


def _is_local_file_or_folder(spec: str) -> bool:
    path = Path(spec).expanduser()
    return path.suffix.lower() in CORPUS_SUFFIXES or path.exists()


def corpus_files(spec: str, column: str | None, suffixes: tuple[str, ...] | None = None) -> list[CorpusFile]:
    """Every file ``spec`` names, sorted, keyed by its path under the folder, prefix or glob's fixed part; with
    ``suffixes``, only those of a folder or glob that end so (others are no data: a manifest beside the shards)."""
    uri = spec if "://" in spec else str(Path(spec).expanduser().resolve())
    filesystem, path = file_system(uri)
    scheme = uri[: uri.index("://") + 3] if "://" in uri else ""
    wildcard = next((i for i, c in enumerate(path) if c in GLOB_CHARACTERS), None)
    base = path if wildcard is None else posixpath.dirname(path[:wildcard])
    try:
        info = filesystem.get_file_info(base)
        if wildcard is None and info.type != fs.FileType.Directory:  # one file: checked as such (or not there)
            return [CorpusFile(uri, posixpath.basename(path), _file_column(uri, column))]
        if info.type != fs.FileType.Directory:
            raise DataError(f"{spec}: no such folder {scheme}{base}")
        listed = filesystem.get_file_info(fs.FileSelector(base, recursive=True))
    except OSError as err:
        raise DataError(f"{spec}: cannot be listed ({err})") from None
    found = sorted(
        entry.path
        for entry in listed
        if entry.type == fs.FileType.File
        and (wildcard is None or fnmatch.fnmatchcase(entry.path, path))
        and not is_hidden(entry.path, base)
        and (suffixes is None or posixpath.splitext(entry.path)[1].lower() in suffixes)
    )
    if not found:
        raise DataError(f"{spec}: no files found")
    files = [CorpusFile(f"{scheme}{found_path}", posixpath.relpath(found_path, base), None) for found_path in found]
    return [dataclasses.replace(file, column=_file_column(file.uri, column)) for file in files]


def _file_column(uri: str, column: str | None) -> str | None:
    suffix = posixpath.splitext(uri)[1].lower()
    if suffix not in CORPUS_SUFFIXES:
        raise DataError(f"{uri}: unsupported file type {suffix!r} (use {', '.join(CORPUS_SUFFIXES)})")
    if suffix == ".txt" and column is not None:
        raise DataError(f"{uri}: a text file has one sentence per line and no columns; --column is for tables")
    return None if suffix == ".txt" else column or DEFAULT_COLUMN


def _check_file(corpus: CorpusFile) -> CorpusFile:
    filesystem, path = file_system(corpus.uri)
    info = filesystem.get_file_info(path)
    if info.type == fs.FileType.NotFound:
        raise DataError(f"{corpus.uri}: no such file")
    try:
        with open_binary(corpus.uri):
            pass
    except OSError as err:
        raise DataError(f"{corpus.uri}: cannot be read ({err.strerror or err})") from None
    if next(corpus.rows(), None) is None:  # reads up to the first row only
        raise DataError(f"{corpus.uri}: no rows to embed (an empty file, a header only, or blank lines only)")
    return corpus


def file_system(uri: str) -> tuple[fs.FileSystem, str]:
    if "://" not in uri:
        return fs.LocalFileSystem(), uri
    try:
        return fs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as err:
        raise DataError(f"{uri}: pyarrow cannot open it ({err})") from None


@contextmanager
def open_binary(uri: str) -> Iterator[BinaryIO]:
    """A buffered binary stream of the file (local or object storage)."""
    filesystem, path = file_system(uri)
    with filesystem.open_input_stream(path) as stream:
        yield io.BufferedReader(stream)


def _tables(rows: Iterable[tuple[int, str]], rows_per_table: int) -> Iterator[pa.Table]:
    rows = iter(rows)
    while chunk := list(_next_rows(rows, rows_per_table)):
        ids, texts = zip(*chunk, strict=True)
        yield pa.table([pa.array(ids, pa.int64()), pa.array(texts, pa.string())], schema=SCHEMA)


def _next_rows(rows: Iterator[tuple[int, str]], most: int) -> Iterator[tuple[int, str]]:
    """The next ``most`` rows, fewer where their texts reach ``TABLE_CHARACTERS``: a table of long texts holds no
    more than that (and one text) whatever its row count (``sbert-ray mine`` reads a local corpus on the driver)."""
    characters = 0
    for count, (row, text) in enumerate(rows, start=1):
        yield row, text
        characters += len(text)
        if count == most or characters >= TABLE_CHARACTERS:
            return


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text without its LF or CRLF) of a UTF-8 file; a byte that is not UTF-8 names its line."""
    with open_binary(path) as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}, line {number}: not UTF-8 text ({err.reason} at byte {err.start})") from None
            yield number, line.removesuffix("\n").removesuffix("\r")


def _json_text(path: str, number: int, line: str, column: str) -> str:
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


def _table_texts(path: str, column: str) -> Iterator[str]:
    """The column of a CSV (RFC-4180 quoting, values may span lines) or TSV (TAB, no quoting) file, streamed."""
    header = csv_header(path)
    if not header:
        return
    if column not in header:
        raise DataError(f"{path}, line 1: no column {column!r} (columns: {header})")
    convert = pa_csv.ConvertOptions(include_columns=[column], column_types={column: pa.string()})
    for batch in csv_batches(path, convert):
        yield from batch.column(0).to_pylist()


def csv_header(path: str) -> list[str]:
    """The column names on the first line of a CSV or TSV file ([] for an empty file)."""
    try:
        with open_binary(path) as stream, io.TextIOWrapper(stream, encoding="utf-8-sig", newline="") as file:
            return next(
                csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE) if _tsv(path) else csv.reader(file), []
            )
    except UnicodeDecodeError:
        raise DataError(f"{path}, line 1: not UTF-8 text") from None


def csv_batches(path: str, convert: pa_csv.ConvertOptions) -> Iterator[pa.RecordBatch]:
    """The records of a CSV (RFC-4180 quoting, values may span lines) or TSV (TAB, no quoting) file, streamed."""
    parse = (
        pa_csv.ParseOptions(delimiter="\t", quote_char=False)
        if _tsv(path)
        else pa_csv.ParseOptions(newlines_in_values=True)
    )
    try:
        with open_binary(path) as stream:
            yield from pa_csv.open_csv(stream, parse_options=parse, convert_options=convert)
    except pa.ArrowInvalid as err:  # a row with the wrong number of fields, text that is not UTF-8
        raise DataError(f"{path}: {err}") from None


def _tsv(path: str) -> bool:
    return path.lower().endswith(".tsv")


def _parquet_texts(path: str, column: str) -> Iterator[str]:
    filesystem, fs_path = file_system(path)
    try:
        file = pq.ParquetFile(filesystem.open_input_file(fs_path))
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    schema = file.schema_arrow
    if column not in schema.names:
        raise DataError(f"{path}: no column {column!r} (columns: {schema.names})")
    if not pa.types.is_string(schema.field(column).type) and not pa.types.is_large_string(schema.field(column).type):
        raise DataError(f"{path}: column {column!r} holds {schema.field(column).type}, not text")
    # A row group at a time, 1,024 rows at a time: iter_batches over the whole file reads row groups ahead (a corpus
    # of 200 kB texts: 3x the peak memory), and its default of 65,536 rows is that many long texts at once.
    batches = (file.iter_batches(1024, row_groups=[group], columns=[column]) for group in range(file.num_row_groups))
    row = 0
    for batch in itertools.chain.from_iterable(batches):
        texts = batch.column(0)
        if texts.null_count:
            first = texts.is_null().to_pylist().index(True)
            raise DataError(f"{path}, row {row + first}: {column!r} is null, not text")
        yield from texts.to_pylist()
        row += len(texts)


def table_rows(uri: str, rows_per_table: int) -> Iterator[pa.Table]:
    """Every column of a CSV, TSV, JSONL or parquet file's rows, ``rows_per_table`` at a time (``sbert-ray score``
    and ``encode --keep-columns`` write them out beside what they add)."""
    suffix = posixpath.splitext(uri)[1].lower()
    if suffix == ".parquet":
        return _parquet_tables(uri, rows_per_table)
    if suffix == ".jsonl":
        return _rebatched(_json_tables(uri), rows_per_table)
    return _rebatched(_csv_tables(uri), rows_per_table)


def _parquet_tables(uri: str, rows_per_table: int) -> Iterator[pa.Table]:
    filesystem, path = file_system(uri)
    try:
        file = pq.ParquetFile(filesystem.open_input_file(path))
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{uri}: not a readable parquet file ({err})") from None
    for batch in file.iter_batches(batch_size=rows_per_table):
        yield pa.Table.from_batches([batch])


def _csv_tables(uri: str) -> Iterator[pa.Table]:
    """Every column, as text."""
    header = csv_header(uri)
    convert = pa_csv.ConvertOptions(column_types=dict.fromkeys(header, pa.string()))
    for batch in csv_batches(uri, convert) if header else ():
        yield pa.Table.from_batches([batch])


def _json_tables(uri: str) -> Iterator[pa.Table]:
    """JSON objects, one a line; the column types are those of the file's first block of lines."""
    try:
        with open_binary(uri) as stream:
            for batch in pa_json.open_json(stream):
                yield pa.Table.from_batches([batch])
    except pa.ArrowInvalid as err:  # not JSON, a value whose type differs from the first block's
        raise DataError(f"{uri}: {err}") from None


def _rebatched(tables: Iterator[pa.Table], rows_per_table: int) -> Iterator[pa.Table]:
    """The same rows, ``rows_per_table`` at a time (the last table may hold fewer)."""
    for table in tables:
        for start in itertools.count(0, rows_per_table):
            if start >= table.num_rows:
                break
            yield table.slice(start, rows_per_table)


def checked_text_column(table: pa.Table, column: str, uri: str, first_row: int) -> pa.Table:
    """``table`` with ``column`` as strings; a column that is not text, or a null in it, is refused naming its row."""
    values = table[column]
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise DataError(f"{uri}: column {column!r} holds {values.type}, not text")
    if values.null_count:
        row = values.is_null().to_pylist().index(True)
        raise DataError(f"{uri}, row {first_row + row + 1}: column {column!r} is null, not text")
    return table.set_column(table.schema.get_field_index(column), column, values.cast(pa.string()))
