"""Evaluation at truncated embedding sizes (Matryoshka models): any task at several sizes in one run, each size
scored as sentence-transformers scores the model loaded with ``truncate_dim``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from sbert_ray.evaluation.tasks import Results


class PrefixEncoder:
    """An encoder whose ``encode`` returns the first ``dim`` values of the wrapped encoder's embeddings.

    Each list of sentences is encoded once, at the wrapped encoder's size, and cut again for every ``dim``.
    """

    def __init__(self, encoder) -> None:
        self.encoder = encoder
        self.dim: int | None = None
        self._full: dict[tuple, np.ndarray] = {}

    @property
    def prompts(self) -> dict[str, str]:
        return self.encoder.prompts

    def encode(
        self, sentences: Sequence[str], batch_size: int = 32, convert_to: str = "numpy", prompt_name: str | None = None
    ):
        key = (tuple(sentences), batch_size, convert_to, prompt_name)
        if key not in self._full:
            self._full[key] = self.encoder.encode(
                sentences, batch_size=batch_size, convert_to=convert_to, prompt_name=prompt_name
            )
        full = self._full[key]
        if self.dim is not None and full.shape[1] < self.dim:
            raise ValueError(f"cannot truncate {full.shape[1]}-dimensional embeddings to {self.dim}")
        return full[:, : self.dim]


def evaluate_at_dims(encoder, dims: Sequence[int], evaluate: Callable[..., Results]) -> Results:
    """``evaluate(encoder)`` at each embedding size in ``dims``, each entry renamed ``<entry>@<dim>``
    (``stsb/spearman_cosine`` -> ``stsb@128/spearman_cosine``). ``encoder`` must give full-size embeddings."""
    prefixes = PrefixEncoder(encoder)
    results: Results = {}
    for dim in dims:
        prefixes.dim = dim
        for key, value in evaluate(prefixes).items():
            entry, _, rest = key.partition("/")
            results[f"{entry}@{dim}/{rest}"] = value
    return results
