"""Training arithmetic per device: ``scaling.precision`` resolved to an autocast dtype (and a gradient scaler for
fp16). Weights, gradients and optimizer state stay fp32 in every mode; autocast runs the matrix products in 16 bit
(under FSDP in bf16 the blocks also compute on bf16 copies of the fp32 shards: ``training.sharding``)."""

from __future__ import annotations

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def resolve_precision(precision: str, device: torch.device) -> str:
    """``bf16``, ``fp16`` or ``fp32`` for ``precision`` (auto, bf16, fp16, fp32) on ``device``. auto: bf16 on GPUs
    with native bf16 (compute capability 8 and up), fp16 on older ones (V100, T4), fp32 on CPUs, where published
    numbers are measured. An explicit bf16 on a GPU without it is an error, not a silent emulation."""
    if device.type == "cuda":
        native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        if precision == "auto":
            return "bf16" if native_bf16 else "fp16"
        if precision == "bf16" and not native_bf16:
            raise ValueError(
                f"scaling.precision: bf16 on {torch.cuda.get_device_name(device)}, which has no native bf16; "
                "use fp16 or auto"
            )
        return precision
    return "fp32" if precision == "auto" else precision


def autocast(precision: str, device: torch.device):
    """The autocast context of a resolved precision (a disabled one for fp32)."""
    dtype = AUTOCAST_DTYPES[precision]
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
