"""Argument similarity (paper, Table 3): Pearson r / Spearman rho x100 between cosine similarity and gold scores,
averaged over folds.

Protocols: cross-topic (score each held-out topic group with a model that never saw those topics) and k-fold
cross-validation over pairs. Here the given model is scored on every fold's test pairs as it is; fine-tuning a
fresh copy per fold on the fold's training pairs first is a training run per fold, orchestrated by
``sbert_ray.runs.argsim_folds``.

Datasets: AFS (the paper's corpus, ArgPairs_{DP,GC,GM}.csv, one file per topic; not shipped), and the two
offline substitutes UKP ASPECT (its official 4 cross-topic folds) and BWS (leave-one-topic-out over 8 topics).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sbert_ray.data.readers import UKP_ASPECT_FOLDS, load_records, resolve_data_dir
from sbert_ray.data.records import DataError, Records, TopicPair
from sbert_ray.evaluation.results import Undefined
from sbert_ray.evaluation.sts import SIMILARITIES, embed_pairs, pearson_spearman

ARGSIM_DATASETS = ("afs", "ukp-aspect", "bws")
# Top of each gold scale: regression targets are score / max, as the paper scales STSb's 0-5 to 0-1.
SCORE_MAX = {"afs": 5.0, "ukp-aspect": 3.0, "bws": 1.0}
AFS_TOPICS = {"DP": "death penalty", "GC": "gun control", "GM": "gay marriage"}
AFS_FOLDS = 10  # the paper's within-topic protocol: 10-fold cross-validation over all pairs


@dataclass(frozen=True)
class Fold:
    name: str
    train: list[TopicPair]
    test: list[TopicPair]
    dev: tuple[str, str] | None = None  # (dataset, split) the trainer's dev evaluation uses, when there is one


# --- data ---------------------------------------------------------------------------------------------------


def read_afs(folder: str | Path) -> Records:
    """ArgPairs_{DP,GC,GM}.csv of the AFS release as TopicPair (topic = file).

    Columns by position, as SentEval's AFS reader: 0 = regression_label (0-5), 9 = sentence_1, 10 = sentence_2;
    the first line is a header and rows without a score are unscored pairs (counted as dropped).
    """
    records: list[TopicPair] = []
    dropped = 0
    for code, topic in AFS_TOPICS.items():
        path = Path(folder) / f"ArgPairs_{code}.csv"
        if not path.is_file():
            raise DataError(f"{path}: AFS file not found (download the corpus from https://nlds.soe.ucsc.edu/node/44)")
        with path.open(encoding="utf-8", errors="replace", newline="") as f:
            rows = csv.reader(f)
            next(rows, None)
            for number, row in enumerate(rows, start=2):
                if len(row) < 11:
                    raise DataError(f"{path}, line {number}: expected at least 11 columns, got {len(row)}")
                if not row[0].strip():
                    dropped += 1
                    continue
                try:
                    score = float(row[0])
                except ValueError:
                    raise DataError(f"{path}, line {number}: score {row[0]!r} is not a number") from None
                records.append(TopicPair(topic, row[9], row[10], score))
    return Records(records, dropped=dropped)


def load_argsim(name: str, data_dir=None, path: str | None = None) -> Records:
    """All pairs of one argument-similarity corpus; AFS from ``path`` or ``<data dir>/afs``."""
    if name == "afs":
        root = resolve_data_dir(data_dir)
        if path is None and root is None:
            raise DataError("AFS is read from local files: give its folder (--tasks afs:/path/to/afs) or --data-dir")
        return read_afs(path or root / "afs")
    if name not in ARGSIM_DATASETS:
        raise ValueError(f"unknown argument-similarity dataset {name!r}; choose from {', '.join(ARGSIM_DATASETS)}")
    return load_records(name, "all", data_dir)


def cross_topic_folds(name: str, records: Sequence[TopicPair]) -> list[Fold]:
    """UKP ASPECT: its official folds (train = the 17 topics in neither test nor dev). Otherwise leave one topic
    out (AFS: train on two topics, test on the third, as the paper; BWS: 8 folds)."""
    if name == "ukp-aspect":
        folds = []
        for k, split in enumerate(UKP_ASPECT_FOLDS):
            held_out = set(split["test"]) | set(split["dev"])
            train = [r for r in records if r.topic not in held_out]
            test = [r for r in records if r.topic in split["test"]]
            folds.append(Fold(f"fold{k}", train, test, dev=("ukp-aspect", f"fold{k}/dev")))
        return folds
    topics = sorted({r.topic for r in records})
    return [
        Fold(topic, [r for r in records if r.topic != topic], [r for r in records if r.topic == topic])
        for topic in topics
    ]


def kfold_folds(records: Sequence[TopicPair], k: int = AFS_FOLDS, seed: int = 42) -> list[Fold]:
    """k-fold cross-validation over pairs (topics mixed), shuffled with a fixed seed."""
    from sklearn.model_selection import KFold  # here: sklearn's import (~0.5 s) only where folds are made

    splitter = KFold(n_splits=k, shuffle=True, random_state=seed)
    return [
        Fold(f"fold{i}", [records[j] for j in train], [records[j] for j in test])
        for i, (train, test) in enumerate(splitter.split(np.arange(len(records))))
    ]


# --- scoring ------------------------------------------------------------------------------------------------


def pair_similarities(model, pairs: Sequence[TopicPair], batch_size: int = 64) -> np.ndarray:
    """Cosine similarity per pair; a model may bring its own (the tf-idf baseline works on sparse vectors)."""
    if hasattr(model, "pair_similarities"):
        return model.pair_similarities(pairs)
    emb1, emb2 = embed_pairs(model, pairs, batch_size)
    return SIMILARITIES["cosine"](emb1, emb2)


def score_pairs(model, pairs: Sequence[TopicPair], batch_size: int = 64) -> dict[str, float]:
    predicted = pair_similarities(model, pairs, batch_size)
    pearson, spearman = pearson_spearman(np.array([p.score for p in pairs]), predicted)
    return {"pearson_cosine": pearson, "spearman_cosine": spearman, "n": len(pairs)}


def average_folds(per_fold: dict[str, dict]) -> dict:
    """Mean (and std) of Pearson / Spearman over folds, with each fold's numbers under ``folds``."""
    result: dict = {}
    for key in ("pearson_cosine", "spearman_cosine"):
        values = [m[key] for m in per_fold.values()]
        undefined = [fold for fold, m in per_fold.items() if math.isnan(m[key])]
        if undefined:  # a mean over the other folds would not be the protocol's number
            result[key] = result[f"{key}_std"] = Undefined(f"undefined on fold(s) {', '.join(undefined)}")
            continue
        result[key] = float(np.mean(values))
        result[f"{key}_std"] = float(np.std(values))
    result["n"] = sum(m["n"] for m in per_fold.values())
    result["folds"] = per_fold
    return result


