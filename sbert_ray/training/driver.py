"""The driver of one training run: check the config, open the MLflow run, fit a ``TorchTrainer``, close the run."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import ray
import ray.train
from ray.train.torch import TorchTrainer

from sbert_ray.config import ConfigError, TrainConfig, dump_yaml, flatten, to_dict
from sbert_ray.data.readers import load_records, resolve_data_dir
from sbert_ray.evaluation import suite
from sbert_ray.models.resolve import resolve_model_ref
from sbert_ray.tracking.mlflow_run import RunTracker, environment_tags, plot_curves, resolve_tracking_uri
from sbert_ray.training.batches import load_training_records, texts_and_labels
from sbert_ray.training.storage import download_final_model, is_remote, resolve_storage
from sbert_ray.training.worker import load_encoder, train_loop_per_worker


@dataclass
class TrainResult:
    run_id: str
    tracking_uri: str
    artifact_uri: str
    model_dir: str
    before: dict[str, dict]
    final: dict[str, float]  # dataset -> the final model's primary metric (Spearman x100 for STS)


def prepare(config: TrainConfig) -> TrainConfig:
    """Fill in defaults that depend on where the run lives, and check data and model before Ray starts."""
    storage = resolve_storage(config.checkpoint.storage_path)
    output_dir = config.output_dir
    if output_dir is None and not is_remote(storage):  # remote storage: the driver downloads it after training
        output_dir = f"{storage}/{config.name}/final-model"
    config = dataclasses.replace(
        config,
        checkpoint=dataclasses.replace(config.checkpoint, storage_path=storage),
        output_dir=str(Path(output_dir).expanduser().resolve()) if output_dir else None,
    )
    if config.data_dir and not Path(config.data_dir).is_dir():
        raise ConfigError(f"data_dir: {config.data_dir} is not a directory")
    data_dir = resolve_data_dir(config.data_dir)
    if not config.model.name.startswith("random:"):
        resolve_model_ref(config.model.name)  # a missing folder or unknown id fails here
    for i, stage in enumerate(config.stages):  # reading validates every row and the objective/record match
        try:
            texts_and_labels(load_training_records(stage, data_dir), stage)
        except ValueError as err:
            raise ConfigError(f"stages.{i}: {err}") from None
    load_records(config.evaluation.dev_dataset, config.evaluation.dev_split, data_dir)
    suite.parse_tasks(",".join(config.evaluation.final_tasks + config.evaluation.before_tasks) or "sts")
    return config


def build_trainer(config: TrainConfig, tracking_uri: str, run_id: str, callbacks: list | None = None) -> TorchTrainer:
    scaling = config.scaling
    resources = {
        "CPU": scaling.cpus_per_worker,
        **({"GPU": scaling.gpus_per_worker} if scaling.use_gpu else {}),
    }
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": to_dict(config), "tracking_uri": tracking_uri, "run_id": run_id},
        scaling_config=ray.train.ScalingConfig(
            num_workers=scaling.num_workers,
            use_gpu=scaling.use_gpu,
            resources_per_worker=resources,
            placement_strategy=scaling.placement_strategy,
        ),
        run_config=ray.train.RunConfig(
            # Same name + storage = same run: a resubmitted job resumes from its latest checkpoint.
            name=config.name,
            storage_path=config.checkpoint.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=config.checkpoint.max_failures),
            callbacks=callbacks,
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=config.checkpoint.keep_best,
                checkpoint_score_attribute="dev_spearman",
                checkpoint_score_order="max",
            ),
        ),
    )


def connect_ray() -> None:
    """Join the cluster in RAY_ADDRESS (set under `ray job submit`), else start a fresh local one: never whatever
    cluster happens to be recorded in /tmp/ray, which may be stale."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local")


def runs_that_fit(configs: list[TrainConfig], driver_cpus: float = 0.0) -> int:
    """How many of these training runs the connected Ray cluster can hold at once, sized by the largest; each
    run's own driver takes ``driver_cpus``. Used to bound sweep trials and argument-similarity folds."""
    available = ray.cluster_resources()
    cpus = max(c.scaling.num_workers * c.scaling.cpus_per_worker for c in configs) + driver_cpus
    fits = [available.get("CPU", 0) // cpus]
    gpus = max((c.scaling.num_workers * c.scaling.gpus_per_worker for c in configs if c.scaling.use_gpu), default=0)
    if gpus:
        fits.append(available.get("GPU", 0) // gpus)
    return max(1, int(min(fits)))


def train(config: TrainConfig, parent_run_id: str | None = None, callbacks: list | None = None) -> TrainResult:
    """Run one training job. Under a sweep, ``parent_run_id`` nests the MLflow run under the sweep's run and
    ``callbacks`` (e.g. Tune's ``TuneReportCallback``) go to the ``TorchTrainer``."""
    config = prepare(config)
    tracking_uri = resolve_tracking_uri(config.tracking.tracking_uri)
    tracker = RunTracker(
        tracking_uri,
        config.tracking.experiment,
        run_name=config.tracking.run_name or config.name,
        resume_key=f"{config.checkpoint.storage_path}/{config.name}",
        parent_run_id=parent_run_id,
    )
    print(f"MLflow: {tracking_uri}  run {tracker.run_id}{' (resumed)' if tracker.resumed else ''}", flush=True)
    print(f"MLflow artifacts: {tracker.artifact_uri}", flush=True)
    ok = False
    try:
        tracker.log_params(flatten(to_dict(config)))
        tracker.set_tags(environment_tags())
        tracker.log_text(dump_yaml(config), "config.yaml")
        data_dir = resolve_data_dir(config.data_dir)
        before = {}
        if config.evaluation.before_tasks:
            before = suite.run_tasks(load_encoder(config.model, config.seed), config.evaluation.before_tasks, data_dir)
            tracker.log_metrics(suite.metric_items(before, "before"))
        connect_ray()
        result = build_trainer(config, tracking_uri, tracker.run_id, callbacks).fit()
        model_dir = config.output_dir
        if is_remote(config.checkpoint.storage_path):  # rank 0 may have run on another machine
            model_dir = download_final_model(
                result.checkpoint, config.output_dir or f"~/sbert-ray/models/{config.name}"
            )
        plot_curves(tracker, {"train/loss": "plots/loss.png", "dev/spearman_cosine": "plots/dev_spearman.png"})
        ok = True
        return TrainResult(
            run_id=tracker.run_id,
            tracking_uri=tracking_uri,
            artifact_uri=tracker.artifact_uri,
            model_dir=model_dir,
            before=before,
            final=suite.primary_scores(tracker.logged_results("final")),
        )
    finally:
        tracker.end(ok)
