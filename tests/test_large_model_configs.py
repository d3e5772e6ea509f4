"""The large-model job configs (issue 29): they load, train what their comments say, name LoRA targets the model has
and fit the memory arithmetic they state. Offline, on the models' published transformers configs built on the meta
device (no weights allocated or read), as preflight checks LoRA targets."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModel, Qwen3Config

from sbert_ray.config import load_config
from sbert_ray.models.lora import check_target_modules

JOBS = Path(__file__).parents[1] / "jobs" / "configs"
# config.json of Qwen/Qwen3-Embedding-0.6B and -4B (the shapes that set their size)
QWEN3_EMBEDDING = {
    "qwen3-embedding-0.6b-lora": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                      num_attention_heads=16, num_key_value_heads=8),
    "qwen3-embedding-4b-fsdp": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                    num_attention_heads=32, num_key_value_heads=8),
}  # fmt: skip


def skeleton(name: str) -> torch.nn.Module:
    shape = QWEN3_EMBEDDING[name]
    config = Qwen3Config(vocab_size=151669, head_dim=128, tie_word_embeddings=True, **shape)
    with torch.device("meta"):
        return AutoModel.from_config(config)


@pytest.mark.parametrize("name", sorted(QWEN3_EMBEDDING))
def test_a_large_model_config_is_one_8_gpu_node_in_bf16_with_the_models_pooling_and_instruction(name):
    config = load_config(JOBS / f"{name}.yaml")
    assert config.model.name.startswith("Qwen/Qwen3-Embedding-") and config.model.pooling == "lasttoken"
    assert config.model.prompts["query"].startswith("Instruct: ") and config.model.prompts["query"].endswith("\nQuery:")
    assert config.model.prompts["document"] == ""
    scaling = config.scaling
    assert (scaling.max_workers, scaling.use_gpu, scaling.precision) == (8, True, "bf16")
    assert all(stage.batch_size % scaling.max_workers == 0 for stage in config.stages)  # equal shares per GPU


def test_the_lora_config_targets_every_projection_qwen3_has():
    config = load_config(JOBS / "qwen3-embedding-0.6b-lora.yaml")
    assert config.scaling.strategy == "ddp" and config.model.lora is not None
    model = skeleton("qwen3-embedding-0.6b-lora")
    check_target_modules(model.config, config.model.lora)  # a ModelError if one is missing
    linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    assert set(config.model.lora.target_modules) == linear  # every projection, attention and MLP
    assert 0.55e9 < sum(p.numel() for p in model.parameters()) < 0.65e9  # the "0.6 B" of its comments


def test_the_fsdp_config_shards_4b_parameters_to_8_gb_per_gpu():
    config = load_config(JOBS / "qwen3-embedding-4b-fsdp.yaml")
    assert config.scaling.strategy == "fsdp" and config.model.lora is None and config.model.gradient_checkpointing
    parameters = sum(p.numel() for p in skeleton("qwen3-embedding-4b-fsdp").parameters())
    assert 3.9e9 < parameters < 4.1e9
    # fp32 parameters, gradients and AdamW's two moments: 16 bytes each, an eighth per GPU; "8 GB" in the comments
    assert 16 * parameters / config.scaling.max_workers / 1e9 == pytest.approx(8, abs=0.2)
