"""Hard-negative mining, Ray-free: which corpus texts become each anchor's negatives, chosen as
sentence-transformers' ``util.mine_hard_negatives`` chooses them (same negatives with exact search and ``top``
sampling, up to ties), from an exact chunked top-k search (``retrieval.search_corpus``: no full score matrix).

The semantics, read off sentence-transformers 6.3 (``util/hard_negatives.py``; pyproject asks for >= 6.3):

- The data set's anchors are deduplicated (first seen first); an anchor's positives are the distinct positives of
  its rows. The corpus is the separate corpus, if any, then the positives, deduplicated (``dict.fromkeys``).
- Embeddings are unit length; scores are cosine similarities.
- Each anchor's candidates are its ``range_max + max_positives + 1`` best corpus rows (``max_positives``: the most
  rows any one anchor has, repeats counted; the one more stands in for the anchor's own text). ``range_max``
  defaults to ``range_min + num_negatives + max_positives``, or ``range_min + 10 * num_negatives + max_positives``
  when a margin or ``max_score`` may drop candidates.
- Candidates are dropped when they are the anchor's own text or a positive of the anchor; with ``margin`` when
  ``score + margin`` exceeds the anchor's lowest positive score; with ``relative_margin`` when ``score`` exceeds
  ``p - |p| * relative_margin`` (``p`` that lowest positive score); with ``max_score`` when above it, with
  ``min_score`` when below it.
- What remains, best first, is cut to ranks ``[range_min, range_max)``: ``range_min`` skips the best *remaining*
  candidates, not ranks of the raw search. ``top`` keeps the first ``num_negatives``; ``random`` draws
  ``num_negatives`` of them (fewer when fewer remain), kept in score order.
- n-tuples: one row per (anchor, positive) whose anchor has all ``num_negatives`` negatives; the others are left
  out (and counted). Triplets: one row per (anchor, positive, negative).
- With a teacher (``cross_encoder=``, our ``rescore``), every candidate's and every positive pair's score is the
  teacher's before the filters and the ranking, with or without a filter (as sentence-transformers 6.3 rescores
  whenever it has a cross-encoder). ``range_max``'s default then also widens for ``min_score``.
  ``output_scores`` adds the scores of each row's positive and negatives (sentence-transformers' ``scores`` list;
  here ``score_positive``, ``score_negative_1..n``).

Equal scores go to the lower corpus row here (sentence-transformers leaves ties to ``torch.topk``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch
from torch import Tensor

from sbert_ray.config import ConfigError
from sbert_ray.evaluation.retrieval import CORPUS_CHUNK, QUERY_CHUNK, ChunkSearch, search_chunks, text_chunks

Sampling = Literal["top", "random"]
OutputFormat = Literal["n-tuple", "triplet"]
CANDIDATES_PER_NEGATIVE = 10  # default range_max when filters may drop candidates: 10 per negative wanted


@dataclass(frozen=True)
class MiningSettings:
    """How negatives are chosen (the module docstring); checked on creation, a ConfigError naming the option."""

    num_negatives: int = 3
    range_min: int = 0
    range_max: int | None = None
    max_score: float | None = None
    min_score: float | None = None
    margin: float | None = None  # absolute
    relative_margin: float | None = None
    sampling: Sampling = "top"
    seed: int = 0  # for random sampling
    output_format: OutputFormat = "n-tuple"
    rescored: bool = False  # a teacher (a cross-encoder) rescores the candidates and positives
    output_scores: bool = False  # score_positive, score_negative_1..n (or score_negative) beside the texts

    def __post_init__(self) -> None:
        if self.num_negatives < 1:
            raise ConfigError(f"num_negatives must be at least 1, got {self.num_negatives}")
        if self.range_min < 0:
            raise ConfigError(f"range_min must be >= 0, got {self.range_min}")
        if self.range_max is not None and self.range_max - self.range_min < self.num_negatives:
            raise ConfigError(
                f"range_max={self.range_max} leaves {self.range_max - self.range_min} candidates after range_min="
                f"{self.range_min}, fewer than num_negatives={self.num_negatives}"
            )
        for name in ("max_score", "min_score", "margin", "relative_margin"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value}")
        if self.sampling not in ("top", "random"):
            raise ConfigError(f"sampling must be top or random, got {self.sampling!r}")
        if self.output_format not in ("n-tuple", "triplet"):
            raise ConfigError(f"output format must be n-tuple or triplet, got {self.output_format!r}")

    @property
    def filters_candidates(self) -> bool:
        """Whether filters may drop many candidates (then the default window is 10 per negative)."""
        widened = self.margin, self.relative_margin, self.max_score, (self.min_score if self.rescored else None)
        return any(value is not None for value in widened)

    def window_end(self, max_positives: int) -> int:
        """range_max, or its default (the module docstring)."""
        if self.range_max is not None:
            return self.range_max
        per_negative = CANDIDATES_PER_NEGATIVE if self.filters_candidates else 1
        return self.range_min + per_negative * self.num_negatives + max_positives

    def candidates(self, max_positives: int) -> int:
        """How many of the best corpus rows each anchor's search keeps: the window, the positives and the anchor."""
        return self.window_end(max_positives) + max_positives + 1


