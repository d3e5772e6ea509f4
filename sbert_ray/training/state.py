"""What a checkpoint holds and how a worker restores it: model, objective head, optimizer, scheduler, position."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

STATE_FILE = "train_state.json"
MODEL_DIR = "model"


@dataclass
class TrainState:
    """Where training stands. ``batch`` counts micro-batches already consumed in ``epoch`` (the sampler resumes
    there); ``stage_done`` marks a stage whose last step is behind us."""

    stage: int = 0
    epoch: int = 0
    batch: int = 0
    step: int = 0  # optimizer steps within the stage
    global_step: int = 0  # optimizer steps over all stages (the MLflow step axis)
    stage_done: bool = False
    dev_spearman: float | None = None  # the latest dev score, carried into the final report for Tune

    def save(self, directory: Path) -> None:
        (directory / STATE_FILE).write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def load(cls, directory: Path) -> TrainState:
        return cls(**json.loads((directory / STATE_FILE).read_text()))


def save_checkpoint(directory: Path, state: TrainState, objective, optimizer, scheduler) -> None:
    """The encoder in sentence-transformers layout (a checkpoint is a usable model), the rest beside it."""
    objective.encoder.save(directory / MODEL_DIR)
    head = {k: v for k, v in objective.state_dict().items() if not k.startswith("encoder.")}
    torch.save(
        {"head": head, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()},
        directory / "training.pt",
    )
    state.save(directory)


def restore_training(directory: Path, objective, optimizer, scheduler) -> None:
    saved = torch.load(directory / "training.pt", map_location="cpu", weights_only=True)
    # The encoder's weights came with the checkpoint's model folder; only the head is loaded here.
    missing, unexpected = objective.load_state_dict(saved["head"], strict=False)
    if unexpected or any(not key.startswith("encoder.") for key in missing):
        raise RuntimeError(f"checkpoint {directory} does not match the objective: {missing=} {unexpected=}")
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
