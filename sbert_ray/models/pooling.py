"""Pooling: token vectors -> one fixed-size sentence vector (SBERT section 3)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sbert_ray.models.pooling_mode import POOLING_MODES, PoolingMode


class Pooling(nn.Module):
    """MEAN or MAX over the non-padding tokens, or the first ([CLS]) token's vector.

    ``include_prompt=False`` (sentence-transformers' flag of the same name) leaves a prompt's tokens out: the first
    ``prompt_length`` attended tokens of every row are masked before pooling, and CLS pooling takes the first token
    after them, as sentence-transformers' ``Pooling`` does.
    """

    def __init__(self, mode: PoolingMode = "mean", include_prompt: bool = True) -> None:
        super().__init__()
        if mode not in POOLING_MODES:
            raise ValueError(f"unknown pooling mode {mode!r}; expected one of {POOLING_MODES}")
        self.mode = mode
        self.include_prompt = include_prompt

    def forward(self, token_embeddings: Tensor, attention_mask: Tensor, prompt_length: int = 0) -> Tensor:
        if prompt_length and not self.include_prompt:
            attention_mask = without_prompt(attention_mask, prompt_length)
        if self.mode == "cls":
            # The first attended token: position 0 under right padding, as before any prompt is excluded.
            first = attention_mask.argmax(dim=1)
            return token_embeddings[torch.arange(len(first), device=first.device), first]
        mask = attention_mask.unsqueeze(-1).to(token_embeddings.dtype)
        if self.mode == "max":
            # Padding must never win the max, so it is pushed to the dtype's lowest value.
            lowest = torch.finfo(token_embeddings.dtype).min
            return token_embeddings.masked_fill(mask == 0, lowest).max(dim=1).values
        # The clamp only matters for an all-padding row, which would otherwise divide by zero.
        return (token_embeddings * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}" + ("" if self.include_prompt else ", include_prompt=False")


def without_prompt(attention_mask: Tensor, prompt_length: int) -> Tensor:
    """A copy of ``attention_mask`` with each row's first ``prompt_length`` attended positions masked (after any
    left padding), as sentence-transformers' ``Pooling._exclude_prompt_from_mask``."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    first = attention_mask.argmax(dim=1, keepdim=True)
    return attention_mask.masked_fill(positions < first + prompt_length, 0)
