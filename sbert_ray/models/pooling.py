"""Pooling: token vectors -> one fixed-size sentence vector (SBERT section 3)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sbert_ray.models.pooling_mode import POOLING_MODES, PoolingMode


class Pooling(nn.Module):
    """MEAN or MAX over the non-padding tokens, or the first ([CLS]) token's vector."""

    def __init__(self, mode: PoolingMode = "mean") -> None:
        super().__init__()
        if mode not in POOLING_MODES:
            raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
        self.mode = mode

    def forward(self, token_embeddings: Tensor, attention_mask: Tensor) -> Tensor:
        if self.mode == "cls":
            return token_embeddings[:, 0]
        mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)
        if self.mode == "max":
            # Padding must never win the max, so it is pushed to the dtype's lowest value.
            lowest = torch.finfo(token_embeddings.dtype).min
            return token_embeddings.masked_fill(mask == 0, lowest).max(dim=1).values
        # The clamp only matters for an all-padding row, which would otherwise divide by zero.
        return (token_embeddings * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"
