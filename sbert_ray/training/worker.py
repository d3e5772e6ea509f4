"""``train_loop_per_worker``: what every Ray Train worker runs, a thin adapter around the Ray-free training core
(``training.stages``, ``training.loop``): DDP set up by Ray Train, each stage's data from the object store, and a
reporter that logs rank 0's metrics to the run the driver opened and calls ``ray.train.report``.

Rank 0 additionally scores the dev set and writes checkpoints (the last one holds the final model); all ranks call
``ray.train.report`` at the same points, which is also where they synchronise. Saving the final model and scoring
it are the run layer's (``sbert_ray.runs.train_run``). On a NaN or infinite loss every rank stops together and
returns it (rather than fail: Ray would restart them from the checkpoint into the same NaN).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from sbert_ray.config import TrainConfig, from_dict
from sbert_ray.data.readers import load_records, resolve_data_dir
from sbert_ray.evaluation.sts import evaluate_pairs
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.model_card import describe_hardware
from sbert_ray.tracking.mlflow_run import RunLogger
from sbert_ray.training.loop import Diverged
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.precision import resolve_precision
from sbert_ray.training.stages import Worker, start_worker, train_stages
from sbert_ray.training.state import TrainState

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
        checkpoint = ray.train.get_checkpoint()
        restored = None if checkpoint is None else Path(checkpoint.to_directory(resume_dir))
        encoder, state = start_worker(config, worker, restored)
        if config.scaling.compile:
            encoder.compile_for_training()
        run_logger = RunLogger(**tracking) if worker.rank == 0 and tracking else None
        reporter = RayReporter(config, worker, encoder, run_logger)
        try:
            train_stages(config, encoder, state, restored, _stage_data(loop_config), worker, reporter, meter)
        except Diverged as diverged:
            return _summary(worker, meter, diverged)
        finally:
            if run_logger:
                run_logger.drain()  # the metrics thread dies with this process: hand its queue on first
    return _summary(worker, meter)


def _stage_data(loop_config: dict) -> Callable[[int], object]:
    """Stage i's ``TokenizedColumns``: tokenised once for the cluster, read zero-copy from the object store."""
    stage_data = loop_config["stage_data"]
    return lambda index: (
        ray.get(stage_data[index]) if isinstance(stage_data[index], ray.ObjectRef) else stage_data[index]
    )


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
    """Rank 0 logs metrics to the MLflow run (``logger``; None: no run), scores the dev set and reports each
    checkpoint to Ray Train; the other ranks report their position, which keeps every rank in step."""

    def __init__(self, config: TrainConfig, worker: Worker, encoder: SentenceEncoder, logger: RunLogger | None):
        self.rank, self.device, self.encoder, self.logger = worker.rank, worker.device, encoder, logger
        self.batch_size = config.evaluation.batch_size
        self.dev_pairs = None
        if worker.rank == 0:
            evaluation = config.evaluation
            dev_pairs = load_records(evaluation.dev_dataset, evaluation.dev_split, resolve_data_dir(config.data_dir))
            self.dev_pairs = dev_pairs[: evaluation.dev_limit] if evaluation.dev_limit else dev_pairs

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.logger:
            self.logger.log_metrics(metrics, step=step)

    def report(self, state: TrainState, save: Callable[[Path], None], window: dict[str, float]) -> None:
        metrics = {"stage": state.stage, "step": state.step, "global_step": state.global_step}
        if self.rank != 0:
            ray.train.report(metrics)
            return
        metrics["hardware"] = describe_hardware(self.device)  # for the model card
        metrics |= window
        dev = evaluate_pairs(self.encoder, self.dev_pairs, batch_size=self.batch_size)
        metrics["dev_spearman"] = state.dev_spearman = dev["spearman_cosine"]
        self.log({"dev/spearman_cosine": dev["spearman_cosine"]}, step=state.global_step)
        if self.logger:
            self.logger.drain()  # the metrics up to this checkpoint survive this worker's loss after it
        with tempfile.TemporaryDirectory(prefix="sbert-ray-ckpt-") as directory:
            save(Path(directory))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def _summary(worker: Worker, meter: StepMeter, diverged: Diverged | None = None) -> dict:
    """What rank 0 returns to the driver (``Result.return_value``)."""
    return {
        "precision": worker.precision,
        **meter.summary(),
        "diverged": None
        if diverged is None
        else {"stage": diverged.stage, "step": diverged.global_step, "loss": diverged.loss},
    }
