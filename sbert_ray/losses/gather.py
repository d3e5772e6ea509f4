"""Gathering embeddings across data-parallel workers with gradients kept, for in-batch-negative losses."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor


def gather_across_workers(local: Tensor) -> tuple[Tensor, int]:
    """All workers' rows of `local` concatenated in rank order, and where this worker's rows start.

    Gradients flow back from every worker's use of the result to the worker that computed each row
    (torch.distributed.nn's all_gather sums them in backward). Workers may hold different numbers of rows
    (a last, smaller batch); rows are padded for the collective and the padding is dropped again.
    Outside an initialised process group of two or more workers, returns (local, 0).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local, 0
    # Filled on the device (no host-to-device copy, which would wait for the queued work); the one host sync of
    # the gather is reading every worker's count, which sizes the padding.
    size = local.new_full((1,), local.shape[0], dtype=torch.long)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    counts = torch.cat(sizes).tolist()
    padded = torch.cat([local, local.new_zeros(max(counts) - local.shape[0], *local.shape[1:])])
    gathered = dist_fn.all_gather(padded)
    rows = torch.cat([chunk[:count] for chunk, count in zip(gathered, counts, strict=True)])
    return rows, sum(counts[: dist.get_rank()])
