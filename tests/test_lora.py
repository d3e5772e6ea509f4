"""LoRA (``model.lora``, ``sbert_ray.models.lora``) in one process, no Ray: a LoRA step is the chain rule of the
merged-weights model's gradient, only the adapters train, the model saved merged loads in sentence-transformers
with our embeddings, and a run resumed from a checkpoint continues with its adapter.

The step's arithmetic runs the tiny BERT in float64 (as tests/test_training_loop.py): the merged weights
W + (alpha / r) B A and the adapter path x W^T + (alpha / r) x A^T B^T round at ~1e-16 relative in different
orders, ~1e-13 of the largest value after a few layers, far inside the 1e-9 allowed; a wrong scale (alpha
instead of alpha / r) or a base weight that moved is of order 1.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
from sentence_transformers import SentenceTransformer
from test_training_loop import (
    CPU,
    EXACT,
    PAIRS,
    Interrupted,
    StopAfter,
    float64_objective,
    micro_batch,
    run,
    sgd,
    train,
    two_stage_config,
)

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, ModelConfig, StageConfig, TrainConfig
from sbert_ray.losses import CosineSimilarityLoss
from sbert_ray.models import ModelError, SentenceEncoder, build_random_decoder, load_encoder
from sbert_ray.models.lora import ADAPTER_DIR, apply_lora, restore_adapter
from sbert_ray.models.lora_settings import LoraSettings
from sbert_ray.training.loop import LocalReporter
from sbert_ray.training.optimization import prepare_optimization
from sbert_ray.training.stages import Worker, start_worker
from sbert_ray.training.state import MODEL_DIR

SETTINGS = LoraSettings(r=4, alpha=8.0, target_modules=["query", "value", "dense"])
SENTENCES = ["A man plays a guitar.", "Two dogs run in the park.", "The weather is sunny and warm today."]
CLOSE = 1e-5  # float32 embeddings of the same weights through two libraries' kernels

REPO = Path(__file__).resolve().parents[1]


def lora_layers(transformer: peft.PeftModel) -> dict[str, peft.tuners.lora.LoraLayer]:
    """The wrapped linear modules by their name in the base model."""
    base = transformer.get_base_model()
    return {name: module for name, module in base.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}


def factors(layer: peft.tuners.lora.LoraLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The frozen weight W [out, in] and the adapter's A [r, in] and B [out, r]."""
    return layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight


def with_random_adapters(encoder: SentenceEncoder, settings: LoraSettings, seed: int = 1) -> SentenceEncoder:
    """``encoder`` with LoRA whose B is random, not peft's zeros: at B = 0 the merged model is the base model and
    A gets no gradient, which would hide a wrong merge or a wrong gradient of A."""
    encoder.transformer = apply_lora(encoder.transformer, settings)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(encoder.transformer).values():
            _, _, b = factors(layer)
            b.copy_(torch.randn(b.shape, generator=generator, dtype=b.dtype) * 0.1)
    return encoder


def merged_by_hand(lora_objective, settings: LoraSettings):
    """A copy of the objective whose encoder is the plain base model with W + (alpha / r) B A in each targeted
    module: the merge computed here, not by peft."""
    merged = copy.deepcopy(lora_objective)
    base = merged.encoder.transformer.get_base_model()
    with torch.no_grad():
        for name, layer in lora_layers(lora_objective.encoder.transformer).items():
            w, a, b = factors(layer)
            base.get_submodule(name).base_layer.weight.copy_(w + settings.alpha / settings.r * b @ a)
    merged.encoder.transformer = merged.encoder.transformer.unload()  # the base model without the adapters
    merged.requires_grad_(True)  # peft froze the base; here it is the model whose gradient is taken
    return merged


