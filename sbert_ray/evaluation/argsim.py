"""Argument similarity (paper, Table 3): Pearson r / Spearman rho x100 between cosine similarity and gold scores,
averaged over folds.

Protocols: cross-topic (score each held-out topic group with a model that never saw those topics) and k-fold
cross-validation over pairs. Modes: ``unsupervised`` scores the given model on every fold's test pairs;
``finetune`` first trains a fresh copy of the model on the fold's training pairs with the regression objective
(the project's Ray Train loop, one Ray task per fold, so folds run in parallel on a cluster), then scores it.

Datasets: AFS (the paper's corpus, ArgPairs_{DP,GC,GM}.csv, one file per topic; not shipped), and the two
offline substitutes UKP ASPECT (its official 4 cross-topic folds) and BWS (leave-one-topic-out over 8 topics).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.model_selection import KFold

from sbert_ray.data.readers import UKP_ASPECT_FOLDS, load_records, resolve_data_dir
from sbert_ray.data.records import DataError, Records, TopicPair
from sbert_ray.evaluation.sts import SIMILARITIES, embed_pairs

ARGSIM_DATASETS = ("afs", "ukp-aspect", "bws")
# Top of each gold scale: regression targets are score / max, as the paper scales STSb's 0-5 to 0-1.
SCORE_MAX = {"afs": 5.0, "ukp-aspect": 3.0, "bws": 1.0}
AFS_TOPICS = {"DP": "death penalty", "GC": "gun control", "GM": "gay marriage"}
AFS_FOLDS = 10  # the paper's within-topic protocol: 10-fold cross-validation over all pairs
MODES = ("unsupervised", "finetune")


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
    gold = np.array([p.score for p in pairs])
    return {
        "pearson_cosine": float(pearsonr(gold, predicted).statistic * 100),
        "spearman_cosine": float(spearmanr(gold, predicted).statistic * 100),
        "n": len(pairs),
    }


def average_folds(per_fold: dict[str, dict]) -> dict:
    """Mean (and std) of Pearson / Spearman over folds, with each fold's numbers under ``folds``."""
    result: dict = {}
    for key in ("pearson_cosine", "spearman_cosine"):
        values = [m[key] for m in per_fold.values()]
        result[key] = float(np.mean(values))
        result[f"{key}_std"] = float(np.std(values))
    result["n"] = sum(m["n"] for m in per_fold.values())
    result["folds"] = per_fold
    return result


def evaluate_folds(
    model,
    name: str,
    folds: Sequence[Fold],
    mode: str = "unsupervised",
    batch_size: int = 64,
    train_config=None,
) -> dict:
    """Score every fold's test pairs (after fine-tuning a fresh copy on its training pairs in ``finetune`` mode)."""
    if mode == "unsupervised":
        per_fold = {fold.name: score_pairs(model, fold.test, batch_size) for fold in folds}
    elif mode == "finetune":
        if train_config is None:
            raise ValueError("finetune mode needs a TrainConfig (model, budget, scaling) to fine-tune each fold")
        per_fold = finetune_folds(name, folds, train_config, batch_size)
    else:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    return average_folds(per_fold)


def evaluate_argsim(
    model, name: str, data_dir=None, mode: str = "unsupervised", batch_size: int = 64, train_config=None, path=None
) -> dict[str, dict]:
    """{entry: metrics}: ``ukp-aspect`` / ``bws`` cross-topic; AFS both of the paper's protocols."""
    records = load_argsim(name, data_dir, path)
    protocols = {name: cross_topic_folds(name, records)}
    if name == "afs":
        protocols = {"afs-cross-topic": protocols[name], "afs-10fold": kfold_folds(records)}
    return {
        entry: evaluate_folds(model, name, folds, mode, batch_size, train_config) for entry, folds in protocols.items()
    }


# --- fine-tuning per fold (Ray) -----------------------------------------------------------------------------


def finetune_config(model_ref: str, data_dir=None, pooling: str | None = None, overrides: Sequence[str] = ()):
    """The TrainConfig every fold starts from: the model as given, one regression stage with the paper's settings
    (batch 16, AdamW 2e-5, 10% warm-up, 1 epoch), then the caller's key=value overrides (a step budget:
    ``stages.0.max_steps=20``; cluster scale: ``scaling.num_workers=4``)."""
    from sbert_ray.config import load_config

    base = [f"model.name={model_ref}", "stages.0.objective=regression"]
    base += [f"model.pooling={pooling}"] if pooling else []
    base += [f"data_dir={data_dir}"] if data_dir else []
    return load_config(None, [*base, *overrides])


