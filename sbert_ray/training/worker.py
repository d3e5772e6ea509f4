"""``train_loop_per_worker``: what every Ray Train worker runs, a thin adapter around the Ray-free training core
(``training.stages``, ``training.loop``): DDP set up by Ray Train, each stage's data from its Ray Data shards, and a
reporter that logs rank 0's metrics to the run the driver opened and calls ``ray.train.report``.

Rank 0 additionally scores the dev set (or, with ``evaluation.async_dev``, has Ray Train score each checkpoint in a
task beside training: ``training.validation``) and writes checkpoints (the last one holds the final model),
weights-only or full state (``checkpoint.full_every``); all ranks call ``ray.train.report`` at the same points,
which is also where they synchronise. Checkpoints upload in the background (Ray Train's async upload mode: one
upload thread per worker, so uploads never race and are committed in report order) while training continues
(``checkpoint.upload: sync``: the report point waits for it). A
restarted worker resumes from the latest full-state checkpoint (``resume_checkpoint``), never from a weights-only
one; so does every worker of an elastic run (``scaling.num_workers: [min, max]``) that Ray Train restarted at
another size, where each stage's global batch, data position and schedule carry over (``training.stream``).
Saving the final model and scoring it are the run layer's (``sbert_ray.runs.train_run``). On a NaN or infinite
loss every rank stops together and returns it (rather than fail: Ray would restart them from the checkpoint into
the same NaN).
"""

from __future__ import annotations

import functools
import logging
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from sbert_ray.config import TrainConfig, from_dict
from sbert_ray.data.readers import resolve_data_dir
from sbert_ray.evaluation.dev_score import DEV_SCORE, DevScorer
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.model_card import describe_hardware
from sbert_ray.tracking.mlflow_run import RunLogger
from sbert_ray.training.loop import CheckpointWriter, Diverged
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.precision import resolve_precision
from sbert_ray.training.stages import Worker, start_worker, train_stages
from sbert_ray.training.state import TrainState
from sbert_ray.training.stream import SourceStream

log = logging.getLogger(__name__)

UPLOAD_MODES = {"async": ray.train.CheckpointUploadMode.ASYNC, "sync": ray.train.CheckpointUploadMode.SYNC}
WEIGHTS_ONLY = "weights_only"  # in a report's metrics: its checkpoint holds no optimizer state, no resume point

# DDP all-reduces gradients in buckets of this size as soon as backward has filled one (the last layers' first),
# so communication overlaps the rest of backward.
DDP_BUCKET_CAP_MB = 25


def train_loop_per_worker(loop_config: dict) -> dict:
    """Train every stage; returns rank 0's summary (``Result.return_value``): throughput, time to the first step,
    and ``diverged`` when a NaN/inf loss stopped the run."""
    config = from_dict(TrainConfig, loop_config["config"])
    context = ray.train.get_context()
    # use_gpu decides, not what is visible: a CPU run on a machine with GPUs stays on the CPU.
    device = ray.train.torch.get_device() if config.scaling.use_gpu else torch.device("cpu")
    meter = StepMeter(loop_config["fit_started"], device)  # from fit(): Ray Train's start-up counts
    precision, world_size = resolve_precision(config.scaling.precision, device), context.get_world_size()
    # Gradients travel as bf16 (half the bytes) and are averaged back into fp32.
    bf16_gradients = world_size > 1 and device.type == "cuda" and precision == "bf16"
    ddp = functools.partial(_ddp, bf16_gradients=bf16_gradients)
    worker = Worker(device, precision, context.get_world_rank(), world_size, distribute=ddp)
    tracking = loop_config["tracking"]  # run id, URI, file for metrics in outages; None: no MLflow run (benchmarks)
    with tempfile.TemporaryDirectory(prefix="sbert-ray-resume-") as resume_dir:
        checkpoint = resume_checkpoint()
        restored = None if checkpoint is None else Path(checkpoint.to_directory(resume_dir))
        encoder, state = start_worker(config, worker, restored)
        if config.scaling.compile:
            encoder.compile_for_training()
        run_logger = RunLogger(**tracking) if worker.rank == 0 and tracking else None
        reporter = RayReporter(config, worker, encoder, run_logger, loop_config["report_gate"])
        try:
            train_stages(config, encoder, state, restored, _stage_data(loop_config), worker, reporter, meter)
        except Diverged as diverged:
            return _summary(worker, meter, diverged)
        finally:
            if run_logger:
                run_logger.drain()  # the metrics thread dies with this process: hand its queue on first
    return _summary(worker, meter)


