"""Training throughput: this project's Ray Train worker loop with 1..N workers beside sentence-transformers'
``SentenceTransformerTrainer``, at the same model, data (STSb train, regression), batch and maximum sequence length.
The in-batch-negative objectives (``mnrl``, ``cached_mnrl``) train on the offline NLI set's entailment pairs
(``nli-offline``: 5,270 pairs), ours only. ``reranker_bce`` trains a reranker (``model.type: cross_encoder``) on
STSb's pairs, scores / 5 as the targets, beside sentence-transformers' ``CrossEncoderTrainer`` with
``BinaryCrossEntropyLoss``.

Every variant trains ``steps`` optimizer steps from the same model; repeats run interleaved (A B C A B C ...) so
that a change in machine load hits all variants alike. Per run: the time from ``fit()`` (ours: building the
``TorchTrainer``, so Ray Train's worker start-up counts; the reference: loading its model) to the end of the first
optimizer step, and the steady pairs/s after it. Ours runs the real worker loop (``train_loop_per_worker``) on the
connected Ray cluster (``bench.train_speed_on_ray``), or with ``local`` the same Ray-free training core
(``training.stages``) in this process, without importing Ray, MLflow or datasets (one GPU machine without them);
the reference runs as a Ray task with one worker's resources (or, ``local``, in this process; it needs the
``datasets`` package). The model is loaded where each variant runs (a ``random:<shape>`` model is built there from
the seed), so nothing on the driver's disk needs to be visible to other nodes except the checkpoint storage: on a
multi-node cluster ``storage_path`` must be shared (``s3://...`` or NFS), as ``checkpoint.storage_path`` of a
training run.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from sbert_ray.bench import tables
from sbert_ray.bench.flops import ForwardFlops, datasheet_peak, matmul_peak
from sbert_ray.config import ConfigError, EvalConfig, ModelConfig, ScalingConfig, StageConfig, TrainConfig
from sbert_ray.data.readers import check_available, load_records
from sbert_ray.evaluation.dev_score import DevScorer, dev_spec
from sbert_ray.files import json_text
from sbert_ray.models import build_random_bert, check_model, load_encoder, resolve_model_ref
from sbert_ray.models.encoder import compiles, half_dtype
from sbert_ray.models.load import RANDOM_PREFIX
from sbert_ray.models.model_type import ModelType
from sbert_ray.training.batches import TokenizedRows
from sbert_ray.training.loop import LocalReporter
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.precision import resolve_precision
from sbert_ray.training.stage_plan import stage_plans
from sbert_ray.training.stages import Worker, start_worker, train_stages
from sbert_ray.training.storage import resolve_storage
from sbert_ray.training.stream import local_sources

OURS, REFERENCE = "sbert-ray", "sentence-transformers"
# How our report points treat the dev scoring and the checkpoint: (evaluation.async_dev, checkpoint.upload).
# none: no report point before the last step (the baseline the others' step times are held to); sync: rank 0 scores
# the dev pairs and training waits for the checkpoint's write and upload; async-upload (a training run's defaults
# where no dev scorer fits beside the workers): rank 0 scores, the checkpoint is copied to host memory and written
# and uploaded in the background; async: both beside training (a Ray task on evaluation.dev_resources scores each
# checkpoint).
REPORT_MODES = {
    "none": (False, "async"),
    "sync": (False, "sync"),
    "async-upload": (False, "async"),
    "async": (True, "async"),
}
DEFAULT_REPORTS = "async-upload"
STARTUP_KEYS = ("time_to_worker_start_s", "time_to_data_s")
# The registered dataset each objective the bench runs trains on: STSb's scored pairs, or for in-batch negatives the
# entailment pairs of the offline NLI set (both local with a data folder: scripts/gpu_carry.py copies them).
DATASETS = {"regression": "stsb", "mnrl": "nli-offline", "cached_mnrl": "nli-offline", "reranker_bce": "stsb"}
REFERENCE_OBJECTIVES = ("regression", "reranker_bce")  # what sentence-transformers' trainers run here


@dataclass(frozen=True)
class TrainBenchSettings:
    """What every variant shares: model, data, batch, length, steps, device and precision."""

    model: str = "sentence-transformers/all-MiniLM-L6-v2"
    objective: str = "regression"  # a DATASETS key
    data_dir: str | None = None
    batch_size: int = 16  # global: split over the workers
    max_seq_length: int = 128
    steps: int = 60  # optimizer steps per run; the first is timed apart, the rest give pairs/s
    limit: int | None = None  # first N training pairs (default: all)
    device: str = "cpu"
    precision: str = "fp32"  # auto, bf16, fp16, fp32 as scaling.precision
    seed: int = 42
    eval_every: int = 0  # steps between report points (dev evaluation + checkpoint); 0: only after the last step
    dev_limit: int | None = 10  # STSb dev pairs each report point scores (None: all 1,500, as the quickstart)
    compile: bool | Literal["auto"] = "auto"  # scaling.compile

    @property
    def model_type(self) -> ModelType:
        return "cross_encoder" if self.objective.startswith("reranker") else "bi_encoder"

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ConfigError("--steps must be >= 2: the first step is timed apart from the rest")
        if self.batch_size % 2:
            raise ConfigError("--batch-size must be even: the 2-process reference trainer splits it in halves")
        if self.objective not in DATASETS:
            raise ConfigError(f"--objective: {self.objective!r} is not one of {', '.join(DATASETS)}")


def worker_layouts(workers: Sequence[int], threads_per_worker: Sequence[int]) -> list[tuple[int, int]]:
    """(workers, torch threads per worker) of each variant: one thread count for every worker count, or one each."""
    threads = threads_per_worker
    if len(threads) not in (1, len(workers)):
        raise ConfigError("--threads-per-worker takes one number, or one per --workers entry")
    return list(zip(workers, threads * len(workers) if len(threads) == 1 else threads, strict=True))


@dataclass
class Variant:
    impl: str
    workers: int
    threads_per_worker: int
    reports: str | None = None  # ours: a REPORT_MODES key
    pairs_per_s: list[float] = field(default_factory=list)
    time_to_first_step_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)  # each run from its start to its result (scores included)
    load_1m: list[float] = field(default_factory=list)  # the machine's 1-minute load average as each run started
    startup: list[dict] = field(default_factory=list)  # ours: seconds from fit() to the worker's start and its data
    report_share: list[float | None] = field(default_factory=list)  # ours: share of rank 0's time at report points
    peak_memory_gib: list[float | None] = field(default_factory=list)  # ours, in this process on a GPU


def check_inputs(settings: TrainBenchSettings, reference: bool = True) -> None:
    """Model, data and device checked on the driver before any cluster work (ModelError, DataError, ConfigError)."""
    if settings.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device: {settings.device!r} is not cpu or cuda")
    if reference and settings.objective not in REFERENCE_OBJECTIVES:
        raise ConfigError(f"--objective {settings.objective}: sentence-transformers' trainers run "
                          f"{' and '.join(REFERENCE_OBJECTIVES)} here; add --no-reference")  # fmt: skip
    if reference and importlib.util.find_spec("datasets") is None:
        raise ConfigError("sentence-transformers' trainer needs the datasets package: install it, or --no-reference")
    check_model(settings.model, settings.max_seq_length, model_type=settings.model_type)
    check_available(DATASETS[settings.objective], "train", settings.data_dir)


def run_train_bench(
    settings: TrainBenchSettings,
    layouts: Sequence[tuple[int, int]],
    repeats: int = 3,
    reference_threads: int | None = None,
    reference: bool = True,
    local: bool = False,
    storage_path: str | None = None,
    reports: Sequence[str] = (DEFAULT_REPORTS,),
    progress: Callable[[str], None] = lambda line: None,
) -> list[dict]:
    """Records for our loop at each (workers, threads per worker) layout in each of the ``reports`` modes
    (``REPORT_MODES``) and for the reference trainer (with ``reference_threads``, default the most CPUs a layout
    uses), interleaved ``repeats`` times. Unless ``local``, Ray must be initialised (the CLI joins RAY_ADDRESS, else
    starts a local cluster). Checkpoints go under ``storage_path`` (default: a temporary folder on this node,
    removed at the end)."""
    if local and any(workers != 1 for workers, _ in layouts):
        raise ConfigError("--local runs one worker in this process: use --workers 1")
    if local and "async" in reports:
        raise ConfigError("--reports async: --local has no Ray task to score checkpoints in; use sync, async-upload")
    on_ray = None
    if not local:
        from sbert_ray.bench import train_speed_on_ray as on_ray

        on_ray.check_cluster(settings.device)
    variants = [Variant(OURS, workers, threads, mode) for workers, threads in layouts for mode in reports]
    if reference:
        variants += [Variant(REFERENCE, workers, threads) for workers, threads in
                     reference_layouts(layouts, reference_threads)]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sbert-ray-bench-train-") as tmp:
        # One folder per bench: repeats of a layout never resume each other's checkpoints.
        storage = f"{resolve_storage(storage_path or tmp)}/bench-train-{time.strftime('%Y%m%d-%H%M%S')}"
        for repeat in range(repeats):
            for variant in variants:
                variant.load_1m.append(os.getloadavg()[0])
                started = time.perf_counter()
                # A run folder per variant too: Ray Train would resume another mode's run of the same layout.
                run_folder = f"{storage}/run-{repeat}" + (f"-{variant.reports}" if variant.reports else "")
                measured = _measure(settings, variant, run_folder, on_ray)
                variant.wall_s.append(time.perf_counter() - started)
                variant.pairs_per_s.append(measured["pairs_per_s"])
                variant.time_to_first_step_s.append(measured["time_to_first_step_s"])
                variant.startup.append({key: measured.get(key) for key in STARTUP_KEYS})
                variant.report_share.append(measured.get("report_share"))
                variant.peak_memory_gib.append(measured.get("peak_memory_gib"))
                share, first = variant.report_share[-1], measured["time_to_first_step_s"]
                progress(
                    f"repeat {repeat + 1}/{repeats} {label(_describe(variant, settings))}: "
                    f"{measured['pairs_per_s']:.1f} pairs/s, first step after {first:.1f} s, "
                    f"{variant.wall_s[-1]:.0f} s in all (load {variant.load_1m[-1]:.1f})"
                    + ("" if share is None else f", {share:.1%} at report points")
                )
    records = [_record(variant, settings) for variant in variants]
    _add_ratios(records)
    if local:  # the model loads here to count its FLOPs (on a cluster it may not fit this machine)
        add_utilisation(records, settings)
    return records


def reference_layouts(layouts: Sequence[tuple[int, int]], threads: int | None) -> list[tuple[int, int]]:
    """(processes, threads each) of the reference trainer: one process with ``threads`` (default: the most CPUs a
    layout of ours uses), and for each multi-worker count of ours as many DDP processes at that layout's threads,
    so that our N workers are compared with the peer paying the same all-reduce."""
    single = (1, threads or max(workers * each for workers, each in layouts))
    several = {workers: each for workers, each in layouts if workers > 1}
    return [single, *sorted(several.items())]


def _measure(settings: TrainBenchSettings, variant: Variant, storage: str, on_ray) -> dict:
    """One timed run of ``variant``: on the cluster (``on_ray``: the ``train_on_ray`` module) or in this process."""
    threads = variant.threads_per_worker
    if variant.impl == REFERENCE:
        run, args = (
            (reference_trainer_run, (settings, threads))
            if variant.workers == 1
            else (reference_ddp_run, (settings, variant.workers, threads))
        )
        if on_ray is None:
            return run(*args)
        gpus = variant.workers * int(settings.device == "cuda")
        return on_ray.run_as_task(run, *args, num_cpus=variant.workers * threads, num_gpus=gpus)
    config = bench_config(settings, variant.workers, threads, storage, variant.reports)
    return ours_in_process(config) if on_ray is None else on_ray.ours(config)


def model_folder(ref: str, workdir: Path, seed: int) -> str:
    """A folder (or Hub id) sentence-transformers loads: ``random:<shape>`` is built into ``workdir`` with the
    weights our workers build from the same seed (``load_encoder``)."""
    if ref.startswith(RANDOM_PREFIX):
        shape = ref.removeprefix(RANDOM_PREFIX)
        return str(build_random_bert(workdir / f"random-{shape}", shape=shape, seed=seed))
    return resolve_model_ref(ref)


def bench_config(
    settings: TrainBenchSettings, workers: int, threads: int, storage: str, reports: str = DEFAULT_REPORTS
) -> TrainConfig:
    """The quickstart's stage (STSb regression, lr 2e-5, 10% warm-up) cut to ``steps`` steps, on the bench's
    layout; report points (dev evaluation + checkpoint) every ``eval_every`` steps and after the last one, on
    ``dev_limit`` STSb dev pairs, scored and uploaded as the ``reports`` mode says (``REPORT_MODES``; none: only
    after the last step)."""
    async_dev, upload = REPORT_MODES[reports]
    config = TrainConfig(
        name="bench-train",
        seed=settings.seed,
        data_dir=settings.data_dir,
        model=ModelConfig(name=settings.model, max_seq_length=settings.max_seq_length, type=settings.model_type),
        # As many epochs as ``steps`` needs (the reference trainer also runs on past an epoch).
        stages=[
            StageConfig(
                dataset=DATASETS[settings.objective],
                objective=settings.objective,
                limit=settings.limit,
                epochs=settings.steps,
                max_steps=settings.steps,
                batch_size=settings.batch_size,
            )
        ],
        evaluation=EvalConfig(
            dev_limit=settings.dev_limit,
            eval_every=0 if reports == "none" else settings.eval_every,
            async_dev=async_dev,
            final_tasks=[],
        ),
        scaling=ScalingConfig(
            num_workers=workers,
            use_gpu=settings.device == "cuda",
            cpus_per_worker=threads,
            torch_threads=threads,
            precision=settings.precision,
            compile=settings.compile,
        ),
    )
    config.checkpoint.storage_path, config.checkpoint.upload = storage, upload
    config.validate()
    return config


def ours_in_process(config: TrainConfig) -> dict:
    """The worker's training core in this process, no Ray: one worker, its data read and tokenised in this
    process as it streams, whose report points score the dev pairs and write a checkpoint to a temporary folder on
    this machine (what a Ray worker does there, less the upload): with ``checkpoint.upload: async`` from a host copy
    in the background, as rank 0 does; with ``sync`` in the report. Timed from here, so the model's loading counts as
    a worker's does. On a GPU also the peak of its memory allocated by torch (``peak_memory_gib``)."""
    device = torch.device("cuda" if config.scaling.use_gpu else "cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    meter = StepMeter(time.time(), device)
    worker = Worker(device, resolve_precision(config.scaling.precision, device))
    started = start_worker(config, worker, restored=None)
    encoder = started.encoder
    if compiles(config.scaling.compile, device):
        encoder.compile_for_training()
    scorer = DevScorer(config.evaluation, config.data_dir, dev_spec(config.evaluation, model_type=config.model.type))
    stage_data = functools.partial(local_sources, config, encoder=encoder)
    with tempfile.TemporaryDirectory(prefix="sbert-ray-bench-checkpoints-") as checkpoints:
        background = config.checkpoint.upload == "async"
        reporter = ScoringReporter(encoder, scorer, Path(checkpoints), background)
        train_stages(stage_plans(config), started, stage_data, worker, reporter, meter)
        reporter.close()  # the last checkpoint written before its folder goes
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"precision": worker.precision, "peak_memory_gib": peak, **meter.summary()}


