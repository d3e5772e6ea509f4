"""LoRA through peft: an encoder's transformer wrapped with adapters for training (``apply_lora``), a checkpoint's
adapter restored into it (``restore_adapter``), and saved merged with the adapter beside it (``save_merged``, which
``SentenceEncoder.save`` calls): a LoRA model's folder is a plain sentence-transformers model, which
sentence-transformers, ``SentenceEncoder.load``, encode/eval/mine and the MLflow flavor load as any other.
The one module that imports peft; it works on transformers, not encoders (``models.encoder`` calls into it)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import peft
import torch
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
from torch import nn

from sbert_ray.models.lora_settings import LoraSettings
from sbert_ray.models.st_layout import ModelError

ADAPTER_DIR = "adapter"  # beside the merged weights in a saved model folder: peft's adapter_config.json + weights
KEY = "model.lora"


def apply_lora(transformer: nn.Module, settings: LoraSettings) -> peft.PeftModel:
    """``transformer`` wrapped in peft's LoRA adapters (B = 0: it computes what it did before); only the adapters
    require gradients. A ModelError naming ``model.lora.target_modules`` when a target names no linear
    module of the model, or when peft knows no default for its family."""
    # A frozen module stays without adapters: BERT's [CLS] pooler ("dense", as its layers' projections), which
    # sentence pooling never uses; its adapters would get no gradient, and DDP would wait for one.
    frozen = [name for name, module in _linear_modules(transformer).items() if not module.weight.requires_grad]
    config = peft.LoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=_target_modules(transformer, settings),
        exclude_modules=frozen or None,
    )
    with warnings.catch_warnings():  # peft asks transformers 5 for a name it deprecated: nothing of ours to change
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return peft.get_peft_model(transformer, config)


def check_target_modules(model_config, settings: LoraSettings) -> None:
    """Before any cluster work: ``apply_lora``'s ModelError for targets the model of ``model_config`` (a
    transformers config) lacks, found on its skeleton on the meta device (no weights allocated or read)."""
    from transformers import AutoModel

    with torch.device("meta"):
        _target_modules(AutoModel.from_config(model_config), settings)


def _target_modules(transformer: nn.Module, settings: LoraSettings) -> list[str]:
    """The configured targets, or peft's default for the model's family, each matching a linear module (as peft
    matches them: the module's name, or the end of its dotted path)."""
    linear = sorted(_linear_modules(transformer))
    family = transformer.config.model_type
    targets = settings.target_modules or TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(family)
    names = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in linear}))
    if targets is None:
        raise ModelError(f"{KEY}.target_modules: peft has no default for {family} models; name some of: {names}")
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in linear):
            raise ModelError(f"{KEY}.target_modules: {target!r} is not a linear module of the model (its: {names})")
    return list(targets)


def _linear_modules(transformer: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in transformer.named_modules() if isinstance(module, nn.Linear)}


def restore_adapter(transformer: peft.PeftModel, model_dir: Path) -> None:
    """Load the adapter saved in ``model_dir`` (a checkpoint's model folder, ``save_merged``) into ``transformer``
    (``apply_lora``'s): with the frozen base built from the config again, training continues where it stood."""
    adapter = model_dir / ADAPTER_DIR
    if not adapter.is_dir():
        raise ModelError(f"{model_dir} holds no LoRA adapter ({ADAPTER_DIR}/): was it saved by a run without {KEY}?")
    loaded = peft.set_peft_model_state_dict(transformer, peft.utils.load_peft_weights(str(adapter)))
    # Missing: the frozen base (built from the config), fine; an adapter the checkpoint lacks (targets changed), not
    missing = [key for key in loaded.missing_keys if ".lora_" in key]
    if loaded.unexpected_keys or missing:
        raise ModelError(
            f"{adapter} does not match {KEY}: {loaded.unexpected_keys[:2]} unexpected, {missing[:2]} missing"
        )


def save_merged(transformer: peft.PeftModel, path: Path) -> None:
    """The adapter at ``path/adapter`` and, at ``path``, the transformer with the adapters merged into its weights
    (a plain Hugging Face model). Merged in a copy: the model being trained keeps its frozen base and adapters
    (merging in place and back would not restore the base's bits)."""
    transformer.save_pretrained(path / ADAPTER_DIR)
    copy.deepcopy(transformer).merge_and_unload().save_pretrained(path)
