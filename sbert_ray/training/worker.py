"""``train_loop_per_worker``: what every Ray Train worker runs (DDP, smart batching, AdamW, warm-up, checkpoints).

Workers only train and report. Rank 0 additionally scores the dev set, writes checkpoints (the last one holds the
final model) and logs training metrics to the run the driver opened; all ranks call ``ray.train.report`` at the
same points, which is also where they synchronise. Saving the final model and scoring it are the run layer's
(``sbert_ray.runs.training``).

The step never waits for the device: losses stay on it and are read once per ``LOG_EVERY`` steps (and at each
report), which is also where a NaN or infinite loss is caught. Then every rank stops together, the run layer
names the step and the last good checkpoint, and no checkpoint is written from the broken weights.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from transformers import get_linear_schedule_with_warmup

from sbert_ray.config import StageConfig, TrainConfig, from_dict
from sbert_ray.data.readers import load_records, resolve_data_dir
from sbert_ray.data.sampler import SmartBatchSampler
from sbert_ray.evaluation.sts import evaluate_pairs
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.losses.registry import build_loss
from sbert_ray.models import SentenceEncoder, load_encoder
from sbert_ray.models.model_card import describe_hardware
from sbert_ray.tracking.mlflow_run import RunLogger
from sbert_ray.training.batches import TokenizedColumns, local_batch_size, log_coverage, stage_steps
from sbert_ray.training.precision import autocast, grad_scaler, resolve_precision
from sbert_ray.training.sparse_embeddings import densify, sparse_embedding_gradients
from sbert_ray.training.state import (
    MODEL_DIR,
    TrainState,
    load_rng_states,
    restore_training,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

log = logging.getLogger(__name__)

LOG_EVERY = 10  # optimizer steps between loss reads (and MLflow metric points)
NO_DECAY = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm.weight", "layer_norm.bias")
FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW kernel
# DDP all-reduces gradients in buckets of this size as soon as backward has filled one (the last layers' first),
# so communication overlaps the rest of backward.
DDP_BUCKET_CAP_MB = 25


class Diverged(Exception):
    """A NaN or infinite loss at ``global_step`` (all ranks raise it together, after their loss all-reduce)."""

    def __init__(self, stage: int, global_step: int, loss: float):
        super().__init__(f"loss {loss} at step {global_step}")
        self.stage, self.global_step, self.loss = stage, global_step, loss


def train_loop_per_worker(loop_config: dict) -> dict:
    """Train every stage; returns rank 0's summary (``Result.return_value``): throughput, time to the first step,
    and ``diverged`` when a NaN/inf loss stopped the run."""
    config = from_dict(TrainConfig, loop_config["config"])
    fit_started = loop_config["fit_started"]
    started = time.time() - fit_started  # Ray Train's start-up: controller, worker processes, imports
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    torch.set_num_threads(config.scaling.threads_per_worker())
    seed_everything(config.seed)
    # Ray Train's local mode (benchmarks) gives a GPU whenever one is visible: use_gpu decides.
    device = ray.train.torch.get_device() if config.scaling.use_gpu else torch.device("cpu")
    tracking = loop_config["tracking"]  # run id, URI, file for metrics in outages; None: no MLflow run (benchmarks)
    logger = RunLogger(**tracking) if rank == 0 and tracking else None
    data_dir = resolve_data_dir(config.data_dir)

    with tempfile.TemporaryDirectory(prefix="sbert-ray-resume-") as resume_dir:
        checkpoint = ray.train.get_checkpoint()
        state, restored = TrainState(), None
        if checkpoint is not None:
            restored = Path(checkpoint.to_directory(resume_dir))
            state = TrainState.load(restored)
            encoder = SentenceEncoder.load(str(restored / MODEL_DIR))
        else:
            encoder = load_encoder(**dataclasses.asdict(config.model), seed=config.seed)
        # On its device before any optimizer is built or restored: optimizer state follows its parameters' device.
        encoder.to(device)
        if restored is not None:  # the dropout stream continues where the checkpoint left it
            rng_states = load_rng_states(restored)
            if len(rng_states) == world_size:
                set_rng_state(rng_states[rank], device)
            else:
                log.warning(
                    "checkpoint holds random states of %d workers, not %d: reseeded", len(rng_states), world_size
                )
        dev_pairs = None
        if rank == 0:
            dev_pairs = load_records(config.evaluation.dev_dataset, config.evaluation.dev_split, data_dir)
            dev_pairs = dev_pairs[: config.evaluation.dev_limit] if config.evaluation.dev_limit else dev_pairs

        worker = _Worker(config, encoder, device, rank, world_size, logger, dev_pairs, fit_started, started)
        try:
            for index, stage in enumerate(config.stages):
                if index < state.stage or (index == state.stage and state.stage_done):
                    continue
                if index > state.stage:
                    state = TrainState(stage=index, global_step=state.global_step)
                resume_from = restored if (restored is not None and index == state.stage and state.step) else None
                # Tokenised once for the cluster; read zero-copy from the object store on this node.
                data = loop_config["stage_data"][index]
                data: TokenizedColumns = ray.get(data) if isinstance(data, ray.ObjectRef) else data
                state = worker.run_stage(stage, state, data, resume_from)
        except Diverged as diverged:
            return worker.summary(diverged)
    return worker.summary()


def seed_everything(seed: int) -> None:
    """torch (CPU and every GPU), numpy's global generator and Python's ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


