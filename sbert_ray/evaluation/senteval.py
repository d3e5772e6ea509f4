"""SentEval transfer tasks (paper, Table 5): logistic regression on frozen sentence embeddings, accuracy x100.

As SentEval: MR, CR, SUBJ, MPQA by 10-fold cross-validation; SST2, TREC, MRPC on their standard splits. The L2
strength C comes from SentEval's grid, chosen on SST2's dev split, else by an inner k-fold on the training part.
MRPC classifies the pair features (|u - v|, u * v), as SentEval does. Files: ``<data dir>/senteval-transfer``
in SentEval's ``data/downstream`` layout. sklearn is imported in the functions that fit: a Ray Train worker imports
this module (through the dev-score tasks) but never fits, and sklearn's import costs it ~0.5 s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sbert_ray.data.readers import resolve_data_dir
from sbert_ray.data.records import DataError
from sbert_ray.evaluation.embeddings import embed_columns, encoder_embeddings

SENTEVAL_TASKS = ("MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC")
C_GRID = [2.0**t for t in range(-2, 4)]  # SentEval's regularisation grid for its scikit-learn classifier
OUTER_FOLDS, INNER_FOLDS = 10, 5
MAX_ITER = 2000

# Two-file binary tasks: (folder, file with label 1, file with label 0).
BINARY_FILES = {
    "MR": ("MR", "rt-polarity.pos", "rt-polarity.neg"),
    "CR": ("CR", "custrev.pos", "custrev.neg"),
    "SUBJ": ("SUBJ", "subj.subjective", "subj.objective"),
    "MPQA": ("MPQA", "mpqa.pos", "mpqa.neg"),
}


@dataclass
class TaskData:
    texts: list[tuple[str, ...]]  # one sentence per example, or a sentence pair (MRPC)
    labels: np.ndarray
    splits: np.ndarray | None = None  # "train" / "dev" / "test" per example; None = cross-validation


def _lines(path: Path, encoding: str) -> list[str]:
    # Blank lines are kept, as SentEval does (CR and MPQA ship a few; the official counts include them).
    return [line.strip() for line in path.read_text(encoding=encoding).splitlines()]


def load_task(name: str, root: Path) -> TaskData:
    """One task from SentEval's layout (file formats in shared/data/senteval-transfer/SOURCE.md)."""
    if name in BINARY_FILES:
        folder, positive, negative = BINARY_FILES[name]
        pos, neg = _lines(root / folder / positive, "latin-1"), _lines(root / folder / negative, "latin-1")
        return TaskData([(s,) for s in pos + neg], np.array([1] * len(pos) + [0] * len(neg)))
    texts, labels, splits = [], [], []
    if name == "SST2":
        for split in ("train", "dev", "test"):
            for line in _lines(root / "SST" / "binary" / f"sentiment-{split}", "utf-8"):
                sentence, _, label = line.rpartition("\t")
                texts.append((sentence.strip(),))
                labels.append(int(label))
                splits.append(split)
    elif name == "TREC":
        classes: dict[str, int] = {}
        for split, file in (("train", "train_5500.label"), ("test", "TREC_10.label")):
            for line in _lines(root / "TREC" / file, "latin-1"):
                label, _, question = line.partition(" ")
                texts.append((question,))
                labels.append(classes.setdefault(label.split(":")[0], len(classes)))  # the 6 coarse classes
                splits.append(split)
    elif name == "MRPC":
        for split in ("train", "test"):
            # TAB-separated without quoting (sentences contain '"'); the header line is skipped.
            for line in _lines(root / "MRPC" / f"msr_paraphrase_{split}.txt", "utf-8-sig")[1:]:
                quality, _, _, s1, s2 = line.split("\t")
                texts.append((s1, s2))
                labels.append(int(quality))
                splits.append(split)
    else:
        raise ValueError(f"unknown SentEval task {name!r}; choose from {', '.join(SENTEVAL_TASKS)}")
    return TaskData(texts, np.array(labels), np.array(splits))


