"""FSDP (``scaling.strategy: fsdp``, ``training.sharding``) without a cluster: two gloo processes train the same
2-stage recipe under DDP and under FSDP through the Ray Train worker's core (``training.stages``); the curves, the
checkpoints and a resume compared."""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from spawned_workers import StrategyRun, strategy_config, strategy_runs

from sbert_ray.cli import main
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.lora import ADAPTER_DIR
from sbert_ray.models.random_decoder import build_random_decoder
from sbert_ray.training.loop import LocalReporter
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.sharding import shard_encoder
from sbert_ray.training.stage_plan import stage_plans
from sbert_ray.training.stages import Worker, start_worker, train_stages
from sbert_ray.training.state import MODEL_DIR, TRAINING_FILE
from sbert_ray.training.stream import local_sources

CPU = torch.device("cpu")
# How far DDP's and FSDP's float32 runs may drift apart. Both compute every forward on the same whole weights
# (FSDP all-gathers copies) and average the two ranks' gradients as (a + b) / 2, exact in either order (two
# terms commute; halving is exact). What is summed in another order: the gradient norm for clipping (per shard,
# then across ranks, vs per tensor) and the word-embedding gradient (DDP's sparse rows on gloo, coalesced, vs
# FSDP's dense backward): a few ulps (~1e-7 relative) in an update. AdamW's step m / sqrt(v) is invariant to a
# gradient's scale, so the updates, and through 8 steps of a tiny model the losses, move by about as much:
# 1e-5 leaves two orders of magnitude for that drift, while a rank's gradient left out or counted twice, or a
# micro-batch synced wrongly, moves a loss by percents.
CURVE_RTOL = 1e-5
SENTENCES = ["A man plays a guitar.", "Two dogs run in the park.", "The train leaves at noon."]


# The tests on these runs are slow (one spawn of two processes) and stay in one pytest-xdist process (it runs once).
@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The recipe trained by two DDP workers, by two FSDP workers, and by two FSDP workers resumed from the DDP run's
    checkpoint of step 2; by both strategies in bf16 and with LoRA; and both ways, with and without LoRA, on a
    Mistral-shaped decoder (lasttoken pooling, left padding): each run's folder (reports.pt, checkpoints/)."""
    tmp = tmp_path_factory.mktemp("runs")
    decoder = str(build_random_decoder(tmp / "mistral", model_type="mistral"))
    runs = [
        StrategyRun("ddp", False),
        StrategyRun("fsdp", True),
        StrategyRun("fsdp_from_ddp", True, "ddp/checkpoints/step-2"),
        StrategyRun("ddp_bf16", False, precision="bf16"),
        StrategyRun("fsdp_bf16", True, precision="bf16"),
        StrategyRun("ddp_lora", False, lora=True),
        StrategyRun("fsdp_lora", True, lora=True),
        *(StrategyRun(f"{way}_decoder", way == "fsdp", model_dir=decoder) for way in ("ddp", "fsdp")),
        *(StrategyRun(f"{way}_decoder_lora", way == "fsdp", lora=True, model_dir=decoder) for way in ("ddp", "fsdp")),
    ]
    mp.spawn(strategy_runs, args=(2, str(tmp), str(tiny_model_dir), str(data_dir), runs), nprocs=2, join=True)
    return {run.name: tmp / run.name for run in runs}


