"""``sbert-ray encode``: embed a corpus of any size with Ray Data: one parquet file of (file, id, text, vector) per
input file, in a local folder or under an object storage prefix.

    input checked: every file readable, with the column and a first row (or the dataset is there)   (no Ray yet)
      -> the output marked as ours (a rerun must use the same model and column; a folder of other files is refused)
      -> files whose output is already there are skipped (a rerun resumes)
      -> model loaded once; a CPU copy in the object store; the replicas checked against the cluster's nodes
      -> read: one task per input file (in parallel), streaming blocks of rows numbered within their file
      -> tokenise: a CPU map_batches stage (token ids per row), so the replicas only run the model
      -> encode: map_batches on an actor pool, an EncoderReplica per actor (one GPU each with --device cuda);
         each block is cut into batches by a token budget (SentenceEncoder.encode_token_ids)
      -> each encoded block written as a part file in a hidden staging folder inside the output
      -> once every row of an input file is written, its parts are joined into one file in staging and moved to
         ``OUTPUT/KEY.parquet`` (a rename on disk, one copy on object storage): a file under the output's names is
         always complete; the staging folder is removed at the end, whatever happened (one a killed run left
         is removed by the next run into that output)

Local input and output stay on the driver's node (where the paths were checked; other nodes need not see them);
object storage is read and written from any node. A row is ``(file, id)``: the input file's key (its path under the
folder, prefix or glob; see ``sbert_ray.data.corpus``) and its 0-based row within that file.
"""

from __future__ import annotations

import os
import posixpath
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray
import ray.data
from pyarrow import fs
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask
from ray.util.placement_group import remove_placement_group

from sbert_ray.config import RESOURCE_WAIT_S, ConfigError
from sbert_ray.data.corpus import CorpusSource, open_corpus
from sbert_ray.evaluation.encoder_pool import EncoderReplica, replica_resources, reserve_replicas, shareable
from sbert_ray.files import check_folder
from sbert_ray.models import load_encoder
from sbert_ray.models.encoder import token_ids
from sbert_ray.progress import quiet
from sbert_ray.ray_compat import connect_ray
from sbert_ray.runs import owned_paths
from sbert_ray.runs.cluster import input_errors_unwrapped, refuse_impossible_encoders
from sbert_ray.runs.owned_paths import filesystem_of

BLOCK_BYTES = 1 << 20  # rows read into one block (~10k sentences), encoded (cut by the token budget) in one call
ROWS_PER_READ = 1024  # rows the read task turns into one table at a time
READ_SCHEMA = pa.schema([("file", pa.string()), ("id", pa.int64()), ("text", pa.string()), ("last", pa.bool_())])
STAGING_PREFIX = ".partial-"  # + 12 hex digits: a run's staging folder inside the output
STAGING_NAME = re.compile(re.escape(STAGING_PREFIX) + "[0-9a-f]{12}")
ENCODE_MARKER = "_sbert_ray_encode.json"  # marks an output folder as ours, with the settings its vectors were made with
PARTS, JOINED = "parts", "joined"  # staging subfolders: encoded blocks, and whole files waiting to be moved


@dataclass
class EncodeResult:
    output: str
    rows: int  # written by this run
    dimension: int
    seconds: float
    files_written: int
    files_skipped: int  # complete from an earlier run


@dataclass(frozen=True)
class EncodeRequest:
    """What ``sbert-ray encode`` embeds (``input_spec``, see ``sbert_ray.data.corpus``), with which model and how many
    replicas (one GPU each with a cuda ``device``, or by default when the cluster has GPUs), into which folder or
    object storage prefix (created, or resumed: input files whose output is there are skipped)."""

    model_ref: str
    input_spec: str
    output: str | os.PathLike
    column: str | None = None
    batch_size: int = 32
    workers: int = 1
    device: str | None = None
    data_dir: str | os.PathLike | None = None
    block_bytes: int = BLOCK_BYTES
    prompt_name: str | None = None  # one of the model's prompts, put before every text; None: its default, if any
    resource_wait_s: float = RESOURCE_WAIT_S  # for the replicas' CPUs/GPUs while other work holds them

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")
        if self.device and self.device.partition(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device}: encoding runs on Ray actors, on cpu or cuda")
        owned_paths.refuse_protected(self.output, "--output")


