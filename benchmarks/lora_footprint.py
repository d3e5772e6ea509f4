"""What LoRA (``model.lora``) saves in training state and time: trainable parameters, the bytes of gradients and
AdamW state after one real step, and (``--steps N``) the median time of a training step, full fine-tuning against
LoRA, per model, their steps interleaved.

    python benchmarks/lora_footprint.py --models random:tiny sentence-transformers/all-MiniLM-L6-v2 qwen3 --steps 20

``qwen3`` is the tests' random Qwen3-shaped decoder (``models.random_decoder``); the others are ``model.name``s.
Each step is MNRL on 16 short pairs, with AdamW over the parameters that require gradients (as training builds it).
The bytes are counted from the tensors (the same on any machine); the times are this machine's. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sbert_ray.losses import MultipleNegativesRankingLoss
from sbert_ray.models import load_encoder
from sbert_ray.models.lora import apply_lora
from sbert_ray.models.lora_settings import LoraSettings
from sbert_ray.models.random_decoder import random_decoder

PAIRS = [(f"A sentence about topic {i}.", f"Another sentence on topic {i}.") for i in range(16)]


def _mib(tensors) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


class Training:
    """One model's training step as a run takes it: MNRL, AdamW over the parameters that require gradients."""

    def __init__(self, model: str, lora: LoraSettings | None) -> None:
        torch.manual_seed(0)
        encoder = random_decoder("qwen3") if model == "qwen3" else load_encoder(model)
        if lora is not None:
            encoder.transformer = apply_lora(encoder.transformer, lora)
        self.model, self.lora = model, lora
        self.objective = MultipleNegativesRankingLoss(encoder.train())
        self.trainable = [p for p in self.objective.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-4)
        self.features = [encoder.tokenize([pair[column] for pair in PAIRS]) for column in (0, 1)]
        self.seconds: list[float] = []

    def step(self, timed: bool = True) -> None:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as between a run's steps
        self.objective(self.features).backward()
        self.optimizer.step()
        if timed:
            self.seconds.append(time.perf_counter() - start)

    def footprint(self) -> dict:
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        lora = self.lora
        return {
            "model": self.model,
            "lora": None if lora is None else {"r": lora.r, "target_modules": lora.target_modules or "peft's default"},
            "parameters": sum(p.numel() for p in self.objective.parameters()),
            "trainable": sum(p.numel() for p in self.trainable),
            "gradients_mib": round(_mib(p.grad for p in self.trainable), 3),
            "adamw_state_mib": round(_mib(state), 3),
            "step_ms_median": round(1e3 * statistics.median(self.seconds), 2) if self.seconds else None,
        }


def measure(model: str, lora: LoraSettings, steps: int) -> list[dict]:
    """Full fine-tuning and LoRA of one model, their timed steps interleaved (this machine's speed drifts)."""
    full, adapted = Training(model, None), Training(model, lora)
    for training in (full, adapted):
        training.step(timed=False)  # allocates gradients and AdamW state; the first step also warms the kernels
    for i in range(steps):
        for training in (full, adapted) if i % 2 == 0 else (adapted, full):
            training.step()
    rows = [full.footprint(), adapted.footprint()]
    if steps:
        rows[1]["step_time_vs_full"] = round(statistics.median(adapted.seconds) / statistics.median(full.seconds), 3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["random:tiny", "qwen3"])
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--steps", type=int, default=0, help="timed steps per variant, interleaved (0: memory only)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lora = LoraSettings(r=args.r, alpha=2.0 * args.r)
    rows = [row for model in args.models for row in measure(model, lora, args.steps)]
    print(json.dumps({"threads": args.threads, "pairs_per_step": len(PAIRS), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
