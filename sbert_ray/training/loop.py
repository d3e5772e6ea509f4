"""``train_stage``: one stage's optimizer steps, plain PyTorch (no Ray), in one process or as one DDP rank.

The step never waits for the device: losses stay on it and are read once per ``LOG_EVERY`` steps (and at each
report point), which is also where a NaN or infinite loss is caught (``Diverged``); every rank reads at the same
steps, so all stop together, and no checkpoint is written from the broken weights. The same read carries whether
any rank was asked to stop (a preemption notice: ``StepSettings.stop_requested``): then every rank writes a
full-state checkpoint at that step and raises ``Stopped``. Metrics and checkpoints leave through a ``Reporter``:
Ray's (``training.worker``) logs to MLflow and reports to Ray Train; ``LocalReporter`` keeps them in memory (tests,
the in-process benchmark).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sbert_ray.training.checkpoint_writes import CheckpointWrites
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.optimization import Optimization
from sbert_ray.training.precision import autocast
from sbert_ray.training.sharding import Whole, gather_whole, gradients_kept_local, is_sharded
from sbert_ray.training.sparse_embeddings import densify, sparse_gradient_weight
from sbert_ray.training.state import Snapshot, TrainState, rng_state, take_snapshot

LOG_EVERY = 10  # optimizer steps between loss reads (and MLflow metric points)


def never() -> bool:
    return False


class Stopped(Exception):
    """A rank was asked to stop: every rank reported a full-state checkpoint at ``global_step`` and stops."""

    def __init__(self, global_step: int):
        super().__init__(f"asked to stop: full-state checkpoint at step {global_step}")
        self.global_step = global_step


class Diverged(Exception):
    """A NaN or infinite loss at ``global_step`` (all ranks raise it together, after their loss all-reduce)."""

    def __init__(self, stage: int, global_step: int, loss: float):
        super().__init__(f"loss {loss} at step {global_step}")
        self.stage, self.global_step, self.loss = stage, global_step, loss


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of this worker: the objective's inputs on the training device, and where it stands in
    the data (``position``: micro-batches of ``epoch`` consumed with this one; a resume continues after it).
    ``text_hashes``: one int64 tensor [size] per column (the order of ``features``), a hash of each text, with
    which an in-batch-negative objective keeps a duplicate of an anchor's positive out of its negatives."""

    features: list[dict]
    labels: torch.Tensor | None
    size: int  # examples on this worker; its loss weighs size / global batch (0: a stand-in that weighs nothing)
    epoch: int
    position: int
    text_hashes: list[torch.Tensor] | None = None  # int64 [batch] per column: equal texts, equal hashes
    # Per column, the padded columns each row uses, on the host: a cached loss cuts its mini-batches' padding
    # with them without reading the attention mask back from the device.
    used_widths: list[np.ndarray] | None = None


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """What one stage's steps need beyond the model, the data and the optimizer."""

    total_steps: int  # optimizer steps of the stage
    batches_per_epoch: int  # global micro-batches per epoch (whole optimizer steps), for the logged epoch
    device: torch.device
    global_batch: int  # examples per optimizer step, all workers together: the stage's batch_size
    precision: str = "fp32"  # resolved: bf16, fp16 or fp32
    grad_accum_steps: int = 1  # micro-batches per optimizer step on this worker
    max_grad_norm: float = 1.0
    eval_every: int = 0  # optimizer steps between report points; 0: only at the stage's last step
    full_every: int = 1  # report points between full-state checkpoints (the others hold weights only)
    # Whether this rank was asked to stop (a preemption notice), asked at each loss read: every LOG_EVERY steps. A
    # flag all-reduced each step would cost a host sync per step (the loop otherwise never waits for the device);
    # carried in the loss read's all-reduce it costs nothing, and a notice waits at most LOG_EVERY steps.
    stop_requested: Callable[[], bool] = never

    def full_state_at(self, step: int) -> bool:
        """Whether the report point at ``step`` of the stage writes a full-state checkpoint: every ``full_every``
        report points and at the stage's last step (a function of the step, so a resumed run agrees)."""
        return step == self.total_steps or (self.eval_every > 0 and step % (self.eval_every * self.full_every) == 0)


class Reporter(Protocol):
    """Where the loop's metrics and checkpoints go. Every rank calls both methods at the same steps."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Training metrics at global ``step`` (a distributed reporter keeps rank 0's)."""

    def report(self, state: TrainState, save: CheckpointWriter, window: dict[str, float]) -> None:
        """A report point: every ``eval_every`` steps and at the stage's last step (``state.stage_done``).
        ``save(folder)`` writes the checkpoint of this moment: model in sentence-transformers layout and position,
        and when ``save.full_state`` optimizer, scheduler and every rank's random state; ``save.snapshot()`` copies
        it to host memory, to be written from there while training goes on. A reporter that scores the model sets
        ``state.dev_score`` before either. ``window``: the latest ``train_loss`` and ``pairs_per_s``."""