class ScoringReporter(LocalReporter):
    """A local reporter that scores the dev pairs before writing each report point's checkpoint, as rank 0 does."""

    def __init__(self, encoder, scorer: DevScorer, checkpoints: Path, background: bool):
        super().__init__(checkpoints, background)
        self.encoder, self.scorer = encoder, scorer

    def report(self, state, save, window: dict[str, float]) -> None:
        state.dev_score = self.scorer.scores(self.encoder)[self.scorer.key]
        super().report(state, save, window)


def training_flops_per_pair(settings: TrainBenchSettings) -> float:
    """Model FLOPs of training on one example, averaged over the bench's examples: forward and backward (3 x the
    forward, ``bench.flops.ForwardFlops``) of each of its texts at its own length, padding not counted. The texts are
    the training stream's (``local_sources``: the objective's dataset, tokenised as a worker tokenises it)."""
    encoder = load_encoder(settings.model, max_seq_length=settings.max_seq_length, seed=settings.seed)
    encoder.to(torch.device(settings.device))
    (source,) = local_sources(bench_config(settings, 1, 1, storage=""), 0, encoder)
    rows = TokenizedRows.concat(list(source.open_pass((settings.seed, 0, 0))))
    forward = ForwardFlops(encoder.transformer)
    lengths = [int(n) for column in rows.columns for n in np.diff(column.offsets)]
    return 3 * sum(forward.per_sequence(length) for length in lengths) / len(rows)