def losses(folder: Path) -> list[float]:
    return [report["train_loss"] for report in torch.load(folder / "reports.pt")]


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp runs")
def test_two_fsdp_workers_train_the_ddp_curve(runs):
    """Regression with accumulation, then MNRL gathering across the workers: the losses at every report point."""
    losses_ddp, losses_fsdp = losses(runs["ddp"]), losses(runs["fsdp"])
    assert len(losses_fsdp) == 4
    torch.testing.assert_close(losses_fsdp, losses_ddp, rtol=CURVE_RTOL, atol=0)


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp runs")
def test_fsdp_workers_resume_a_ddp_checkpoint_on_its_curve(runs):
    """The whole state DDP saved at step 2, sharded into two FSDP workers (weights and AdamW state): the losses of
    the uninterrupted DDP run at every later report point."""
    torch.testing.assert_close(losses(runs["fsdp_from_ddp"]), losses(runs["ddp"])[1:], rtol=CURVE_RTOL, atol=0)


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp runs")
def test_an_fsdp_checkpoint_is_a_ddp_checkpoint(runs):
    """Rank 0 wrote the whole optimizer state in ``optimizer.state_dict()``'s layout, the same as DDP's."""
    step = "step-2"
    ddp = torch.load(runs["ddp"] / "checkpoints" / step / TRAINING_FILE, weights_only=True)
    fsdp = torch.load(runs["fsdp"] / "checkpoints" / step / TRAINING_FILE, weights_only=True)
    assert fsdp["optimizer"]["param_groups"] == ddp["optimizer"]["param_groups"]
    assert fsdp["optimizer"]["state"].keys() == ddp["optimizer"]["state"].keys()
    torch.testing.assert_close(fsdp["optimizer"]["state"], ddp["optimizer"]["state"], rtol=CURVE_RTOL, atol=1e-9)


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp runs")
def test_the_fsdp_model_reloads_in_sentence_transformers(runs):
    from sentence_transformers import SentenceTransformer

    final = runs["fsdp"] / "checkpoints" / "step-8" / MODEL_DIR
    theirs = SentenceTransformer(str(final), device="cpu").encode(SENTENCES)
    np.testing.assert_allclose(theirs, SentenceEncoder.load(final).encode(SENTENCES), rtol=0, atol=1e-5)
    ddp = SentenceEncoder.load(runs["ddp"] / "checkpoints" / "step-8" / MODEL_DIR).encode(SENTENCES)
    np.testing.assert_allclose(theirs, ddp, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp runs")
def test_a_run_resumes_from_an_fsdp_checkpoint_on_one_worker(runs, tiny_model_dir: Path, data_dir: Path):
    """The full state FSDP wrote at step 2 (mid stage 1), resumed by one worker (no process group: the whole model
    and optimizer state, as saved): the same later losses as the one-worker resume of the DDP checkpoint of the
    same step. (Not the two-worker run's losses: at another world size each worker cuts its smart-batching windows
    from other rows, ``training.stream``.)"""
    resumed = {}
    for strategy in ("ddp", "fsdp"):
        config = strategy_config(str(tiny_model_dir), str(data_dir))
        worker = Worker(CPU)
        started = start_worker(config, worker, runs[strategy] / "checkpoints" / "step-2")
        reporter = LocalReporter()
        data = functools.partial(local_sources, config, encoder=started.encoder)
        train_stages(stage_plans(config), started, data, worker, reporter, StepMeter(time.time(), CPU))
        resumed[strategy] = [report["train_loss"] for report in reporter.reports]
    assert len(resumed["fsdp"]) == 3
    torch.testing.assert_close(resumed["fsdp"], resumed["ddp"], rtol=CURVE_RTOL, atol=0)


def test_under_bf16_the_blocks_compute_on_bf16_weights_while_the_shards_stay_fp32(tiny_model_dir, tmp_path):
    """FSDP's mixed precision on one gloo rank: inside a block's forward its weights are the bf16 copies; the
    parameters the optimizer steps are the fp32 shards; the embeddings come out in fp32 for the losses."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        encoder = SentenceEncoder.load(str(tiny_model_dir))
        shard_encoder(encoder, keep_meta_copy=False, precision="bf16")
        query = next(m for name, m in encoder.transformer.named_modules() if name.endswith("attention.self.query"))
        seen = []
        query.register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
        embeddings = encoder(encoder.tokenize(SENTENCES))
        embeddings.sum().backward()
        assert seen == [torch.bfloat16] and embeddings.dtype == torch.float32
        gradients = [p.grad for p in encoder.parameters() if p.grad is not None]  # (not the unused pooler's)
        assert gradients and {p.dtype for p in encoder.parameters()} | {g.dtype for g in gradients} == {torch.float32}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp runs")
def test_fsdp_in_bf16_trains_the_bf16_ddp_curve_and_keeps_fp32_weights_and_adamw_state(runs):
    """DDP in bf16 autocasts each matrix product's fp32 weights to bf16; FSDP all-gathers bf16 copies of them (the
    same rounding), but its embeddings, norms and residual sums also run in bf16. bf16 keeps 8 significant bits
    (a relative step of 2^-8 = 0.4 %): a few such steps through two layers and 8 updates stay within 3 % (0.24 %
    measured here on 2026-12-02), while training in fp32 instead (also 0.24 % away: it must not be equal) or a rank's
    gradient lost moves the curve."""
    bf16_ddp, bf16_fsdp, fp32_fsdp = losses(runs["ddp_bf16"]), losses(runs["fsdp_bf16"]), losses(runs["fsdp"])
    torch.testing.assert_close(bf16_fsdp, bf16_ddp, rtol=3e-2, atol=0)
    assert bf16_fsdp != fp32_fsdp  # bf16 did compute
    final = runs["fsdp_bf16"] / "checkpoints" / "step-8"
    assert {value.dtype for value in SentenceEncoder.load(final / MODEL_DIR).state_dict().values()} == {torch.float32}
    state = torch.load(final / TRAINING_FILE, weights_only=True)["optimizer"]["state"]
    assert {t.dtype for moments in state.values() for t in moments.values() if t.dim() > 0} == {torch.float32}


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp runs")
def test_lora_under_fsdp_trains_the_ddp_curve_and_saves_the_merged_model(runs):
    """Adapters on a sharded base: the DDP LoRA run's losses (fp32: CURVE_RTOL), and the merged final model with its
    adapter beside it, loaded by sentence-transformers with the DDP run's embeddings."""
    from sentence_transformers import SentenceTransformer

    torch.testing.assert_close(losses(runs["fsdp_lora"]), losses(runs["ddp_lora"]), rtol=CURVE_RTOL, atol=0)
    assert losses(runs["fsdp_lora"]) != losses(runs["fsdp"])  # the adapters trained, not every weight
    final = runs["fsdp_lora"] / "checkpoints" / "step-8" / MODEL_DIR
    assert (final / ADAPTER_DIR / "adapter_config.json").is_file()
    theirs = SentenceTransformer(str(final), device="cpu").encode(SENTENCES)
    ddp = SentenceEncoder.load(runs["ddp_lora"] / "checkpoints" / "step-8" / MODEL_DIR).encode(SENTENCES)
    np.testing.assert_allclose(theirs, ddp, rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.xdist_group("fsdp runs")
@pytest.mark.parametrize("training", ["decoder", "decoder_lora"])
def test_a_decoder_trains_the_ddp_curve_under_fsdp_and_reloads_in_sentence_transformers(runs, training):
    """Another family than BERT (Mistral's blocks, grouped-query attention, left padding, lasttoken pooling), all
    weights or LoRA adapters: FSDP's losses are DDP's, and the final model, loaded by sentence-transformers, embeds
    as ours does and as DDP's does."""
    from sentence_transformers import SentenceTransformer

    fsdp, ddp = runs[f"fsdp_{training}"], runs[f"ddp_{training}"]
    assert len(losses(fsdp)) == 4
    torch.testing.assert_close(losses(fsdp), losses(ddp), rtol=CURVE_RTOL, atol=0)
    final = fsdp / "checkpoints" / "step-8" / MODEL_DIR
    assert (final / ADAPTER_DIR).is_dir() == training.endswith("lora")
    theirs = SentenceTransformer(str(final), device="cpu").encode(SENTENCES)
    np.testing.assert_allclose(theirs, SentenceEncoder.load(final).encode(SENTENCES), rtol=0, atol=1e-5)
    ddp_embeddings = SentenceEncoder.load(ddp / "checkpoints" / "step-8" / MODEL_DIR).encode(SENTENCES)
    np.testing.assert_allclose(theirs, ddp_embeddings, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["scaling.strategy=zero3"], "scaling.strategy: 'zero3' is not one of ddp, fsdp"),
        (
            ["scaling.strategy=fsdp", "stages.0.objective=softmax", "stages.0.dataset=nli-offline"],
            "stages.0.objective: softmax trains a head beside the encoder, which scaling.strategy: fsdp does not shard",
        ),
    ],
)
def test_a_strategy_fsdp_cannot_train_is_refused_before_ray(tiny_train_config, capsys, overrides, message):
    """One line naming the config file and the key, before Ray or MLflow start."""
    config = tiny_train_config()
    code = main(["train", str(config), *overrides])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"sbert-ray train: error: {config}: {message}") and err.count("\n") == 1, err