class Trainee(NamedTuple):
    """What a stage trains: ``model`` (the objective; in DDP when several workers train) and its optimizer,
    schedule and gradient scaler."""

    model: torch.nn.Module
    optimization: Optimization


class Telemetry(NamedTuple):
    """Where a worker's measurements go, stage after stage: ``reporter`` (metrics, and each report point with its
    checkpoint) and ``meter`` (throughput, time to the first step, time spent at report points)."""

    reporter: Reporter
    meter: StepMeter


class LocalReporter:
    """A reporter for one process without a tracking store: keeps what it is given; with ``checkpoints``, writes
    each report point's checkpoint to ``checkpoints/step-<global step>``: in the report, or with ``background`` in
    a thread of its own while training goes on, as a Ray worker's rank 0 does (``training.checkpoint_writes``;
    complete once ``close`` returns)."""

    def __init__(self, checkpoints: Path | None = None, background: bool = False):
        self.checkpoints = checkpoints
        self.writes = CheckpointWrites(background=background)
        self.logged: list[tuple[int, dict[str, float]]] = []  # (step, metrics) as logged
        self.reports: list[dict] = []  # per report point: stage, step, global_step and the window

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, dict(metrics)))

    def report(self, state: TrainState, save: CheckpointWriter, window: dict[str, float]) -> None:
        self.reports.append({"stage": state.stage, "step": state.step, "global_step": state.global_step, **window})
        if self.checkpoints is not None:
            folder = self.checkpoints / f"step-{state.global_step}"
            folder.mkdir(parents=True)
            self.writes.save(save.snapshot, folder, state.global_step)

    def close(self) -> None:
        """Wait for the checkpoints still being written (raising a write's error)."""
        self.writes.close()


def train_stage(
    trainee: Trainee,
    batches: Iterable[MicroBatch],
    settings: StepSettings,
    state: TrainState,
    telemetry: Telemetry,
    data_metrics: Callable[[], dict[str, float]] = dict,
) -> TrainState:
    """Train ``trainee.model`` (the objective, in DDP when several workers train) on ``batches`` from ``state``
    until the stage's last step; returns the state there. Metrics and report points go to ``telemetry.reporter``;
    ``data_metrics()``: what the data stream did so far, logged with the loss. Raises ``Diverged`` on a NaN or
    infinite loss.

    Each micro-batch's loss (a mean over its rows; for in-batch negatives over its anchors, ranked against the
    candidates gathered from every worker) is weighed by its rows over the step's ``global_batch``, times the
    world size that DDP's gradient average divides by: the step is the mean over the global batch's examples,
    however unevenly the workers share it (``batches.BatchSplit``) and however each cuts its share."""
    model, optimization = trainee
    reporter, meter = telemetry
    objective = model.module if isinstance(model, DistributedDataParallel) else model
    sharded = is_sharded(objective.encoder)  # FSDP: the objective as it is, its encoder sharded
    world_size = dist.get_world_size() if (objective is not model or sharded) else 1
    sparse_embeddings = sparse_gradient_weight(objective.encoder)
    accum, device = settings.grad_accum_steps, settings.device
    window_losses = torch.zeros(LOG_EVERY, device=device)  # each step's loss summed over micro-batches, on device
    window_masked = None  # duplicates the objective masked out of its negatives in the window, on device
    window_steps = 0
    model.train()
    meter.restart()
    for micro, batch in enumerate(batches, start=1):
        syncs = micro % accum == 0
        # Accumulating micro-batches skip the gradients' all-reduce; the last one of a step syncs them.
        with _without_gradient_sync(model, objective) if (world_size > 1 and not syncs) else nullcontext():
            share = batch.size * world_size / settings.global_batch
            with autocast(settings.precision, device):
                loss = model(batch.features, batch.labels, batch.text_hashes, batch.used_widths) * share
            (optimization.scaler.scale(loss) if optimization.scaler else loss).backward()
        window_losses[window_steps] += loss.detach()  # stays on the device: no sync
        if (masked := objective.masked_duplicates) is not None:
            window_masked = masked if window_masked is None else window_masked + masked
        meter.count(batch.size * world_size)
        if not syncs:
            continue
        optimizer_step(model, optimization, settings.max_grad_norm, sparse_embeddings, world_size)
        state.step, state.global_step = state.step + 1, state.global_step + 1
        state.epoch, state.batch = batch.epoch, batch.position
        window_steps += 1
        if (first_step_s := meter.after_step(state.global_step)) is not None:
            # a resumed run's own start (what a restart costs before training goes on) under a name of its own
            name = "train/time_to_first_step_s" if state.global_step == 1 else "train/time_to_resumed_step_s"
            reporter.log({name: first_step_s}, step=state.global_step)
        last = state.step == settings.total_steps
        report = last or (settings.eval_every and state.step % settings.eval_every == 0)
        stop = False
        if report or window_steps == LOG_EVERY:
            losses, stop = read_losses(window_losses[:window_steps], state, world_size, settings.stop_requested())
            window = {"train_loss": sum(losses) / len(losses), "pairs_per_s": meter.close_window()}
            metrics = {
                "train/loss": window["train_loss"],
                "train/learning_rate": optimization.scheduler.get_last_lr()[0],
                "train/pairs_per_s": window["pairs_per_s"],
                "train/epoch": state.epoch + state.batch / settings.batches_per_epoch,
                "train/workers": world_size,  # changes when an elastic run resizes
            }
            if window_masked is not None:  # per optimizer step (all workers' anchors), mean over the window
                metrics["train/masked_duplicates"] = read_count(window_masked, world_size) / window_steps
            reporter.log(metrics | data_metrics(), step=state.global_step)
            window_losses.zero_()
            window_masked, window_steps = None, 0
        if report or stop:
            state.stage_done = last
            save = checkpoint_writer(
                state, objective, optimization, device, world_size, stop or settings.full_state_at(state.step)
            )
            save = dataclasses.replace(save, stopping=stop)
            with meter.reporting():  # not training time: evaluation, checkpoint, upload, waiting for the others
                reporter.report(state, save, window)
            # What the report point cost this rank's training (scoring, writing, handing the checkpoint over).
            reporter.log({"train/report_s": meter.last_report_s}, step=state.global_step)
        if stop:
            raise Stopped(state.global_step)
        if last:
            break
    return state


