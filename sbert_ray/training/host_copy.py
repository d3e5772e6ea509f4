"""Host copies of what a checkpoint holds, taken at a report point so that the checkpoint is serialised and written
from them in the background while training goes on (``training.state.Snapshot``).

On CUDA the training thread only queues the copies: into pinned host memory, non-blocking, on the training stream
(so they read the weights before the next step's kernels change them), and records an event the writer waits on.
Pinned blocks come from torch's caching host allocator, so after the first report point a snapshot of the same
shapes reuses them. On the CPU the copies are plain clones. An encoder is rebuilt around its copied weights in the
writer from a skeleton made once per encoder: its modules with parameters on the meta device (no storage) and a
tokenizer of its own, which no training thread uses (a fast tokenizer is not safe to use from two threads).
"""

from __future__ import annotations

import copy
import weakref

import torch

from sbert_ray.models import SentenceEncoder

# Per trained encoder, its skeleton: made at its first snapshot.
_SKELETONS: weakref.WeakKeyDictionary[SentenceEncoder, SentenceEncoder] = weakref.WeakKeyDictionary()


class HostCopier:
    """Copies tensors (and dicts, lists and tuples of them) to host memory for one snapshot; ``ready()`` after the
    last copy: the CUDA event the copies are complete at (None on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.queued = False  # whether a non-blocking copy from the device was queued

    def copy(self, value):
        """Every tensor in ``value`` copied to the host, whatever device it is on (a live tensor training changes)."""
        return self._map(value, lambda tensor: True)

    def on_host(self, value):
        """``value`` with its device tensors copied to the host and its host tensors kept (tensors training never
        changes: what FSDP gathered for this report point)."""
        return self._map(value, lambda tensor: tensor.device.type != "cpu")

    def ready(self) -> torch.cuda.Event | None:
        if not self.queued:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # the training stream, which the copies were queued on
        return event

    def _map(self, value, needs_copy):
        if isinstance(value, torch.Tensor):
            return self._tensor(value) if needs_copy(value) else value
        if isinstance(value, dict):
            return {key: self._map(item, needs_copy) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._map(item, needs_copy) for item in value)
        return value  # numbers, strings, None: immutable

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.clone()
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        self.queued = True
        return host


def skeleton_of(encoder: SentenceEncoder, template: SentenceEncoder | None = None) -> SentenceEncoder:
    """The skeleton of ``encoder``, made once from ``template`` (default ``encoder`` itself; under FSDP the encoder
    gathered whole, as the sharded one cannot be copied): ``meta_copy`` of it."""
    skeleton = _SKELETONS.get(encoder)
    if skeleton is None:
        skeleton = _SKELETONS[encoder] = meta_copy(template or encoder)
    return skeleton


def meta_copy(encoder: SentenceEncoder) -> SentenceEncoder:
    """A deep copy whose parameters are on the meta device (shape and dtype, no storage), buffers (position ids,
    rotary frequencies: small, some not in a state dict) copied to the host, with a tokenizer of its own and no
    compiled forward (a copy never trains)."""
    memo = {
        id(param): torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        for param in encoder.parameters()
    }
    memo |= {id(buffer): buffer.detach().to("cpu", copy=True) for buffer in encoder.buffers()}
    if encoder._compiled_forward is not None:
        memo[id(encoder._compiled_forward)] = None
    return copy.deepcopy(encoder, memo)  # in the encoder's mode: a mode change re-kernelises, not on meta


def encoder_holding(skeleton: SentenceEncoder, weights: dict[str, torch.Tensor]) -> SentenceEncoder:
    """A copy of ``skeleton`` holding ``weights`` (its state dict's keys): the skeleton's meta parameters and its
    tokenizer are shared, so it stays storage-free."""
    shared = {id(param): param for param in skeleton.parameters()} | {id(skeleton.tokenizer): skeleton.tokenizer}
    encoder = copy.deepcopy(skeleton, shared)
    encoder.load_state_dict(weights, assign=True)
    return encoder