class Corpus(Protocol):
    """The texts negatives come from, by row (first appearance: ``MiningPairs.build``): a list in this process
    (``Texts``), or one kept off the driver (``runs.mining_corpus.StoredCorpus``); looked up in batches."""

    def __len__(self) -> int: ...

    def rows_of(self, texts: Sequence[str]) -> list[int]:
        """Each text's row, -1 where the corpus does not hold it."""

    def take(self, rows: Sequence[int]) -> list[str]:
        """The texts of ``rows``."""


class Texts(list):
    """A corpus held in this process: its texts, in row order."""

    def rows_of(self, texts: Sequence[str]) -> list[int]:
        row_of = {text: row for row, text in enumerate(self)}
        return [row_of.get(text, -1) for text in texts]

    def take(self, rows: Sequence[int]) -> list[str]:
        return [self[row] for row in rows]


@dataclass(frozen=True)
class MiningPairs:
    """A data set of (anchor, positive) rows as mining sees it: distinct anchors (``queries``), each one's
    distinct positives as rows of ``corpus`` (``positives``), and ``max_positives`` (the most input rows of one
    anchor, repeats counted, as sentence-transformers counts them)."""

    queries: list[str]
    positives: list[list[int]]
    corpus: Corpus
    max_positives: int
    anchor_rows: list[int]  # each anchor's own row in the corpus, -1 where the corpus does not hold it

    @classmethod
    def build(cls, anchors: Sequence[str], positives: Sequence[str], corpus: Sequence[str] = ()) -> MiningPairs:
        """The pairs over the separate ``corpus`` and then the positives, deduplicated, held in this process."""
        return cls.over(Texts(dict.fromkeys([*corpus, *positives])), anchors, positives)

    @classmethod
    def over(cls, corpus: Corpus, anchors: Sequence[str], positives: Sequence[str]) -> MiningPairs:
        """The pairs over a corpus that holds every positive (``build``'s rows, made elsewhere)."""
        if len(anchors) != len(positives):
            raise ValueError(f"{len(anchors)} anchors but {len(positives)} positives")
        rows_of: dict[str, list[int]] = {}
        for anchor, row in zip(anchors, corpus.rows_of(positives), strict=True):
            rows_of.setdefault(anchor, []).append(row)
        max_positives = max(map(len, rows_of.values()), default=0)
        positive_rows = [list(dict.fromkeys(rows)) for rows in rows_of.values()]
        return cls(list(rows_of), positive_rows, corpus, max_positives, corpus.rows_of(list(rows_of)))

    def slice(self, start: int, stop: int) -> MiningPairs:
        """Anchors [start, stop) with the same corpus and ``max_positives`` (a shard mines as the whole would)."""
        return MiningPairs(
            self.queries[start:stop],
            self.positives[start:stop],
            self.corpus,
            self.max_positives,
            self.anchor_rows[start:stop],
        )

    def pair_rows(self) -> Tensor:
        """(anchor index, corpus row) of every positive, [n, 2], anchors in order."""
        pairs = [(query, row) for query, rows in enumerate(self.positives) for row in rows]
        return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


