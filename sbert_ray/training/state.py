"""What a checkpoint holds and how a worker restores it. A full-state checkpoint: model, objective head, optimizer,
scheduler, gradient scaler, position, and every rank's random number generators (so a resumed run draws the same
dropout masks). A weights-only checkpoint: model and position, for keeping the best model; a run never resumes
from one (``is_full_state``)."""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sbert_ray.models import SentenceEncoder
from sbert_ray.training.host_copy import HostCopier, encoder_holding, skeleton_of
from sbert_ray.training.sharding import Whole, is_sharded, load_whole_optimizer_state

STATE_FILE = "train_state.json"
MODEL_DIR = "model"
TRAINING_FILE = "training.pt"
RNG_FILE = "rng.pt"


@dataclass
class TrainState:
    """Where training stands. ``batch`` counts global micro-batches (``batch_size / grad_accum_steps`` examples of
    all workers together) already consumed in ``epoch``: the stream resumes there, at any world size
    (``training.stream.StageBatches``); ``stage_done`` marks a stage whose last step is behind us."""

    stage: int = 0
    epoch: int = 0
    batch: int = 0
    step: int = 0  # optimizer steps within the stage
    global_step: int = 0  # optimizer steps over all stages (the MLflow step axis)
    stage_done: bool = False
    dev_score: float | None = None  # the latest dev score (sbert_ray.evaluation.dev_score)

    def save(self, directory: Path) -> None:
        (directory / STATE_FILE).write_text(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def load(cls, directory: Path) -> TrainState:
        saved = json.loads((directory / STATE_FILE).read_text())
        saved.setdefault("dev_score", saved.pop("dev_spearman", None))  # the name in checkpoints before dev_task
        saved.pop("samples", None)  # per-source counts older checkpoints held (MLflow has them: data/<source>/samples)
        return cls(**saved)


@dataclass(frozen=True)
class Snapshot:
    """A report point's checkpoint in host memory (``take_snapshot``), serialised by ``write`` later, in another
    thread while training goes on: the encoder's weights (rebuilt around its skeleton, ``training.host_copy``) and
    where training stood; for a full-state checkpoint also ``training`` (head, optimizer, scheduler, scaler) and
    ``rng_states``, one entry per rank. ``copied``: the CUDA event the host copies are complete at."""

    state: TrainState
    weights: dict[str, torch.Tensor]
    skeleton: SentenceEncoder
    training: dict | None = None
    rng_states: list[dict] | None = None
    copied: torch.cuda.Event | None = None

    @property
    def full_state(self) -> bool:
        return self.training is not None

    def write(self, directory: Path) -> None:
        """The checkpoint's files in ``directory``: the encoder in sentence-transformers layout (a checkpoint is a
        usable model), ``STATE_FILE``, and for a full state ``TRAINING_FILE`` and ``RNG_FILE``."""
        if self.copied is not None:
            self.copied.synchronize()
        encoder_holding(self.skeleton, self.weights).save(directory / MODEL_DIR)
        self.state.save(directory)
        if self.training is not None:
            torch.save(self.training, directory / TRAINING_FILE)
            torch.save(self.rng_states, directory / RNG_FILE)


def take_snapshot(
    state: TrainState,
    objective,
    device: torch.device,
    whole: Whole | None = None,
    optimization=None,
    rng_states: list[dict] | None = None,
) -> Snapshot:
    """The checkpoint of this moment copied to host memory (``training.host_copy``): weights only, or with
    ``optimization`` (``training.optimization.Optimization``) and ``rng_states`` (``rng_state()`` of each rank) the
    full state. ``whole``: a sharded encoder's weights and optimizer state as rank 0 gathered them
    (``training.sharding``; the same files as an unsharded run's), kept as they are where they are on the host."""
    copier = HostCopier(device)
    if whole:
        weights = copier.on_host(whole.encoder.state_dict())
    else:
        weights = copier.copy(objective.encoder.state_dict())
    skeleton = skeleton_of(objective.encoder, whole.encoder if whole else None)
    training = None
    if optimization is not None:
        optimizer, scheduler, scaler = optimization
        head = {k: v for k, v in objective.state_dict().items() if not k.startswith("encoder.")}
        optimizer_state = copier.on_host(whole.optimizer_state) if whole else copier.copy(optimizer.state_dict())
        # The schedule's and scaler's state: numbers, in lists the next step may replace.
        schedule = copier.copy(scheduler.state_dict())
        training = {"head": copier.copy(head), "optimizer": optimizer_state, "scheduler": schedule}
        if scaler is not None:
            training["scaler"] = copier.copy(scaler.state_dict())
    return Snapshot(dataclasses.replace(state), weights, skeleton, training, rng_states, copier.ready())


def is_full_state(directory: Path) -> bool:
    """Whether a run can resume from this checkpoint folder (a weights-only one lacks the optimizer state)."""
    return (directory / TRAINING_FILE).exists()


def restore_training(directory: Path, objective, optimizer, scheduler, scaler) -> None:
    """Load head, optimizer, scheduler and scaler state. The objective must already be on its training device:
    ``optimizer.load_state_dict`` puts each state tensor on its parameter's device as it is then."""
    saved = torch.load(directory / TRAINING_FILE, map_location="cpu", weights_only=True)
    # The encoder's weights came with the checkpoint's model folder; only the head is loaded here.
    missing, unexpected = objective.load_state_dict(saved["head"], strict=False)
    if unexpected or any(not key.startswith("encoder.") for key in missing):
        raise RuntimeError(f"checkpoint {directory} does not match the objective: {missing=} {unexpected=}")
    if is_sharded(objective.encoder):
        load_whole_optimizer_state(objective, optimizer, saved["optimizer"])
    else:
        optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    if scaler is not None and "scaler" in saved:
        scaler.load_state_dict(saved["scaler"])


def rng_state(device: torch.device) -> dict:
    """This process's generators: torch (CPU, and the device's on CUDA), numpy's global one, Python's ``random``.
    Plain tensors, numbers and tuples only, so the file loads with ``weights_only=True``."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def load_rng_states(directory: Path) -> list[dict]:
    """Every rank's generator state saved with a checkpoint ([] for a checkpoint written before they were)."""
    path = directory / RNG_FILE
    return torch.load(path, weights_only=True) if path.exists() else []
