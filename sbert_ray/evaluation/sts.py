"""STS evaluation: Spearman / Pearson (x100) between embedding similarity and gold scores (paper, Table 1).

STS12-STS16 are scored as one concatenated set each, as the paper does (SentEval averages sub-sets instead,
which gives lower numbers); per-subset numbers are reported beside them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from sbert_ray.data.readers import load_records, load_sts_subsets, resolve_data_dir
from sbert_ray.data.records import Records, ScoredPair
from sbert_ray.evaluation.embeddings import embed_columns, encoder_embeddings
from sbert_ray.evaluation.results import Undefined

STS_YEARS = ("sts12", "sts13", "sts14", "sts15", "sts16")
STS_DATASETS = (*STS_YEARS, "stsb", "sickr")
# SICK-R: the 4,927 pairs of SICK's test split from local files; the Hub copy (mteb/sickr-sts) has only all
# 9,927 pairs in one split, so without a data folder that is what gets scored.
SICKR_LOCAL_SPLIT, SICKR_HUB_SPLIT = "test", "all"

# Larger means more similar for every function, so rank correlations are comparable.
SIMILARITIES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "cosine": lambda a, b: np.sum(_unit(a) * _unit(b), axis=1),
    "manhattan": lambda a, b: -np.abs(a - b).sum(axis=1),
    "euclidean": lambda a, b: -np.linalg.norm(a - b, axis=1),
    "dot": lambda a, b: np.sum(a * b, axis=1),
}


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.clip(np.linalg.norm(x, axis=1, keepdims=True), 1e-12, None)


def embed_pairs(encoder, pairs: Sequence[ScoredPair], batch_size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Embed both sides of every pair, encoding each distinct sentence once."""
    emb1, emb2 = embed_columns(
        encoder_embeddings(encoder, batch_size), [[p.sentence1 for p in pairs], [p.sentence2 for p in pairs]]
    )
    return emb1, emb2


def correlations(
    emb1: np.ndarray, emb2: np.ndarray, gold: np.ndarray, similarities: Sequence[str] = ("cosine",)
) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for name in similarities:
        predicted = SIMILARITIES[name](emb1, emb2)
        metrics[f"pearson_{name}"], metrics[f"spearman_{name}"] = pearson_spearman(gold, predicted)
    metrics["n"] = len(gold)
    return metrics


def pearson_spearman(gold: np.ndarray, predicted: np.ndarray) -> tuple[float, float]:
    """Pearson's and Spearman's ``correlation``. scipy.stats is imported here, not with this module: its ~1 s import
    would otherwise be paid by every Ray Train worker and CLI process that imports the evaluation but scores nothing."""
    from scipy.stats import pearsonr, spearmanr

    return correlation(pearsonr, gold, predicted), correlation(spearmanr, gold, predicted)


def correlation(statistic: Callable, gold: np.ndarray, predicted: np.ndarray) -> float:
    """``statistic`` (scipy's spearmanr or pearsonr) x100; Undefined, with the reason, where it has no value: scores
    that do not vary have no ranking or variance to compare (scipy returns NaN with a warning)."""
    if not np.isfinite(predicted).all():
        return Undefined("the model gave similarities that are not numbers")
    if np.ptp(gold) == 0:
        return Undefined(f"all {len(gold)} gold scores are equal")
    if np.ptp(predicted) == 0:
        return Undefined(f"the model gave all {len(gold)} pairs the same similarity")
    return float(statistic(gold, predicted).statistic * 100)


def evaluate_pairs(
    encoder, pairs: Sequence[ScoredPair], batch_size: int = 64, similarities: Sequence[str] = ("cosine",)
) -> dict[str, float]:
    """Flat metrics dict for one set of scored pairs; the primary metric is ``spearman_cosine``."""
    if len(pairs) < 2:
        raise ValueError(f"STS evaluation needs at least 2 scored pairs, got {len(pairs)}")
    emb1, emb2 = embed_pairs(encoder, pairs, batch_size)
    return correlations(emb1, emb2, np.array([p.score for p in pairs]), similarities)


def evaluate_pair_scores(reranker, pairs: Sequence[ScoredPair], batch_size: int = 64) -> dict[str, float]:
    """A reranker's ``evaluate_pairs``: its scores of the pairs (``predict``, the sigmoid of its logits) against the
    gold scores, as ``pearson_pair_score`` / ``spearman_pair_score`` x100."""
    if len(pairs) < 2:
        raise ValueError(f"scoring pairs needs at least 2 scored pairs, got {len(pairs)}")
    predicted = reranker.predict([(p.sentence1, p.sentence2) for p in pairs], batch_size=batch_size)
    gold = np.array([p.score for p in pairs])
    pearson, spearman = pearson_spearman(gold, predicted.astype(np.float64))
    return {"pearson_pair_score": pearson, "spearman_pair_score": spearman, "n": len(gold)}


def evaluate_sts_year(
    encoder, name: str, data_dir=None, batch_size: int = 64, similarities: Sequence[str] = ("cosine",)
) -> dict:
    """One STS year scored as a single concatenated set, with each sub-set's numbers under ``subsets`` when the
    data names them (local files do; the Hub copies do not, so from the Hub there is no ``subsets``)."""
    subsets = load_sts_subsets(name, data_dir)
    pairs = Records.concat(subsets.values()) if subsets else load_records(name, "test", data_dir)
    emb1, emb2 = embed_pairs(encoder, pairs, batch_size)
    gold = np.array([p.score for p in pairs])
    result = correlations(emb1, emb2, gold, similarities)
    if subsets:
        result["subsets"] = {}
    start = 0
    for subset, subset_pairs in subsets.items():
        part = slice(start, start + len(subset_pairs))
        result["subsets"][subset] = correlations(emb1[part], emb2[part], gold[part], similarities)
        start += len(subset_pairs)
    return result


def sts_split(name: str, data_dir=None) -> str:
    """The split each STS dataset is scored on (SICK-R: its test split locally, all pairs from the Hub)."""
    if name == "sickr":
        return SICKR_LOCAL_SPLIT if resolve_data_dir(data_dir) else SICKR_HUB_SPLIT
    return "test"


def run_sts_suite(
    encoder,
    data_dir=None,
    datasets: Sequence[str] = STS_DATASETS,
    batch_size: int = 64,
    similarities: Sequence[str] = ("cosine",),
) -> dict[str, dict]:
    """{dataset: metrics} for STS12-16 (concatenated), STSb test and SICK-R test."""
    unknown = set(similarities) - set(SIMILARITIES)
    if unknown:
        raise ValueError(f"unknown similarity {sorted(unknown)}; choose from {sorted(SIMILARITIES)}")
    results: dict[str, dict] = {}
    for name in datasets:
        if name in STS_YEARS:
            results[name] = evaluate_sts_year(encoder, name, data_dir, batch_size, similarities)
        elif name in ("stsb", "sickr"):
            pairs = load_records(name, sts_split(name, data_dir), data_dir)
            results[name] = evaluate_pairs(encoder, pairs, batch_size, similarities)
        else:
            raise ValueError(f"unknown STS dataset {name!r}; choose from {', '.join(STS_DATASETS)}")
    return results