def add_utilisation(records: list[dict], settings: TrainBenchSettings) -> None:
    """Each record's model TFLOP/s (pairs/s x ``training_flops_per_pair``) and its share of the measured matmul
    peak of the record's arithmetic (``mfu``) and of the GPU's datasheet peak (``mfu_datasheet``, where
    ``bench.flops.datasheet_peak`` knows the GPU; else None)."""
    device = torch.device(settings.device)
    per_pair = training_flops_per_pair(settings)
    peaks: dict[str, float] = {}
    for record in records:
        precision = record["precision"]
        if precision not in peaks:
            peaks[precision] = matmul_peak(device, torch.float32 if precision == "fp32" else half_dtype(device))
        flops = record["pairs_per_s"] * per_pair
        datasheet = datasheet_peak(device, precision)
        record["model_tflops_per_s"] = flops / 1e12
        record["mfu"] = flops / peaks[precision]
        record["matmul_peak_tflops"] = peaks[precision] / 1e12
        record["mfu_datasheet"] = None if datasheet is None else flops / datasheet
        record["datasheet_tflops"] = None if datasheet is None else datasheet / 1e12


def reference_ddp_run(settings: TrainBenchSettings, processes: int, threads: int) -> dict:
    """sentence-transformers' trainer in ``processes`` DDP processes started by torchrun (gloo on CPUs, NCCL on
    GPUs), each with ``threads`` torch threads and its share of the global batch; timed on rank 0 from here."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="sbert-ray-bench-st-ddp-") as tmp:
        result = Path(tmp) / "rank0.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
            "-m", "sbert_ray.bench.train_speed", json_text(dataclasses.asdict(settings)), str(threads),
            str(started), str(result),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        ran = subprocess.run(command, env=env, capture_output=True, text=True)
        if ran.returncode:
            raise RuntimeError(f"the {processes}-process reference trainer failed:\n{ran.stderr[-3000:]}")
        return json.loads(result.read_text())


def reference_trainer_run(settings: TrainBenchSettings, threads: int, started: float | None = None) -> dict:
    """sentence-transformers' own trainer with the quickstart's settings on the same pairs (a reranker's: its
    ``CrossEncoderTrainer``, ``BinaryCrossEntropyLoss`` on scores / 5); timed by a callback from ``started``
    (default: now, before the model is loaded) to the end of the first step, then over the remaining steps. Under
    torchrun each process trains its share of the batch with DDP."""
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback

    started = started or time.time()
    torch.set_num_threads(threads)
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(settings.device)
    precision = resolve_precision(settings.precision, device)
    pairs = load_records("stsb", "train", settings.data_dir)[: settings.limit]
    data = {
        "sentence1": [p.sentence1 for p in pairs],
        "sentence2": [p.sentence2 for p in pairs],
        "score": [p.score / 5 for p in pairs],
    }
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_ends.append(time.time())

    with tempfile.TemporaryDirectory(prefix="sbert-ray-bench-st-") as output_dir:
        folder = model_folder(settings.model, Path(output_dir), settings.seed)
        model, trainer_class, arguments_class, loss = _reference_parts(settings, folder, device)
        args = arguments_class(
            output_dir=output_dir,
            per_device_train_batch_size=settings.batch_size // processes,
            max_steps=settings.steps,
            learning_rate=2e-5,
            warmup_steps=0.1,  # a float is a ratio of the steps (transformers 5)
            weight_decay=0.01,
            adam_epsilon=1e-6,
            max_grad_norm=1.0,
            seed=settings.seed,
            bf16=precision == "bf16",
            fp16=precision == "fp16",
            use_cpu=device.type == "cpu",
            ddp_backend=("gloo" if device.type == "cpu" else "nccl") if processes > 1 else None,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
        )
        trainer = trainer_class(
            model=model, args=args, train_dataset=Dataset.from_dict(data), loss=loss, callbacks=[StepClock()]
        )
        trainer.remove_callback(PrinterCallback)  # it prints its logs to stdout, where the bench's JSON goes
        trainer.train()
    return {
        "processes": args.world_size,
        "precision": precision,
        "time_to_first_step_s": step_ends[0] - started,
        "pairs_per_s": (len(step_ends) - 1) * settings.batch_size / (step_ends[-1] - step_ends[0]),
    }


def _reference_parts(settings: TrainBenchSettings, folder: str, device: torch.device) -> tuple:
    """sentence-transformers' model (loaded from ``folder``), trainer and arguments classes and loss for the
    objective: a bi-encoder's CosineSimilarityLoss (regression), or a reranker's BinaryCrossEntropyLoss."""
    if settings.model_type == "cross_encoder":
        from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer, CrossEncoderTrainingArguments
        from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

        model = CrossEncoder(folder, num_labels=1, max_length=settings.max_seq_length, device=str(device))
        return model, CrossEncoderTrainer, CrossEncoderTrainingArguments, BinaryCrossEntropyLoss(model)
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.sentence_transformer.losses import CosineSimilarityLoss

    model = SentenceTransformer(folder, device=str(device), trust_remote_code=False)
    model.max_seq_length = settings.max_seq_length
    return model, SentenceTransformerTrainer, SentenceTransformerTrainingArguments, CosineSimilarityLoss(model)


def _describe(variant: Variant, settings: TrainBenchSettings) -> dict:
    return {
        "impl": variant.impl,
        "objective": settings.objective,
        "compile": compiles(settings.compile, torch.device(settings.device)),
        "reports": variant.reports,
        "precision": resolve_precision(settings.precision, torch.device(settings.device)),
        "device": settings.device,
        "batch_size": settings.batch_size,
        "workers": variant.workers,
        "threads_per_worker": variant.threads_per_worker,
    }


def label(record: dict) -> str:
    """impl/layout/precision, and for ours a report mode other than the default."""
    reports = record.get("reports")
    mode = f"/{reports}" if reports not in (None, DEFAULT_REPORTS) else ""
    return f"{record['impl']}/{record['workers']}x{record['threads_per_worker']}/{record['precision']}{mode}"


def _record(variant: Variant, settings: TrainBenchSettings) -> dict:
    rates, firsts = variant.pairs_per_s, variant.time_to_first_step_s
    median = statistics.median(rates)
    return {
        **_describe(variant, settings),
        "model": settings.model,
        "max_seq_length": settings.max_seq_length,
        "steps": settings.steps,
        "train_pairs_limit": settings.limit,
        "pairs_per_s": median,
        "pairs_per_s_min": min(rates),
        "pairs_per_s_max": max(rates),
        "spread": (max(rates) - min(rates)) / median,
        "pairs_per_s_runs": rates,
        "steps_per_s": median / settings.batch_size,
        "time_to_first_step_s": statistics.median(firsts),
        "time_to_first_step_s_runs": firsts,
        "wall_s": statistics.median(variant.wall_s),
        "wall_s_runs": variant.wall_s,
        "load_1m_runs": variant.load_1m,
        **_report_shares(variant.report_share),
        **_peak_memory(variant.peak_memory_gib),
        **{
            f"{key}_runs": [run[key] for run in variant.startup]
            for key in STARTUP_KEYS
            if any(run.get(key) is not None for run in variant.startup)
        },
    }


def _report_shares(shares: list[float | None]) -> dict:
    """The share of wall time at report points (median and per run), where the runs measured it (ours)."""
    if any(share is None for share in shares):
        return {}
    return {"report_share": statistics.median(shares), "report_share_runs": shares}


def _peak_memory(peaks: list[float | None]) -> dict:
    """The largest peak of GPU memory allocated by torch over the runs, where they measured it (ours on a GPU)."""
    measured = [peak for peak in peaks if peak is not None]
    return {"peak_memory_gib": max(measured)} if measured else {}


def _add_ratios(records: list[dict]) -> None:
    """Ratios of medians: against the reference trainer with as many processes as our workers (else its single
    process), and against our first layout (e.g. 1 worker x 2 threads) as ``vs_first_layout``;
    ``scaling_efficiency`` is pairs/s per worker over one worker's at the same threads and report mode."""
    references = {r["workers"]: r["pairs_per_s"] for r in records if r["impl"] == REFERENCE}
    ours = [r for r in records if r["impl"] == OURS]
    for record in records:
        reference = references.get(record["workers"], references.get(1))
        record["vs_reference"] = record["pairs_per_s"] / reference if reference else None
    for record in ours:
        record["vs_first_layout"] = record["pairs_per_s"] / ours[0]["pairs_per_s"]
        single = next(
            (
                r
                for r in ours
                if r["workers"] == 1
                and r["threads_per_worker"] == record["threads_per_worker"]
                and r["reports"] == record["reports"]
            ),
            None,
        )
        record["scaling_efficiency"] = (
            record["pairs_per_s"] / (record["workers"] * single["pairs_per_s"]) if single else None
        )


