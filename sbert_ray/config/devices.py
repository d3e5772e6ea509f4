"""``--device`` values: what torch calls a device, and whether this process has it. torch is imported inside the
functions: every command imports the config, most never need torch."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING

from sbert_ray.config.conversion import ConfigError

if TYPE_CHECKING:
    import torch


def parse_device(text: str) -> str:
    """A ``--device`` value as torch reads it: cpu, cuda, cuda:N or mps; anything else is a ConfigError."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"{text!r} is not a device: use cpu, cuda, cuda:N or mps")
    return str(device)


def check_device_here(device: str, key: str = "--device") -> None:
    """``device`` (as ``parse_device`` returns it) exists in this process, or a ConfigError naming ``key``."""
    import torch

    parsed = torch.device(device)
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(f"{key} {device}: torch sees no CUDA GPU here (torch {torch.__version__}, {build})")
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(f"{key} {device}: torch sees {count} CUDA GPU(s), numbered from 0")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key} {device}: this machine has no Apple MPS device")


def describe_hardware(device: torch.device) -> str:
    """The accelerator's name, or the CPU architecture: for a model card's ``hardware``. Here, not beside the card:
    a Train worker asks, and importing the card's module (huggingface_hub's card classes) cost it ~0.3 CPU-s."""
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()})"
