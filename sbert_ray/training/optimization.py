"""AdamW, the warm-up schedule and (fp16) the gradient scaler of a stage, as new or restored from a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from sbert_ray.config import StageConfig
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.training.precision import grad_scaler
from sbert_ray.training.state import restore_training

NO_DECAY = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm.weight", "layer_norm.bias")
FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW kernel


class Optimization(NamedTuple):
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None


def prepare_optimization(
    objective: EncoderLoss,
    stage: StageConfig,
    total_steps: int,
    device: torch.device,
    precision: str,
    resume_from: Path | None,
) -> Optimization:
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
    scheduler = linear_warmup_then_decay(optimizer, int(stage.warmup_ratio * total_steps), total_steps)
    scaler = grad_scaler(precision, device)
    if resume_from is not None:
        restore_training(resume_from, objective, optimizer, scheduler, scaler)
    return Optimization(optimizer, scheduler, scaler)


def linear_warmup_then_decay(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' ``get_linear_schedule_with_warmup``, the same factors float for float: importing
    ``transformers.optimization`` imports peft where it is installed, 3-4 CPU seconds in every Train worker."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return float(step) / float(max(1, warmup_steps))
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _parameter_groups(objective: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay everywhere except biases and LayerNorm weights (as the reference training scripts)."""
    decay, no_decay = [], []
    for name, param in objective.named_parameters():
        if param.requires_grad:
            (no_decay if name.endswith(NO_DECAY) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
