"""Rows a teacher scores (``sbert-ray score``): (query, passage) pairs, or mined n-tuples (query, positive,
negative_1..negative_n, as ``sbert-ray mine`` writes them; ``negative`` for its triplets), in CSV, TSV, JSONL or
parquet files (one file, a folder or glob of shards, local or on object storage; listed as a corpus is, see
``sbert_ray.data.corpus``).

Every column of a file is kept (CSV/TSV values as text), so the output is the input rows plus the scores. Which
columns are scored (``ScoreLayout``) is read from the files' columns before any work, and must be the same in every
file; a file that cannot be read, lacks a column or has no rows is refused then, naming it. A null text further on
is a ``DataError`` naming the file and row when the stream reaches it.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyarrow import fs

from sbert_ray.data.corpus import TABLE_SUFFIXES, checked_text_column, corpus_files, file_system, table_rows
from sbert_ray.data.records import DataError

QUERY_COLUMNS = ("query", "anchor")  # the query column when --query-column is not given: the first there
PASSAGE_COLUMNS = ("passage", "positive")  # the passage column of pairs when --passage-column is not given
NEGATIVE = re.compile(r"negative_([1-9][0-9]*)")


@dataclasses.dataclass(frozen=True)
class ScoreLayout:
    """The query column and the passage columns scored against it: one for pairs (scores in ``score``), the positive
    and the negatives for n-tuples (scores in ``score_<column>``: ``score_positive``, ``score_negative_1``...)."""

    query: str
    passages: tuple[str, ...]

    @property
    def score_columns(self) -> tuple[str, ...]:
        return ("score",) if self.pairs else tuple(f"score_{column}" for column in self.passages)

    @property
    def pairs(self) -> bool:
        return len(self.passages) == 1


def layout_of(
    uri: str, columns: Sequence[str], query_column: str | None = None, passage_column: str | None = None
) -> ScoreLayout:
    """The layout of a file with ``columns``: n-tuples when it has ``negative_1`` (or ``negative``) and no
    ``passage_column`` is given, else pairs; a DataError names the file and the missing column."""

    def present(column: str, what: str) -> str:
        if column not in columns:
            raise DataError(f"{uri}: no {what} column {column!r} (columns: {list(columns)})")
        return column

    def first(names: Sequence[str], option: str) -> str:
        found = next((name for name in names if name in columns), None)
        if found is None:
            raise DataError(
                f"{uri}: no column {' or '.join(map(repr, names))} (columns: {list(columns)}); name it with {option}"
            )
        return found

    query = present(query_column, "query") if query_column else first(QUERY_COLUMNS, "--query-column")
    negatives = _negative_columns(uri, columns)
    if passage_column:
        layout = ScoreLayout(query, (present(passage_column, "passage"),))
    elif negatives:
        layout = ScoreLayout(query, (present("positive", "positive"), *negatives))
    else:
        layout = ScoreLayout(query, (first(PASSAGE_COLUMNS, "--passage-column"),))
    taken = [column for column in layout.score_columns if column in columns]
    if taken:
        raise DataError(f"{uri}: already has a column {taken[0]!r}, where its scores would go")
    return layout


def _negative_columns(uri: str, columns: Sequence[str]) -> tuple[str, ...]:
    """``negative_1..negative_n`` (numbered from 1, none missing), or mine's triplet column ``negative``."""
    numbers = sorted(int(match[1]) for column in columns if (match := NEGATIVE.fullmatch(column)))
    if numbers and numbers != list(range(1, len(numbers) + 1)):
        missing = min(set(range(1, numbers[-1] + 1)) - set(numbers))
        raise DataError(f"{uri}: negative columns numbered {numbers}: negative_{missing} is missing")
    return tuple(f"negative_{n}" for n in numbers) or (("negative",) if "negative" in columns else ())


@dataclasses.dataclass(frozen=True)
class ScoreFile:
    uri: str  # a local absolute path or an object storage URI
    key: str  # its path under the folder, prefix or glob it was found in: names its output
    layout: ScoreLayout

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.uri)[1].lower()

    def tables(self, rows_per_table: int, row_column: str | None = None) -> Iterator[pa.Table]:
        """The file's rows, every column, ``rows_per_table`` at a time; with ``row_column``, each row's 0-based
        position in the file first. A null text names its row."""
        row = 0
        for table in table_rows(self.uri, rows_per_table):
            table = _checked_texts(table, self, row)
            if row_column:
                table = table.add_column(0, row_column, pa.array(range(row, row + table.num_rows), pa.int64()))
            row += table.num_rows
            yield table


def open_score_inputs(spec: str, query_column: str | None = None, passage_column: str | None = None) -> list[ScoreFile]:
    """The files of ``spec`` (a file, or the tables of a folder, object storage prefix or glob: ``sbert-ray mine``'s
    shards without its manifest), each with its layout; checked here, before any work: a DataError names the file and
    what is wrong."""
    files = []
    for listed in corpus_files(spec, None, suffixes=TABLE_SUFFIXES):
        if listed.suffix not in TABLE_SUFFIXES:
            raise DataError(f"{listed.uri}: scoring reads tables ({', '.join(TABLE_SUFFIXES)}) with named columns")
        filesystem, path = file_system(listed.uri)
        if filesystem.get_file_info(path).type == fs.FileType.NotFound:
            raise DataError(f"{listed.uri}: no such file")
        try:
            first = next(table_rows(listed.uri, 1), None)
        except OSError as err:
            raise DataError(f"{listed.uri}: cannot be read ({err.strerror or err})") from None
        if first is None or first.num_rows == 0:
            raise DataError(f"{listed.uri}: no rows to score (an empty file or a header only)")
        layout = layout_of(listed.uri, first.column_names, query_column, passage_column)
        if files and layout != files[0].layout:
            raise DataError(
                f"{listed.uri}: scores columns {layout}, but {files[0].uri} scores {files[0].layout}: one run scores "
                "one layout"
            )
        files.append(ScoreFile(listed.uri, listed.key, layout))
    return files


def _checked_texts(table: pa.Table, file: ScoreFile, first_row: int) -> pa.Table:
    """The scored columns as strings; a null (or a value that is not text) names its row."""
    for column in (file.layout.query, *file.layout.passages):
        table = checked_text_column(table, column, file.uri, first_row)
    return table
