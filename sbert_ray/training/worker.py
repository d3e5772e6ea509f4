"""``train_loop_per_worker``: what every Ray Train worker runs (DDP, smart batching, AdamW, warm-up, checkpoints).

Rank 0 additionally evaluates on the dev set, writes checkpoints and logs to MLflow; all ranks call
``ray.train.report`` at the same points, which is also where they synchronise.
"""

from __future__ import annotations

import itertools
import math
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import ray.train
import ray.train.torch
import torch
from transformers import get_linear_schedule_with_warmup

from sbert_ray.config import ModelConfig, StageConfig, TrainConfig, from_dict
from sbert_ray.data.readers import load_records, resolve_data_dir
from sbert_ray.data.sampler import SmartBatchSampler
from sbert_ray.evaluation import suite
from sbert_ray.evaluation.sts import evaluate_pairs
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.random_bert import random_bert
from sbert_ray.tracking.mlflow_run import RunLogger
from sbert_ray.training.batches import (
    TokenizedColumns,
    build_objective,
    load_training_records,
    texts_and_labels,
)
from sbert_ray.training.state import MODEL_DIR, TrainState, restore_training, save_checkpoint
from sbert_ray.training.storage import is_remote

LOG_EVERY = 10  # optimizer steps between MLflow metric points
NO_DECAY = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm.weight", "layer_norm.bias")


def train_loop_per_worker(loop_config: dict) -> None:
    config: TrainConfig = from_dict(TrainConfig, loop_config["config"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    is_main = rank == 0
    torch.set_num_threads(config.scaling.torch_threads or max(1, math.ceil(config.scaling.cpus_per_worker)))
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
            encoder = load_encoder(config.model, config.seed)
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
            ctx = _Worker(config, stage, encoder, device, rank, world_size, logger, dev_pairs)
            state = ctx.run_stage(state, data_dir, resume_from)

    # "finished", not "done": Tune reads a reported "done" as the end of the trial and stops it on the spot.
    metrics = {"global_step": state.global_step, "stage": state.stage, "finished": True}
    if is_main:
        metrics.update(_final_evaluation(config, encoder, data_dir, logger, state.global_step))
        if state.dev_spearman is not None:
            metrics["dev_spearman"] = state.dev_spearman
    ray.train.report(metrics)


class _Worker:
    """One stage of training on one worker: the loop, and the report points (dev evaluation + checkpoint)."""

    def __init__(self, config, stage: StageConfig, encoder, device, rank, world_size, logger, dev_pairs):
        self.config, self.stage, self.encoder, self.device = config, stage, encoder, device
        self.rank, self.world_size, self.logger, self.dev_pairs = rank, world_size, logger, dev_pairs
        self.use_bf16 = device.type == "cuda"

    def run_stage(self, state: TrainState, data_dir, resume_from: Path | None) -> TrainState:
        stage, world_size = self.stage, self.world_size
        records = load_training_records(stage, data_dir)
        columns, labels = texts_and_labels(records, stage)
        data = TokenizedColumns(columns, labels, self.encoder.tokenizer, self.encoder.max_seq_length)
        local_batch = stage.batch_size // (world_size * stage.grad_accum_steps)
        sampler = SmartBatchSampler(
            data.lengths,
            local_batch,
            num_replicas=world_size,
            rank=self.rank,
            seed=self.config.seed + state.stage,
        )
        steps_per_epoch = sampler.num_batches // stage.grad_accum_steps
        if steps_per_epoch == 0:
            raise ValueError(f"stage {state.stage}: {len(data)} examples give no full step of batch {stage.batch_size}")
        total_steps = stage.epochs * steps_per_epoch
        total_steps = min(total_steps, stage.max_steps) if stage.max_steps else total_steps

        objective = build_objective(stage, self.encoder)
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
                    self.logger.log_metrics(
                        {
                            "train/loss": window_loss / steps_in_window,
                            "train/learning_rate": scheduler.get_last_lr()[0],
                            "train/pairs_per_s": window_examples / elapsed,
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
        dev = evaluate_pairs(self.encoder, self.dev_pairs, batch_size=self.config.evaluation.batch_size)
        metrics["dev_spearman"] = state.dev_spearman = dev["spearman_cosine"]
        self.logger.log_metrics({"dev/spearman_cosine": dev["spearman_cosine"]}, step=state.global_step)
        with tempfile.TemporaryDirectory(prefix="sbert-ray-ckpt-") as directory:
            save_checkpoint(Path(directory), state, objective, optimizer, scheduler)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def _final_evaluation(config: TrainConfig, encoder, data_dir, logger: RunLogger, step: int) -> dict[str, float]:
    """Rank 0: save the final model, score the final suite, log model + results to MLflow.
    Returns ``final_<dataset>`` primary scores for the last report (what a Tune trial ends on)."""
    # Local storage: output_dir, which the driver has filled in. Remote storage: this node's scratch space only (the
    # driver may be on another machine); the driver takes the final model from the last checkpoint.
    with tempfile.TemporaryDirectory(prefix="sbert-ray-final-") as scratch:
        model_dir = scratch if is_remote(config.checkpoint.storage_path) else config.output_dir
        encoder.save(model_dir)
        logger.log_artifacts(model_dir, "model")
    results = suite.run_tasks(encoder, config.evaluation.final_tasks, data_dir) if config.evaluation.final_tasks else {}
    if results:
        logger.log_dict(results, "evaluation.json")
        logger.log_metrics(suite.metric_items(results, "final"), step=step)
    return {f"final_{name}": value for name, value in suite.primary_scores(results).items()}


def load_encoder(model: ModelConfig, seed: int) -> SentenceEncoder:
    """The configured model, or for ``random:<shape>`` a freshly initialised BERT (same seed on every worker)."""
    if model.name.startswith("random:"):
        return random_bert(
            model.name.removeprefix("random:"),
            seed=seed,
            pooling=model.pooling or "mean",
            max_seq_length=model.max_seq_length,
            normalize=bool(model.normalize),
        )
    return SentenceEncoder.load(
        model.name, pooling=model.pooling, max_seq_length=model.max_seq_length, normalize=model.normalize
    )


def _parameter_groups(objective: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay everywhere except biases and LayerNorm weights (as the reference training scripts)."""
    decay, no_decay = [], []
    for name, param in objective.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith(NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
