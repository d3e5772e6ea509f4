"""Each stage's training data as the Train workers read it: a raw source as a Ray Data stream, which the workers
consume as their shards; a prepared one read by each worker straight from its shards.

    sources     listed and counted before training (``count_rows``): parquet from its footers, anything else by
                a read of every row on the cluster, which also checks each one (an error names the file and line)
    prepared    a source ``sbert-ray prepare`` tokenised beforehand goes through no Ray Data at all: each worker
                reads its share of each pass from the shards (``training.prepared_reads``, ``stream.share_batches``),
                the same rows for the same pass key, world sizes and rank, on any cluster
    read        one read task per file (or per registered dataset): tables of the objective's examples
    tokenize    a map stage on the cluster's CPUs: token ids, lengths and text hashes per row
    split       Ray Train's streaming_split, equal rows per worker, in a fixed order (``preserve_order``): the
                same data order for the same seed, and a resume regenerates its position
    order       each pass's read tasks in the order ``sources.pass_reads`` gives for the pass's key: only the
                workers know which pass of a source they open (a resumed run starts inside one), so every worker
                hands its key to the source's ``PassKeys`` actor before it opens the pass, and the split's
                coordinator, which lists the read tasks once all have, asks it

The driver never holds the records and no process holds more than a file's table plus a worker's window.
Ray Train's controller and Ray Data's coordinators import this module (and ``training.sources``) to unpickle the
datasets and never tokenise: what needs torch or a tokenizer is imported in the functions that use it.
Read and tokenize tasks reserve no CPU: training workers hold the cluster's CPUs (on a small cluster all of
them), and a task waiting for a CPU behind them would stall the stream. They share the CPUs instead, off a
head labelled as the cluster's control node (``ray_compat.OFF_CONTROL_NODES``), which trains nothing, each
tokenising on one thread (``models.load.one_tokenizer_thread``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterable

import pyarrow as pa
import ray
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from sbert_ray.config import ConfigError, StageConfig, TrainConfig
from sbert_ray.data.records import DataError
from sbert_ray.ray_compat import OFF_CONTROL_NODES, TaskPoolFollowingCluster
from sbert_ray.training.prepared_reads import PreparedPasses
from sbert_ray.training.sources import Source, file_sources, known_rows, pass_reads, read_tables

# Blocks of ~5,000 short pairs, not Ray Data's 128 MiB (a whole shard of them): a worker's iterator waits for
# its first two blocks (prefetch) before the first step, which would otherwise wait for two whole files.
BLOCK_BYTES = 1024**2
StageData = list[list[dict]]  # per stage, per source: its dataset key, name, rows and weight (for the workers)


def count_rows(source: Source, stage: StageConfig, data_dir) -> int:
    """The source's training examples (at most ``stage.limit``), checking every row unless parquet footers
    tell; a bad row is a ConfigError naming the source's key, the file and the line."""
    try:
        rows = source.rows if source.rows is not None else known_rows(source, stage, data_dir)
        if rows is None:
            rows = _read(source, stage, data_dir).count()
    except ray.exceptions.RayTaskError as err:  # first: it is also an instance of the remote error's class
        cause = err.cause  # the read task's own error; Ray's message is the remote traceback
        if isinstance(cause, DataError | ValueError):
            first_line = str(cause).partition("\n")[0]  # Ray Data adds its retry advice as further lines
            raise ConfigError(f"{source.key}: {first_line}") from None
        raise
    except DataError as err:
        raise ConfigError(f"{source.key}: {err}") from None
    return min(rows, stage.limit) if stage.limit else rows


def count_stages(config: TrainConfig, sources: list[list[Source]]) -> list[list[int]]:
    """Each source's examples, counted on the cluster (``count_rows``: every row checked unless
    parquet footers tell); a stage too small for one optimizer step is refused."""
    from sbert_ray.training.stage_plan import stage_plans  # here: see the module's docstring

    rows = []
    for plan, listed in zip(stage_plans(config), sources, strict=True):
        stage = plan.stage
        rows.append([count_rows(source, stage, config.data_dir) for source in listed])
        if plan.steps_for(rows[-1])[1] == 0:
            raise ConfigError(
                f"stages.{plan.index}: {sum(rows[-1])} examples give no optimizer step of global batch "
                f"{stage.batch_size} over {config.scaling.max_workers} workers"
            )
    return rows


def stage_datasets(config: TrainConfig, sources: list[list[Source]], rows: list[list[int]]):
    """The Train datasets of the raw sources (``{key: ray.data.Dataset}``, lazy: nothing runs before the workers
    iterate them) and what each worker needs to stream every source (``source_stream``): a raw one's dataset key
    and the ``PassKeys`` actor that orders each pass's reads, a prepared one's ``PreparedPasses``."""
    datasets, stage_data = {}, []
    model_json = json.dumps(dataclasses.asdict(config.model))
    pass_keys = None
    for i, (stage, stage_sources) in enumerate(zip(config.stages, sources, strict=True)):
        described = []
        for j, (source, n) in enumerate(zip(stage_sources, rows[i], strict=True)):
            key = f"stage{i}.{j}"
            if source.manifest is not None:  # (primitives: see ``PreparedPasses.to_wire``)
                prepared = PreparedPasses.of(source, stage).to_wire()
                described.append({"name": source.name, "rows": n, "weight": source.weight, "prepared": prepared})
                continue
            if pass_keys is None:  # on the driver's node (no CPU): a node lost mid-run must not take it along
                here = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
                pass_keys = PassKeys.options(label_selector=here).remote()
            dataset = _read(source, stage, config.data_dir, (pass_keys, key))
            dataset = dataset.limit(stage.limit) if stage.limit else dataset
            datasets[key] = tokenized = dataset.map_batches(
                tokenize, fn_args=(model_json,), batch_size=None, batch_format="pyarrow", num_cpus=0,
                label_selector=OFF_CONTROL_NODES,  # as the read's, and its task pool: Ray Data fuses the two
                compute=_task_slots(source),
            )  # fmt: skip
            # Training prints its own progress lines; Ray Data's bars would interleave with them in every log.
            tokenized.context.enable_progress_bars = False
            tokenized.context.target_max_block_size = BLOCK_BYTES
            described.append(
                {"key": key, "name": source.name, "rows": n, "weight": source.weight, "pass_keys": pass_keys}
            )
        stage_data.append(described)
    return datasets, stage_data