@dataclass(frozen=True)
class Negatives:
    """Each anchor's chosen negatives: corpus rows and scores, best first (lists per anchor)."""

    rows: list[list[int]]
    scores: list[list[float]]
    dropped: dict[str, int]  # candidates each filter removed (positive, margin, relative_margin, max/min_score)
    positive_scores: list[list[float]]  # each anchor's positive pairs' scores, in ``MiningPairs.positives`` order


def choose_negatives(
    scores: Tensor, rows: Tensor, pairs: MiningPairs, positive_scores: Tensor, settings: MiningSettings
) -> Negatives:
    """Negatives from each anchor's candidates ``scores``/``rows`` [anchors, candidates] (best first, as
    ``search_corpus`` ranks them) and the score of each positive pair (``MiningPairs.pair_rows`` order)."""
    scores = scores.clone()
    dropped = {}

    def drop(name: str, where: Tensor) -> None:
        where = where & scores.isfinite()
        dropped[name] = int(where.sum())
        scores[where] = -math.inf

    drop("anchor", rows == torch.tensor(pairs.anchor_rows, dtype=rows.dtype)[:, None])  # scores ~1: never a negative
    is_positive = torch.zeros_like(rows, dtype=torch.bool)
    for query, positive_rows in enumerate(pairs.positives):
        is_positive[query] = torch.isin(rows[query], torch.tensor(positive_rows))
    drop("positive", is_positive)
    lowest_positive = _lowest_per_anchor(positive_scores, pairs)[:, None]
    if settings.margin is not None:
        drop("margin", scores + settings.margin > lowest_positive)
    if settings.relative_margin is not None:
        drop("relative_margin", scores > lowest_positive - lowest_positive.abs() * settings.relative_margin)
    if settings.max_score is not None:
        drop("max_score", scores > settings.max_score)
    if settings.min_score is not None:
        drop("min_score", scores < settings.min_score)
    # Candidates left, best first (a stable sort keeps the search's order, ties to the lower row), in the window.
    scores, order = scores.sort(dim=1, descending=True, stable=True)
    rows = rows.gather(1, order)
    window = slice(settings.range_min, settings.window_end(pairs.max_positives))
    scores, rows = scores[:, window], rows[:, window]
    picked = _top if settings.sampling == "top" else _random(torch.Generator().manual_seed(settings.seed))
    chosen_rows, chosen_scores = [], []
    for query_scores, query_rows in zip(scores, rows, strict=True):
        kept = picked(int(query_scores.isfinite().sum()), settings.num_negatives)
        chosen_rows.append(query_rows[kept].tolist())
        chosen_scores.append(query_scores[kept].tolist())
    counts = [len(rows) for rows in pairs.positives]
    per_anchor = [scores.tolist() for scores in positive_scores.split(counts)]
    return Negatives(chosen_rows, chosen_scores, dropped, per_anchor)


def _lowest_per_anchor(positive_scores: Tensor, pairs: MiningPairs) -> Tensor:
    counts = torch.tensor([len(rows) for rows in pairs.positives])
    anchor = torch.repeat_interleave(torch.arange(len(counts)), counts)
    lowest = torch.full((len(counts),), math.inf, dtype=positive_scores.dtype)
    return lowest.scatter_reduce(0, anchor, positive_scores, reduce="amin")


def _top(available: int, wanted: int) -> Tensor:
    return torch.arange(min(available, wanted))


def _random(generator: torch.Generator) -> Callable[[int, int], Tensor]:
    def pick(available: int, wanted: int) -> Tensor:
        return torch.randperm(available, generator=generator)[:wanted].sort().values  # score order kept

    return pick


