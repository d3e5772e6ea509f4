"""Cross-validated argument-similarity fine-tuning (paper, Table 3): for every fold, a fresh copy of the model is
trained on the fold's training pairs (a regression training run through ``run_training``) and scored on its
held-out pairs, then the folds are averaged as the unsupervised protocol does (``evaluation.argsim``).

Folds run as Ray tasks, as many at once as the cluster holds; each fold's training run is an MLflow run nested
under one parent run per corpus, which also records every fold's scores.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

import ray

from sbert_ray.config import ConfigError, TrainConfig, flatten, load_config
from sbert_ray.data.records import TopicPair
from sbert_ray.evaluation import argsim
from sbert_ray.evaluation.tasks import ArgsimTask, Results
from sbert_ray.ray_compat import connect_ray
from sbert_ray.runs.cluster import (
    cluster_capacity,
    refuse_impossible,
    resolve_async_dev,
    runs_that_fit,
    with_async_dev,
)
from sbert_ray.runs.train_run import run_training
from sbert_ray.tracking.mlflow_run import RunTracker, resolve_tracking_uri
from sbert_ray.training.storage import is_remote

logger = logging.getLogger(__name__)
FOLD_TEST_ENTRY = "test"  # the fold's held-out pairs, scored as the final task pairs:<run dir>/test.jsonl


def finetune_config(model_ref: str, data_dir=None, pooling: str | None = None, overrides: Sequence[str] = ()):
    """The TrainConfig every fold starts from: the model as given, one regression stage with the paper's settings
    (batch 16, AdamW 2e-5, 10% warm-up, 1 epoch), then the caller's key=value overrides (a step budget:
    ``stages.0.max_steps=20``; cluster scale: ``scaling.num_workers=4``)."""
    base = [f"model.name={model_ref}", "stages.0.objective=regression"]
    base += [f"model.pooling={pooling}"] if pooling else []
    base += [f"data_dir={data_dir}"] if data_dir else []
    config = load_config(None, [*base, *overrides])
    if is_remote(config.checkpoint.storage_path):
        raise ConfigError(
            f"checkpoint.storage_path={config.checkpoint.storage_path}: fine-tuning writes each fold's pairs under "
            "it for the workers to read, so it must be a local or shared folder (e.g. NFS), not object storage"
        )
    for key in ("dev_task", "dev_tasks"):  # fold_config sets each fold's dev pairs, which a dev task replaces
        if getattr(config.evaluation, key):
            raise ConfigError(
                f"evaluation.{key}: argument-similarity folds choose checkpoints on each fold's dev pairs"
            )
    return config


def finetune_argsim(task: ArgsimTask, train_config: TrainConfig, data_dir=None) -> Results:
    """The task's protocols with a fine-tuned model per fold, as flat results like ``task.run``'s."""
    records = argsim.load_argsim(task.name, data_dir, task.path)
    nested = {
        entry: argsim.average_folds(finetune_folds(task.name, folds, train_config))
        for entry, folds in argsim.protocols(task.name, records).items()
    }
    return flatten(nested, sep="/")


def finetune_folds(name: str, folds: Sequence[argsim.Fold], train_config: TrainConfig) -> dict[str, dict]:
    """{fold: scores of its fine-tuned model on its test pairs}; one Ray task per fold, each a training run (whose
    TorchTrainer requests the workers' resources, hence num_cpus=0 here), only as many at once as the cluster
    holds: a fold waiting for workers would hit Ray Train's worker-group start timeout and be retried."""
    tracking = train_config.tracking
    uri = resolve_tracking_uri(tracking.tracking_uri)
    train_config = dataclasses.replace(train_config, tracking=dataclasses.replace(tracking, tracking_uri=uri))
    # The parent run is opened before any fold starts: a fresh MLflow store or experiment must not be set up by
    # several fold tasks at once (concurrent sqlite migrations fail).
    with RunTracker(uri, tracking.experiment, run_name=f"argsim-{name}-finetune") as parent:
        connect_ray()
        refuse_impossible(train_config.scaling)
        # As a sweep's trials: dev scores off the ranks only where that costs no concurrent fold.
        async_dev, why = resolve_async_dev([train_config], cluster_capacity(), runs=None)
        logger.info(why)
        train_config = with_async_dev(train_config, async_dev)
        task = ray.remote(num_cpus=0)(_finetune_fold)
        limit = runs_that_fit([train_config])
        pending, running, scores = list(folds), {}, {}
        while pending or running:
            while pending and len(running) < limit:
                fold = pending.pop(0)
                running[task.remote(name, fold, train_config, parent.run_id)] = fold.name
            (done,), _ = ray.wait(list(running), num_returns=1)
            scores[running.pop(done)] = ray.get(done)
        per_fold = {fold.name: scores[fold.name] for fold in folds}
        parent.log_metrics(flatten(per_fold, sep="/"))
        return per_fold


def fold_config(name: str, fold: argsim.Fold, base: TrainConfig, run_dir: Path) -> TrainConfig:
    """The fold's TrainConfig: one regression stage on a JSONL file of its training pairs, its test pairs as the
    final evaluation. Files live under the checkpoint storage, which a multi-node cluster shares with every
    worker."""
    _write_pairs(fold.train, run_dir / "train.jsonl")
    _write_pairs(fold.test, run_dir / f"{FOLD_TEST_ENTRY}.jsonl")
    stage = dataclasses.replace(
        base.stages[0],
        dataset=str(run_dir / "train.jsonl"),
        columns=None,
        objective="regression",
        loss={},
        score_max=argsim.SCORE_MAX[name],
    )
    evaluation = dataclasses.replace(
        base.evaluation, final_tasks=[f"pairs:{run_dir / FOLD_TEST_ENTRY}.jsonl"], before_tasks=[]
    )
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


def _write_pairs(pairs: Sequence[TopicPair], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in pairs:
            f.write(json.dumps({"sentence1": r.sentence1, "sentence2": r.sentence2, "score": r.score}) + "\n")


def _finetune_fold(name: str, fold: argsim.Fold, base: TrainConfig, parent_run_id: str) -> dict[str, float]:
    storage = Path(base.checkpoint.storage_path).expanduser().resolve()
    run_dir = storage / f"argsim-{name}-{fold.name}-{uuid.uuid4().hex[:8]}".replace(" ", "_")
    run_dir.mkdir(parents=True)
    try:
        result = run_training(fold_config(name, fold, base, run_dir), parent_run_id=parent_run_id)
        scores = {key.removeprefix(f"{FOLD_TEST_ENTRY}/"): value for key, value in result.final.items()}
        return scores | {"train_pairs": len(fold.train)}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints of a throw-away fold model; MLflow keeps the run
