"""Input pipeline throughput: the pairs/s one worker's data path delivers with no model in the way (read, tokenise,
windowed smart batching and collation into padded tensors), beside the pairs/s the training step consumes.

The pipeline runs as a training worker's does (``training.stream.StageBatches``, world size 1): ``local`` in this
process without Ray (``local_sources``: read and tokenised here, as ``sbert-ray bench train --local`` and a
one-GPU machine run), else through the cluster (``training.stage_data.stage_datasets``: read and tokenise tasks on
the cluster's CPUs, the stream consumed in this process as a Train worker consumes its shard). Each run times
``batches`` micro-batches (default: one pass over the data) from opening the stream, so the pipeline's start counts.

The training side is our Ray-free training core on the same model, batch and length (``bench.train_speed``,
STSb regression). The ratio says how far the input path is ahead of the step; ``target_pairs_per_s`` (default:
a GPU worker taking a step of 256 pairs every 40 ms) says whether one worker's input path would keep up with it.

Per CPU: ``local``, the pairs per CPU-second this process spent (all its threads, the tokenizer's among them);
through the cluster, per CPU of the cluster (every one may run a read-and-tokenise task: an upper bound on what
the path used). ``cpus_per_target``: the CPUs that feed ``target_pairs_per_s`` at that rate, e.g. per GPU. A
source ``sbert-ray prepare`` wrote (``source``: prepared) is read as it is; timing it beside its raw source shows
what tokenising once saves.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from sbert_ray.bench import tables
from sbert_ray.config import ConfigError, ModelConfig, StageConfig, TrainConfig
from sbert_ray.models import load_encoder
from sbert_ray.models.padded_widths import buckets_for
from sbert_ray.training.sources import stage_sources
from sbert_ray.training.stream import SourceStream, StageBatches, batch_plan, local_sources, stage_steps

GPU_STEP_PAIRS_PER_S = 256 / 0.040  # a GPU worker taking a 256-pair step every 40 ms


@dataclass(frozen=True)
class IngestBenchSettings:
    model: str = "sentence-transformers/all-MiniLM-L6-v2"
    data_dir: str | None = None
    dataset: str = "stsb"  # a registered name, or a file, folder, glob or s3:// prefix of scored pairs
    batch_size: int = 16  # one worker's micro-batch
    max_seq_length: int = 128
    window_batches: int = 200
    limit: int | None = None  # first N pairs of the dataset
    batches: int | None = None  # micro-batches timed per run; None: one pass over the data
    seed: int = 42

    def stage(self) -> StageConfig:
        return StageConfig(
            dataset=self.dataset,
            limit=self.limit,
            batch_size=self.batch_size,
            window_batches=self.window_batches,
        )

    def config(self) -> TrainConfig:
        config = TrainConfig(
            name="bench-ingest",
            seed=self.seed,
            data_dir=self.data_dir,
            model=ModelConfig(name=self.model, max_seq_length=self.max_seq_length),
            stages=[self.stage()],
        )
        config.validate()
        return config


def run_ingest_bench(
    settings: IngestBenchSettings,
    repeats: int = 3,
    local: bool = False,
    train_steps: int = 0,
    train_threads: int = 1,
    target_pairs_per_s: float = GPU_STEP_PAIRS_PER_S,
    progress: Callable[[str], None] = lambda line: None,
) -> dict:
    """One record: the input path's pairs/s over ``repeats`` runs (median, runs) and, with ``train_steps``, the
    pairs/s our training core consumes on the same model and batch (STSb regression, ``train_threads`` torch
    threads, this process). Unless ``local``, Ray must be initialised."""
    if train_steps == 1 or train_steps < 0:
        raise ConfigError("--train-steps must be 0 (no training run) or >= 2: the first step is timed apart")
    config = settings.config()
    encoder = load_encoder(settings.model, max_seq_length=settings.max_seq_length, seed=settings.seed)
    sources = _sources(config, encoder, local)
    rates, steady, firsts, busy, pairs = [], [], [], [], 0
    for repeat in range(repeats):
        cpu_started = time.process_time()
        pairs, seconds, first, first_pairs = _time_batches(config, sources, encoder, settings.batches)
        busy.append((time.process_time() - cpu_started) / seconds)  # CPUs this process kept busy
        rates.append(pairs / seconds)
        steady.append((pairs - first_pairs) / (seconds - first) if seconds > first else None)
        firsts.append(first)
        progress(f"repeat {repeat + 1}/{repeats}: {rates[-1]:.0f} pairs/s, first batch after {first:.2f} s")
    train = _train_rate(settings, train_steps, train_threads) if train_steps else None
    median = statistics.median(rates)
    cpus = statistics.median(busy) if local else _cluster_cpus()
    return {
        "impl": "sbert-ray",
        "mode": "local" if local else "ray",
        "source": "prepared" if any(s.manifest for s in stage_sources(config.stages[0], 0)) else "raw",
        **{k: v for k, v in asdict(settings).items() if k != "data_dir"},
        "rows": sum(s.rows for s in sources),
        "pairs_per_run": pairs,
        "ingest_pairs_per_s": median,
        "ingest_pairs_per_s_runs": rates,
        "spread": (max(rates) - min(rates)) / median,
        # the stream's start (read, tokeniser start-up, the first window) left out
        "ingest_pairs_per_s_after_first_batch": statistics.median(steady) if None not in steady else None,
        "time_to_first_batch_s": statistics.median(firsts),
        "train_pairs_per_s": train,
        "train_steps": train_steps or None,
        "train_threads": train_threads if train_steps else None,
        "ingest_vs_train": median / train if train else None,
        "target_pairs_per_s": target_pairs_per_s,
        "ingest_vs_target": median / target_pairs_per_s,
        "ingest_cpus": cpus,
        "ingest_pairs_per_s_per_cpu": median / cpus,
        "cpus_per_target": target_pairs_per_s * cpus / median,
        "cpus": os.cpu_count(),
        "load_1m": os.getloadavg()[0],
    }


def _cluster_cpus() -> float:
    import ray  # here: the local mode runs without it

    return ray.cluster_resources().get("CPU", 0.0)


def _sources(config: TrainConfig, encoder, local: bool) -> list[SourceStream]:
    """The stage's sources as one worker streams them: tokenised here (``local``) or by the cluster."""
    if local:
        return local_sources(config, 0, encoder, tokenise_every_pass=True)
    import ray.data

    from sbert_ray.training.stage_data import count_rows, source_stream, stage_datasets

    # as the Train workers' DataConfig: one fixed order, so every run streams the same batches
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    stage = config.stages[0]
    listed = stage_sources(stage, 0)
    rows = [count_rows(source, stage, config.data_dir) for source in listed]
    datasets, (described,) = stage_datasets(config, [listed], [rows])
    return [source_stream(d, datasets.get, stage) for d in described]


