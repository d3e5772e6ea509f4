"""The paper's unsupervised baselines, for any backbone (Tables 1, 3, 5):

- ``avg``: the mean of the backbone's last-layer token embeddings, no fine-tuning ("Avg. BERT embeddings"; the
  paper's number pooled several layers, so a last-layer mean will not match it exactly);
- ``cls``: the backbone's CLS token vector ("BERT CLS-vector");
- ``tfidf``: tf-idf cosine (Table 3's unsupervised baseline; argument-similarity tasks only).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from sklearn.feature_extraction.text import TfidfVectorizer

from sbert_ray.evaluation.embeddings import embed_columns
from sbert_ray.models.encoder import SentenceEncoder

BASELINES = ("avg", "cls", "tfidf")
BASELINE_POOLING = {"avg": "mean", "cls": "cls"}


class TfidfBaseline:
    """Cosine of tf-idf vectors. The vocabulary and idf come from the sentences being scored (no labels are
    used), so each held-out fold is weighted by its own corpus."""

    def pair_similarities(self, pairs: Sequence) -> np.ndarray:
        # Rows are L2-normalised: cosine = dot product.
        left, right = embed_columns(
            TfidfVectorizer().fit_transform, [[p.sentence1 for p in pairs], [p.sentence2 for p in pairs]]
        )
        return np.asarray(left.multiply(right).sum(axis=1)).ravel()


def load_model(
    ref: str, baseline: str | None = None, allow_unsafe_weights: bool = False
) -> SentenceEncoder | TfidfBaseline:
    """The model at ``ref`` as saved, or one of BASELINES built from it (tf-idf needs no model)."""
    if baseline is None:
        return SentenceEncoder.load(ref, allow_unsafe_weights=allow_unsafe_weights)
    if baseline == "tfidf":
        return TfidfBaseline()
    if baseline not in BASELINE_POOLING:
        raise ValueError(f"unknown baseline {baseline!r}; choose from {', '.join(BASELINES)}")
    # Raw pooled vectors: no normalisation layer, whatever the saved model had.
    return SentenceEncoder.load(
        ref, pooling=BASELINE_POOLING[baseline], normalize=False, allow_unsafe_weights=allow_unsafe_weights
    )
