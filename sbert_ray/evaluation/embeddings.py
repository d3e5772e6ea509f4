"""Embed several columns of sentences (pairs, triplets) encoding each distinct sentence once."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


def embed_columns(encode: Callable[[list[str]], np.ndarray], columns: Sequence[Sequence[str]]) -> list[np.ndarray]:
    """One embedding matrix per column: ``encode`` sees every distinct sentence once (in first-seen order); the
    rows are then looked up per column. ``encode`` may return any row-indexable matrix (e.g. sparse tf-idf)."""
    sentences = list(dict.fromkeys(s for column in columns for s in column))
    position = {s: i for i, s in enumerate(sentences)}
    embeddings = encode(sentences)
    return [embeddings[[position[s] for s in column]] for column in columns]


def encoder_embeddings(encoder, batch_size: int) -> Callable[[list[str]], np.ndarray]:
    """``encode`` for embed_columns from a sentence encoder, in float64 for the statistics that follow."""
    return lambda sentences: encoder.encode(sentences, batch_size=batch_size, convert_to="numpy").astype(np.float64)