def resume_checkpoint() -> ray.train.Checkpoint | None:
    """The checkpoint a restarted or resubmitted run resumes from: the latest one reported when it holds the full
    state (Ray Train's ``get_checkpoint()``, which returns the latest), else the latest full-state one Ray Train still
    keeps. None: a new run, or keep_best removed every full-state checkpoint (the run starts over, warned)."""
    if ray.train.get_checkpoint() is None:
        return None
    reported = ray.train.get_all_reported_checkpoints(consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)
    full = [r for r in reported if not r.metrics.get(WEIGHTS_ONLY)]
    if not full:
        log.warning("no full-state checkpoint left to resume from (checkpoint.keep_best removed them): starting over")
        return None
    return max(full, key=lambda r: r.metrics["global_step"]).checkpoint


def _stage_data(loop_config: dict) -> Callable[[int], list[SourceStream]]:
    """Stage i's sources as this worker's shards of their Ray datasets (``training.stage_data``), each pass a new
    iteration of the shard."""

    def streams(index: int) -> list[SourceStream]:
        return [
            SourceStream(source["name"], source["rows"], source["weight"], _passes(source["key"]))
            for source in loop_config["stage_data"][index]
        ]

    return streams


def _passes(key: str) -> Callable[[], Iterable]:
    shard = ray.train.get_dataset_shard(key)
    return lambda: shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2)


def _ddp(objective: torch.nn.Module, bf16_gradients: bool) -> torch.nn.Module:
    """The objective in DistributedDataParallel when several workers train (as it is alone): gradients live in
    the all-reduce buckets (no copy in and out each step), buckets overlap backward at DDP_BUCKET_CAP_MB. Buffers
    are not broadcast before each forward: the encoders' buffers (BERT's position_ids, token_type_ids) are
    constants, equal on every rank from the same weights, so the broadcast would only cost a collective."""
    options = {"gradient_as_bucket_view": True, "bucket_cap_mb": DDP_BUCKET_CAP_MB, "broadcast_buffers": False}
    model = ray.train.torch.prepare_model(objective, move_to_device=False, parallel_strategy_kwargs=options)
    if bf16_gradients:
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return model


class RayReporter:
    """Rank 0 logs metrics to the MLflow run (``logger``; None: no run), scores the dev set (``dev_score``) and
    reports each checkpoint to Ray Train; the other ranks report their position, which keeps every rank in step."""

    def __init__(
        self,
        config: TrainConfig,
        worker: Worker,
        encoder: SentenceEncoder,
        logger: RunLogger | None,
        gate: ray.actor.ActorHandle | None = None,
    ):
        self.rank, self.device, self.encoder, self.logger = worker.rank, worker.device, encoder, logger
        self.gate = gate  # a sweep trial's (tuning.trial_gate): Tune's verdict on each report, before training on
        self.async_dev = config.evaluation.async_dev  # scored beside training (``training.validation.dev_validation``)
        self.upload = UPLOAD_MODES[config.checkpoint.upload]
        self.dev = None
        if worker.rank == 0 and not self.async_dev:
            self.dev = DevScorer(config.evaluation, resolve_data_dir(config.data_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.logger:
            self.logger.log_metrics(metrics, step=step)

    def report(self, state: TrainState, save: CheckpointWriter, window: dict[str, float]) -> None:
        metrics = {"stage": state.stage, "step": state.step, "global_step": state.global_step}
        if self.rank != 0:
            ray.train.report(metrics)
            return
        metrics["hardware"] = describe_hardware(self.device)  # for the model card
        metrics |= window
        validation = self.score_dev(state, metrics)
        if self.logger:
            self.logger.drain()  # the metrics up to this checkpoint survive this worker's loss after it
        metrics[WEIGHTS_ONLY] = not save.full_state
        directory = tempfile.mkdtemp(prefix="sbert-ray-ckpt-")  # Ray Train deletes it once uploaded
        save(Path(directory))
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(directory),
            checkpoint_upload_mode=self.upload,
            validation=validation,
        )
        if self.gate:  # returns when Tune lets the trial go on; a trial Tune stopped is aborted while it waits
            ray.get(self.gate.ask.remote(metrics))

    def score_dev(self, state: TrainState, metrics: dict) -> ray.train.ValidationTaskConfig | bool:
        """Score the dev set now (into ``metrics``, the state and the run), or with ``evaluation.async_dev`` return
        the request that Ray Train score this report's checkpoint beside training, logged at this step."""
        if self.async_dev:
            return ray.train.ValidationTaskConfig({"step": state.global_step})
        metrics[DEV_SCORE] = state.dev_score = self.dev.score(self.encoder)
        self.log({f"dev/{self.dev.metric}": state.dev_score}, step=state.global_step)
        return False


def _summary(worker: Worker, meter: StepMeter, diverged: Diverged | None = None) -> dict:
    """What rank 0 returns to the driver (``Result.return_value``)."""
    return {
        "precision": worker.precision,
        **meter.summary(),
        "diverged": None
        if diverged is None
        else {"stage": diverged.stage, "step": diverged.global_step, "loss": diverged.loss},
    }
