"""Triplet accuracy (paper, Table 4): the share of (anchor, positive, negative) triplets whose positive is closer
to the anchor than the negative. Euclidean distance as in the paper; cosine beside it.

Datasets: ``wikisec`` (Dor et al. 2018 Wikipedia-section triplets: the Hub copy, ``<data dir>/wikisec/test.csv``
or a CSV with Sentence1/2/3 columns) and ``nli-triplets`` (premise, entailed and contradicting hypothesis from the
local SNLI test split; an offline stand-in with the same structure).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sbert_ray.data.readers import load_records, read_wikisec_csv
from sbert_ray.data.records import Triplet
from sbert_ray.evaluation.embeddings import embed_columns, encoder_embeddings
from sbert_ray.evaluation.sts import SIMILARITIES

TRIPLET_DATASETS = ("wikisec", "nli-triplets")
DISTANCES = ("euclidean", "cosine")


def embed_triplets(encoder, triplets: Sequence[Triplet], batch_size: int = 64) -> list[np.ndarray]:
    """Anchor, positive and negative embeddings, encoding each distinct sentence once."""
    sides = ("anchor", "positive", "negative")
    return embed_columns(encoder_embeddings(encoder, batch_size), [[getattr(t, s) for t in triplets] for s in sides])


def evaluate_triplets(encoder, triplets: Sequence[Triplet], batch_size: int = 64) -> dict[str, float]:
    """{"accuracy_euclidean" (primary), "accuracy_cosine", "n"}; accuracies are fractions, as in Table 4."""
    if not triplets:
        raise ValueError("triplet evaluation needs at least one triplet")
    anchor, positive, negative = embed_triplets(encoder, triplets, batch_size)
    metrics: dict[str, float] = {}
    for name in DISTANCES:
        similarity = SIMILARITIES[name]  # larger = closer (negated distance for euclidean)
        closer = similarity(anchor, positive) > similarity(anchor, negative)
        metrics[f"accuracy_{name}"] = float(np.mean(closer))
    metrics["n"] = len(triplets)
    return metrics


def load_triplets(name: str, data_dir=None, path: str | None = None) -> list[Triplet]:
    """Test triplets of ``name``; wikisec from ``path`` (a Sentence1/2/3 CSV) when given."""
    if name not in TRIPLET_DATASETS:
        raise ValueError(f"unknown triplet dataset {name!r}; choose from {', '.join(TRIPLET_DATASETS)}")
    if name == "wikisec" and path:
        return read_wikisec_csv(path)
    return load_records(name, "test", data_dir)
