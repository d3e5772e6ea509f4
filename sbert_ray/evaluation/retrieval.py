"""Retrieval evaluation: rank the corpus for every query and score the ranking as sentence-transformers'
``InformationRetrievalEvaluator`` does with its defaults (same numbers to 1e-4 on the same embeddings).

Metrics (fractions, averaged over the queries that have a relevant document): ``accuracy_at_k`` (a relevant
document in the top k), ``precision_at_k`` and ``recall_at_k`` for k in 1, 3, 5, 10; ``mrr_at_10``, ``ndcg_at_10``
(binary relevance) and ``map_at_100`` (the precisions at the relevant ranks, summed, over min(100, relevant
documents)). Each name ends with its similarity (``ndcg_at_10_cosine``, the task's primary metric); ``dot`` is
scored too when the embeddings are not unit length (there it ranks differently from cosine). Names say ``_at_``
where sentence-transformers writes ``@`` (``cosine_ndcg@10``) because MLflow refuses ``@`` in metric names.

Ranking is exact: equal scores go to the smaller document id (string order), as in sentence-transformers, so the
numbers do not depend on chunk sizes.

A model with prompts encodes the queries with its query prompt and the corpus with its document prompt, as
sentence-transformers' evaluator does through ``encode_query`` / ``encode_document`` (``sbert_ray.models.prompts``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from sbert_ray.data.retrieval_sets import RetrievalSet
from sbert_ray.models.prompts import document_prompt_name, query_prompt_name

ACCURACY_AT = (1, 3, 5, 10)
PRECISION_RECALL_AT = (1, 3, 5, 10)
MRR_AT, NDCG_AT, MAP_AT = 10, 10, 100
TOP_K = max(*ACCURACY_AT, *PRECISION_RECALL_AT, MRR_AT, NDCG_AT, MAP_AT)
QUERY_CHUNK, CORPUS_CHUNK = 1024, 16384
UNIT_NORM_TOLERANCE = 1e-3  # below this every query embedding counts as unit length: dot would equal cosine

Similarity = Callable[[Tensor, Tensor], Tensor]  # (queries [q, d], documents [n, d]) -> scores [q, n]
SIMILARITIES: dict[str, Similarity] = {
    "cosine": lambda queries, documents: F.normalize(queries, dim=1) @ F.normalize(documents, dim=1).T,
    "dot": lambda queries, documents: queries @ documents.T,
}


def _in_rank_order(scores: Tensor, columns: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's (score, column) candidates sorted by score descending, equal scores by column ascending."""
    columns, by_column = columns.sort(dim=1)
    scores, by_score = scores.gather(1, by_column).sort(dim=1, descending=True, stable=True)
    return scores, columns.gather(1, by_score)


