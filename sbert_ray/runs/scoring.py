"""Scoring a training run's model on a worker's resources: "before" (the configured model) and final (the last
checkpoint's model) evaluation run as one Ray task sized like a training worker, on the same footing, and their
scores come back as the task's return value."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import ray
import ray.train
import torch

from sbert_ray.config import ScalingConfig
from sbert_ray.evaluation.tasks import EvalTask, Results
from sbert_ray.models import SentenceEncoder
from sbert_ray.training.state import MODEL_DIR

ModelSource = Callable[[], SentenceEncoder]  # called where the evaluation runs, which loads the model there


def checkpoint_model(checkpoint: ray.train.Checkpoint) -> SentenceEncoder:
    """The model a training checkpoint holds (local or object storage alike)."""
    with checkpoint.as_directory() as directory:
        return SentenceEncoder.load(Path(directory) / MODEL_DIR)


def _evaluate(
    load: ModelSource, tasks: Sequence[EvalTask], data_dir: str | None, batch_size: int, device: str, threads: int
) -> Results:
    torch.set_num_threads(threads)
    encoder = load().to(device)
    results: Results = {}
    for task in tasks:
        results |= task.run(encoder, data_dir, batch_size)
    return results


def evaluate_on_worker_resources(
    load: ModelSource, tasks: Sequence[EvalTask], data_dir: str | None, batch_size: int, scaling: ScalingConfig
) -> Results:
    """Run ``tasks`` on the model ``load`` returns, in a Ray task sized like one training worker (its CPUs and
    threads, its GPU when training used one)."""
    task = ray.remote(_evaluate).options(
        num_cpus=scaling.cpus_per_worker,
        num_gpus=scaling.gpus_per_worker if scaling.use_gpu else 0,
        # Never inside the caller's placement group: a Tune trial's holds only the trial's token CPU.
        scheduling_strategy="DEFAULT",
    )
    device = "cuda" if scaling.use_gpu else "cpu"
    return ray.get(task.remote(load, list(tasks), data_dir, batch_size, device, scaling.threads_per_worker()))
