"""Gathering embeddings across data-parallel workers with gradients kept, for in-batch-negative losses."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor


def gather_across_workers(local: Tensor, hashes: Tensor | None = None) -> tuple[Tensor, Tensor | None, int]:
    """All workers' rows of `local` concatenated in rank order, the same for `hashes` (the texts' hashes, one
    row per row of `local`; None stays None), and where this worker's rows start.

    Gradients flow back from every worker's use of the result to the worker that computed each row
    (torch.distributed.nn's all_gather sums them in backward); the hashes are gathered without. Workers may hold
    different numbers of rows (a last, smaller batch); rows are padded for the collective and the padding is
    dropped again. Outside an initialised process group of two or more workers, returns (local, hashes, 0).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local, hashes, 0
    # Filled on the device (no host-to-device copy, which would wait for the queued work); the one host sync of
    # the gather is reading every worker's count, which sizes the padding of both tensors.
    size = local.new_full((1,), local.shape[0], dtype=torch.long)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    counts = torch.cat(sizes).tolist()
    rows = _unpadded(dist_fn.all_gather(_padded(local, max(counts))), counts)
    if hashes is not None:
        padded = _padded(hashes, max(counts))
        chunks = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(chunks, padded)
        hashes = _unpadded(chunks, counts)
    return rows, hashes, sum(counts[: dist.get_rank()])


def _padded(local: Tensor, rows: int) -> Tensor:
    return torch.cat([local, local.new_zeros(rows - local.shape[0], *local.shape[1:])])


def _unpadded(chunks: list[Tensor] | tuple[Tensor, ...], counts: list[int]) -> Tensor:
    return torch.cat([chunk[:count] for chunk, count in zip(chunks, counts, strict=True)])