class _Worker:
    """Training on one worker: each stage's loop, the loss window (read every LOG_EVERY steps), the report points
    (dev evaluation + checkpoint), and the throughput rank 0 returns."""

    def __init__(
        self, config, encoder, device, rank, world_size, logger, dev_pairs, fit_started: float, started: float
    ):
        self.config, self.encoder, self.device = config, encoder, device
        self.rank, self.world_size, self.logger, self.dev_pairs = rank, world_size, logger, dev_pairs
        self.precision = resolve_precision(config.scaling.precision, device)
        self.fit_started = fit_started  # wall clock at trainer.fit(), for the time to the first optimizer step
        self.stepped = False  # whether this process has taken an optimizer step yet
        # Seconds from fit() to: this function's start, the first stage's data tokenised, the first optimizer step.
        self.time_to_worker_start = started
        self.time_to_data: float | None = None
        self.time_to_first_step: float | None = None
        self.steady_pairs, self.steady_seconds = 0, 0.0  # after the first step, reports excluded
        # The loss of each step of the current window, summed over micro-batches, on the device until read.
        self.window_losses = torch.zeros(LOG_EVERY, device=device)
        self.window_steps, self.window_pairs, self.window_start = 0, 0, time.perf_counter()
        self.last_window: dict[str, float] = {}  # rank 0's latest loss and rate, for the driver's progress

    def run_stage(
        self, stage: StageConfig, state: TrainState, data: TokenizedColumns, resume_from: Path | None
    ) -> TrainState:
        world_size = self.world_size
        sampler = SmartBatchSampler(
            data.lengths,
            local_batch_size(stage, world_size),
            num_replicas=world_size,
            rank=self.rank,
            seed=self.config.seed + state.stage,
        )
        steps_per_epoch, total_steps = stage_steps(len(data), stage, world_size)  # prepare() checked both are > 0
        self.time_to_data = self.time_to_data or time.time() - self.fit_started
        if self.rank == 0:
            log_coverage(state.stage, data, sampler, steps_per_epoch * stage.grad_accum_steps)

        # A head restored from the checkpoint must not advance the random stream restored with it.
        with torch.random.fork_rng(self._rng_devices()) if resume_from is not None else nullcontext():
            objective = build_loss(
                stage.objective, self.encoder, stage.loss, stage.matryoshka_dims, stage.matryoshka_weights
            )
        optimizer, scheduler, scaler = prepare_optimization(
            objective, stage, total_steps, self.device, self.precision, resume_from
        )
        if resume_from is not None and self.logger:
            self.logger.log_metrics({"train/resumed_from_step": state.step}, step=state.global_step)
        sparse_embeddings = sparse_embedding_gradients(self.encoder, self.device, world_size)
        model = ray.train.torch.prepare_model(
            objective, move_to_device=False, parallel_strategy_kwargs=ddp_options(self.device)
        )
        if world_size > 1 and self.device.type == "cuda" and self.precision == "bf16":
            # Gradients travel as bf16 (half the bytes) and are averaged back into fp32.
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        model.train()

        self._reset_window()
        while state.step < total_steps:
            sampler.set_epoch(state.epoch, start_batch=state.batch)
            micro_batches = itertools.islice(sampler, steps_per_epoch * stage.grad_accum_steps - state.batch)
            for micro, indices in enumerate(micro_batches, start=state.batch + 1):
                features, batch_labels = data.collate(indices, self.device)
                syncs = micro % stage.grad_accum_steps == 0
                # Accumulating micro-batches skip DDP's all-reduce; the last one of a step syncs the gradients.
                with model.no_sync() if (world_size > 1 and not syncs) else nullcontext():
                    with autocast(self.precision, self.device):
                        loss = model(features, batch_labels) / stage.grad_accum_steps
                    (scaler.scale(loss) if scaler else loss).backward()
                self.window_losses[self.window_steps] += loss.detach()  # stays on the device: no sync
                self.window_pairs += len(indices) * world_size
                if not syncs:
                    continue
                if sparse_embeddings is not None:
                    densify(sparse_embeddings)
                if scaler:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), stage.max_grad_norm)
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                scheduler.step()
                if sparse_embeddings is not None:
                    sparse_embeddings.grad = None  # a sparse gradient cannot accumulate into a dense one
                optimizer.zero_grad(set_to_none=world_size == 1)  # DDP's gradients are views into its buckets
                state.step, state.global_step, state.batch = state.step + 1, state.global_step + 1, micro
                self.window_steps += 1
                if not self.stepped:
                    self._first_step(state)
                last = state.step == total_steps
                every = self.config.evaluation.eval_every
                report = last or (every and state.step % every == 0)
                if report or self.window_steps == LOG_EVERY:
                    self._read_window(state, scheduler, steps_per_epoch * stage.grad_accum_steps, micro)
                if report:
                    state.stage_done = last
                    self._report(state, model.module if world_size > 1 else model, optimizer, scheduler, scaler)
                    self._reset_window()  # the dev evaluation is not training time
                if last:
                    break
            if state.step < total_steps:
                state.epoch, state.batch = state.epoch + 1, 0
        return state

    def _first_step(self, state: TrainState) -> None:
        """The first optimizer step of this worker process: the time since ``fit()`` for a run that starts from
        scratch; steady throughput is counted from here on (start-up and first-call allocations left out)."""
        self.stepped = True
        if state.global_step == 1:
            synchronize(self.device)
            self.time_to_first_step = time.time() - self.fit_started
            if self.logger:
                self.logger.log_metrics({"train/time_to_first_step_s": self.time_to_first_step}, step=1)
        self.window_pairs, self.window_start = 0, time.perf_counter()

    def _reset_window(self) -> None:
        self.window_losses.zero_()
        self.window_steps, self.window_pairs, self.window_start = 0, 0, time.perf_counter()

    def _read_window(self, state: TrainState, scheduler, micro_per_epoch: int, micro: int) -> None:
        """The one host sync per window: every rank's step losses summed (so all ranks see a NaN anywhere and stop
        together), checked, logged by rank 0 as the mean over workers."""
        losses = self.window_losses[: self.window_steps]
        if self.world_size > 1:
            dist.all_reduce(losses)
        values = [value / self.world_size for value in losses.tolist()]
        first_step = state.global_step - len(values) + 1
        for offset, value in enumerate(values):
            if not math.isfinite(value):
                raise Diverged(state.stage, first_step + offset, value)
        elapsed = time.perf_counter() - self.window_start
        if self.stepped:
            self.steady_pairs += self.window_pairs
            self.steady_seconds += elapsed
        if self.rank == 0 and values:
            self.last_window = {"train_loss": sum(values) / len(values), "pairs_per_s": self.window_pairs / elapsed}
        if self.logger and values:
            self.logger.log_metrics(
                {
                    "train/loss": self.last_window["train_loss"],
                    "train/learning_rate": scheduler.get_last_lr()[0],
                    "train/pairs_per_s": self.last_window["pairs_per_s"],
                    "train/epoch": state.epoch + micro / micro_per_epoch,
                },
                step=state.global_step,
            )
        self._reset_window()

    def _report(self, state: TrainState, objective, optimizer, scheduler, scaler) -> None:
        """Dev evaluation and checkpoint on rank 0; every rank reports, which keeps them in step."""
        rng_states = [rng_state(self.device)]
        if self.world_size > 1:
            rng_states = [None] * self.world_size
            dist.all_gather_object(rng_states, rng_state(self.device))
        metrics = {"stage": state.stage, "step": state.step, "global_step": state.global_step}
        if self.rank != 0:
            ray.train.report(metrics)
            return
        metrics["hardware"] = describe_hardware(self.device)  # for the model card
        metrics |= self.last_window
        dev = evaluate_pairs(self.encoder, self.dev_pairs, batch_size=self.config.evaluation.batch_size)
        metrics["dev_spearman"] = state.dev_spearman = dev["spearman_cosine"]
        if self.logger:
            self.logger.log_metrics({"dev/spearman_cosine": dev["spearman_cosine"]}, step=state.global_step)
        with tempfile.TemporaryDirectory(prefix="sbert-ray-ckpt-") as directory:
            save_checkpoint(Path(directory), state, objective, optimizer, scheduler, scaler, rng_states)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))

    def _rng_devices(self) -> list[int]:
        return [self.device.index or 0] if self.device.type == "cuda" else []

    def summary(self, diverged: Diverged | None = None) -> dict:
        """What rank 0 returns to the driver (``Result.return_value``)."""
        return {
            "precision": self.precision,
            "time_to_worker_start_s": self.time_to_worker_start,
            "time_to_data_s": self.time_to_data,
            "time_to_first_step_s": self.time_to_first_step,
            "pairs_per_s": self.steady_pairs / self.steady_seconds if self.steady_seconds else None,
            "diverged": None
            if diverged is None
            else {"stage": diverged.stage, "step": diverged.global_step, "loss": diverged.loss},
        }