def _read(source: Source, stage: StageConfig, data_dir, pass_key: tuple | None = None) -> ray.data.Dataset:
    """One read task per file (the default would split a small source into ~200 blocks of a few rows), in the
    order of the pass ``pass_key`` (a ``PassKeys`` actor and the dataset's key) finds (None: the listed order, as
    counting reads it). Read tasks reserve no CPU, so without a cap Ray Data would run one per file at once: every
    one a process of its own (~400 MB with torch imported), which grows with the number of shards. At most one per
    CPU of the cluster runs at a time instead (``_task_slots``)."""
    files = max(1, len(source.files))
    return ray.data.read_datasource(
        _SourceFiles(source, stage, data_dir, pass_key), num_cpus=0, override_num_blocks=files,
        compute=_task_slots(source),
        label_selector=OFF_CONTROL_NODES,
    )  # fmt: skip


def _task_slots(source: Source) -> TaskPoolFollowingCluster:
    """How many read (and fused tokenise) tasks of ``source`` run at once: one per file, at most one per CPU the
    cluster has when the pass starts (nodes that join count from the next pass). Not more than its files: Ray Data
    warns of slots it cannot fill."""
    return TaskPoolFollowingCluster(max(1, len(source.files)))


@ray.remote(num_cpus=0)
class PassKeys:
    """The key (stage seed, source index, pass number) of the pass each dataset's workers open next. Every worker
    sets it before it opens the pass (all to the same key: the schedule is equal on every rank); the split's
    coordinator starts the pass once every worker has asked for it, and only then lists its read tasks."""

    def __init__(self):
        self.keys: dict[str, tuple[int, int, int]] = {}

    def set(self, dataset: str, key: tuple[int, int, int]) -> None:
        self.keys[dataset] = key

    def get(self, dataset: str) -> tuple[int, int, int] | None:
        """None: no worker opened a pass (the dataset iterated as it is): the listed order."""
        return self.keys.get(dataset)


def source_stream(described: dict, dataset: Callable[[str], object], stage: StageConfig):
    """A source of ``stage`` as a worker streams it (``training.stream.SourceStream``), as ``stage_datasets``
    described it: a prepared one read from its shards, a raw one as passes over ``dataset(key)`` (this worker's
    shard of the dataset, or the dataset itself)."""
    from sbert_ray.training.stream import SourceStream  # here: see the module's docstring

    if "prepared" in described:
        prepared = PreparedPasses.from_wire(described["prepared"], stage)
        return SourceStream(described["name"], described["rows"], described["weight"], None, prepared)
    opener = pass_opener(dataset(described["key"]), described)
    return SourceStream(described["name"], described["rows"], described["weight"], opener)


def pass_opener(stream, described: dict) -> Callable[[tuple[int, int, int]], Iterable[pa.Table]]:
    """Passes over ``stream`` (a worker's shard of the dataset ``described`` names, or the dataset itself), each
    read in the order its key seeds: the key handed to the dataset's ``PassKeys`` before the pass is asked for."""

    def open_pass(key: tuple[int, int, int]) -> Iterable[pa.Table]:
        ray.get(described["pass_keys"].set.remote(described["key"], key))
        return stream.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2)

    return open_pass


class _SourceFiles(Datasource):
    """A source as read tasks: one per file, or one for a registered dataset, in the order of the pass its
    ``pass_key`` (a ``PassKeys`` actor, the dataset's key) names; None: the listed order."""

    def __init__(self, source: Source, stage: StageConfig, data_dir, pass_key: tuple | None = None):
        super().__init__()
        self.source, self.stage, self.data_dir, self.pass_key = source, stage, data_dir, pass_key

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
        stage, data_dir = self.stage, self.data_dir
        key = None if self.pass_key is None else ray.get(self.pass_key[0].get.remote(self.pass_key[1]))
        own = dict(file_sources(self.source))  # each file's task carries that file alone
        metadata = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=None)
        return [
            ReadTask(functools.partial(read_tables, own[file], file, stage, data_dir), metadata, schema=None)
            for file, _ in pass_reads(self.source, stage, key)
        ]


def tokenize(table: pa.Table, model_json: str) -> pa.Table:
    """The map stage, fused into the read tasks (no process of its own to start; Ray's pooled workers keep the
    tokenizer they loaded for the next table)."""
    from sbert_ray.models.load import one_tokenizer_thread  # here: see the module's docstring
    from sbert_ray.training.batches import tokenize_table

    one_tokenizer_thread()
    return tokenize_table(table, _tokenizer(model_json))


@functools.lru_cache(maxsize=2)
def _tokenizer(model_json: str):
    from sbert_ray.models.load import load_tokenizer  # here: see the module's docstring

    return load_tokenizer(**json.loads(model_json))
