"""A corpus under an object-storage prefix (``s3://bucket/prefix``, or any URI pyarrow opens), read by Ray Data.

``check_remote_corpus`` looks before any Ray work: the prefix holds files of one kind (.parquet, .jsonl, .csv,
.tsv or .txt), and a table has the text column (a parquet file's schema is read; JSON and CSV name their columns
row by row, so a missing one is found by the read). ``RemoteCorpus.texts`` then streams the column through Ray
Data: read tasks on the cluster fetch the files (the nodes' own object-storage access, as for checkpoints), blocks
come to the driver in file order, one at a time. ``RemoteCorpus.lines_of`` reads one file as lines the same way
(a BEIR corpus.jsonl, whose rows retrieval evaluation parses as it streams them to the encoder actors).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow.csv as pa_csv
import pyarrow.fs as pa_fs
import pyarrow.parquet as pq

from sbert_ray.data.corpus import CORPUS_SUFFIXES, DEFAULT_COLUMN
from sbert_ray.data.records import DataError

if TYPE_CHECKING:
    import ray
    import ray.data

ROWS_PER_BATCH = 4096  # texts the driver takes from Ray Data at a time


@dataclass(frozen=True)
class RemoteCorpus:
    uri: str
    files: tuple[str, ...]  # full paths in the filesystem, in name order
    suffix: str
    column: str | None  # None for text files

    @classmethod
    def lines_of(cls, uri: str) -> RemoteCorpus:
        """One file (a JSON-lines file whose rows the caller parses: a BEIR corpus.jsonl) read as its non-blank
        lines, with Ray Data's text reader; ``texts`` yields them."""
        return cls(uri, (pa_fs.FileSystem.from_uri(uri)[1],), ".txt", None)

    def texts(self, cpus_per_read: float = 1.0) -> Iterator[str]:
        """Every row's text, file by file in name order, rows in file order. ``cpus_per_read``: what each read
        task reserves (0 where encoder actors may hold every CPU of the cluster while the corpus streams to them:
        a read that waited for a CPU would wait for ever)."""
        for batch in self._rows(cpus_per_read).iter_batches(batch_size=ROWS_PER_BATCH, batch_format="pyarrow"):
            column = batch.column(0)
            if column.null_count:
                raise DataError(f"{self.uri}: column {self.column!r} has a null where text should be")
            yield from column.to_pylist()

    def blocks(self, cpus_per_read: float = 1.0) -> list[ray.ObjectRef]:
        """The rows as Ray Data's blocks, left in the object store (arrow tables, the text first), in ``texts``'
        order: the corpus read on the cluster without coming to the driver (``runs.mining_corpus``)."""
        return self._rows(cpus_per_read).to_arrow_refs()

    def _rows(self, cpus_per_read: float) -> ray.data.Dataset:
        """The text column, first, rows in file order (the data set keeps the context it was made in)."""
        import ray.data  # here, not at import: the data layer's checks (``check_remote_corpus``) run without Ray

        filesystem, _ = pa_fs.FileSystem.from_uri(self.uri)
        context = ray.data.DataContext.get_current()
        preserve = context.execution_options.preserve_order
        context.execution_options.preserve_order = True  # row ids follow the files' order, run after run
        try:
            return self._read(filesystem, cpus_per_read)
        finally:
            context.execution_options.preserve_order = preserve

    def _read(self, filesystem: pa_fs.FileSystem, cpus_per_read: float) -> ray.data.Dataset:
        import ray.data

        files, options = list(self.files), {"filesystem": filesystem, "num_cpus": cpus_per_read}
        if self.suffix == ".parquet":
            return ray.data.read_parquet(files, **options).select_columns([self.column])
        if self.suffix == ".jsonl":
            return ray.data.read_json(files, lines=True, **options).select_columns([self.column])
        if self.suffix == ".txt":
            return ray.data.read_text(files, drop_empty_lines=True, **options)
        parse = pa_csv.ParseOptions(delimiter="\t", quote_char=False) if self.suffix == ".tsv" else None
        return ray.data.read_csv(files, parse_options=parse, **options).select_columns([self.column])


def check_remote_corpus(uri: str, column: str | None = None) -> RemoteCorpus:
    """The corpus under ``uri``, checked before any Ray work; a DataError names the prefix and what is wrong."""
    try:
        filesystem, path = pa_fs.FileSystem.from_uri(uri)
        found = filesystem.get_file_info(pa_fs.FileSelector(path.rstrip("/"), recursive=True, allow_not_found=True))
    except (OSError, ValueError) as err:
        raise DataError(f"{uri}: cannot be listed ({str(err).strip().splitlines()[0]})") from None
    files = sorted(info.path for info in found if info.type == pa_fs.FileType.File)
    suffixes = {"." + name.rpartition(".")[2].lower() for name in files}
    if not files:
        raise DataError(f"{uri}: no files under this prefix")
    if len(suffixes) > 1 or not suffixes <= set(CORPUS_SUFFIXES):
        raise DataError(f"{uri}: expected files of one kind ({', '.join(CORPUS_SUFFIXES)}), found {sorted(suffixes)}")
    [suffix] = suffixes
    if suffix == ".txt":
        if column is not None:
            raise DataError(f"{uri}: text files have one sentence per line and no columns; drop the corpus column")
        return RemoteCorpus(uri, tuple(files), suffix, None)
    column = column or DEFAULT_COLUMN
    if suffix == ".parquet":
        names = pq.read_schema(files[0], filesystem=filesystem).names
        if column not in names:
            raise DataError(f"{uri}: {files[0]} has no column {column!r} (columns: {names})")
    return RemoteCorpus(uri, tuple(files), suffix, column)
