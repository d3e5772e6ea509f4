"""``train_loop_per_worker``: what every Ray Train worker runs, a thin adapter around the Ray-free training core
(``training.stages``, ``training.loop``): DDP set up by Ray Train (or, with ``scaling.strategy: fsdp``, the encoder
sharded: ``training.sharding``), each stage's data from its Ray Data shards, and a
reporter that logs rank 0's metrics to the run the driver opened and calls ``ray.train.report``.

Rank 0 additionally scores the dev set (or, with ``evaluation.async_dev``, has Ray Train score each checkpoint in a
task beside training: ``training.validation``) and writes checkpoints (the last one holds the final model); all
ranks call ``ray.train.report`` at the same points, which is also where they synchronise. Every checkpoint Ray Train
gets holds the model (it keeps the best by dev score); every ``checkpoint.full_every``-th report point's full state
becomes a resume point of its own beside them (``training.resume_points``). At a report point rank 0 only copies
the checkpoint to host memory; it is serialised and written in rank 0's checkpoint-writing thread
(``training.checkpoint_writes``, which also uploads the resume points) and uploaded by Ray Train's upload thread
once written (its async upload mode: one upload thread per worker, so uploads never race and are committed in
report order), while training continues (``checkpoint.upload: sync``: the report point waits for all of it). A
restarted worker resumes from the newest complete resume point, downloaded once per node; so does every worker of an
elastic run (``scaling.num_workers: [min, max]``) that Ray Train restarted at another size, where each stage's
global batch, data position and schedule carry over (``training.stream``).
Saving the final model and scoring it are the run layer's (``sbert_ray.runs.train_run``). On a NaN or infinite
loss every rank stops together and returns it (rather than fail: Ray would restart them from the checkpoint into
the same NaN).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import logging
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import ray.train
import ray.train.collective
import ray.train.torch
import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from sbert_ray.config import StageConfig
from sbert_ray.config.devices import describe_hardware
from sbert_ray.data.readers import resolve_data_dir
from sbert_ray.evaluation.dev_score import DEV_SCORE, DevScorer
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.encoder import compiles
from sbert_ray.ray_compat import checkpoint_persister, run_storage
from sbert_ray.training.checkpoint_writes import CheckpointWrites, link_weights
from sbert_ray.training.faults import WorkerFaults
from sbert_ray.training.loop import CheckpointWriter, Diverged, Stopped
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.precision import resolve_precision
from sbert_ray.training.preemption import watch_sigterm
from sbert_ray.training.resume_points import (
    RESUME_FOLDER,
    ResumePoint,
    ResumePoints,
    drop_node_copy,
    fetch_once_per_node,
)
from sbert_ray.training.stage_data import source_stream
from sbert_ray.training.stage_plan import WorkerPlan
from sbert_ray.training.stages import Worker, alone, start_worker, train_stages

if TYPE_CHECKING:
    from sbert_ray.tracking.mlflow_run import RunLogger
from sbert_ray.training.state import STATE_FILE, TrainState
from sbert_ray.training.stream import SourceStream

log = logging.getLogger(__name__)

UPLOAD_MODES = {"async": ray.train.CheckpointUploadMode.ASYNC, "sync": ray.train.CheckpointUploadMode.SYNC}

# DDP all-reduces gradients in buckets of this size as soon as backward has filled one (the last layers' first),
# so communication overlaps the rest of backward.
DDP_BUCKET_CAP_MB = 25


def train_loop_per_worker(loop_config: dict) -> dict:
    """Train every stage; returns rank 0's summary (``Result.return_value``): throughput, time to the first step,
    and ``diverged`` when a NaN/inf loss stopped the run."""
    # A native crash prints every Python thread's stack to the worker's log (Ray enables only the crashing thread's,
    # which shows nothing when that is a native one: gloo's, a data loader's; training, metrics and checkpoint
    # writing each run a thread of their own here).
    faulthandler.enable(all_threads=True)
    plan = WorkerPlan.from_wire(loop_config["plan"])
    config = plan.config
    context = ray.train.get_context()
    # use_gpu decides, not what is visible: a CPU run on a machine with GPUs stays on the CPU.
    device = ray.train.torch.get_device() if config.scaling.use_gpu else torch.device("cpu")
    meter = StepMeter(loop_config["fit_started"], device)  # from fit(): Ray Train's start-up counts
    precision, world_size = resolve_precision(config.scaling.precision, device), context.get_world_size()
    # Gradients travel as bf16 (half the bytes) and are averaged back into fp32.
    bf16_gradients = world_size > 1 and device.type == "cuda" and precision == "bf16"
    shard = config.scaling.strategy == "fsdp"  # the encoder sharded (``training.sharding``), not wrapped in DDP
    distribute = alone if shard else functools.partial(_ddp, bf16_gradients=bf16_gradients)
    worker = Worker(
        device, precision, context.get_world_rank(), world_size, distribute, shard, stop_requested=watch_sigterm()
    )
    tracking = loop_config["tracking"]  # run id, URI, file for metrics in outages; None: no MLflow run (benchmarks)
    faults = WorkerFaults(config)  # an error a restart would meet again ends the run (``training.faults``)
    with faults:
        points, point, restored, downloads = _restore(context, worker)
        started = start_worker(config, worker, restored)
        if compiles(config.scaling.compile, device):
            started.encoder.compile_for_training()
        run_logger = _run_logger(tracking) if worker.rank == 0 and tracking else None
        writes = CheckpointWrites(points, background=config.checkpoint.upload == "async") if worker.rank == 0 else None
        reporter = RayReporter(plan, worker, started.encoder, run_logger, writes, loop_config["report_gate"])
        if point is not None:
            reporter.log({"train/resume_downloads": downloads}, step=started.state.global_step)
            if point.global_step > _registered_step():
                reporter.report_restored(started.state, restored)
        try:
            stage_data = faults.opened(_stage_data(loop_config, config.stages))
            train_stages(plan.stages, started, stage_data, worker, reporter, meter)
        except Diverged as diverged:
            return _summary(worker, meter, diverged)
        except Stopped:  # a SIGTERM: every rank reported a full-state checkpoint (``training.preemption``)
            ray.train.collective.barrier()  # every rank's report is queued before one fails and Ray stops them all
            raise
        finally:
            if writes:
                writes.close()  # the last resume point complete before the run may end
            if run_logger:
                run_logger.drain()  # the metrics thread dies with this process: hand its queue on first
            if point is not None and context.get_local_rank() == 0:
                drop_node_copy(point)  # every rank restored it before the first step's collectives
    return _summary(worker, meter)


def _restore(context, worker: Worker) -> tuple[ResumePoints, ResumePoint | None, Path | None, int]:
    """The run's resume points, the one this run resumes from (None: it starts anew), its folder on this node, and
    how many ranks downloaded it (one per node: ``fetch_once_per_node``)."""
    points = _resume_points(context)
    point = _agreed_resume_point(points, worker)
    if point is None:
        return points, None, None, 0
    restored, downloaded = fetch_once_per_node(points.filesystem, point)
    return points, point, restored, _count(downloaded, worker)


def _resume_points(context) -> ResumePoints:
    """The run's resume points, beside Ray Train's checkpoints in its run folder on its storage filesystem."""
    filesystem, run_folder = run_storage(context)
    return ResumePoints(filesystem, f"{run_folder}/{RESUME_FOLDER}")


def _agreed_resume_point(points: ResumePoints, worker: Worker) -> ResumePoint | None:
    """The newest complete resume point as rank 0 found it, on every rank (a listing per rank could disagree);
    None: a new run, or one killed before its first full-state checkpoint was complete (starts over, warned)."""
    found = [points.latest() if worker.rank == 0 else None]
    if worker.world_size > 1:
        torch.distributed.broadcast_object_list(found, src=0)
    if found[0] is None and ray.train.get_checkpoint() is not None:
        log.warning("no complete resume point in %s: starting over", points.folder)
    return found[0]


def _registered_step() -> int:
    """The global step of the newest checkpoint Ray Train registered for this run (-1: none), read from its
    position file alone (every checkpoint reported to Ray holds one)."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return -1
    with checkpoint.filesystem.open_input_stream(f"{checkpoint.path}/{STATE_FILE}") as stream:
        return json.loads(stream.read())["global_step"]