def features(encoder, texts: Sequence[tuple[str, ...]], batch_size: int = 64) -> np.ndarray:
    """Embeddings of single sentences, or (|u - v|, u * v) of pairs; each distinct sentence is encoded once."""
    columns = embed_columns(encoder_embeddings(encoder, batch_size), list(zip(*texts, strict=True)))
    if len(columns) == 1:
        return columns[0]
    u, v = columns
    return np.hstack([np.abs(u - v), u * v])


def best_c(x: np.ndarray, y: np.ndarray, cv, c_grid: Sequence[float] = C_GRID) -> float:
    """The C of the grid with the best mean validation accuracy over ``cv``'s splits of these rows."""
    from sklearn.linear_model import LogisticRegression  # sklearn is imported where it is used (module docstring)
    from sklearn.model_selection import GridSearchCV

    # All cores: the grid's fits dominate once the sentences are encoded.
    search = GridSearchCV(LogisticRegression(max_iter=MAX_ITER), {"C": list(c_grid)}, cv=cv, refit=False, n_jobs=-1)
    return search.fit(x, y).best_params_["C"]


def test_accuracy(c: float, x_train, y_train, x_test, y_test, seed: int) -> float:
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=c, max_iter=MAX_ITER, random_state=seed).fit(x_train, y_train)
    return float(model.score(x_test, y_test) * 100)


def classify(x: np.ndarray, data: TaskData, seed: int = 1111, c_grid: Sequence[float] = C_GRID) -> dict[str, float]:
    from sklearn.model_selection import PredefinedSplit, StratifiedKFold

    y = data.labels
    inner = StratifiedKFold(INNER_FOLDS, shuffle=True, random_state=seed)
    if data.splits is None:
        outer = StratifiedKFold(OUTER_FOLDS, shuffle=True, random_state=seed)
        scores = [
            test_accuracy(best_c(x[tr], y[tr], inner, c_grid), x[tr], y[tr], x[te], y[te], seed)
            for tr, te in outer.split(x, y)
        ]
        return {"accuracy": float(np.mean(scores)), "accuracy_std": float(np.std(scores))}
    train, test = data.splits == "train", data.splits == "test"
    if np.any(data.splits == "dev"):  # SST2: C chosen on dev, the classifier fitted on train only
        rows = data.splits != "test"
        c = best_c(x[rows], y[rows], PredefinedSplit(np.where(data.splits[rows] == "dev", 0, -1)), c_grid)
    else:
        c = best_c(x[train], y[train], inner, c_grid)
    return {"accuracy": test_accuracy(c, x[train], y[train], x[test], y[test], seed)}


def run_senteval(
    encoder,
    data_dir=None,
    tasks: Sequence[str] = SENTEVAL_TASKS,
    batch_size: int = 64,
    seed: int = 1111,
    c_grid: Sequence[float] = C_GRID,
) -> dict[str, dict]:
    """{task: {"accuracy" (x100, primary), "n", "seconds"}}; CV tasks also give the std over folds."""
    root = resolve_data_dir(data_dir)
    if root is None:
        raise DataError("SentEval tasks are read from local files: pass --data-dir or set SBERT_RAY_DATA_DIR")
    unknown = [t for t in tasks if t not in SENTEVAL_TASKS]
    if unknown:
        raise ValueError(f"unknown SentEval task {unknown}; choose from {', '.join(SENTEVAL_TASKS)}")
    results = {}
    for name in tasks:
        start = time.perf_counter()
        data = load_task(name, root / "senteval-transfer")
        x = features(encoder, data.texts, batch_size)
        encoded = time.perf_counter()
        results[name] = classify(x, data, seed, c_grid) | {
            "n": len(data.texts),
            "encode_seconds": encoded - start,
            "fit_seconds": time.perf_counter() - encoded,
        }
    return results