def test_a_lora_step_is_the_merged_models_step_through_the_adapters(tiny_model_dir):
    """The loss equals the merged-weights model's, and one SGD step (lr 1) of the adapters moves the merged weights
    to W + s (B - s G A^T)(A - s B^T G), s = alpha / r, G the merged model's gradient of the merged weight: LoRA's
    gradients are the chain rule through W + s B A, with peft scaling by alpha / r."""
    objective = float64_objective(tiny_model_dir)
    objective.encoder.float()  # peft makes float32 adapters on a float32 model; the whole then in float64
    with_random_adapters(objective.encoder, SETTINGS)
    objective.double()
    merged = merged_by_hand(objective, SETTINGS)
    batch = micro_batch(objective.encoder, PAIRS)

    losses = [model(batch.features, batch.labels) for model in (objective, merged)]
    assert abs(losses[0].item() - losses[1].item()) <= EXACT * abs(losses[1].item())
    losses[1].backward()
    s, layers = SETTINGS.alpha / SETTINGS.r, lora_layers(objective.encoder.transformer)
    expected = {}
    for name, layer in layers.items():
        w, a, b = (t.detach().clone() for t in factors(layer))
        g = merged.encoder.transformer.get_submodule(name).weight.grad
        expected[name] = w + s * (b - s * g @ a.T) @ (a - s * b.T @ g)

    run(objective, [batch], sgd(objective), total_steps=1, max_grad_norm=1e9)  # no clipping: the plain step
    largest = max((e - factors(layers[n])[0]).abs().max().item() for n, e in expected.items())
    for name, layer in layers.items():
        w, a, b = factors(layer)
        got = w + s * b @ a
        assert (got - expected[name]).abs().max().item() <= EXACT * largest, name
    assert largest > 1e-3  # the step moved the merged weights: the comparison above is not of equal inputs


def test_only_the_adapters_train_and_the_optimizer_holds_only_them(tiny_model_dir):
    """AdamW gets the adapters' parameters only; after a step every other weight (embeddings, LayerNorm, the base
    of each targeted linear module) is bit for bit where it was, and every adapter moved: none sits on the [CLS]
    pooler, which "dense" also names but sentence pooling never uses (DDP would wait for its gradients)."""
    encoder = with_random_adapters(SentenceEncoder.load(str(tiny_model_dir)).train(), SETTINGS)
    objective = CosineSimilarityLoss(encoder)
    optimization = prepare_optimization(objective, StageConfig(learning_rate=1e-3), 1, CPU, "fp32", None)
    trainable = {name for name, p in objective.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimized = {id(p) for group in optimization.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in objective.parameters() if p.requires_grad}

    before = {name: p.detach().clone() for name, p in objective.named_parameters()}
    run(objective, [micro_batch(encoder, PAIRS)], optimization, total_steps=1)
    for name, p in objective.named_parameters():
        assert torch.equal(p, before[name]) != (name in trainable), name


@pytest.mark.parametrize("model", ["bert", "qwen3"])
def test_the_merged_model_loads_in_sentence_transformers_with_our_embeddings(tiny_model_dir, tmp_path, model):
    """Saved merged (the adapter beside it), the folder is a plain model: sentence-transformers and
    ``SentenceEncoder.load`` encode as the LoRA encoder did, and the adapter restores into a fresh LoRA model."""
    if model == "bert":
        base = str(tiny_model_dir)
        settings = SETTINGS
    else:
        base = str(build_random_decoder(tmp_path / "decoder", model_type="qwen3"))
        settings = LoraSettings(r=2, alpha=4.0)  # peft's default targets for Qwen: q_proj, v_proj
    encoder = with_random_adapters(load_encoder(base), settings)
    ours = encoder.encode(SENTENCES)
    assert np.abs(ours - load_encoder(base).encode(SENTENCES)).max() > 1e-3  # the adapters change the embeddings
    encoder.save(tmp_path / "lora")

    assert (tmp_path / "lora" / ADAPTER_DIR / "adapter_config.json").is_file()
    theirs = SentenceTransformer(str(tmp_path / "lora"), device="cpu").encode(SENTENCES)
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=CLOSE)
    np.testing.assert_allclose(SentenceEncoder.load(tmp_path / "lora").encode(SENTENCES), ours, rtol=0, atol=CLOSE)
    restored = load_encoder(base, lora=settings)
    restore_adapter(restored.transformer, tmp_path / "lora")
    np.testing.assert_allclose(restored.encode(SENTENCES), ours, rtol=0, atol=CLOSE)


