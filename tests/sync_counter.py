"""Counting host-device syncs without a GPU. On the CPU a sync cannot stall anything, but what would wait for a GPU
still runs and is counted: operators seen by a ``TorchDispatchMode`` (below autograd) that read a value to the host
(``_local_scalar_dense``: ``.item()``, ``bool(tensor)``) or whose output size depends on the data (``nonzero``,
``masked_select``), and ``Tensor.tolist`` / ``Tensor.numpy``, which copy a GPU tensor to the host without
dispatching an operator on a CPU one. Only torch is imported: spawned workers use it too (``spawned_workers``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
}
READS = ("tolist", "numpy")


class SyncCounter(TorchDispatchMode):
    """Counts, while active, the operators in ``SYNCING`` that run and the host reads in ``READS`` (patched on
    ``torch.Tensor`` for as long, then restored)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []
        self._reads: dict[str, Callable] = {}

    def __enter__(self) -> SyncCounter:
        self._reads = {name: getattr(torch.Tensor, name) for name in READS}
        for name, read in self._reads.items():
            setattr(torch.Tensor, name, self._counted(name, read))
        return super().__enter__()

    def __exit__(self, *exc_info) -> None:
        try:
            super().__exit__(*exc_info)
        finally:
            for name, read in self._reads.items():
                setattr(torch.Tensor, name, read)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCING:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))

    def _counted(self, name: str, read: Callable) -> Callable:
        def counted(tensor, *args, **kwargs):
            self.syncs.append(f"Tensor.{name}")
            return read(tensor, *args, **kwargs)

        return counted
