"""Multiple-negatives ranking with gradient caching (GradCache, Gao et al. 2021): the global batch's in-batch
negatives at the memory cost of one mini-batch, with the same loss and gradients as the uncached loss."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from sbert_ray.losses.multiple_negatives_ranking import MultipleNegativesRankingLoss
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.padded_widths import bucketed_width, buckets_for, unpadded


class CachedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """MultipleNegativesRankingLoss whose encoder runs over `mini_batch_size` rows at a time.

    GradCache's three steps are what autograd does with each mini-batch wrapped in (non-reentrant) activation
    checkpointing: (1) the forward pass embeds every mini-batch and keeps only its embeddings, never its
    activations; (2) backward computes the loss's gradient w.r.t. all embeddings of the global batch (candidates
    gathered across workers exactly as the uncached loss does): the cache; (3) for each mini-batch in turn it
    re-runs the encoder, with the RNG state (dropout masks) and autocast state of step 1, and back-propagates
    that mini-batch's cached gradient. The engine finishes one mini-batch's backward before it re-runs the next
    (tests/test_losses.py checks the order), so activations of one mini-batch are alive at a time.

    Because this is one ordinary backward pass, each parameter's gradient is summed over the mini-batches before
    its gradient hook fires, once: DDP synchronises exactly as for the uncached loss, and the training loop's
    plain `loss.backward()`, `no_sync` accumulation and loss scaling all work unchanged. The same holds for the
    `symmetric` loss (sentence-transformers' CachedMultipleNegativesSymmetricRankingLoss): only the formula differs.
    """

    def __init__(
        self,
        encoder: SentenceEncoder,
        scale: float = 20.0,
        gather_across_workers: bool = True,
        mini_batch_size: int | Literal["auto"] = "auto",
        mask_duplicates: bool = True,
        symmetric: bool = False,
    ) -> None:
        super().__init__(
            encoder,
            scale=scale,
            gather_across_workers=gather_across_workers,
            mask_duplicates=mask_duplicates,
            symmetric=symmetric,
        )
        if mini_batch_size != "auto" and mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be >= 1 or 'auto', got {mini_batch_size!r}")
        self.mini_batch_size = mini_batch_size  # "auto": resolved at the first embed, on the encoder's device

    def _resolved_mini_batch_size(self) -> int:
        """``mini_batch_size``, "auto" resolved at the first embed: on CUDA from the memory free on the device with
        the model on it (``auto_mini_batch_size``), the least over the workers (FSDP's sharded forwards gather
        parameters per mini-batch, so every rank must cut alike); elsewhere CPU_MINI_BATCH_SIZE."""
        if self.mini_batch_size != "auto":
            return self.mini_batch_size
        encoder = self.encoder
        if encoder.device.type != "cuda":
            self.mini_batch_size = CPU_MINI_BATCH_SIZE
            return self.mini_batch_size
        free, _ = torch.cuda.mem_get_info(encoder.device)
        parameters = sum(p.numel() for p in encoder.parameters())
        bytes_per_value = 2 if torch.is_autocast_enabled("cuda") else 4
        rows = auto_mini_batch_size(
            free, parameters, ModelShape.of(encoder.transformer.config), encoder.max_seq_length, bytes_per_value
        )
        least = torch.tensor(rows, device=encoder.device)
        if dist.is_initialized():
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
        self.mini_batch_size = int(least)  # one read, at the first step
        return self.mini_batch_size

    def embed(
        self, features: Sequence[dict[str, Tensor]], used_widths: Sequence[np.ndarray] | None = None
    ) -> list[Tensor]:
        """``used_widths``: per column, the padded columns each row uses, known on the host (the collated batch's);
        without them they are read from the attention masks (one device-to-host read)."""
        if used_widths is None:
            used_widths = _used_widths([column["attention_mask"] for column in features])
        encoder = self.encoder
        cut = _MiniBatches(
            self._resolved_mini_batch_size(), buckets_for(encoder.device, encoder.compiled, encoder.max_seq_length),
            encoder.tokenizer.padding_side == "left",
        )  # fmt: skip
        return [
            torch.cat(
                [
                    checkpoint(encoder, mini_batch, padded, use_reentrant=False)
                    for mini_batch, padded in cut(column, widths)
                ]
            )
            for column, widths in zip(features, used_widths, strict=True)
        ]


CPU_MINI_BATCH_SIZE = 32  # "auto" on CPUs: memory is rarely the bound there, and 32 rows keep matrix units busy
MEMORY_SHARE = 0.8  # of the free device memory left after the optimizer's state: the rest for the allocator's slack
OPTIMIZER_BYTES_PER_PARAMETER = 12  # fp32 gradients and AdamW's two moments, allocated by the first step


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int

    @classmethod
    def of(cls, config) -> ModelShape:
        """From a transformers config (BERT-style names)."""
        return cls(config.num_hidden_layers, config.hidden_size, config.num_attention_heads)


def auto_mini_batch_size(free_bytes: int, parameters: int, shape: ModelShape, width: int, bytes_per_value: int) -> int:
    """The rows of one mini-batch whose activations fit the device: ``free_bytes`` (with the weights on it), less
    the optimizer's state still to come, times MEMORY_SHARE, over one row's activations at ``width`` tokens. Per
    layer and row a transformer keeps ``width * hidden * (34 + 5 * heads * width / hidden)`` bytes in 16-bit
    arithmetic (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section
    4.1; the attention-score term is an upper bound where a fused kernel keeps none), twice that in fp32. Rounded
    down to a multiple of 8 (tensor-core tiles) from 8 rows up; at least 1."""
    per_row = shape.layers * width * shape.hidden * (34 + 5 * shape.heads * width / shape.hidden) * bytes_per_value / 2
    budget = MEMORY_SHARE * (free_bytes - OPTIMIZER_BYTES_PER_PARAMETER * parameters)
    rows = int(budget // per_row)
    return rows // 8 * 8 if rows >= 8 else max(rows, 1)


def _used_widths(masks: Sequence[Tensor]) -> list[np.ndarray]:
    """Per attention mask, the padded columns each row uses (its last attended column plus one; 0: none), all
    read to the host at once: one read per step, not one per column or mini-batch."""
    per_row = [(mask.bool() * torch.arange(1, mask.shape[1] + 1, device=mask.device)).amax(dim=1) for mask in masks]
    widths = np.asarray(torch.cat(per_row).tolist())
    return np.split(widths, np.cumsum([len(column) for column in per_row[:-1]]))


@dataclasses.dataclass(frozen=True)
class _MiniBatches:
    """How a padded column is cut into mini-batches: ``size`` rows, trimmed to a width from ``buckets`` (None:
    exact widths; see ``models.padded_widths``)."""

    size: int
    buckets: tuple[int, ...] | None
    pad_left: bool

    def __call__(self, features: dict[str, Tensor], used_widths: np.ndarray) -> Iterator[tuple[dict, bool]]:
        """Consecutive row slices of a padded batch without the padding columns at the end that none of their rows
        uses (``used_widths``: per row; padding is masked out anyway, and a mini-batch of short sentences should not
        pay for the batch's longest; a left-padded batch keeps its width), each with whether it has padding left."""
        rows, full = features["attention_mask"].shape
        for start in range(0, rows, self.size):
            used = used_widths[start : start + self.size]
            width = min(bucketed_width(int(used.max()), self.buckets), full)
            mini_batch = {name: tensor[start : start + self.size, :width] for name, tensor in features.items()}
            yield mini_batch, not unpadded(used, width, self.pad_left)
