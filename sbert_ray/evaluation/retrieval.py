"""Retrieval evaluation: rank the corpus for every query and score the ranking as sentence-transformers'
``InformationRetrievalEvaluator`` does with its defaults (same numbers to 1e-4 on the same embeddings).

Metrics (fractions, averaged over the queries that have a relevant document): ``accuracy_at_k`` (a relevant
document in the top k), ``precision_at_k`` and ``recall_at_k`` for k in 1, 3, 5, 10; ``mrr_at_10``, ``ndcg_at_10``
(binary relevance) and ``map_at_100`` (the precisions at the relevant ranks, summed, over min(100, relevant
documents)). Each name ends with its similarity (``ndcg_at_10_cosine``, the task's primary metric); ``dot`` is
scored too when the embeddings are not unit length (there it ranks differently from cosine). Names say ``_at_``
where sentence-transformers writes ``@`` (``cosine_ndcg@10``) because MLflow refuses ``@`` in metric names.

Ranking is exact: equal scores go to the smaller document id (string order), as in sentence-transformers, so the
numbers do not depend on chunk sizes (``CorpusRows`` numbers the documents in id order). The corpus is encoded and
searched a chunk at a time, chunks in file order (``search_chunks``); with ``eval --workers N`` each chunk is
encoded and searched on one of N encoder actors and only its top k comes back, with the same numbers as one
process. A BEIR corpus on object storage (``StreamedCorpus``) is never held: it streams by twice, for its ids and
then for its texts, read by Ray Data on a cluster. ``sbert-ray mine`` searches the same way (``hard_negatives``).

A model with prompts encodes the queries with its query prompt and the corpus with its document prompt, as
sentence-transformers' evaluator does through ``encode_query`` / ``encode_document`` (``sbert_ray.models.prompts``).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from sbert_ray.config import ConfigError
from sbert_ray.data.records import DataError
from sbert_ray.data.retrieval_sets import RetrievalSet, StreamedCorpus
from sbert_ray.models.prompts import document_prompt_name, query_prompt_name

ACCURACY_AT = (1, 3, 5, 10)
PRECISION_RECALL_AT = (1, 3, 5, 10)
MRR_AT, NDCG_AT, MAP_AT = 10, 10, 100
TOP_K = max(*ACCURACY_AT, *PRECISION_RECALL_AT, MRR_AT, NDCG_AT, MAP_AT)
QUERY_CHUNK, CORPUS_CHUNK = 1024, 16384
HNSW_NEIGHBOURS, HNSW_SEARCH_DEPTH = 32, 128  # approximate search: graph degree, candidates followed per query
UNIT_NORM_TOLERANCE = 1e-3  # below this every query embedding counts as unit length: dot would equal cosine

Similarity = Callable[[Tensor, Tensor], Tensor]  # (queries [q, d], documents [n, d]) -> scores [q, n]
SIMILARITIES: dict[str, Similarity] = {
    "cosine": lambda queries, documents: F.normalize(queries, dim=1) @ F.normalize(documents, dim=1).T,
    "dot": lambda queries, documents: queries @ documents.T,
}
PAIRWISE: dict[str, Similarity] = {  # (queries [n, d], documents [n, d]) -> the n scores of the aligned pairs
    "cosine": lambda queries, documents: (F.normalize(queries, dim=1) * F.normalize(documents, dim=1)).sum(dim=1),
    "dot": lambda queries, documents: (queries * documents).sum(dim=1),
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


Ranked = dict[str, tuple[Tensor, Tensor]]  # similarity -> (scores, corpus rows), each [queries, <= k], best first


def chunk_top_k(
    queries: Tensor, chunk: Tensor, rows: Tensor, k: int, similarities: Sequence[str], query_chunk: int = QUERY_CHUNK
) -> Ranked:
    """Every query's k best rows of one corpus chunk (its embeddings' corpus rows: ``rows``, ascending), best
    first, ties to the lower row. Memory beyond the inputs: one score block of query_chunk x len(chunk) float32
    values, twice that for the comparison that finds ties (rows tied at the k-th score are sorted whole: 12 bytes
    a score), and the result (12 bytes per query, similarity and k)."""
    ranked = {}
    for name in similarities:
        parts = [_best_columns(SIMILARITIES[name](part, chunk), k) for part in queries.split(query_chunk)]
        ranked[name] = torch.cat([s for s, _ in parts]), rows[torch.cat([c for _, c in parts])]
    return ranked


def merge_top_k(best: Ranked | None, found: Ranked, k: int) -> Ranked:
    """The k best of two rankings of the same queries over disjoint rows. The order (score descending, row
    ascending) is total, so merging chunks in any order gives the same ranking as one search of the whole."""
    if best is None:
        return found
    merged = {}
    for name, (scores, rows) in found.items():
        scores, rows = _in_rank_order(torch.cat([best[name][0], scores], 1), torch.cat([best[name][1], rows], 1))
        merged[name] = scores[:, :k], rows[:, :k]
    return merged


def exact_top_k(
    queries: Tensor,
    corpus_chunks: Iterable[Tensor],
    k: int,
    similarities: Sequence[str],
    query_chunk: int = QUERY_CHUNK,
) -> Ranked:
    """{similarity: (scores, corpus rows)}, each [len(queries), min(k, corpus size)]: every query's k best rows of
    the corpus (given as consecutive chunks, read once), best first, ties to the lower row.

    Memory beyond the inputs: ``chunk_top_k``'s score block for one chunk, and the running top k plus one chunk's
    top k per query and similarity (24 bytes per query, similarity and k). No query x corpus matrix is ever whole."""
    best, offset = None, 0
    for chunk in corpus_chunks:
        rows = torch.arange(offset, offset + len(chunk))
        best = merge_top_k(best, chunk_top_k(queries, chunk, rows, k, similarities, query_chunk), k)
        offset += len(chunk)
    if best is None:  # an empty corpus: no rows for anyone
        return {
            name: (queries.new_empty(len(queries), 0), torch.empty(len(queries), 0, dtype=torch.long))
            for name in similarities
        }
    return best


def check_faiss() -> None:
    """Approximate search needs faiss (``pip install 'sbert-ray[faiss]'``, i.e. faiss-cpu): a ConfigError if absent."""
    if importlib.util.find_spec("faiss") is None:
        raise ConfigError("approximate search needs faiss: pip install 'sbert-ray[faiss]' (faiss-cpu)")


def approximate_top_k(queries: Tensor, chunk: Tensor, rows: Tensor, k: int, similarities: Sequence[str]) -> Ranked:
    """``chunk_top_k`` by a faiss HNSW graph (inner product; cosine on unit vectors) over the chunk: no score
    block, and most of the true top k (a found row's score is exact). Rows HNSW does not reach score -inf, row -1.
    Memory: the chunk's vectors and graph (HNSW_NEIGHBOURS x 2 links of 4 bytes per row)."""
    import faiss  # an optional extra: check_faiss() has looked before any work

    ranked = {}
    for name in similarities:
        if name == "cosine":
            queries_here, chunk_here = F.normalize(queries, dim=1), F.normalize(chunk, dim=1)
        else:
            queries_here, chunk_here = queries, chunk
        index = faiss.IndexHNSWFlat(chunk.shape[1], HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = max(HNSW_SEARCH_DEPTH, k)
        index.add(chunk_here.contiguous().numpy())
        scores, columns = (
            torch.from_numpy(a) for a in index.search(queries_here.contiguous().numpy(), min(k, len(chunk)))
        )
        scores[columns < 0] = -math.inf
        ranked[name] = _in_rank_order(scores, torch.where(columns < 0, -1, rows[columns.clamp(min=0)]))
    return ranked


def pair_scores(queries: Tensor, chunk: Tensor, rows: Tensor, pairs: Tensor, similarity: str) -> Tensor:
    """The score of each (query, corpus row) pair of ``pairs`` [n, 2] whose row is one of this chunk's ``rows``
    (ascending; NaN for the others), one pair at a time as sentence-transformers' ``similarity_pairwise`` scores
    them."""
    scores = torch.full((len(pairs),), float("nan"))
    inside = torch.isin(pairs[:, 1], rows)
    if inside.any():
        query_rows, corpus_rows = pairs[inside, 0], torch.searchsorted(rows, pairs[inside, 1])
        scores[inside] = PAIRWISE[similarity](queries[query_rows], chunk[corpus_rows])
    return scores


@dataclass(frozen=True)
class ChunkSearch:
    """What every chunk of one corpus search shares: how many rows to keep per query, by which similarities,
    how many queries to score at once, the (query, corpus row) pairs whose scores are wanted too, and whether the
    top k may be approximate (``approximate_top_k``; exact is the default)."""

    k: int
    similarities: tuple[str, ...]
    query_chunk: int = QUERY_CHUNK
    pairs: Tensor = field(default_factory=lambda: torch.empty(0, 2, dtype=torch.long))
    approximate: bool = False
    document_prompt: str | None = None  # the encoder's prompt name for corpus texts (None: no prompt)


def search_chunk(
    encoder, texts: Sequence[str] | np.ndarray, rows: Tensor, batch_size: int, queries: Tensor, search: ChunkSearch
) -> tuple[Ranked, Tensor]:
    """Encode one corpus chunk (``texts``, whose corpus rows are ``rows``, ascending) and search it: its top k per
    query (``chunk_top_k``) and the scores of the ``search.pairs`` that fall in it (``pair_scores``). What one
    worker does with one chunk (``search_chunks``). ``texts`` may be the chunk's embeddings already, kept from an
    earlier encoding of the same corpus (``runs.corpus_embeddings``)."""
    if isinstance(texts, np.ndarray):  # from the object store, read-only, as the queries
        chunk = torch.from_numpy(texts.copy())
    else:
        chunk = _encode(encoder, texts, batch_size, search.document_prompt)
    if isinstance(queries, np.ndarray):  # from the object store, read-only: torch wants memory it may write
        queries = torch.from_numpy(queries.copy())
    if search.approximate:
        ranked = approximate_top_k(queries, chunk, rows, search.k, search.similarities)
    else:
        ranked = chunk_top_k(queries, chunk, rows, search.k, search.similarities, search.query_chunk)
    return ranked, pair_scores(queries, chunk, rows, search.pairs, search.similarities[0])


def search_corpus(
    encoder,
    queries: Tensor,
    texts: Sequence[str],
    search: ChunkSearch,
    batch_size: int,
    corpus_chunk: int = CORPUS_CHUNK,
    progress: Callable[[int], None] = lambda rows: None,
) -> tuple[Ranked, Tensor]:
    """``search_chunks`` over ``texts`` cut into consecutive chunks of ``corpus_chunk``: a text's row is its place."""
    return search_chunks(encoder, queries, text_chunks(texts, corpus_chunk), search, batch_size, progress)


def text_chunks(texts: Sequence[str], corpus_chunk: int = CORPUS_CHUNK) -> Iterator[tuple[Sequence[str], Tensor]]:
    """``texts`` in consecutive chunks of ``corpus_chunk``, each with its rows (a text's row is its place)."""
    for start in range(0, len(texts), corpus_chunk):
        yield texts[start : start + corpus_chunk], torch.arange(start, min(start + corpus_chunk, len(texts)))


def search_chunks(
    encoder,
    queries: Tensor,
    chunks: Iterable[tuple[Sequence[str], Tensor]],
    search: ChunkSearch,
    batch_size: int,
    progress: Callable[[int], None] = lambda rows: None,
) -> tuple[Ranked, Tensor]:
    """Every query's top ``search.k`` rows of a corpus given as ``chunks`` (texts and their rows, ascending; each
    row in one chunk) and the scores of ``search.pairs``, each chunk encoded and searched by ``search_chunk``;
    ``progress`` hears of each chunk searched. An encoder that spreads work over workers (``RayEncoder``: it has
    ``map_unordered``) gets whole chunks, each encoded and searched on one worker, and the driver merges the
    per-chunk top k as they come: the chunks, their batches and their score blocks are the same as in one process,
    and the merge does not depend on the order of arrival, so the ranking is the same bit for bit (on workers with
    the same kind of processor). ``chunks`` is read as the workers take them: a streamed corpus is never whole.

    Memory: here, the query embeddings, the running top k and, per chunk in flight, its texts and top k (12 bytes
    per query, similarity and k each); on the worker that searches a chunk, its texts and embeddings and one score
    block of query_chunk x chunk size (``chunk_top_k``). No query x corpus score matrix exists anywhere."""
    if hasattr(encoder, "map_unordered"):
        found = encoder.map_unordered(search_chunk, chunks, batch_size, queries.numpy(), search)
    else:
        found = (search_chunk(encoder, part, rows, batch_size, queries, search) for part, rows in chunks)
    best, scores = None, torch.full((len(search.pairs),), float("nan"))
    for ranked, chunk_pair_scores in found:
        best = merge_top_k(best, ranked, search.k)
        scores = torch.where(chunk_pair_scores.isnan(), scores, chunk_pair_scores)
        progress(1)
    if best is None:
        best = exact_top_k(queries, [], search.k, search.similarities)
    return best, scores


def metric_names() -> tuple[str, ...]:
    """Every metric ``evaluate_retrieval`` may return (the ``_dot`` ones for unnormalised models only)."""
    ranking = [f"accuracy_at_{k}" for k in ACCURACY_AT]
    ranking += [f"{kind}_at_{k}" for k in PRECISION_RECALL_AT for kind in ("precision", "recall")]
    ranking += [f"mrr_at_{MRR_AT}", f"ndcg_at_{NDCG_AT}", f"map_at_{MAP_AT}"]
    return tuple(f"{metric}_{similarity}" for similarity in SIMILARITIES for metric in ranking)


def ranking_metrics(hits: np.ndarray, relevant_counts: np.ndarray) -> dict[str, float]:
    """Metrics from ``hits`` [queries, ranks] (True where the document at that rank is relevant; ranks past TOP_K
    are not scored, and a ranking shorter than TOP_K leaves the last ranks False) and each query's number of
    relevant documents."""
    hits = np.pad(hits[:, :TOP_K], ((0, 0), (0, max(0, TOP_K - hits.shape[1])))).astype(np.float64)
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


def _encode(encoder, texts: list[str], batch_size: int, prompt_name: str | None = None) -> Tensor:
    embeddings = encoder.encode(texts, batch_size=batch_size, convert_to="numpy", prompt_name=prompt_name)
    return torch.as_tensor(embeddings, dtype=torch.float32)


@dataclass(frozen=True)
class CorpusRows:
    """A corpus's row numbers: documents are numbered in id (string) order, so that equal scores go to the smaller
    id however the corpus is cut into chunks, while the chunks follow the file (a streamed corpus cannot be
    sorted before it is read). ``ids`` is in row order; ``rows`` gives each document's row in file order."""

    ids: list[str]
    rows: np.ndarray

    @classmethod
    def of(cls, ids_in_file_order: Sequence[str]) -> CorpusRows:
        order = np.argsort(np.array(ids_in_file_order, dtype=object), kind="stable")
        rows = np.empty(len(order), dtype=np.int64)
        rows[order] = np.arange(len(order))
        return cls([ids_in_file_order[i] for i in order], rows)

    def chunks(self, texts: Iterable[str], corpus_chunk: int) -> Iterator[tuple[list[str], Tensor]]:
        """``texts`` (in file order) in chunks of ``corpus_chunk``, each put in row order, with its rows. A corpus
        of one chunk is encoded in id order whichever order its file has."""
        texts, start = iter(texts), 0
        while part := list(itertools.islice(texts, corpus_chunk)):
            rows = torch.from_numpy(self.rows[start : start + len(part)])
            rows, order = rows.sort()
            yield [part[i] for i in order.tolist()], rows
            start += len(part)


def _corpus_rows_and_texts(encoder, corpus: dict[str, str] | StreamedCorpus) -> tuple[CorpusRows, Iterable[str]]:
    """The corpus's rows and its texts in file order. A streamed corpus is read twice, each time a stream: first
    for the ids (checked: each once, every judged one there), then for the texts, as the search takes them. On a
    cluster (``RayEncoder``) Ray Data reads it (``data.remote_corpus``), else this process does."""
    if isinstance(corpus, dict):
        return CorpusRows.of(list(corpus)), corpus.values()
    if hasattr(encoder, "map_unordered"):
        from sbert_ray.data.remote_corpus import RemoteCorpus  # Ray: only where encoding is on a cluster already

        lines = functools.partial(RemoteCorpus.lines_of(corpus.uri).texts, cpus_per_read=0)  # the actors hold CPUs
    else:
        lines = corpus.lines
    ids, seen = [], set()
    for where, key, _ in corpus.documents(lines()):
        if key in seen:
            raise DataError(f"{where}: id {key!r} appears twice")
        ids.append(key)
        seen.add(key)
    return CorpusRows.of(ids), (text for _, _, text in corpus.documents(lines()))


@dataclass(frozen=True)
class Retrieved:
    """One search of a retrieval set: the judged queries (in ``data.relevant``'s order), the corpus's rows and each
    query's top k rows by each similarity (``Ranked``)."""

    query_ids: list[str]
    corpus: CorpusRows
    ranked: Ranked

    def metrics(self, data: RetrievalSet, rows: Tensor) -> dict[str, float]:
        """``ranking_metrics`` of a ranking of the corpus rows ``rows`` [queries, ranks], judged by ``data``."""
        hits = np.array(
            [
                [self.corpus.ids[row] in data.relevant[key] for row in top]
                for key, top in zip(self.query_ids, rows.tolist(), strict=True)
            ]
        ).reshape(len(self.query_ids), -1)
        relevant_counts = np.array([len(data.relevant[key]) for key in self.query_ids])
        return ranking_metrics(hits, relevant_counts)


def retrieve(
    encoder,
    data: RetrievalSet,
    batch_size: int = 64,
    k: int = TOP_K,
    query_chunk: int = QUERY_CHUNK,
    corpus_chunk: int = CORPUS_CHUNK,
) -> Retrieved:
    """Every judged query's top k of the corpus by cosine, and by dot too when the query embeddings are not unit
    length. The corpus is encoded and searched one chunk at a time, here or on the workers of a ``RayEncoder``
    (``search_chunks``, which states the memory bound; beyond it, this process holds every document's id and row)."""
    query_ids = list(data.relevant)
    prompts = encoder.prompts
    queries = _encode(encoder, [data.queries[key] for key in query_ids], batch_size, query_prompt_name(prompts))
    unit = bool(torch.allclose(queries.norm(dim=1), torch.ones(len(queries)), atol=UNIT_NORM_TOLERANCE, rtol=0))
    names = ("cosine",) if unit else ("cosine", "dot")
    search = ChunkSearch(k, names, query_chunk, document_prompt=document_prompt_name(prompts))
    corpus, texts = _corpus_rows_and_texts(encoder, data.corpus)
    if isinstance(data.corpus, StreamedCorpus):
        data.corpus.check_judged(data.relevant, set(corpus.ids))
    ranked, _ = search_chunks(encoder, queries, corpus.chunks(texts, corpus_chunk), search, batch_size)
    return Retrieved(query_ids, corpus, ranked)


def evaluate_retrieval(
    encoder, data: RetrievalSet, batch_size: int = 64, query_chunk: int = QUERY_CHUNK, corpus_chunk: int = CORPUS_CHUNK
) -> dict[str, float]:
    """Flat metrics (see the module docstring) plus ``queries`` and ``documents`` (the counts scored), from one
    ``retrieve``: the same numbers here or on workers, and for a corpus on object storage as for the same folder
    on disk."""
    found = retrieve(encoder, data, batch_size, TOP_K, query_chunk, corpus_chunk)
    metrics: dict[str, float] = {}
    for name, (_, rows) in found.ranked.items():
        metrics |= {f"{metric}_{name}": value for metric, value in found.metrics(data, rows).items()}
    return metrics | {"queries": len(found.query_ids), "documents": len(found.corpus.ids)}
