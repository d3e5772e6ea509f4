"""What every Ray Data job that turns each input file into one output file shares (``sbert-ray encode``, ``sbert-ray
score``): the owned output folder, resuming per file, one read task per file, and each file's output appearing only
once complete.

    the output marked as ours (``claim``: a rerun must use the same settings; a folder of other files is refused)
      -> files whose output is already there are skipped (``not_written``: a rerun resumes)
      -> read: one task per input file (``read_files``), streaming blocks of rows tagged with their file's key, their
         row within the file and whether it is the file's last row (``RowTags``)
      -> the job's own stages (tokenise, encode or score on an actor pool)
      -> each block written as part files in a hidden staging folder inside the output (``write_parts``)
      -> once every row of an input file is written, its parts are joined into one file in staging and moved to
         ``OUTPUT/KEY.parquet`` (a rename on disk, one copy on object storage): a file under the output's names is
         always complete; the staging folder is removed at the end, whatever happened (one a killed run left is
         removed by the next run into that output) (``write_files``)

Local input and output stay on the driver's node (where the paths were checked; other nodes need not see them);
object storage is read and written from any node.
"""

from __future__ import annotations

import functools
import os
import posixpath
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import ray.data
from pyarrow import fs
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask
from ray.util.placement_group import remove_placement_group

from sbert_ray.config import ConfigError
from sbert_ray.evaluation.encoder_pool import replica_resources, reserve_replicas
from sbert_ray.files import check_folder
from sbert_ray.progress import quiet
from sbert_ray.ray_compat import OFF_CONTROL_NODES, connect_ray
from sbert_ray.runs import owned_paths
from sbert_ray.runs.cluster import refuse_impossible_encoders
from sbert_ray.runs.owned_paths import filesystem_of

ROWS_PER_READ = 1024  # rows the read task turns into one table at a time
STAGING_PREFIX = ".partial-"  # + 12 hex digits: a run's staging folder inside the output
STAGING_NAME = re.compile(re.escape(STAGING_PREFIX) + "[0-9a-f]{12}")
PARTS, JOINED = "parts", "joined"  # staging subfolders: written blocks, and whole files waiting to be moved


@dataclass(frozen=True)
class RowTags:
    """The columns a read task adds to every row: its input file's key, its 0-based row within that file (part files
    are named and joined in this order) and whether it is the file's last row (so the driver knows when all of a
    file is written). ``kept``: those that stay in the output files."""

    file: str
    row: str
    last: str
    kept: tuple[str, ...]


# Tags for rows that go out with every column they came with (an "id" or "file" among them): names none takes.
WHOLE_ROW_TAGS = RowTags("__sbert_ray_file", "__sbert_ray_row", "__sbert_ray_last", kept=())


def check_request(batch_size: int, workers: int, device: str | None, output: str | os.PathLike, work: str) -> None:
    """The options every such job takes: ``work`` (encoding, scoring) runs on Ray actors, on cpu or cuda."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if device and device.partition(":")[0] not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: {work} runs on Ray actors, on cpu or cuda")
    owned_paths.refuse_protected(output, "--output")


@dataclass(frozen=True)
class Output:
    """The output folder (local, absolute) or prefix (object storage), as a pyarrow filesystem and path."""

    uri: str

    @classmethod
    def of(cls, output: str | os.PathLike) -> Output:
        text = str(output)
        uri = text.rstrip("/") if "://" in text else str(Path(text).expanduser().resolve())
        if not uri.split("://")[-1].strip("/"):
            raise ConfigError(f"--output {text}: name a folder (or a prefix inside the bucket)")
        return cls(check_folder(uri, "--output"))

    @property
    def local(self) -> bool:
        return "://" not in self.uri

    def file(self, key: str) -> str:
        return f"{filesystem_of(self.uri)[1]}/{key}.parquet"


def claim(output: Output, marker: str, settings: dict[str, Any], command: str, contents: str) -> None:
    """Mark the output as ours (``marker``, holding ``settings``), or refuse it: a folder that exists and is neither
    empty nor ours, or ours with other settings (its files would mix two kinds of ``contents``). Then remove what
    a killed run left there."""
    not_ours = (
        f"--output {output.uri} exists and is not an sbert-ray {command} output (no {marker}): choose a new folder "
        "or an empty one"
    )
    theirs = owned_paths.claim_output(output.uri, marker, settings, not_ours)
    if theirs != settings:
        raise ConfigError(
            f"--output {output.uri} holds {contents} made with {theirs}, this run's are {settings}: choose another "
            "folder"
        )
    remove_left_staging(output)


def run(
    request: Any,
    pending: Sequence,
    output: Output,
    pipeline: Callable[[bool, Placement], ray.data.Dataset],
    rows_per_group: int | None = None,
) -> tuple[int, float]:
    """Write the output of the ``pending`` sources with ``pipeline(use_gpu, placement)`` (read_files, the job's
    stages, write_parts) on the request's ``workers`` replicas on its ``device``, waiting ``resource_wait_s`` at
    most for them: (rows written, seconds, from joining the cluster). ``rows_per_group``: the output files' row
    groups (None: one per written block)."""
    start = time.perf_counter()
    use_gpu = start_replicas(request.device, request.workers, request.resource_wait_s)
    if not pending:
        return 0, time.perf_counter() - start
    local_input = any("://" not in getattr(source, "uri", "") for source in pending)  # a dataset is read here too
    placement = Placement.of(output, local_input)
    written = write_files(pipeline(use_gpu, placement), output, placement, rows_per_group)
    return written, time.perf_counter() - start


def remove_left_staging(output: Output) -> None:
    """Staging folders a killed run left in the output (a run removes its own however it ends, unless killed).
    Only names this module makes are removed; two runs into one output at once are not supported."""
    filesystem, root = filesystem_of(output.uri)
    for info in filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True)):
        if info.type == fs.FileType.Directory and STAGING_NAME.fullmatch(info.base_name):
            filesystem.delete_dir(info.path)


def model_setting(model_ref: str) -> str:
    """A model as an output's marker names it: a local folder by its absolute path, a Hub id as it is."""
    model = Path(model_ref).expanduser()
    return str(model.resolve()) if model.exists() else model_ref


