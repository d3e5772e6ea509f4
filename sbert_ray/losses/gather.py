"""Gathering embeddings across data-parallel workers with gradients kept, for in-batch-negative losses."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Every worker's rows (and their texts' hashes, or None) in rank order, each worker's padded to the same count.

    ``offset`` is where this worker's rows start; ``valid`` ([rows], bool) is False for padding, which a loss must
    leave out; None where nothing is padded (one worker)."""

    rows: Tensor
    hashes: Tensor | None
    offset: int = 0
    valid: Tensor | None = None


def gather_across_workers(local: Tensor, hashes: Tensor | None = None, rows_per_worker: int | None = None) -> Gathered:
    """All workers' rows of ``local``, the same for ``hashes`` (the texts' hashes, one row per row of ``local``).

    Gradients flow back from every worker's use of the rows to the worker that computed each one
    (torch.distributed.nn's all_gather sums them in backward); the hashes are gathered without. Workers may hold
    different numbers of rows (a last, smaller batch): each pads its rows to ``rows_per_worker``, a bound every
    worker knows without asking the others (the training loop's largest micro-batch), and the counts are gathered
    on the device as the validity mask, so nothing is read to the host. Without the bound (a loss used outside
    training) the largest count is read to the host: one sync. Outside an initialised process group of two or
    more workers, returns the rows as they are.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Gathered(local, hashes)
    # Filled on the device: a tensor built from host data is a host-to-device copy, which waits for queued work.
    count = local.new_full((1,), local.shape[0], dtype=torch.long)
    if rows_per_worker is None:
        rows_per_worker = _most_rows(count)
    if local.shape[0] > rows_per_worker:
        raise ValueError(f"{local.shape[0]} rows on this worker, more than the {rows_per_worker} every worker pads to")
    counts = torch.cat(_all_gathered(count))
    valid = torch.arange(rows_per_worker, device=local.device) < counts[:, None]
    rows = torch.cat([_contiguous_gradient(chunk) for chunk in dist_fn.all_gather(_padded(local, rows_per_worker))])
    if hashes is not None:
        hashes = torch.cat(_all_gathered(_padded(hashes, rows_per_worker)))
    return Gathered(rows, hashes, dist.get_rank() * rows_per_worker, valid.flatten())


def _contiguous_gradient(chunk: Tensor) -> Tensor:
    """``chunk``, its gradient made contiguous before torch.distributed.nn's all_gather backward sees it. A loss that
    reads the rows column by column (MNRL's candidates) hands back a transposed gradient, and that backward
    receives into ``empty_like`` buffers of the gradient's strides as if they were contiguous: on gloo the rows'
    gradients came back in the wrong order (tests/test_losses.py, hard negatives, not symmetric)."""
    if chunk.requires_grad:
        chunk.register_hook(torch.Tensor.contiguous)
    return chunk


def _most_rows(count: Tensor) -> int:
    most = count.clone()
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _all_gathered(local: Tensor) -> list[Tensor]:
    """Every worker's ``local`` (of the same shape on all), without gradients."""
    chunks = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(chunks, local)
    return chunks


def _padded(local: Tensor, rows: int) -> Tensor:
    if rows == local.shape[0]:
        return local
    return torch.cat([local, local.new_zeros(rows - local.shape[0], *local.shape[1:])])