def _best_columns(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k best columns of each row of ``scores`` in rank order. torch.topk picks any of several columns tied at
    the k-th score; rows with such ties are sorted whole (stably) so the lowest columns win."""
    k = min(k, scores.shape[1])
    best, columns = scores.topk(k, dim=1)
    tied = (scores >= best[:, -1:]).sum(dim=1) > k
    if tied.any():
        best[tied], columns[tied] = (part[:, :k] for part in scores[tied].sort(dim=1, descending=True, stable=True))
    return _in_rank_order(best, columns)


def exact_top_k(
    queries: Tensor,
    corpus_chunks: Iterable[Tensor],
    k: int,
    similarities: dict[str, Similarity],
    query_chunk: int = QUERY_CHUNK,
) -> dict[str, tuple[Tensor, Tensor]]:
    """{similarity: (scores, corpus rows)}, each [len(queries), min(k, corpus size)]: every query's k best rows of
    the corpus (given as consecutive chunks, read once), best first, ties to the lower row.

    Memory beyond the inputs: one score block of query_chunk x (rows of a corpus chunk) float32 values, twice
    that for the comparison that finds ties (rows tied at the k-th score are sorted whole: 12 bytes a score), and
    the running top k per query and similarity (12 bytes each). No query x corpus matrix is ever whole."""
    query_parts = queries.split(query_chunk)
    empty = [(part.new_empty(len(part), 0), torch.empty(len(part), 0, dtype=torch.long)) for part in query_parts]
    best = {name: list(empty) for name in similarities}
    offset = 0
    for chunk in corpus_chunks:
        for name, similarity in similarities.items():
            for i, part in enumerate(query_parts):
                chunk_scores, chunk_rows = _best_columns(similarity(part, chunk), k)
                scores, rows = best[name][i]
                scores, rows = _in_rank_order(
                    torch.cat([scores, chunk_scores], 1), torch.cat([rows, chunk_rows + offset], 1)
                )
                best[name][i] = scores[:, :k], rows[:, :k]
        offset += len(chunk)
    return {name: (torch.cat([s for s, _ in parts]), torch.cat([r for _, r in parts])) for name, parts in best.items()}


def metric_names() -> tuple[str, ...]:
    """Every metric ``evaluate_retrieval`` may return (the ``_dot`` ones for unnormalised models only)."""
    ranking = [f"accuracy_at_{k}" for k in ACCURACY_AT]
    ranking += [f"{kind}_at_{k}" for k in PRECISION_RECALL_AT for kind in ("precision", "recall")]
    ranking += [f"mrr_at_{MRR_AT}", f"ndcg_at_{NDCG_AT}", f"map_at_{MAP_AT}"]
    return tuple(f"{metric}_{similarity}" for similarity in SIMILARITIES for metric in ranking)


def ranking_metrics(hits: np.ndarray, relevant_counts: np.ndarray) -> dict[str, float]:
    """Metrics from ``hits`` [queries, ranks] (True where the document at that rank is relevant; a corpus
    smaller than TOP_K leaves the last ranks False) and each query's number of relevant documents."""
    hits = np.pad(hits, ((0, 0), (0, TOP_K - hits.shape[1]))).astype(np.float64)
    ranks = np.arange(1, TOP_K + 1)
    found = hits.cumsum(axis=1)  # relevant documents up to each rank
    metrics = {f"accuracy_at_{k}": float(np.mean(found[:, k - 1] > 0)) for k in ACCURACY_AT}
    for k in PRECISION_RECALL_AT:
        metrics[f"precision_at_{k}"] = float(np.mean(found[:, k - 1] / k))
        metrics[f"recall_at_{k}"] = float(np.mean(found[:, k - 1] / relevant_counts))
    first = np.where(found[:, MRR_AT - 1] > 0, hits[:, :MRR_AT].argmax(axis=1) + 1, np.inf)
    metrics[f"mrr_at_{MRR_AT}"] = float(np.mean(1 / first))
    discount = 1 / np.log2(ranks[:NDCG_AT] + 1)
    ideal = np.cumsum(discount)[np.minimum(relevant_counts, NDCG_AT) - 1]
    metrics[f"ndcg_at_{NDCG_AT}"] = float(np.mean((hits[:, :NDCG_AT] @ discount) / ideal))
    precision_at_hits = (hits * found / ranks)[:, :MAP_AT].sum(axis=1)
    metrics[f"map_at_{MAP_AT}"] = float(np.mean(precision_at_hits / np.minimum(relevant_counts, MAP_AT)))
    return metrics


def _corpus_chunks(encoder, texts: list[str], batch_size: int, chunk: int, prompt_name: str | None) -> Iterable[Tensor]:
    for start in range(0, len(texts), chunk):
        yield _encode(encoder, texts[start : start + chunk], batch_size, prompt_name)


def _encode(encoder, texts: list[str], batch_size: int, prompt_name: str | None) -> Tensor:
    embeddings = encoder.encode(texts, batch_size=batch_size, convert_to="numpy", prompt_name=prompt_name)
    return torch.as_tensor(embeddings, dtype=torch.float32)


def evaluate_retrieval(
    encoder, data: RetrievalSet, batch_size: int = 64, query_chunk: int = QUERY_CHUNK, corpus_chunk: int = CORPUS_CHUNK
) -> dict[str, float]:
    """Flat metrics (see the module docstring) plus ``queries`` and ``documents`` (the counts scored). The corpus
    is encoded and searched one chunk at a time: memory holds the query embeddings, one chunk's embeddings, one
    score block (``exact_top_k``) and the top TOP_K per query."""
    query_ids = list(data.relevant)
    corpus_ids = sorted(data.corpus)  # row order = id order, so ties going to the lower row go to the smaller id
    corpus_texts = [data.corpus[key] for key in corpus_ids]
    prompts = encoder.prompts
    queries = _encode(encoder, [data.queries[key] for key in query_ids], batch_size, query_prompt_name(prompts))
    unit = bool(torch.allclose(queries.norm(dim=1), torch.ones(len(queries)), atol=UNIT_NORM_TOLERANCE, rtol=0))
    relevant_counts = np.array([len(data.relevant[key]) for key in query_ids])
    names = ("cosine",) if unit else ("cosine", "dot")
    chunks = _corpus_chunks(encoder, corpus_texts, batch_size, corpus_chunk, document_prompt_name(prompts))
    ranked = exact_top_k(queries, chunks, TOP_K, {name: SIMILARITIES[name] for name in names}, query_chunk)
    metrics: dict[str, float] = {}
    for name, (_, rows) in ranked.items():
        hits = np.array(
            [
                [corpus_ids[row] in data.relevant[key] for row in top]
                for key, top in zip(query_ids, rows.tolist(), strict=True)
            ]
        ).reshape(len(query_ids), -1)
        metrics |= {f"{metric}_{name}": value for metric, value in ranking_metrics(hits, relevant_counts).items()}
    return metrics | {"queries": len(query_ids), "documents": len(corpus_ids)}