def finetune_folds(name: str, folds: Sequence[Fold], train_config, batch_size: int = 64) -> dict[str, dict]:
    """One Ray task per fold; each trains through ``driver.train`` (whose TorchTrainer requests the workers'
    resources, hence num_cpus=0 here) and scores the held-out pairs, as many folds at once as the cluster fits."""
    import ray

    from sbert_ray.tracking.mlflow_run import RunTracker, resolve_tracking_uri
    from sbert_ray.training.driver import connect_ray, runs_that_fit  # lazy: the driver imports the task registry

    # The parent run is opened here, before any fold starts: a fresh MLflow store or experiment must not be set
    # up by several fold tasks at once (concurrent sqlite migrations fail). It records every fold's scores.
    tracking = train_config.tracking
    uri = resolve_tracking_uri(tracking.tracking_uri)
    parent = RunTracker(uri, tracking.experiment, run_name=f"argsim-{name}-finetune")
    train_config = dataclasses.replace(train_config, tracking=dataclasses.replace(tracking, tracking_uri=uri))
    ok = False
    try:
        connect_ray()
        task = ray.remote(num_cpus=0)(_finetune_fold)
        # Only as many folds at once as the cluster holds: a fold waiting for workers would hit Ray Train's
        # worker-group start timeout and be retried.
        limit = runs_that_fit([train_config])
        pending, running, scores = list(folds), {}, {}
        while pending or running:
            while pending and len(running) < limit:
                fold = pending.pop(0)
                running[task.remote(name, fold, train_config, batch_size)] = fold.name
            (done,), _ = ray.wait(list(running), num_returns=1)
            scores[running.pop(done)] = ray.get(done)
        per_fold = {fold.name: scores[fold.name] for fold in folds}
        parent.log_metrics({f"{f}/{k}".replace(" ", "_"): v for f, m in per_fold.items() for k, v in m.items()})
        ok = True
        return per_fold
    finally:
        parent.end(ok)


def fold_config(name: str, fold: Fold, base, run_dir: Path):
    """The fold's TrainConfig: one regression stage on a JSONL file of its training pairs (read by the user-file
    reader). Files live under the checkpoint storage, which a multi-node cluster shares with every worker."""
    train_file = run_dir / "train.jsonl"
    with train_file.open("w", encoding="utf-8") as f:
        for r in fold.train:
            f.write(json.dumps({"sentence1": r.sentence1, "sentence2": r.sentence2, "score": r.score}) + "\n")
    stage = dataclasses.replace(
        base.stages[0], dataset=str(train_file), objective="regression", score_max=SCORE_MAX[name], columns=None
    )
    evaluation = dataclasses.replace(base.evaluation, final_tasks=[], before_tasks=[])
    if fold.dev is not None:
        evaluation = dataclasses.replace(evaluation, dev_dataset=fold.dev[0], dev_split=fold.dev[1], dev_limit=None)
    elif evaluation.dev_limit is None:
        # The dev set only ranks the kept checkpoints (the fold's model is the final one), so a slice will do.
        evaluation = dataclasses.replace(evaluation, dev_limit=200)
    return dataclasses.replace(
        base,
        name=run_dir.name,
        stages=[stage],
        evaluation=evaluation,
        output_dir=str(run_dir / "final-model"),
        tracking=dataclasses.replace(base.tracking, run_name=run_dir.name),
    )


def _finetune_fold(name: str, fold: Fold, base, batch_size: int) -> dict[str, float]:
    from sbert_ray.models.encoder import SentenceEncoder
    from sbert_ray.training.driver import train  # lazy: the driver imports the task registry, which imports us

    storage = Path(base.checkpoint.storage_path).expanduser().resolve()
    run_dir = storage / f"argsim-{name}-{fold.name}-{uuid.uuid4().hex[:8]}".replace(" ", "_")
    run_dir.mkdir(parents=True)
    try:
        result = train(fold_config(name, fold, base, run_dir))
        metrics = score_pairs(SentenceEncoder.load(result.model_dir), fold.test, batch_size)
        metrics["train_pairs"] = len(fold.train)
        return metrics
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints of a throw-away fold model; MLflow keeps the run