def test_a_lora_run_resumed_from_a_mid_epoch_checkpoint_continues_with_its_adapter(tiny_model_dir, data_dir, tmp_path):
    """One epoch of tests/test_training_loop.py's first stage with LoRA, stopped after the full-state checkpoint of
    step 2 (mid-epoch) and resumed: the frozen base from the config, the adapter and optimizer state from the
    checkpoint give the uninterrupted run's losses and its final adapter and merged weights, bit for bit."""
    config = two_stage_config(tiny_model_dir, data_dir)
    config.stages = [dataclasses.replace(config.stages[0], epochs=1)]  # 3 steps: reports at 2 (mid-epoch) and 3
    config.model.lora = LoraSettings(r=2, alpha=4.0)
    whole = LocalReporter(tmp_path / "whole")
    train(config, whole)
    with pytest.raises(Interrupted):
        train(config, StopAfter(tmp_path / "first", global_step=2))
    resumed = LocalReporter(tmp_path / "resumed")
    train(config, resumed, restored=tmp_path / "first" / "step-2")

    assert [r["train_loss"] for r in resumed.reports] == [r["train_loss"] for r in whole.reports[1:]]
    ends = [tmp_path / run / "step-3" / MODEL_DIR for run in ("whole", "resumed")]
    merged = [SentenceEncoder.load(end).state_dict() for end in ends]
    assert all(torch.equal(merged[0][name], merged[1][name]) for name in merged[0])
    adapters = [peft.utils.load_peft_weights(str(end / ADAPTER_DIR)) for end in ends]
    assert adapters[0].keys() == adapters[1].keys() != set()
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])
    start = start_worker(config, Worker(CPU), None)[0]
    assert not all(torch.equal(adapters[0][k], v) for k, v in peft.get_peft_model_state_dict(start.transformer).items())


def test_a_target_module_the_model_lacks_is_named_with_the_models_linear_modules(tiny_model_dir):
    with pytest.raises(ModelError, match=r"^model\.lora\.target_modules: 'q_proj' is not a linear module .*query"):
        load_encoder(str(tiny_model_dir), lora=LoraSettings(target_modules=["q_proj"]))


@pytest.mark.parametrize(
    "setting, message",
    [
        ("r=0", "model.lora.r must be >= 1, got 0"),
        ("alpha=0", "model.lora.alpha must be > 0, got 0.0"),
        ("dropout=1", "model.lora.dropout must be in [0, 1), got 1.0"),
        ("target_modules=[]", "model.lora.target_modules: name modules"),
        ("rank=4", "unknown key model.lora.'rank'"),
        ("target_modules=[q_proj]", "model.lora.target_modules: 'q_proj' is not a linear module of the model (its: "),
    ],
)
def test_bad_lora_settings_are_one_line_from_train_before_ray(tiny_train_config, capsys, setting, message):
    """As a user meets them; a target module the model lacks is found on the model's skeleton in preflight."""
    assert main(["train", str(tiny_train_config()), f"model.lora.{setting}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sbert-ray train: error: ") and err.count("\n") == 1 and message in err, err


def test_no_lora_is_full_fine_tuning():
    assert ModelConfig().lora is None
    config = TrainConfig(model=ModelConfig(lora=LoraSettings(r=0)))
    with pytest.raises(ConfigError, match=r"^model\.lora\.r must be >= 1"):
        config.validate()
    assert dataclasses.asdict(ModelConfig(lora=LoraSettings()))["lora"]["target_modules"] is None


def test_the_footprint_benchmark_times_both_variants_and_counts_only_the_adapters_state(monkeypatch):
    """benchmarks/lora_footprint.py (docs/large-models.md's table), at its smallest: what it prints holds together."""
    spec = importlib.util.spec_from_file_location("lora_footprint", REPO / "benchmarks" / "lora_footprint.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    full, adapted = bench.measure("random:tiny", LoraSettings(r=4, alpha=8.0), steps=2)
    assert (full["lora"], adapted["lora"]["r"]) == (None, 4) and full["parameters"] < adapted["parameters"]
    assert adapted["trainable"] < full["trainable"] <= full["parameters"]  # (an unused pooler stays frozen)
    # AdamW keeps two moments per trainable parameter, in float32: 8 bytes each
    for row in (full, adapted):
        assert row["adamw_state_mib"] == pytest.approx(8 * row["trainable"] / 2**20, abs=1e-3)
        assert row["gradients_mib"] == pytest.approx(4 * row["trainable"] / 2**20, abs=1e-3)
        assert row["step_ms_median"] > 0
    assert adapted["step_time_vs_full"] > 0