def not_written(sources: Sequence, output: Output) -> list:
    """The sources (anything with a ``key``) whose output file is not there yet."""
    filesystem, _ = filesystem_of(output.uri)
    infos = filesystem.get_file_info([output.file(source.key) for source in sources])
    return [source for source, info in zip(sources, infos, strict=True) if info.type == fs.FileType.NotFound]


def start_replicas(device: str | None, workers: int, resource_wait_s: float) -> bool:
    """Join the cluster and wait, within ``resource_wait_s``, until ``workers`` actors of one CPU (and one GPU each
    with a cuda ``device``, or by default when the cluster has GPUs) fit. Returns whether they use GPUs."""
    connect_ray()
    use_gpu = device.startswith("cuda") if device else ray.cluster_resources().get("GPU", 0) > 0
    replica = replica_resources(use_gpu)
    refuse_impossible_encoders(replica, workers)
    # Ray Data places its actor pool itself and would wait for ever: wait for the replicas' resources here, bounded.
    remove_placement_group(reserve_replicas(replica, workers, resource_wait_s))
    return use_gpu


@dataclass(frozen=True)
class Placement:
    """Where the read tasks and the writing stages run: on the driver's node for local input or output, else off a
    control node (``ray_compat.OFF_CONTROL_NODES``: they take no CPU, which would not keep them off it)."""

    staging: str
    read: dict
    write: dict

    @classmethod
    def of(cls, output: Output, local_input: bool) -> Placement:
        here = {"label_selector": {"ray.io/node-id": ray.get_runtime_context().get_node_id()}}
        staging = f"{output.uri}/{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
        elsewhere = {"label_selector": OFF_CONTROL_NODES}
        return cls(staging, here if local_input else elsewhere, here if output.local else elsewhere)


def read_files(
    sources: Sequence,
    tables: Callable[[Any], Iterator[pa.Table]],
    tags: RowTags,
    block_bytes: int,
    placement: Placement,
    schema: pa.Schema | None = None,
) -> ray.data.Dataset:
    """One read task per source, streaming its ``tables(source)`` (each holding the ``tags.row`` column) with the
    file and last-row tags added, in blocks of about ``block_bytes``."""
    # Ray Data gathers what a read task yields into blocks of up to DataContext.target_max_block_size (128 MiB);
    # smaller ones let the actors share the work. The context is sealed into the dataset when it is created.
    context = ray.data.DataContext.get_current()
    defaults = context.target_max_block_size, context.enable_progress_bars
    context.target_max_block_size, context.enable_progress_bars = block_bytes, defaults[1] and not quiet()
    try:
        # Reading takes no CPU from the actors (on a full cluster they would wait on each other).
        return ray.data.read_datasource(
            _Files(sources, tables, tags, schema), override_num_blocks=len(sources), num_cpus=0, **placement.read
        )
    finally:
        context.target_max_block_size, context.enable_progress_bars = defaults


class _Files(Datasource):
    def __init__(self, sources: Sequence, tables: Callable, tags: RowTags, schema: pa.Schema | None):
        super().__init__()
        self.sources, self.tables, self.tags, self.schema = sources, tables, tags, schema

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        metadata = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
        # Each task carries its own file, not this datasource with every file (n tasks of n files each).
        return [
            ReadTask(functools.partial(_file_tables, source, self.tables, self.tags), metadata, schema=self.schema)
            for source in self.sources
        ]


def _file_tables(source, tables: Callable[[Any], Iterator[pa.Table]], tags: RowTags) -> Iterator[pa.Table]:
    tables = tables(source)
    table = next(tables)  # every source has a first row (checked before the job)
    for following in tables:
        yield _tagged(table, source.key, tags, last=False)
        table = following
    yield _tagged(table, source.key, tags, last=True)