COLUMNS = (  # (header, record key, format)
    ("impl", "impl", "{}"),
    ("reports", "reports", "{}"),
    ("workers x threads", "layout", "{}"),
    ("precision", "precision", "{}"),
    ("batch", "batch_size", "{}"),
    ("pairs/s", "pairs_per_s", "{:.1f}"),
    ("steps/s", "steps_per_s", "{:.2f}"),
    ("spread", "spread", "{:.0%}"),
    ("x reference", "vs_reference", "{:.2f}"),
    ("x first layout", "vs_first_layout", "{:.2f}"),
    ("scaling eff.", "scaling_efficiency", "{:.2f}"),
    ("at reports", "report_share", "{:.1%}"),
    ("MFU", "mfu", "{:.1%}"),
    ("MFU datasheet", "mfu_datasheet", "{:.1%}"),
    ("peak GiB", "peak_memory_gib", "{:.1f}"),
    ("first step s", "time_to_first_step_s", "{:.1f}"),
    ("wall s", "wall_s", "{:.0f}"),
)


def format_table(records: Sequence[dict]) -> str:
    """One row per record (medians over the repeats); spread is (max - min) / median of the runs' pairs/s."""
    layouts = [{**record, "layout": f"{record['workers']} x {record['threads_per_worker']}"} for record in records]
    return tables.format_table(layouts, COLUMNS)