def _time_batches(config: TrainConfig, sources: list[SourceStream], encoder, batches: int | None):
    """(pairs, seconds, seconds to the first batch, its pairs) for ``batches`` collated micro-batches (None: one
    pass) from a fresh stream."""
    stage = config.stages[0]
    plan = batch_plan(stage, 0, config.seed, world_size=1, rank=0)
    per_epoch, _ = stage_steps([s.rows for s in sources], [s.weight for s in sources], stage, plan)
    tokenizer, device = encoder.tokenizer, torch.device("cpu")
    pad_left = tokenizer.padding_side == "left"
    buckets = buckets_for(device, encoder.compiled, encoder.max_seq_length)
    started = time.perf_counter()
    stream = StageBatches(
        sources, plan, per_epoch, epoch=0, position=0,
        collate=lambda batch: batch[0].collate(batch[1], tokenizer.pad_token_id, pad_left, device, buckets),
    )  # fmt: skip
    pairs, first, first_pairs = 0, None, 0
    try:
        for taken, micro_batch in enumerate(stream, start=1):
            pairs += micro_batch.size
            if first is None:
                first, first_pairs = time.perf_counter() - started, micro_batch.size
            if taken == (batches or per_epoch):
                break
        return pairs, time.perf_counter() - started, first, first_pairs
    finally:
        # A stream left mid-pass keeps Ray Data's executor running; after Ray shuts down at exit its threads
        # would retry their metrics calls for ever. Closing the sources' generators ends their iterators now.
        for source_batches in stream.streams:
            source_batches.close()


def _train_rate(settings: IngestBenchSettings, steps: int, threads: int) -> float:
    """Pairs/s our training core consumes (after its first step) on the same model, batch and length."""
    from sbert_ray.bench.train_speed import TrainBenchSettings, bench_config, ours_in_process

    train = TrainBenchSettings(
        model=settings.model,
        data_dir=settings.data_dir,
        batch_size=settings.batch_size,
        max_seq_length=settings.max_seq_length,
        steps=steps,
        precision="fp32",
    )
    torch.set_num_threads(threads)
    return ours_in_process(bench_config(train, 1, threads, storage=""))["pairs_per_s"]


COLUMNS = (  # (header, record key, format)
    ("mode", "mode", "{}"),
    ("source", "source", "{}"),
    ("batch", "batch_size", "{}"),
    ("window", "window_batches", "{}"),
    ("ingest pairs/s", "ingest_pairs_per_s", "{:.0f}"),
    ("spread", "spread", "{:.0%}"),
    ("first batch s", "time_to_first_batch_s", "{:.2f}"),
    ("after it", "ingest_pairs_per_s_after_first_batch", "{:.0f}"),
    ("train pairs/s", "train_pairs_per_s", "{:.1f}"),
    ("x train", "ingest_vs_train", "{:.1f}"),
    ("target pairs/s", "target_pairs_per_s", "{:.0f}"),
    ("x target", "ingest_vs_target", "{:.2f}"),
    ("CPUs", "ingest_cpus", "{:.2f}"),
    ("pairs/s per CPU", "ingest_pairs_per_s_per_cpu", "{:.0f}"),
    ("CPUs for target", "cpus_per_target", "{:.1f}"),
)
LOGGED_METRICS = ("ingest_pairs_per_s", "ingest_pairs_per_s_after_first_batch", "time_to_first_batch_s",
                  "train_pairs_per_s", "ingest_vs_train", "ingest_vs_target", "ingest_pairs_per_s_per_cpu",
                  "cpus_per_target")  # fmt: skip


def format_table(records: list[dict]) -> str:
    return tables.format_table(records, COLUMNS)


def log_records(records: list[dict], params: dict, tracking_uri: str, experiment: str) -> str:
    """One MLflow run: params, the headline numbers per record, the records as JSON; returns its id."""
    return tables.log_records(
        records, "ingest", lambda r: f"{r['mode']}/{r['source']}", LOGGED_METRICS, params, tracking_uri, experiment
    )
