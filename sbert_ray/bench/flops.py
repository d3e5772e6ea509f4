"""Utilisation: model FLOPs of the encoder forwards for the padded batches that ran, and a matmul peak to compare."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode


class ForwardFlops:
    """FLOPs of a Hugging Face model's forward over padded batches of shape (batch, sequence length), counted
    by ``torch.utils.flop_counter`` (matmuls, attention) on one sequence per length and scaled by the batch:
    every part of an encoder forward is linear in the batch size. Works for any architecture the counter knows.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._per_sequence: dict[int, int] = {}

    def __call__(self, batch_shapes: Iterable[tuple[int, int]]) -> float:
        return float(sum(batch * self.per_sequence(length) for batch, length in batch_shapes))

    def per_sequence(self, length: int) -> int:
        if length not in self._per_sequence:
            ids = torch.ones(1, length, dtype=torch.long, device=self.model.device)
            # SDPA's math backend: fused CPU/GPU attention kernels are invisible to the counter.
            with FlopCounterMode(display=False) as counter, torch.inference_mode(), sdpa_kernel(SDPBackend.MATH):
                self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
            self._per_sequence[length] = counter.get_total_flops()
        return self._per_sequence[length]


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int | None = None, repeats: int = 5) -> float:
    """The best FLOP/s of a square ``torch.matmul`` in ``dtype`` on ``device``: the ceiling utilisation is
    measured against (measured, not the datasheet's, so it includes this machine's clocks and load)."""
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    best = float("inf")
    for attempt in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        if attempt:  # the first call only warms up (oneDNN / cuBLAS pick and cache their kernels)
            best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


# Dense bf16/fp16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s (without sparsity), by a name fragment of
# torch.cuda.get_device_name(); more specific fragments first (an H100 PCIe card is "NVIDIA H100 PCIe").
DATASHEET_HALF_TFLOPS = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("L4", 121.0),
)


def datasheet_peak(device: torch.device, precision: str) -> float | None:
    """The datasheet's dense FLOP/s of ``device`` in ``precision`` (bf16 or fp16 on a GPU that
    ``DATASHEET_HALF_TFLOPS`` names); None where it is not known (CPUs, fp32, other GPUs)."""
    if device.type != "cuda" or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((tflops * 1e12 for fragment, tflops in DATASHEET_HALF_TFLOPS if fragment in name), None)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer around it measures the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
