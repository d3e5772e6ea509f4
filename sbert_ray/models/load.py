"""One way to get the encoder a config names: a saved model, a Hub id, or a randomly initialised BERT."""

from __future__ import annotations

from sbert_ray.models.encoder import DEFAULT_MAX_SEQ_LENGTH, SentenceEncoder
from sbert_ray.models.pooling import PoolingMode
from sbert_ray.models.random_bert import random_bert

RANDOM_PREFIX = "random:"


def load_encoder(
    name: str,
    pooling: PoolingMode | None = None,
    max_seq_length: int | None = None,
    normalize: bool | None = None,
    seed: int = 0,
    allow_unsafe_weights: bool = False,
) -> SentenceEncoder:
    """``name`` as ``SentenceEncoder.load`` reads it, or for ``random:<shape>`` a freshly initialised BERT (the
    same weights for the same seed, so every data-parallel worker starts equal). Arguments that are not None
    override what a saved model says; ``allow_unsafe_weights`` also loads pickled PyTorch weights."""
    if name.startswith(RANDOM_PREFIX):
        return random_bert(
            name.removeprefix(RANDOM_PREFIX),
            seed=seed,
            pooling=pooling or "mean",
            max_seq_length=max_seq_length or DEFAULT_MAX_SEQ_LENGTH,
            normalize=bool(normalize),
        )
    return SentenceEncoder.load(
        name,
        pooling=pooling,
        max_seq_length=max_seq_length,
        normalize=normalize,
        allow_unsafe_weights=allow_unsafe_weights,
    )
