"""The Ray side of ``sbert-ray bench train``: our worker loop as a Ray Train run on the connected cluster, and
sentence-transformers' trainer as a Ray task with one worker's resources. Imported only for cluster runs, so that
the in-process benchmark runs where Ray is not installed."""

from __future__ import annotations

from collections.abc import Callable

import ray
import ray.train

from sbert_ray.config import ConfigError, TrainConfig
from sbert_ray.training.sources import stage_sources
from sbert_ray.training.stage_data import count_stages, stage_datasets
from sbert_ray.training.stage_plan import WorkerPlan
from sbert_ray.training.trainer import torch_trainer
from sbert_ray.training.validation import dev_validation


def check_cluster(device: str) -> None:
    if device == "cuda" and not ray.cluster_resources().get("GPU"):
        raise ConfigError("--device cuda: the Ray cluster has no GPU")


def ours(config: TrainConfig) -> dict:
    """``train_loop_per_worker`` on ``config.scaling.num_workers`` workers, streaming the stage's data as a training
    run does (with ``evaluation.async_dev`` its checkpoints scored beside it, no MLflow run); its summary
    (``Result.return_value``)."""
    scaling = config.scaling
    run_config = ray.train.RunConfig(
        name=f"{scaling.num_workers}x{scaling.torch_threads}",
        storage_path=config.checkpoint.storage_path,
        failure_config=ray.train.FailureConfig(max_failures=0),
    )
    sources = [stage_sources(stage, i) for i, stage in enumerate(config.stages)]
    rows = count_stages(config, sources)
    data = stage_datasets(config, sources, rows)
    plan = WorkerPlan.of(config, rows)
    trainer = torch_trainer(plan, data, run_config, validation=dev_validation(plan, None))
    return trainer.fit().return_value


def run_as_task(function: Callable[..., dict], *args, num_cpus: int, num_gpus: int) -> dict:
    """``function(*args)`` as a Ray task with these resources, wherever the cluster has room."""
    task = ray.remote(function).options(num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy="DEFAULT")
    return ray.get(task.remote(*args))