def _count(flag: bool, worker: Worker) -> int:
    """How many ranks raised ``flag``."""
    flags = [flag]
    if worker.world_size > 1:
        flags = [None] * worker.world_size
        torch.distributed.all_gather_object(flags, flag)
    return sum(flags)


def _stage_data(loop_config: dict, stages: list[StageConfig]) -> Callable[[int], list[SourceStream]]:
    """Stage i's sources as this worker streams them (``training.stage_data.source_stream``): a raw one's passes
    new iterations of its shard of the Ray dataset, a prepared one's read from the shards."""

    def streams(index: int) -> list[SourceStream]:
        shard = ray.train.get_dataset_shard
        return [source_stream(source, shard, stages[index]) for source in loop_config["stage_data"][index]]

    return streams


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
        plan: WorkerPlan,
        worker: Worker,
        encoder: SentenceEncoder,
        logger: RunLogger | None,
        writes: CheckpointWrites | None,
        gate: ray.actor.ActorHandle | None = None,
    ):
        config = plan.config
        self.rank, self.device, self.encoder, self.logger = worker.rank, worker.device, encoder, logger
        # Rank 0's: checkpoints written off the training thread, full states uploaded as resume points.
        self.writes = writes
        self.persist = checkpoint_persister(ray.train.get_context()) if writes else None
        self.gate = gate  # a sweep trial's (tuning.trial_gate): Tune's verdict on each report, before training on
        # Scored beside training (``training.validation.dev_validation``); the driver resolved auto.
        self.async_dev = config.evaluation.async_dev is True
        self.upload = UPLOAD_MODES[config.checkpoint.upload]
        self.model_type = config.model.type
        self.dev = None
        if worker.rank == 0 and not self.async_dev:
            self.dev = DevScorer(config.evaluation, resolve_data_dir(config.data_dir), plan.dev)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.logger:
            self.logger.log_metrics(metrics, step=step)

    def report(self, state: TrainState, save: CheckpointWriter, window: dict[str, float]) -> None:
        metrics = self._position(state)
        if self.rank != 0:
            ray.train.report(metrics)
            return
        metrics |= window
        # Under FSDP the whole model rank 0 gathered for the checkpoint, on the device while it scores.
        validation = self.score_dev(
            state, metrics, lambda: save.whole.encoder.to(self.device) if save.whole else self.encoder
        )
        if self.logger:
            self.logger.drain()  # the metrics up to this checkpoint survive this worker's loss after it
        # The training thread copies the checkpoint to host memory and goes on; it is written in the background
        # (the model alone here: Ray Train keeps models by dev score; a full state also as a resume point).
        directory = Path(tempfile.mkdtemp(prefix="sbert-ray-ckpt-"))  # deleted once uploaded
        written = self.writes.save(save.snapshot, directory, state.global_step)
        if save.stopping:  # complete before the ranks meet and stop: Ray may end this process right after
            self.writes.wait()
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(directory),
            # Stored before the ranks stop (a preemption) or before Tune's verdict (a sweep trial, aborted when stopped)
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.SYNC if save.stopping or self.gate else self.upload,
            checkpoint_upload_fn=functools.partial(self._store_when_written, written),
            delete_local_checkpoint_after_upload=True,
            validation=validation,
        )
        if self.gate:  # returns when Tune lets the trial go on; a trial Tune stopped is aborted while it waits
            ray.get(self.gate.ask.remote(metrics))

    def report_restored(self, state: TrainState, restored: Path) -> None:
        """Report the resume point this worker restored (``restored``: its folder here) as a checkpoint, on every
        rank before the first step: Ray Train never registered it (the worker that wrote it died between the
        point's upload and its report), so no dev score would rank or log its model. A sweep trial's gate is not
        asked again: Tune may have had this report before the worker died."""
        metrics = self._position(state)
        if self.rank != 0:
            ray.train.report(metrics)
            return
        from sbert_ray.training.validation import checkpoint_model  # here: only a resume after such a loss needs it

        directory = Path(tempfile.mkdtemp(prefix="sbert-ray-ckpt-"))  # deleted once uploaded
        link_weights(restored, directory)
        checkpoint = ray.train.Checkpoint.from_directory(directory)
        validation = self.score_dev(
            state, metrics, lambda: checkpoint_model(checkpoint, self.model_type).to(self.device)
        )
        if self.logger:
            self.logger.drain()  # as at every report point: its metrics survive this worker's loss after it
        log.warning("step %d's checkpoint was never registered with Ray Train: reported again", state.global_step)
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.SYNC,
            delete_local_checkpoint_after_upload=True,
            validation=validation,
        )

    def _position(self, state: TrainState) -> dict:
        """What every rank reports: where training stands (rank 0 adds the hardware, for the model card)."""
        metrics = {"stage": state.stage, "step": state.step, "global_step": state.global_step}
        if self.rank == 0:
            metrics["hardware"] = describe_hardware(self.device)
        return metrics

    def _store_when_written(self, written: Future, checkpoint: ray.train.Checkpoint, name: str) -> ray.train.Checkpoint:
        """Ray Train's upload of a report's checkpoint (in its upload thread; in the report when SYNC): once its
        folder is written (a failed write fails the upload, and Ray Train the run), stored as Ray would store it."""
        written.result()
        return self.persist(checkpoint, name)

    def score_dev(
        self, state: TrainState, metrics: dict, model: Callable[[], torch.nn.Module]
    ) -> ray.train.ValidationTaskConfig | bool:
        """Score the dev set on ``model()`` now (into ``metrics``, the state and the run), or with
        ``evaluation.async_dev`` return the request that Ray Train score this report's checkpoint beside training,
        logged at this step."""
        if self.async_dev:
            return ray.train.ValidationTaskConfig({"step": state.global_step})
        scores = self.dev.scores(model())
        metrics[DEV_SCORE] = state.dev_score = scores[self.dev.key]
        self.log(scores, step=state.global_step)
        return False


def _run_logger(tracking: dict) -> RunLogger:
    """Rank 0's logger into the run the driver opened: MLflow is imported (~1 CPU-s) in the one process that logs."""
    from sbert_ray.tracking.mlflow_run import RunLogger

    return RunLogger(**tracking)


def _summary(worker: Worker, meter: StepMeter, diverged: Diverged | None = None) -> dict:
    """What rank 0 returns to the driver (``Result.return_value``)."""
    return {
        "precision": worker.precision,
        **meter.summary(),
        "diverged": None
        if diverged is None
        else {"stage": diverged.stage, "step": diverged.global_step, "loss": diverged.loss},
    }