def _without_gradient_sync(model: torch.nn.Module, objective: torch.nn.Module):
    """DDP's ``no_sync``, or FSDP's counterpart on the sharded encoder."""
    return gradients_kept_local(objective.encoder) if model is objective else model.no_sync()


def optimizer_step(
    model: torch.nn.Module,
    optimization: Optimization,
    max_grad_norm: float,
    sparse_embeddings: torch.nn.Parameter | None,
    world_size: int,
) -> None:
    """Clip the accumulated gradients to ``max_grad_norm``, step optimizer and schedule, clear the gradients."""
    optimizer, scheduler, scaler = optimization
    if sparse_embeddings is not None:
        densify(sparse_embeddings)
    if scaler:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    if sparse_embeddings is not None:
        sparse_embeddings.grad = None  # a sparse gradient cannot accumulate into a dense one
    optimizer.zero_grad(set_to_none=world_size == 1)  # DDP's gradients are views into its buckets


def read_losses(
    losses: torch.Tensor, state: TrainState, world_size: int, stop: bool = False
) -> tuple[list[float], bool]:
    """The one host sync per window: every rank's step losses summed (so all ranks see a NaN anywhere and stop
    together), as the mean over workers, and whether any rank asked to ``stop`` (summed in the same all-reduce);
    raises ``Diverged`` at the first step whose loss is not finite."""
    read = torch.cat([losses, losses.new_full((1,), float(stop))])
    if world_size > 1:
        dist.all_reduce(read)
    *values, stops = read.tolist()
    values = [value / world_size for value in values]
    first_step = state.global_step - len(values) + 1
    for offset, value in enumerate(values):
        if not math.isfinite(value):
            raise Diverged(state.stage, first_step + offset, value)
    return values, stops > 0


def read_count(count: torch.Tensor, world_size: int) -> int:
    """A count summed over every rank (each rank calls this at the same steps), read to the host."""
    if world_size > 1:
        count = count.clone()
        dist.all_reduce(count)
    return int(count.item())


@dataclasses.dataclass(frozen=True)
class CheckpointWriter:
    """The checkpoint of a report point: ``snapshot()`` copies it to host memory (``state.Snapshot``, whose
    ``write(folder)`` serialises it, in any thread), ``save(folder)`` does both here. A full-state checkpoint when
    ``full_state``, else the weights only; ``whole``: under FSDP, what rank 0 gathered to write (and score);
    ``stopping``: the last before the workers stop (``Stopped``), whose report waits until it is stored."""

    full_state: bool
    snapshot: Callable[[], Snapshot]
    whole: Whole | None = None
    stopping: bool = False

    def __call__(self, folder: Path) -> None:
        self.snapshot().write(folder)


def checkpoint_writer(
    state: TrainState,
    objective: torch.nn.Module,
    optimization: Optimization,
    device: torch.device,
    world_size: int,
    full_state: bool = True,
) -> CheckpointWriter:
    """The writer of a report point's checkpoint. For a full-state one every rank's random state is gathered now
    (a collective: each rank calls this with the same ``full_state``), so that a resumed run draws the dropout
    masks the uninterrupted one would."""
    whole = None
    if is_sharded(objective.encoder):  # every rank gathers; rank 0 writes (and scores) the whole model
        whole = gather_whole(objective.encoder, objective, optimization.optimizer if full_state else None)
    if not full_state:
        return CheckpointWriter(False, lambda: take_snapshot(state, objective, device, whole), whole)
    rng_states = [rng_state(device)]
    if world_size > 1:
        rng_states = [None] * world_size
        dist.all_gather_object(rng_states, rng_state(device))
    return CheckpointWriter(
        True, lambda: take_snapshot(state, objective, device, whole, optimization, rng_states), whole
    )
