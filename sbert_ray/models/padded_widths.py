"""The widths training batches are padded to: on GPUs a few bucketed widths, so a compiled forward meets a bounded
number of shapes; and whether a batch has any padding at all (the attention mask can then be left out, and SDPA can
run its flash kernel). Pure functions of host-side numbers: nothing here reads the device."""

from __future__ import annotations

import numpy as np
import torch

# Every multiple of 8 up to 64 (tensor-core tiles), then 96 and 128, then powers of two. Coarser small buckets
# (32/64/96/128) were measured to double the tokens of sentence-length text (docs/performance.md), and sentences
# are what this service trains on; eight widths under 64 cost a compile each, once per run.
SMALL_BUCKETS = (8, 16, 24, 32, 40, 48, 56, 64, 96, 128)


def width_buckets(max_seq_length: int) -> tuple[int, ...]:
    """The widths a GPU batch is padded to: SMALL_BUCKETS, then powers of two, below ``max_seq_length``, and
    ``max_seq_length`` itself (no text is longer)."""
    buckets, width = [b for b in SMALL_BUCKETS if b < max_seq_length], 256
    while width < max_seq_length:
        buckets.append(width)
        width *= 2
    return (*buckets, max_seq_length)


def bucketed_width(longest: int, buckets: tuple[int, ...] | None) -> int:
    """The padded width of a batch whose longest text has ``longest`` tokens: the smallest bucket that holds it,
    or ``longest`` itself without buckets (on CPUs, where nothing is compiled by default and every token costs)."""
    if buckets is None:
        return longest
    return next((bucket for bucket in buckets if bucket >= longest), longest)


def buckets_for(device: torch.device, compiled: bool, max_seq_length: int) -> tuple[int, ...] | None:
    """Bucketed widths on CUDA (tensor cores, and a compiled forward by default) or for a compiled forward anywhere,
    exact widths otherwise."""
    return width_buckets(max_seq_length) if device.type == "cuda" or compiled else None


def unpadded(used_widths: np.ndarray | None, width: int, pad_left: bool) -> bool:
    """Whether every row of a batch of ``width`` columns uses all of them (``used_widths``: per row, its last
    attended column plus one, known on the host): then there is no padding and no attention mask is needed. Left
    padding reports the full width for every row, so it never counts as unpadded; nor does a batch whose widths
    are unknown."""
    return used_widths is not None and not pad_left and bool((used_widths == width).all())
