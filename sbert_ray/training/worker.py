"""``train_loop_per_worker``: what every Ray Train worker runs (DDP, smart batching, AdamW, warm-up, checkpoints).

Workers only train and report. Rank 0 additionally scores the dev set, writes checkpoints (the last one holds the
final model) and logs training metrics to the run the driver opened; all ranks call ``ray.train.report`` at the
same points, which is also where they synchronise. Saving the final model and scoring it are the run layer's
(``sbert_ray.runs.training``).
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import ray
import ray.train
import ray.train.torch
import torch
from transformers import get_linear_schedule_with_warmup

from sbert_ray.config import StageConfig, TrainConfig
from sbert_ray.data.readers import load_records, resolve_data_dir
from sbert_ray.data.sampler import SmartBatchSampler
from sbert_ray.evaluation.sts import evaluate_pairs
from sbert_ray.losses.registry import build_loss
from sbert_ray.models import SentenceEncoder, load_encoder
from sbert_ray.models.model_card import describe_hardware
from sbert_ray.tracking.mlflow_run import RunLogger
from sbert_ray.training.batches import TokenizedColumns, local_batch_size, log_coverage, stage_steps
from sbert_ray.training.state import MODEL_DIR, TrainState, restore_training, save_checkpoint

LOG_EVERY = 10  # optimizer steps between MLflow metric points
NO_DECAY = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm.weight", "layer_norm.bias")


def train_loop_per_worker(loop_config: dict) -> None:
    config: TrainConfig = loop_config["config"]
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    is_main = rank == 0
    torch.set_num_threads(config.scaling.threads_per_worker())
    torch.manual_seed(config.seed)
    device = ray.train.torch.get_device()
    data_dir = resolve_data_dir(config.data_dir)
    logger = RunLogger(loop_config["tracking_uri"], loop_config["run_id"]) if is_main else None

    with tempfile.TemporaryDirectory(prefix="sbert-ray-resume-") as resume_dir:
        checkpoint = ray.train.get_checkpoint()
        state, restored = TrainState(), None
        if checkpoint is not None:
            restored = Path(checkpoint.to_directory(resume_dir))
            state = TrainState.load(restored)
            encoder = SentenceEncoder.load(str(restored / MODEL_DIR))
        else:
            encoder = load_encoder(**dataclasses.asdict(config.model), seed=config.seed)
        dev_pairs = None
        if is_main:
            dev_pairs = load_records(config.evaluation.dev_dataset, config.evaluation.dev_split, data_dir)
            dev_pairs = dev_pairs[: config.evaluation.dev_limit] if config.evaluation.dev_limit else dev_pairs

        for index, stage in enumerate(config.stages):
            if index < state.stage or (index == state.stage and state.stage_done):
                continue
            if index > state.stage:
                state = TrainState(stage=index, global_step=state.global_step)
            resume_from = restored if (restored is not None and index == state.stage and state.step) else None
            # Tokenised once by the run layer; read zero-copy from the object store on this node.
            data: TokenizedColumns = ray.get(loop_config["stage_data"][index])
            ctx = _Worker(config, stage, encoder, device, rank, world_size, logger, dev_pairs)
            state = ctx.run_stage(state, data, resume_from)


class _Worker:
    """One stage of training on one worker: the loop, and the report points (dev evaluation + checkpoint)."""

    def __init__(self, config, stage: StageConfig, encoder, device, rank, world_size, logger, dev_pairs):
        self.config, self.stage, self.encoder, self.device = config, stage, encoder, device
        self.rank, self.world_size, self.logger, self.dev_pairs = rank, world_size, logger, dev_pairs
        self.use_bf16 = device.type == "cuda"
        self.last_window: dict[str, float] = {}  # rank 0's latest logged loss and rate, for the driver's progress

    def run_stage(self, state: TrainState, data: TokenizedColumns, resume_from: Path | None) -> TrainState:
        stage, world_size = self.stage, self.world_size
        sampler = SmartBatchSampler(
            data.lengths,
            local_batch_size(stage, world_size),
            num_replicas=world_size,
            rank=self.rank,
            seed=self.config.seed + state.stage,
        )
        steps_per_epoch, total_steps = stage_steps(len(data), stage, world_size)  # prepare() checked both are > 0
        if self.rank == 0:
            log_coverage(state.stage, data, sampler, steps_per_epoch * stage.grad_accum_steps)

        objective = build_loss(
            stage.objective, self.encoder, stage.loss, stage.matryoshka_dims, stage.matryoshka_weights
        )
        optimizer = torch.optim.AdamW(
            _parameter_groups(objective, stage.weight_decay), lr=stage.learning_rate, eps=stage.adam_eps
        )
        scheduler = get_linear_schedule_with_warmup(optimizer, int(stage.warmup_ratio * total_steps), total_steps)
        if resume_from is not None:
            restore_training(resume_from, objective, optimizer, scheduler)
            if self.logger:
                self.logger.log_metrics({"train/resumed_from_step": state.step}, step=state.global_step)
        model = ray.train.torch.prepare_model(objective)  # to device; DDP when world_size > 1
        model.train()

        window_loss, window_examples, window_start = 0.0, 0, time.perf_counter()
        while state.step < total_steps:
            sampler.set_epoch(state.epoch, start_batch=state.batch)
            micro_batches = itertools.islice(sampler, steps_per_epoch * stage.grad_accum_steps - state.batch)
            for micro, indices in enumerate(micro_batches, start=state.batch + 1):
                features, batch_labels = data.collate(indices, self.device)
                syncs = micro % stage.grad_accum_steps == 0
                # Accumulating micro-batches skip DDP's all-reduce; the last one of a step syncs the gradients.
                with model.no_sync() if (world_size > 1 and not syncs) else nullcontext():
                    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
                        loss = model(features, batch_labels) / stage.grad_accum_steps
                    loss.backward()
                window_loss += loss.item()
                window_examples += len(indices) * world_size
                if not syncs:
                    continue
                torch.nn.utils.clip_grad_norm_(model.parameters(), stage.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step, state.global_step, state.batch = state.step + 1, state.global_step + 1, micro
                last = state.step == total_steps
                if self.logger and (state.step % LOG_EVERY == 0 or last):
                    steps_in_window = max(1, state.step % LOG_EVERY or LOG_EVERY)
                    elapsed = time.perf_counter() - window_start
                    self.last_window = {
                        "train_loss": window_loss / steps_in_window,
                        "pairs_per_s": window_examples / elapsed,
                    }
                    self.logger.log_metrics(
                        {
                            "train/loss": self.last_window["train_loss"],
                            "train/learning_rate": scheduler.get_last_lr()[0],
                            "train/pairs_per_s": self.last_window["pairs_per_s"],
                            "train/epoch": state.epoch + micro / (steps_per_epoch * stage.grad_accum_steps),
                        },
                        step=state.global_step,
                    )
                    window_loss, window_examples, window_start = 0.0, 0, time.perf_counter()
                every = self.config.evaluation.eval_every
                if last or (every and state.step % every == 0):
                    state.stage_done = last
                    self._report(state, model.module if world_size > 1 else model, optimizer, scheduler)
                if last:
                    break
            if state.step < total_steps:
                state.epoch, state.batch = state.epoch + 1, 0
        return state

    def _report(self, state: TrainState, objective, optimizer, scheduler) -> None:
        """Dev evaluation and checkpoint on rank 0; every rank reports, which keeps them in step."""
        metrics = {"stage": state.stage, "step": state.step, "global_step": state.global_step}
        if self.rank != 0:
            ray.train.report(metrics)
            return
        metrics["hardware"] = describe_hardware(self.device)  # for the model card
        metrics |= self.last_window
        dev = evaluate_pairs(self.encoder, self.dev_pairs, batch_size=self.config.evaluation.batch_size)
        metrics["dev_spearman"] = state.dev_spearman = dev["spearman_cosine"]
        self.logger.log_metrics({"dev/spearman_cosine": dev["spearman_cosine"]}, step=state.global_step)
        with tempfile.TemporaryDirectory(prefix="sbert-ray-ckpt-") as directory:
            save_checkpoint(Path(directory), state, objective, optimizer, scheduler)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def _parameter_groups(objective: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay everywhere except biases and LayerNorm weights (as the reference training scripts)."""
    decay, no_decay = [], []
    for name, param in objective.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith(NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
