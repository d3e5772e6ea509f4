"""The training step's parts without a cluster: optimizer state on the model's device after a restore, and the
random state a checkpoint carries."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from sbert_ray.config import StageConfig
from sbert_ray.losses import CosineSimilarityLoss
from sbert_ray.models import SentenceEncoder
from sbert_ray.training.state import RNG_FILE, TrainState, load_rng_states, rng_state, save_checkpoint, set_rng_state
from sbert_ray.training.worker import prepare_optimization

CPU = torch.device("cpu")


def test_restored_optimizer_state_lives_on_the_models_device(tiny_model_dir: Path, tmp_path: Path):
    """On a GPU, restoring AdamW's state before moving the model left the state on the CPU and the first step
    after a restart failed. prepare_optimization moves the objective first; the meta device stands in for a GPU
    here: state restored in the wrong order would stay on the CPU (or belong to parameters the model dropped)."""
    stage = StageConfig()
    trained = CosineSimilarityLoss(SentenceEncoder.load(tiny_model_dir))
    optimizer, scheduler, scaler = prepare_optimization(trained, stage, 10, CPU, "fp32", None)
    features = [trained.encoder.tokenize(["A man plays."]), trained.encoder.tokenize(["Someone plays music."])]
    trained(features, torch.tensor([0.8])).backward()
    optimizer.step()
    scheduler.step()
    save_checkpoint(tmp_path, TrainState(step=1), trained, optimizer, scheduler, scaler, [rng_state(CPU)])

    resumed = CosineSimilarityLoss(SentenceEncoder.load(tiny_model_dir))
    meta = torch.device("meta")
    optimizer, scheduler, _ = prepare_optimization(resumed, stage, 10, meta, "fp32", tmp_path)
    params = [p for p in resumed.parameters() if p.requires_grad]
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {id(p) for p in params}
    states = [optimizer.state[p] for p in params]
    assert all(state["exp_avg"].device == meta and state["exp_avg_sq"].device == meta for state in states)
    assert scheduler.last_epoch == 1


def test_checkpointed_random_state_replays_the_same_draws(tmp_path: Path):
    """torch, numpy and Python generators go into the checkpoint file and come back (weights_only loading)."""
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    torch.save([rng_state(CPU)], tmp_path / RNG_FILE)
    draws = (torch.rand(3), np.random.rand(3), random.random())
    (saved,) = load_rng_states(tmp_path)
    torch.manual_seed(2), np.random.seed(2), random.seed(2)
    set_rng_state(saved, CPU)
    again = (torch.rand(3), np.random.rand(3), random.random())
    torch.testing.assert_close(again[0], draws[0])
    np.testing.assert_array_equal(again[1], draws[1])
    assert again[2] == draws[2]
