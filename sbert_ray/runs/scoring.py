"""Scoring a training run's model on a worker's resources: "before" (the configured model) and final (the last
checkpoint's model) evaluation run as one Ray task sized like a training worker, on the same footing, and their
scores come back as the task's return value (each checkpoint's dev score beside training:
``training.validation``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sbert_ray.config import ScalingConfig
from sbert_ray.evaluation.tasks import EvalTask, Results
from sbert_ray.models import SentenceEncoder
from sbert_ray.reservations import call_reserved, resources_text

ModelSource = Callable[[], SentenceEncoder]  # called where the evaluation runs, which loads the model there


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
    threads, its GPU when training used one), waiting for them at most ``scaling.resource_wait_s``."""
    device, bundle = "cuda" if scaling.use_gpu else "cpu", scaling.resources_per_worker()
    args = (load, list(tasks), data_dir, batch_size, device, scaling.threads_per_worker())
    what = f"scoring the model on one worker's {resources_text(bundle)}"
    return call_reserved(_evaluate, args, bundle, scaling.resource_wait_s, what)