def chart(records: Sequence[dict], title: str):
    """Pairs/s (median, min-max whiskers) and time to the first step, one bar per record; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label(r) for r in records]
    colours = ["tab:blue" if r["impl"] == OURS else "tab:gray" for r in records]
    fig, (rate_ax, first_ax) = plt.subplots(1, 2, figsize=(11, 0.45 * len(records) + 1.8), sharey=True)
    rates = [r["pairs_per_s"] for r in records]
    whiskers = [
        [r["pairs_per_s"] - r["pairs_per_s_min"] for r in records],
        [r["pairs_per_s_max"] - r["pairs_per_s"] for r in records],
    ]
    rate_ax.barh(range(len(records)), rates, xerr=whiskers, color=colours, capsize=3)
    rate_ax.set_yticks(range(len(records)), labels, fontsize=8)
    rate_ax.invert_yaxis()
    rate_ax.set_xlabel("training pairs / s (median of repeats, min-max)")
    first_ax.barh(range(len(records)), [r["time_to_first_step_s"] for r in records], color=colours)
    first_ax.set_xlabel("seconds to the first optimizer step (median)")
    for ax in (rate_ax, first_ax):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def log_records(records: Sequence[dict], params: dict, tracking_uri: str, experiment: str) -> str:
    """One MLflow run: params, pairs/s and ratios per record, the records as JSON and the chart; returns its id."""
    import matplotlib.pyplot as plt

    from sbert_ray.tracking.mlflow_run import RunTracker, environment_tags

    with RunTracker(tracking_uri, experiment, run_name="bench-train") as tracker:
        tracker.set_tags(environment_tags())
        tracker.log_params(params)
        tracker.log_metrics(
            {
                f"{label(record)}/{key}": record[key]
                for record in records
                for key in (
                    "pairs_per_s",
                    "steps_per_s",
                    "time_to_first_step_s",
                    "vs_reference",
                    "vs_first_layout",
                    "scaling_efficiency",
                    "report_share",
                    "wall_s",
                    "mfu",
                    "mfu_datasheet",
                    "peak_memory_gib",
                )
                if record.get(key) is not None
            }
        )
        tracker.log_text(json_text({"records": list(records)}), "bench_train.json")
        figure = chart(records, f"sbert-ray bench train: {params['model']}, batch {params['batch_size']}")
        tracker.log_figure(figure, "bench_train.png")
        plt.close(figure)
        return tracker.run_id


if __name__ == "__main__":  # one process of reference_ddp_run: SETTINGS_JSON THREADS STARTED RESULT_FILE
    _settings, _threads, _started, _result = sys.argv[1:]
    _measured = reference_trainer_run(TrainBenchSettings(**json.loads(_settings)), int(_threads), float(_started))
    if int(os.environ["RANK"]) == 0:
        Path(_result).write_text(json_text(_measured))