def prepare_optimization(
    objective: EncoderLoss,
    stage: StageConfig,
    total_steps: int,
    device: torch.device,
    precision: str,
    resume_from: Path | None,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler | None]:
    """AdamW, the warm-up schedule and (fp16) the gradient scaler for ``objective``, restored from ``resume_from``.
    The objective goes to ``device`` first: the optimizer must hold the parameters the model trains with, and
    restoring puts each state tensor on its parameter's device as it is at that moment."""
    objective.to(device)
    optimizer = torch.optim.AdamW(
        _parameter_groups(objective, stage.weight_decay),
        lr=stage.learning_rate,
        eps=stage.adam_eps,
        fused=device.type in FUSED_ADAMW_DEVICES,  # one kernel over all parameters instead of a dozen passes
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, int(stage.warmup_ratio * total_steps), total_steps)
    scaler = grad_scaler(precision, device)
    if resume_from is not None:
        restore_training(resume_from, objective, optimizer, scheduler, scaler)
    return optimizer, scheduler, scaler


def ddp_options(device: torch.device) -> dict:
    """DistributedDataParallel settings, passed through ``prepare_model``: gradients live in the all-reduce
    buckets (no copy in and out each step); buckets overlap backward (DDP's default) at DDP_BUCKET_CAP_MB."""
    return {"gradient_as_bucket_view": True, "bucket_cap_mb": DDP_BUCKET_CAP_MB}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _parameter_groups(objective: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay everywhere except biases and LayerNorm weights (as the reference training scripts)."""
    decay, no_decay = [], []
    for name, param in objective.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith(NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
