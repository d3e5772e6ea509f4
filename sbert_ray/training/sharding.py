"""FSDP (``scaling.strategy: fsdp``): the encoder sharded across the workers with torch's FSDP2 ``fully_shard``, and
the whole model and optimizer state gathered back for checkpoints and dev scoring. The one module that uses FSDP2 and
``torch.distributed.checkpoint.state_dict`` (tests/test_fsdp.py fails when torch changes them under it).

Each worker holds 1/world of every parameter, gradient and AdamW state (DDP: all of them); a transformer layer's
parameters are all-gathered just before its forward and backward and freed after, and gradients reduce-scattered
(averaged, as DDP's all-reduce). Only the encoder is sharded: an objective with trainable parameters of its own
(a head) is refused, as its gradients would not be averaged. On CPUs FSDP2 runs over gloo as on GPUs over NCCL,
its reduce-scatter done as an all-reduce (``AllReduceThenSlice``: a race in torch's gloo).

A checkpoint holds the whole model and the whole optimizer state, as under DDP (rank 0 writes the same
sentence-transformers folder and the same ``training.pt``), so a run resumes at any world size and from a DDP
checkpoint into FSDP and back. Gathering is a collective: every rank calls ``gather_whole`` at each report point;
rank 0 receives the weights on the host, assigned into a copy of the encoder whose parameters live on the meta
device (no storage) between report points.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist

from sbert_ray.models import SentenceEncoder
from sbert_ray.training.host_copy import encoder_holding, meta_copy

# FSDP and torch.distributed.checkpoint are imported where a sharded run calls them: both pull in DTensor, ~0.7 CPU-s
# in every Train worker process of every DDP run (and the test suite starts a few hundred).
FSDP = "torch.distributed.fsdp"

# Rank 0's copy of each sharded encoder, parameters on the meta device: what the gathered weights are assigned into.
_META_COPIES: weakref.WeakKeyDictionary[SentenceEncoder, SentenceEncoder] = weakref.WeakKeyDictionary()


class Whole(NamedTuple):
    """What one report point gathered: on rank 0 the encoder with whole weights on the host and the optimizer
    state in ``optimizer.state_dict()``'s layout (None when the checkpoint holds weights only); None elsewhere."""

    encoder: SentenceEncoder | None
    optimizer_state: dict | None


def shard_encoder(encoder: SentenceEncoder, keep_meta_copy: bool, precision: str = "fp32") -> None:
    """Shard ``encoder`` (on its training device) in place: every transformer block its own FSDP unit (gathered
    only while it computes), the rest (embeddings, norms) the root's. ``keep_meta_copy``: rank 0, which writes
    checkpoints and scores the dev set, keeps a storage-free copy to gather into.

    Under bf16 the blocks compute on bf16 copies of the weights (FSDP's mixed precision: all-gathered and held
    unsharded in half the bytes) while each rank's shard, its gradients' reduction and AdamW's state stay fp32:
    the fp32 master weights of mixed-precision training at no extra memory. The embeddings come out in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if keep_meta_copy:
        _META_COPIES[encoder] = meta_copy(encoder).eval()  # what it gathers is scored
    # Without bf16 every dtype stays the parameters' own (None): a float64 test encoder must reduce in float64.
    half = precision == "bf16"
    compute, full = (torch.bfloat16, torch.float32) if half else (None, None)
    units = _blocks(encoder.transformer)
    for module in units:
        fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=full))
    fully_shard(encoder, mp_policy=MixedPrecisionPolicy(compute, full, output_dtype=full))
    if dist.get_backend() == "gloo":
        for module in [*units, encoder]:
            module.set_custom_reduce_scatter(AllReduceThenSlice())


class AllReduceThenSlice:
    """FSDP's gradient reduce-scatter on gloo (CPUs) as an all-reduce of the whole flat gradient, of which each rank
    keeps its slice: the same sums, twice the traffic. torch 2.13's gloo group stores each finished collective's name
    in one string, which its two worker threads assign without a lock; "_REDUCE_SCATTER_BASE" is too long for the
    string's inline buffer, so assigning it frees memory the other thread may be writing a name into: the use after
    free that crashed DDP's sparse all-reduce ("A native crash in the SIGTERM test's restarted group",
    docs/testing.md). Every other collective of a sharded run has a name that fits inline. (FSDP2's ``Comm``
    interface: ``allocate`` and the call.)"""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False) -> None:
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])


def is_sharded(encoder: torch.nn.Module) -> bool:
    fsdp = sys.modules.get(FSDP)  # not imported yet: nothing in this process was sharded
    return fsdp is not None and isinstance(encoder, fsdp.FSDPModule)


def _blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules transformers' ``_no_split_modules`` names (a decoder or encoder layer, BERT's embeddings);
    under peft's wrapper, those of the model it wraps. Innermost first: fully_shard takes children before parents."""
    names = set()
    for module in transformer.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = [module for module in transformer.modules() if type(module).__name__ in names]
    return blocks[::-1]


def gather_whole(
    encoder: SentenceEncoder, objective: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> Whole:
    """Every rank: gather the sharded ``encoder``'s whole weights (and with an ``optimizer``, its whole state) to
    rank 0's host. Rank 0 gets them back in its meta copy of the encoder; the others get ``Whole(None, None)``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    # Whole tensors, on rank 0's host only (the other ranks get empty dicts): a model the device could not hold whole.
    whole_on_rank0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(encoder, options=whole_on_rank0)
    optimizer_state = None
    if optimizer is not None:
        by_name = get_optimizer_state_dict(objective, optimizer, options=whole_on_rank0)
        optimizer_state = _by_position(by_name, _names_in_order(objective, optimizer)) if by_name else None
    meta = _META_COPIES.get(encoder)
    if meta is None:
        return Whole(None, None)
    # The weights are freed with this copy after the report point; the meta copy stays storage-free.
    return Whole(encoder_holding(meta, weights), optimizer_state)


def load_whole_optimizer_state(objective: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Every rank: the whole optimizer state of a checkpoint (``optimizer.state_dict()``'s layout, from a DDP or an
    FSDP run of any size) into this rank's shards of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _names_in_order(objective, optimizer)
    by_name = {
        "state": {names[position]: value for position, value in saved["state"].items()},
        "param_groups": [
            {**group, "params": [names[position] for position in group["params"]]} for group in saved["param_groups"]
        ],
    }
    # Every rank passes the whole state it read from the checkpoint and keeps its shard of it.
    set_optimizer_state_dict(objective, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _names_in_order(objective: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The parameters' names in the order ``optimizer.state_dict()`` numbers them (group by group)."""
    name_of = {param: name for name, param in objective.named_parameters()}
    return [name_of[param] for group in optimizer.param_groups for param in group["params"]]


def _by_position(by_name: dict, names: list[str]) -> dict:
    """A whole optimizer state keyed by parameter name (``get_optimizer_state_dict``'s) in the layout of
    ``optimizer.state_dict()``: parameters numbered in group order, as a DDP checkpoint holds it."""
    position = {name: index for index, name in enumerate(names)}
    return {
        "state": {position[name]: value for name, value in by_name["state"].items()},
        "param_groups": [
            {**group, "params": [position[name] for name in group["params"]]} for group in by_name["param_groups"]
        ],
    }


@contextmanager
def gradients_kept_local(encoder: SentenceEncoder):
    """Accumulating micro-batches: gradients stay whole on each rank and are reduce-scattered once, with the last
    micro-batch of the step (FSDP's counterpart of DDP's ``no_sync``)."""
    encoder.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        encoder.set_requires_gradient_sync(True)
