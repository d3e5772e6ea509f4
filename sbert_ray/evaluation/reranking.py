"""Reranking evaluation: a first-stage bi-encoder retrieves each query's top k of a retrieval set (``retrieval``'s
exact cosine search), a reranker scores those k (query, document) pairs, and the ranking is judged before and after.

The reranker is a teacher (``models.teachers.load_teacher``): a cross-encoder folder (ours, saved in the
CrossEncoder layout, or any sentence-transformers CrossEncoder) scored as ``CrossEncoder.predict`` scores, or a
bi-encoder scored by cosine. Reranked documents are ordered by the reranker's score, equal scores in first-stage
order; documents outside the top k stay outside, so reranking can only reorder what the first stage found.

Metrics (fractions, averaged over the judged queries, as ``retrieval.ranking_metrics`` computes them):
``<metric>_first_stage`` for the first stage's top k and ``<metric>_reranked`` for the same k reranked, for every
retrieval metric (``ndcg_at_10``, ``mrr_at_10``, ``recall_at_10``, ...); ``recall_at_k`` (the share of relevant
documents among the k candidates: the most any reranker can find), ``top_k``, ``queries``, ``documents``.
``ndcg_at_10_reranked`` is the primary metric. These are sentence-transformers' ``CrossEncoderRerankingEvaluator``
numbers on the same candidates with ``always_rerank_positives=False`` (``base_ndcg@10`` -> ``ndcg_at_10_first_stage``,
``ndcg@10`` -> ``ndcg_at_10_reranked``): nDCG is normalised by every relevant document, found or not.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from sbert_ray.data.retrieval_sets import RetrievalSet
from sbert_ray.evaluation.retrieval import metric_names as retrieval_metric_names
from sbert_ray.evaluation.retrieval import retrieve
from sbert_ray.models.teachers import Teacher

STAGES = ("first_stage", "reranked")


def reranked_order(scores: np.ndarray) -> Tensor:
    """[queries, k] column order of each row of reranker ``scores`` [queries, k] given in first-stage order: score
    descending, equal scores kept in first-stage order (a reranker that agrees with the first stage changes nothing)."""
    return torch.from_numpy(np.argsort(-scores, axis=1, kind="stable"))


def rerank_candidates(reranker: Teacher, queries: list[str], candidates: list[list[str]], batch_size: int) -> Tensor:
    """Each query's candidate order after reranking: ``candidates[i]`` are query i's k texts in first-stage order."""
    if not queries or not candidates[0]:  # nothing to score: an empty corpus
        return torch.empty(len(queries), 0, dtype=torch.long)
    columns = [list(column) for column in zip(*candidates, strict=True)]  # the teacher scores k columns of pairs
    return reranked_order(reranker.score(queries, columns, batch_size).T)


def evaluate_reranking(
    encoder, reranker: Teacher, data: RetrievalSet, top_k: int, batch_size: int = 64
) -> dict[str, float]:
    """Flat metrics (see the module docstring) of ``encoder``'s top ``top_k`` by cosine, before and after
    ``reranker`` reorders them. The corpus must be held (``data.corpus`` a dict): the candidates' texts are read
    from it."""
    found = retrieve(encoder, data, batch_size, top_k)
    _, first_stage = found.ranked["cosine"]
    candidates = [[data.corpus[found.corpus.ids[row]] for row in top] for top in first_stage.tolist()]
    queries = [data.queries[key] for key in found.query_ids]
    reranked = first_stage.gather(1, rerank_candidates(reranker, queries, candidates, batch_size))
    metrics: dict[str, float] = {}
    for stage, rows in zip(STAGES, (first_stage, reranked), strict=True):
        metrics |= {f"{metric}_{stage}": value for metric, value in found.metrics(data, rows).items()}
    found_relevant = [
        sum(found.corpus.ids[row] in data.relevant[key] for row in top)
        for key, top in zip(found.query_ids, first_stage.tolist(), strict=True)
    ]
    relevant = [len(data.relevant[key]) for key in found.query_ids]
    metrics["recall_at_k"] = float(np.mean(np.array(found_relevant) / np.array(relevant)))
    return metrics | {"top_k": top_k, "queries": len(found.query_ids), "documents": len(found.corpus.ids)}


def metric_names() -> tuple[str, ...]:
    """Every metric ``evaluate_reranking`` returns at its entry's top level."""
    ranking = [name.removesuffix("_cosine") for name in retrieval_metric_names() if name.endswith("_cosine")]
    return (*(f"{metric}_{stage}" for stage in STAGES for metric in ranking), "recall_at_k")
