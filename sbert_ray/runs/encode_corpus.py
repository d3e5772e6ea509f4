"""``sbert-ray encode``: embed a corpus of any size with Ray Data, written as parquet files of (id, text, vector).

    input checked: the file is readable, has the column and a first row (or the dataset is there)   (no Ray yet)
      -> model loaded once; a CPU copy in the object store
      -> read: one task on the driver's node streams the input in blocks of rows, numbered as read
      -> map_batches on an actor pool: an EncoderReplica per actor (one GPU each with --device cuda); each block
         is encoded with smart batching (SentenceEncoder.encode orders it by length)
      -> write_parquet on the driver's node into a hidden staging folder beside the output, which is renamed to
         the output once every row is written: a folder under the output's name is always complete

Reading and writing stay on the driver's node (where the input was checked and where the output is asked for);
only the encoding, which is what takes the time, spreads over the cluster.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from sbert_ray.config import ConfigError
from sbert_ray.data.corpus import SCHEMA, Corpus, open_corpus
from sbert_ray.evaluation.encoder_pool import EncoderReplica, shareable
from sbert_ray.models import load_encoder
from sbert_ray.progress import quiet
from sbert_ray.runs import owned_paths
from sbert_ray.runs.cluster import connect_ray, input_errors_unwrapped

BLOCK_BYTES = 1 << 20  # rows read into one block (~10k sentences), encoded (ordered by length) in one actor call
ROWS_PER_READ = 1024  # rows the read task turns into one table at a time
ROWS_PER_FILE = 65536  # blocks are gathered into parquet files of about this many rows
IO_TASKS = 2  # parquet writers at once


@dataclass
class EncodeResult:
    output: str
    rows: int
    dimension: int
    seconds: float


@dataclass(frozen=True)
class EncodeRequest:
    """What ``sbert-ray encode`` embeds (``input_spec``, see ``sbert_ray.data.corpus``), with which model and how many
    replicas (one GPU each with a cuda ``device``, or by default when the cluster has GPUs), into which new folder."""

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

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.workers}")
        if self.device and self.device.partition(":")[0] not in ("cpu", "cuda"):
            raise ConfigError(f"--device {self.device}: encoding runs on Ray actors, on cpu or cuda")
        owned_paths.refuse_protected(self.output, "--output")


@input_errors_unwrapped()  # a bad row midway is found in the read task
def encode_corpus(request: EncodeRequest) -> EncodeResult:
    """Embed every row of the request's input and write them to the folder ``request.output``, which must not
    exist yet."""
    output = Path(request.output).expanduser().resolve()
    if output.exists():
        raise ConfigError(f"--output {output} already exists; name a new folder")
    corpus = open_corpus(request.input_spec, request.column, request.data_dir)
    encoder = load_encoder(request.model_ref)
    try:
        prompt = encoder.resolve_prompt(prompt_name=request.prompt_name)
    except ValueError as error:
        raise ConfigError(f"--prompt-name: {error}") from None

    start = time.perf_counter()
    connect_ray()
    use_gpu = request.device.startswith("cuda") if request.device else ray.cluster_resources().get("GPU", 0) > 0
    # Reading and writing run on this node, take no CPU from the actors (they would wait on each other on a full
    # cluster) and stay few: one read task, IO_TASKS writers.
    here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    # Ray Data gathers what a read task yields into blocks of up to DataContext.target_max_block_size (128 MiB);
    # smaller ones let the actors share the work. A repartition would be a task of one CPU, which the actors may
    # all hold: a deadlock on a full cluster. The context is sealed into the dataset when it is created.
    context = ray.data.DataContext.get_current()
    defaults = context.target_max_block_size, context.enable_progress_bars
    context.target_max_block_size, context.enable_progress_bars = request.block_bytes, defaults[1] and not quiet()
    try:
        rows = ray.data.read_datasource(_CorpusSource(corpus), override_num_blocks=1, num_cpus=0, label_selector=here)
    finally:
        context.target_max_block_size, context.enable_progress_bars = defaults
    embedded = rows.map_batches(
        _EmbedRows,
        fn_constructor_args=(shareable(encoder), "cuda" if use_gpu else "cpu", request.batch_size, prompt),
        batch_size=None,  # a whole block per call, so smart batching orders the block by length
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=request.workers),
        num_cpus=1,
        num_gpus=1 if use_gpu else 0,
    )
    with owned_paths.staging_beside(output) as staging:
        embedded.write_parquet(
            str(staging / "embeddings"),
            min_rows_per_file=ROWS_PER_FILE,
            concurrency=IO_TASKS,
            ray_remote_args={"num_cpus": 0, "label_selector": here},
        )
        written = sum(pq.ParquetFile(path).metadata.num_rows for path in (staging / "embeddings").glob("*.parquet"))
        os.replace(staging / "embeddings", output)
    return EncodeResult(str(output), written, encoder.embedding_dim, time.perf_counter() - start)


class _CorpusSource(Datasource):
    """The corpus as one read task streaming blocks of rows: ids are positions in the input, so it is read in
    order by one task (encoding, not reading, is what takes the time)."""

    def __init__(self, corpus: Corpus):
        super().__init__()
        self.corpus = corpus

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        corpus = self.corpus
        metadata = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
        return [ReadTask(lambda: corpus.tables(ROWS_PER_READ), metadata, schema=SCHEMA)]


class _EmbedRows(EncoderReplica):
    """Adds each row's vector to a block of (id, text) rows."""

    def __init__(self, encoder: ray.ObjectRef, device: str, batch_size: int, prompt: str):
        super().__init__(encoder, device, threads=1)
        self.batch_size, self.prompt = batch_size, prompt

    def __call__(self, rows: pa.Table) -> pa.Table:
        vectors = self.encode(rows.column("text").to_pylist(), self.batch_size, self.prompt)
        return rows.append_column("vector", pa.FixedSizeListArray.from_arrays(vectors.reshape(-1), vectors.shape[1]))