def _tagged(table: pa.Table, key: str, tags: RowTags, last: bool) -> pa.Table:
    marks = [False] * (table.num_rows - 1) + [last]
    table = table.add_column(0, tags.file, pa.array([key] * table.num_rows, pa.string()))
    return table.append_column(tags.last, pa.array(marks))


def write_parts(dataset: ray.data.Dataset, tags: RowTags, placement: Placement) -> ray.data.Dataset:
    """The last stage: each block's rows written into staging; one summary row per file and block."""
    return dataset.map_batches(
        _write_parts,
        fn_kwargs={"parts": f"{placement.staging}/{PARTS}", "tags": tags},
        batch_size=None,
        batch_format="pyarrow",
        num_cpus=0,
        **placement.write,
    )


def _write_parts(rows: pa.Table, parts: str, tags: RowTags) -> pa.Table:
    """Each input file's rows of the block as ``PARTS/KEY/FIRST-ROW.parquet``; one summary row per file: the rows
    written and, where the block holds the file's last row, the file's row count (else -1)."""
    filesystem, root = filesystem_of(parts)
    summary = {"file": [], "rows": [], "total": []}
    dropped = [tag for tag in (tags.file, tags.row, tags.last) if tag not in tags.kept]
    for key in pc.unique(rows[tags.file]).to_pylist():
        part = rows.filter(pc.equal(rows[tags.file], key))
        ids = part[tags.row]
        folder = f"{root}/{key}"
        filesystem.create_dir(folder, recursive=True)
        path = f"{folder}/{pc.min(ids).as_py():012d}.parquet"
        pq.write_table(part.drop_columns(dropped), path, filesystem=filesystem)
        last = pc.any(part[tags.last]).as_py()
        summary["file"].append(key), summary["rows"].append(part.num_rows)
        summary["total"].append(pc.max(ids).as_py() + 1 if last else -1)
    return pa.table(summary)


def write_files(
    parts: ray.data.Dataset, output: Output, placement: Placement, rows_per_group: int | None = None
) -> int:
    """Run the pipeline ending in ``write_parts``, moving each input file's output in as soon as all its rows are
    written; the staging folder is removed at the end whatever happened (files already moved in stay: they are
    complete). Returns the rows written."""
    join = ray.remote(_join_parts).options(num_cpus=0, **placement.write)
    totals, written, joins = {}, Counter(), []
    try:
        for part in parts.iter_rows():
            key = part["file"]
            written[key] += part["rows"]
            if part["total"] >= 0:
                totals[key] = part["total"]
            if written[key] == totals.get(key):
                joins.append(join.remote(placement.staging, output.uri, key, rows_per_group))
        return sum(ray.get(joins))
    finally:
        ray.wait(joins, num_returns=len(joins))  # none still writing into staging when it is removed
        ray.get(ray.remote(_remove).options(num_cpus=0, **placement.write).remote(placement.staging))


def _join_parts(staging: str, output: str, key: str, rows_per_group: int | None) -> int:
    """The parts of one input file, in row order, as one parquet file moved to ``OUTPUT/KEY.parquet``, in row
    groups of ``rows_per_group`` rows (the last fewer; None: one per part)."""
    filesystem, root = filesystem_of(staging)
    out_path = f"{filesystem_of(output)[1]}/{key}.parquet"
    parts = sorted(
        info.path for info in filesystem.get_file_info(fs.FileSelector(f"{root}/{PARTS}/{key}")) if info.is_file
    )
    joined = f"{root}/{JOINED}/{key}.parquet"
    _make_parent(filesystem, joined)
    rows = 0
    with pq.ParquetWriter(joined, pq.read_schema(parts[0], filesystem=filesystem), filesystem=filesystem) as writer:
        tables = (pq.read_table(part, filesystem=filesystem) for part in parts)  # one part in memory at a time
        for table in _regrouped(tables, rows_per_group) if rows_per_group else tables:
            writer.write_table(table, row_group_size=rows_per_group)  # one row group per table
            rows += table.num_rows
    _make_parent(filesystem, out_path)
    filesystem.move(joined, out_path)  # a rename on disk; on object storage one copy, so it appears complete
    return rows


def _regrouped(tables: Iterator[pa.Table], rows: int) -> Iterator[pa.Table]:
    """The same rows in tables of exactly ``rows`` rows, the last one fewer."""
    pending: list[pa.Table] = []
    held = 0
    for table in tables:
        pending.append(table)
        held += table.num_rows
        while held >= rows:
            joined = pa.concat_tables(pending)
            yield joined.slice(0, rows)
            pending, held = [joined.slice(rows)], held - rows
    if held:
        yield pa.concat_tables(pending)


def _make_parent(filesystem: fs.FileSystem, path: str) -> None:
    """A local file's folder; object storage needs none (pyarrow would add empty marker objects)."""
    if isinstance(filesystem, fs.LocalFileSystem):
        filesystem.create_dir(posixpath.dirname(path), recursive=True)


def _remove(staging: str) -> None:
    filesystem, root = filesystem_of(staging)
    if filesystem.get_file_info(root).type != fs.FileType.NotFound:
        filesystem.delete_dir(root)
