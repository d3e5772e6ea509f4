"""The training step's parts without a cluster: optimizer state on the model's device after a restore, the
random state a checkpoint carries, and word-embedding gradients all-reduced as rows between two gloo processes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from spawned_workers import word_embedding_gradients_both_ways

from sbert_ray.config import StageConfig
from sbert_ray.losses import CosineSimilarityLoss
from sbert_ray.models import SentenceEncoder
from sbert_ray.training.optimization import Optimization, prepare_optimization
from sbert_ray.training.state import RNG_FILE, TrainState, load_rng_states, rng_state, set_rng_state, take_snapshot

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
    optimization = Optimization(optimizer, scheduler, scaler)
    saved = take_snapshot(TrainState(step=1), trained, CPU, optimization=optimization, rng_states=[rng_state(CPU)])
    saved.write(tmp_path)

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


SENTENCES = [["A man plays a guitar.", "Someone makes music."], ["A dog runs in the park.", "Cats sleep all day."]]


@pytest.mark.slow  # spawns a two-process group
def test_sparse_embedding_gradients_all_reduce_to_the_dense_ones(tiny_model_dir: Path, tmp_path: Path):
    """Two gloo processes, each its own pair: DDP leaves the word-embedding gradient as the rank's own rows, and
    those all-reduced on their own group and densified are the dense all-reduce's (the rows neither batch used stay
    zero), on both ranks."""
    port = 29500 + random.Random(str(tmp_path)).randrange(1000)
    args = (str(tiny_model_dir), port, str(tmp_path / "grads"), SENTENCES)
    mp.spawn(word_embedding_gradients_both_ways, args=args, nprocs=2)
    for rank in range(2):
        grads = torch.load(tmp_path / f"grads.{rank}")
        assert grads["dense"].abs().sum() > 0
        # Both sum each row's few per-token terms (the sparse one when it coalesces, maybe in another order) and
        # the two ranks' rows: a reordering of <= 4 terms moves a gradient below ~0.1 by ulps (~1e-8), far inside
        # float32's default tolerance (1e-5 + 1.3e-6 relative); a missing or doubled row would be off by its value.
        torch.testing.assert_close(grads["sparse"], grads["dense"])