def output_columns(pairs: MiningPairs, negatives: Negatives, settings: MiningSettings) -> dict[str, list]:
    """``anchor, positive, negative_1..negative_n`` (n-tuples: anchors with all n negatives) or ``anchor,
    positive, negative`` (triplets: one row per negative), as sentence-transformers names and orders them; with
    ``output_scores``, then ``score_positive`` and ``score_`` + each negative column."""
    n = settings.num_negatives
    triplets = settings.output_format == "triplet"
    negative_columns = ["negative"] if triplets else [f"negative_{i}" for i in range(1, n + 1)]
    names = ["anchor", "positive", *negative_columns]
    if settings.output_scores:
        names += [f"score_{name}" for name in names[1:]]
    columns = {name: [] for name in names}
    needed = sorted({row for rows in (*pairs.positives, *negatives.rows) for row in rows})
    text_of = dict(zip(needed, pairs.corpus.take(needed), strict=True))  # one lookup: the corpus may be off the driver
    anchors = zip(
        pairs.queries, pairs.positives, negatives.positive_scores, negatives.rows, negatives.scores, strict=True
    )
    for query, positive_rows, positive_scores, negative_rows, negative_scores in anchors:
        if not triplets and len(negative_rows) < n:
            continue
        tuples = (
            [([row], [score]) for row, score in zip(negative_rows, negative_scores, strict=True)]
            if triplets
            else [(negative_rows, negative_scores)]
        )
        for positive, positive_score in zip(positive_rows, positive_scores, strict=True):
            for rows, scores in tuples:
                texts = [query, text_of[positive], *(text_of[row] for row in rows)]
                values = texts + [positive_score, *scores] if settings.output_scores else texts
                for name, value in zip(names, values, strict=True):
                    columns[name].append(value)
    return columns


def mine(
    encoder,
    pairs: MiningPairs,
    settings: MiningSettings,
    batch_size: int = 32,
    query_chunk: int = QUERY_CHUNK,
    corpus_chunk: int = CORPUS_CHUNK,
    progress: Callable[[int], None] = lambda chunks: None,
    approximate: bool = False,
    rescore: Callable[[list[str], list[str]], np.ndarray] | None = None,
    corpus_chunks: Iterable[tuple] | None = None,
) -> Negatives:
    """Encode the anchors, search the corpus in chunks (here, or on a ``RayEncoder``'s workers) and choose each
    anchor's negatives. Memory: ``search_corpus``'s bound with k = ``settings.candidates(pairs.max_positives)``.
    ``approximate``: each chunk searched by a faiss HNSW graph (``retrieval.approximate_top_k``), not exactly.
    ``rescore``: the teacher's scores of (query, text) pairs, used when ``settings.rescored``. ``corpus_chunks``:
    the corpus embedded already, chunk by chunk (the embeddings of ``text_chunks(pairs.corpus, corpus_chunk)``
    and their rows: ``runs.corpus_embeddings``), as each of many anchor shards searches the same corpus."""
    queries = torch.as_tensor(np.asarray(encoder.encode(pairs.queries, batch_size=batch_size, convert_to="numpy")))
    k = settings.candidates(pairs.max_positives)
    search = ChunkSearch(k, ("cosine",), query_chunk, pairs.pair_rows(), approximate)
    chunks = text_chunks(pairs.corpus, corpus_chunk) if corpus_chunks is None else corpus_chunks
    ranked, positive_scores = search_chunks(encoder, queries, chunks, search, batch_size, progress)
    scores, rows = ranked["cosine"]
    if settings.rescored:
        scores, positive_scores = _rescored(rescore, pairs, rows)
    return choose_negatives(scores, rows, pairs, positive_scores, settings)


def _rescored(rescore: Callable[[list[str], list[str]], np.ndarray], pairs: MiningPairs, rows: Tensor):
    """The teacher's scores of each anchor's candidates (-inf where the search found fewer: row -1) and of its
    positive pairs (``MiningPairs.pair_rows`` order)."""
    found = rows >= 0
    anchors = found.nonzero()[:, 0].tolist()
    candidates = rescore([pairs.queries[q] for q in anchors], pairs.corpus.take(rows[found].tolist()))
    scores = torch.full(rows.shape, -math.inf)
    scores[found] = torch.as_tensor(np.asarray(candidates), dtype=scores.dtype)
    anchor, positive = pairs.pair_rows().T.tolist()
    positives = rescore([pairs.queries[q] for q in anchor], pairs.corpus.take(positive))
    return scores, torch.as_tensor(np.asarray(positives), dtype=scores.dtype)