@dataclass(frozen=True)
class _Output:
    """The output folder (local, absolute) or prefix (object storage), as a pyarrow filesystem and path."""

    uri: str

    @classmethod
    def of(cls, output: str | os.PathLike) -> _Output:
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


@input_errors_unwrapped()  # a bad row midway is found in a read task
def encode_corpus(request: EncodeRequest) -> EncodeResult:
    """Embed every row of the request's input into one parquet file per input file under ``request.output``;
    input files whose output is already there are skipped."""
    output = _Output.of(request.output)
    sources = open_corpus(request.input_spec, request.column, request.data_dir)
    encoder = load_encoder(request.model_ref)
    try:
        prompt = encoder.resolve_prompt(prompt_name=request.prompt_name)
    except ValueError as error:
        raise ConfigError(f"--prompt-name: {error}") from None
    _claim(output, _settings(request))
    _remove_left_staging(output)
    pending = _not_written(sources, output)

    start = time.perf_counter()
    connect_ray()
    use_gpu = request.device.startswith("cuda") if request.device else ray.cluster_resources().get("GPU", 0) > 0
    replica = replica_resources(use_gpu)
    refuse_impossible_encoders(replica, request.workers)
    # Ray Data places its actor pool itself and would wait for ever: wait for the replicas' resources here, bounded.
    remove_placement_group(reserve_replicas(replica, request.workers, request.resource_wait_s))
    rows = 0
    if pending:
        staging = f"{output.uri}/{STAGING_PREFIX}{uuid.uuid4().hex[:12]}"
        rows = _encode(request, pending, encoder, prompt, use_gpu, output, staging)
    seconds = time.perf_counter() - start
    return EncodeResult(output.uri, rows, encoder.embedding_dim, seconds, len(pending), len(sources) - len(pending))


def _settings(request: EncodeRequest) -> dict[str, str | None]:
    """What decides the vectors of an output: a rerun into the same output must have the same."""
    model = Path(request.model_ref).expanduser()
    model_ref = str(model.resolve()) if model.exists() else request.model_ref
    return {"model": model_ref, "column": request.column, "prompt_name": request.prompt_name}


def _claim(output: _Output, settings: dict[str, str | None]) -> None:
    """Mark the output as ours (``ENCODE_MARKER``, holding ``settings``), or refuse it: a folder that exists and is
    neither empty nor ours, or ours with other settings (its files would mix two models' vectors)."""
    not_ours = (
        f"--output {output.uri} exists and is not an sbert-ray encode output (no {ENCODE_MARKER}): choose a new "
        "folder or an empty one"
    )
    theirs = owned_paths.claim_output(output.uri, ENCODE_MARKER, settings, not_ours)
    if theirs != settings:
        raise ConfigError(
            f"--output {output.uri} holds embeddings made with {theirs}, this run's are {settings}: "
            "choose another folder"
        )


def _remove_left_staging(output: _Output) -> None:
    """Staging folders a killed run left in the output (a run removes its own however it ends, unless killed).
    Only names this module makes are removed; two runs into one output at once are not supported."""
    filesystem, root = filesystem_of(output.uri)
    for info in filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True)):
        if info.type == fs.FileType.Directory and STAGING_NAME.fullmatch(info.base_name):
            filesystem.delete_dir(info.path)


def _not_written(sources: list[CorpusSource], output: _Output) -> list[CorpusSource]:
    filesystem, _ = filesystem_of(output.uri)
    infos = filesystem.get_file_info([output.file(source.key) for source in sources])
    return [source for source, info in zip(sources, infos, strict=True) if info.type == fs.FileType.NotFound]


