"""Word-embedding gradients that cross a CPU cluster as the rows a batch used, not the whole vocabulary.

A batch touches a few hundred of a vocabulary's 30,522 rows, yet DDP all-reduces the dense gradient: for
all-MiniLM-L6-v2 that is 47 of the 91 MB sent each step, in the bucket backward fills last, so nothing hides it.
With ``nn.Embedding(sparse=True)`` the gradient is (indices, rows), which gloo all-reduces and NCCL does not, so
GPUs keep it dense. AdamW and gradient clipping take dense gradients: before them the step sums the workers' rows
and densifies them (zeros in the unused rows, so the update is the dense one), and drops the gradient after, so
that the next backward starts a fresh sparse one.

The rows are all-reduced here, on a gloo group of their own, not by DDP (which ignores the weight). In torch 2.13
each gloo worker thread records the name of the collective it finished in a string the process group shares,
without a lock (``ProcessGroupGloo::runLoop``). DDP's bucket all-reduces ("ALLREDUCE") run on two such threads
while its sparse one ("_ALLREDUCE_SPARSE", too long for the string's inline buffer) finishes, and the race wrote into
freed memory: a worker's native crash, in 1 of 7 runs of the SIGTERM fault test here (docs/testing.md). On the
default group every collective of a DDP run now has a name that fits inline, and this group runs one all-reduce
at a time.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sbert_ray.models import SentenceEncoder


def sparse_embedding_gradients(objective: torch.nn.Module, device: torch.device, world_size: int) -> None:
    """Make the word embeddings' gradient sparse where that pays (several workers on CPU, i.e. gloo, and the
    embeddings train) and keep them out of the DDP that will wrap ``objective``. Every rank calls this at the same
    point (it may create the rows' process group)."""
    embedding = objective.encoder.transformer.get_input_embeddings()
    if world_size == 1 or device.type != "cpu" or not isinstance(embedding, torch.nn.Embedding):
        return
    if not embedding.weight.requires_grad:  # frozen (LoRA): no gradient to send
        return
    embedding.sparse = True
    name = next(name for name, weight in objective.named_parameters() if weight is embedding.weight)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(objective, [name])
    _rows_group()


def sparse_gradient_weight(encoder: SentenceEncoder) -> torch.nn.Parameter | None:
    """The word embeddings' weight when ``sparse_embedding_gradients`` made its gradient sparse, else None."""
    embedding = encoder.transformer.get_input_embeddings()
    return embedding.weight if getattr(embedding, "sparse", False) else None


def densify(weight: torch.nn.Parameter) -> None:
    """The sparse gradient summed over the workers and averaged, as DDP averages the others, as the dense
    gradient the optimizer and clipping take."""
    dist.all_reduce(weight.grad, group=_rows_group())
    weight.grad = weight.grad.to_dense().div_(dist.get_world_size())


@functools.cache
def _rows_group() -> dist.ProcessGroup:
    """This worker's gloo group for the embeddings' rows, made once (``new_group`` is a collective)."""
    return dist.new_group(backend="gloo")
