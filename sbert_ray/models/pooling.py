"""Pooling: token vectors -> one fixed-size sentence vector (SBERT section 3)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from sbert_ray.models.pooling_mode import POOLING_MODES, PoolingMode


class Pooling(nn.Module):
    """MEAN or MAX over the non-padding tokens, the first ([CLS]) token's vector, the last token's vector
    (``lasttoken``: a decoder's last position has attended to the whole input) or a mean weighted by position
    (``weightedmean``: weights 1, 2, ... from each row's first token, so later tokens, which saw more of the input
    through a causal mask, count more). Each as sentence-transformers' ``Pooling`` computes it, under left padding
    as under right padding.

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
        padding = attention_mask
        if prompt_length and not self.include_prompt:
            attention_mask = without_prompt(attention_mask, prompt_length)
        if self.mode == "lasttoken":
            return last_token(token_embeddings, attention_mask)
        if self.mode == "weightedmean":
            return weighted_mean(token_embeddings, attention_mask, padding)
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


def last_token(token_embeddings: Tensor, attention_mask: Tensor) -> Tensor:
    """Each row's vector at its last attended position (the end of the row under left padding, its length minus
    one under right padding); a row with none attended gives zeros (its masked last column), as in
    sentence-transformers."""
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(dim=1)
    rows = torch.arange(len(last), device=last.device)
    return token_embeddings[rows, last] * attention_mask[rows, last].unsqueeze(-1).to(token_embeddings.dtype)


def weighted_mean(token_embeddings: Tensor, attention_mask: Tensor, padding: Tensor) -> Tensor:
    """The mean of the attended tokens weighted by position, 1 for a row's first token (counted from after its left
    padding, which ``padding``, the mask before any prompt was left out, shows), 2 for the next, and so on."""
    positions = torch.arange(1, padding.shape[1] + 1, device=padding.device, dtype=token_embeddings.dtype)
    weights = (positions - padding.argmax(dim=1, keepdim=True)) * attention_mask.to(token_embeddings.dtype)
    summed = (token_embeddings * weights.unsqueeze(-1)).sum(dim=1)
    return summed / weights.sum(dim=1, keepdim=True).clamp(min=1e-9)