def _encode(
    request: EncodeRequest, sources: list[CorpusSource], encoder, prompt: str, use_gpu: bool, output: _Output, staging
):
    """Run the pipeline, moving each input file's output in as soon as all its rows are written; the staging
    folder is removed at the end whatever happened (files already moved in stay: they are complete)."""
    here = {"label_selector": {"ray.io/node-id": ray.get_runtime_context().get_node_id()}}
    local_input = any("://" not in getattr(source, "uri", "") for source in sources)  # a dataset is read here too
    on_output_node = here if output.local else {}
    where = (here if local_input else {}, on_output_node)
    parts = _pipeline(request, sources, encoder, prompt, use_gpu, staging, *where)
    join = ray.remote(_join_parts).options(num_cpus=0, **on_output_node)
    totals, written, joins = {}, Counter(), []
    try:
        for part in parts.iter_rows():
            key = part["file"]
            written[key] += part["rows"]
            if part["total"] >= 0:
                totals[key] = part["total"]
            if written[key] == totals.get(key):
                joins.append(join.remote(staging, output.uri, key))
        return sum(ray.get(joins))
    finally:
        ray.wait(joins, num_returns=len(joins))  # none still writing into staging when it is removed
        ray.get(ray.remote(_remove).options(num_cpus=0, **on_output_node).remote(staging))


def _pipeline(
    request: EncodeRequest,
    sources,
    encoder,
    prompt: str,
    use_gpu: bool,
    staging: str,
    read_where: dict,
    write_where: dict,
) -> ray.data.Dataset:
    # Ray Data gathers what a read task yields into blocks of up to DataContext.target_max_block_size (128 MiB);
    # smaller ones let the actors share the work. The context is sealed into the dataset when it is created.
    context = ray.data.DataContext.get_current()
    defaults = context.target_max_block_size, context.enable_progress_bars
    context.target_max_block_size, context.enable_progress_bars = request.block_bytes, defaults[1] and not quiet()
    try:
        # Reading and tokenising take no CPU from the actors (on a full cluster they would wait on each other);
        # with GPU replicas the actors hold one CPU each and tokenising gets one of the others per task.
        rows = ray.data.read_datasource(
            _CorpusFiles(sources), override_num_blocks=len(sources), num_cpus=0, **read_where
        )
    finally:
        context.target_max_block_size, context.enable_progress_bars = defaults
    tokenized = rows.map_batches(
        _tokenize,
        fn_kwargs={"tokenizer": encoder.tokenizer, "max_length": encoder.max_seq_length, "prompt": prompt},
        batch_size=None,
        batch_format="pyarrow",
        num_cpus=1 if use_gpu else 0,
    )
    embedded = tokenized.map_batches(
        _EmbedRows,
        fn_constructor_args=(
            shareable(encoder),
            "cuda" if use_gpu else "cpu",
            request.batch_size,
            encoder.prompt_length(prompt),
        ),
        batch_size=None,  # a whole block per call: its rows are sorted by length and cut by the token budget
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=request.workers),
        num_cpus=1,
        num_gpus=1 if use_gpu else 0,
    )
    return embedded.map_batches(
        _write_parts,
        fn_kwargs={"parts": f"{staging}/{PARTS}"},
        batch_size=None,
        batch_format="pyarrow",
        num_cpus=0,
        **write_where,
    )


class _CorpusFiles(Datasource):
    """One read task per input file, streaming blocks of (file, id, text, last): ``last`` marks the file's final
    row, so the driver knows when all of a file is written."""

    def __init__(self, sources: list[CorpusSource]):
        super().__init__()
        self.sources = sources

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        metadata = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
        return [ReadTask(lambda s=source: _file_tables(s), metadata, schema=READ_SCHEMA) for source in self.sources]


def _file_tables(source: CorpusSource):
    tables = source.tables(ROWS_PER_READ)
    table = next(tables)  # every source has a first row (checked by open_corpus)
    for following in tables:
        yield _tagged(table, source.key, last=False)
        table = following
    yield _tagged(table, source.key, last=True)


