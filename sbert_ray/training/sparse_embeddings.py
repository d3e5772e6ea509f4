"""Word-embedding gradients that cross a CPU cluster as the rows a batch used, not the whole vocabulary.

A batch touches a few hundred of a vocabulary's 30,522 rows, yet DDP all-reduces the dense gradient: for
all-MiniLM-L6-v2 that is 47 of the 91 MB sent each step, in the bucket backward fills last, so nothing hides it.
With ``nn.Embedding(sparse=True)`` DDP all-reduces that gradient as (indices, rows), which gloo supports and NCCL
does not, so GPUs keep it dense. AdamW and gradient clipping take dense gradients: before them the step densifies
it (zeros in the unused rows, so the update is the dense one), and drops it after, so that the next backward
starts a fresh sparse gradient.
"""

from __future__ import annotations

import torch

from sbert_ray.models import SentenceEncoder


def sparse_embedding_gradients(
    encoder: SentenceEncoder, device: torch.device, world_size: int
) -> torch.nn.Parameter | None:
    """Make the word embeddings' gradient sparse where that pays (several workers on CPU, i.e. gloo) and return
    their weight; None elsewhere. Call before DDP wraps the model: it decides at construction which gradients
    are sparse."""
    embedding = encoder.transformer.get_input_embeddings()
    if world_size == 1 or device.type != "cpu" or not isinstance(embedding, torch.nn.Embedding):
        return None
    embedding.sparse = True
    return embedding.weight


def sparse_gradient_weight(encoder: SentenceEncoder) -> torch.nn.Parameter | None:
    """The word embeddings' weight when ``sparse_embedding_gradients`` made its gradient sparse, else None."""
    embedding = encoder.transformer.get_input_embeddings()
    return embedding.weight if getattr(embedding, "sparse", False) else None


def densify(weight: torch.nn.Parameter) -> None:
    """The all-reduced sparse gradient as the dense one the optimizer and clipping take."""
    if weight.grad is not None and weight.grad.is_sparse:
        weight.grad = weight.grad.to_dense()