def protocols(name: str, records: Sequence[TopicPair]) -> dict[str, list[Fold]]:
    """{result entry: folds}: ``ukp-aspect`` / ``bws`` cross-topic; AFS both of the paper's protocols."""
    if name == "afs":
        cross_topic, ten_fold = entry_names(name)
        return {cross_topic: cross_topic_folds(name, records), ten_fold: kfold_folds(records)}
    return {name: cross_topic_folds(name, records)}


def entry_names(name: str) -> tuple[str, ...]:
    """The result entries of ``name``'s protocols (``protocols``): AFS has two."""
    return ("afs-cross-topic", "afs-10fold") if name == "afs" else (name,)


def evaluate_folds(model, folds: Sequence[Fold], batch_size: int = 64) -> dict:
    """Score the model, as it is, on every fold's test pairs; averaged over folds."""
    return average_folds({fold.name: score_pairs(model, fold.test, batch_size) for fold in folds})


def evaluate_argsim(model, name: str, data_dir=None, batch_size: int = 64, path: str | None = None) -> dict[str, dict]:
    """{entry: metrics} of the unsupervised protocols of one corpus."""
    records = load_argsim(name, data_dir, path)
    return {entry: evaluate_folds(model, folds, batch_size) for entry, folds in protocols(name, records).items()}
