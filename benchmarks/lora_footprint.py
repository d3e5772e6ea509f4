"""What LoRA (``model.lora``) saves in training state: trainable parameters, and the bytes of gradients and AdamW
state after one real step, full fine-tuning against LoRA, per model.

    python benchmarks/lora_footprint.py --models random:tiny sentence-transformers/all-MiniLM-L6-v2 qwen3

``qwen3`` is the tests' random Qwen3-shaped decoder (``models.random_decoder``); the others are ``model.name``s.
Each step is MNRL on 16 short pairs, with AdamW over the parameters that require gradients (as training builds it).
Counted from the tensors themselves, so the numbers do not depend on the machine. Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from sbert_ray.losses import MultipleNegativesRankingLoss
from sbert_ray.models import load_encoder
from sbert_ray.models.lora import apply_lora
from sbert_ray.models.lora_settings import LoraSettings
from sbert_ray.models.random_decoder import random_decoder

PAIRS = [(f"A sentence about topic {i}.", f"Another sentence on topic {i}.") for i in range(16)]


def _mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def measure(model: str, lora: LoraSettings | None) -> dict:
    torch.manual_seed(0)
    encoder = random_decoder("qwen3") if model == "qwen3" else load_encoder(model)
    if lora is not None:
        encoder.transformer = apply_lora(encoder.transformer, lora)
    objective = MultipleNegativesRankingLoss(encoder.train())
    trainable = [p for p in objective.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    features = [encoder.tokenize([pair[column] for pair in PAIRS]) for column in (0, 1)]
    objective(features).backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {
        "model": model,
        "lora": None if lora is None else {"r": lora.r, "target_modules": lora.target_modules or "peft's default"},
        "parameters": sum(p.numel() for p in objective.parameters()),
        "trainable": sum(p.numel() for p in trainable),
        "gradients_mib": round(_mib(p.grad for p in trainable), 3),
        "adamw_state_mib": round(_mib(state), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["random:tiny", "qwen3"])
    parser.add_argument("--r", type=int, default=8)
    args = parser.parse_args()
    lora = LoraSettings(r=args.r, alpha=2.0 * args.r)
    print(json.dumps([measure(model, settings) for model in args.models for settings in (None, lora)], indent=1))


if __name__ == "__main__":
    main()