def _tagged(table: pa.Table, key: str, last: bool) -> pa.Table:
    marks = [False] * (table.num_rows - 1) + [last]
    return pa.table(
        [pa.array([key] * table.num_rows, pa.string()), table["id"], table["text"], pa.array(marks)],
        schema=READ_SCHEMA,
    )


def _tokenize(rows: pa.Table, tokenizer, max_length: int, prompt: str) -> pa.Table:
    texts = [prompt + text for text in rows.column("text").to_pylist()]
    for name, ids in token_ids(tokenizer, texts, max_length).items():
        rows = rows.append_column(name, pa.array(ids, pa.list_(pa.int32())))
    return rows


class _EmbedRows(EncoderReplica):
    """Replaces the token ids of a block of rows by each row's vector."""

    def __init__(self, encoder: ray.ObjectRef, device: str, batch_size: int, prompt_length: int):
        super().__init__(encoder, device, threads=1)
        self.batch_size, self.prompt_length = batch_size, prompt_length

    def __call__(self, rows: pa.Table) -> pa.Table:
        names = [name for name in ("input_ids", "token_type_ids") if name in rows.column_names]
        ids = {name: rows.column(name).to_pylist() for name in names}
        vectors = self.encode_token_ids(ids, self.batch_size, self.prompt_length)
        vector = pa.FixedSizeListArray.from_arrays(vectors.reshape(-1), vectors.shape[1])
        return rows.drop_columns(names).append_column("vector", vector)


def _write_parts(rows: pa.Table, parts: str) -> pa.Table:
    """Each input file's rows of the block as ``PARTS/KEY/FIRST-ID.parquet``; one summary row per file: the rows
    written and, where the block holds the file's last row, the file's row count (else -1)."""
    filesystem, root = filesystem_of(parts)
    summary = {"file": [], "rows": [], "total": []}
    for key in pc.unique(rows["file"]).to_pylist():
        part = rows.filter(pc.equal(rows["file"], key))
        ids = part["id"]
        folder = f"{root}/{key}"
        filesystem.create_dir(folder, recursive=True)
        pq.write_table(
            part.drop_columns(["last"]), f"{folder}/{pc.min(ids).as_py():012d}.parquet", filesystem=filesystem
        )
        last = pc.any(part["last"]).as_py()
        summary["file"].append(key), summary["rows"].append(part.num_rows)
        summary["total"].append(pc.max(ids).as_py() + 1 if last else -1)
    return pa.table(summary)


def _join_parts(staging: str, output: str, key: str) -> int:
    """The parts of one input file, in row order, as one parquet file moved to ``OUTPUT/KEY.parquet``."""
    filesystem, root = filesystem_of(staging)
    out_path = f"{filesystem_of(output)[1]}/{key}.parquet"
    parts = sorted(
        info.path for info in filesystem.get_file_info(fs.FileSelector(f"{root}/{PARTS}/{key}")) if info.is_file
    )
    joined = f"{root}/{JOINED}/{key}.parquet"
    _make_parent(filesystem, joined)
    rows = 0
    with pq.ParquetWriter(joined, pq.read_schema(parts[0], filesystem=filesystem), filesystem=filesystem) as writer:
        for part in parts:  # one part in memory at a time
            table = pq.read_table(part, filesystem=filesystem)
            writer.write_table(table)
            rows += table.num_rows
    _make_parent(filesystem, out_path)
    filesystem.move(joined, out_path)  # a rename on disk; on object storage one copy, so it appears complete
    return rows


def _make_parent(filesystem: fs.FileSystem, path: str) -> None:
    """A local file's folder; object storage needs none (pyarrow would add empty marker objects)."""
    if isinstance(filesystem, fs.LocalFileSystem):
        filesystem.create_dir(posixpath.dirname(path), recursive=True)


def _remove(staging: str) -> None:
    filesystem, root = filesystem_of(staging)
    if filesystem.get_file_info(root).type != fs.FileType.NotFound:
        filesystem.delete_dir(root)
