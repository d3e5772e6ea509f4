"""Attention kernels as a type that needs no torch: the config checks ``model.attn_implementation`` against it."""

from typing import Literal, get_args

# transformers' attention kernels a model can load with (sdpa: PyTorch's fused attention).
AttentionImplementation = Literal["sdpa", "eager", "flash_attention_2"]
ATTENTION_IMPLEMENTATIONS: tuple[str, ...] = get_args(AttentionImplementation)
