"""Scoring a training run's model on a worker's resources: "before" (the configured model) and final (the last
checkpoint's model) evaluation run as one Ray task sized like a training worker, on the same footing, and their
scores come back as the task's return value (each checkpoint's dev score beside training:
``training.validation``)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sbert_ray.config import ScalingConfig, to_dict
from sbert_ray.evaluation.results import nest
from sbert_ray.evaluation.tasks import EvalTask, Results
from sbert_ray.models import SentenceEncoder, load_encoder
from sbert_ray.models.teachers import Teacher, load_teacher
from sbert_ray.reservations import call_reserved, resources_text
from sbert_ray.training.state import MODEL_DIR
from sbert_ray.training.validation import checkpoint_model

if TYPE_CHECKING:  # not at run time: Ray's processes unpickle this module's task, and the plan brings MLflow
    import ray.train

    from sbert_ray.runs.plan import RunPlan
    from sbert_ray.tracking.mlflow_run import RunLogger

# Called where the evaluation runs, which loads the model there (a reranker's run: the reranker, a teacher).
ModelSource = Callable[[], SentenceEncoder | Teacher]


def _evaluate(
    load: ModelSource,
    tasks: Sequence[EvalTask],
    data_dir: str | None,
    batch_size: int,
    device: str,
    threads: int,
    first_stage: str | None,
) -> Results:
    torch.set_num_threads(threads)
    model = load().to(device)
    if first_stage is None:
        scored = (task.run(model, data_dir, batch_size) for task in tasks)
    else:  # a reranker's rerank: tasks: the first stage retrieves, the model reorders its candidates
        encoder = load_encoder(first_stage).to(device)
        scored = (task.run(encoder, data_dir, batch_size, reranker=model) for task in tasks)
    results: Results = {}
    for task_results in scored:
        results |= task_results
    return results


def evaluate_on_worker_resources(
    load: ModelSource,
    tasks: Sequence[EvalTask],
    data_dir: str | None,
    batch_size: int,
    scaling: ScalingConfig,
    first_stage: str | None = None,
) -> Results:
    """Run ``tasks`` on the model ``load`` returns (a reranker's rerank: tasks: on ``first_stage``'s candidates),
    in a Ray task sized like one training worker (its CPUs and threads, its GPU when training used one), waiting
    for them at most ``scaling.resource_wait_s``."""
    device, bundle = "cuda" if scaling.use_gpu else "cpu", scaling.resources_per_worker()
    args = (load, list(tasks), data_dir, batch_size, device, scaling.threads_per_worker(), first_stage)
    what = f"scoring the model on one worker's {resources_text(bundle)}"
    return call_reserved(_evaluate, args, bundle, scaling.resource_wait_s, what)


def score_before(plan: RunPlan, tracker: RunLogger) -> Results:
    """``evaluation.before_tasks`` on the configured model, logged as ``before/<entry>/<metric>``."""
    if not plan.tasks.before:
        return {}
    config = plan.config
    load = functools.partial(load_encoder, **to_dict(config.model), seed=config.seed)
    before = _score(plan, load, plan.tasks.before)
    tracker.log_metrics({f"before/{key}": value for key, value in before.items()})
    return before


def score_final(plan: RunPlan, result: ray.train.Result, tracker: RunLogger) -> Results:
    """``evaluation.final_tasks`` on the last checkpoint's model, logged at the last step and as evaluation.json."""
    if not plan.tasks.final:
        return {}
    reranker = plan.config.model.type == "cross_encoder"  # scored as sbert-ray eval --reranker loads it
    load = functools.partial(checkpoint_reranker if reranker else checkpoint_model, result.checkpoint)
    final = _score(plan, load, plan.tasks.final)
    tracker.log_metrics({f"final/{key}": value for key, value in final.items()}, step=result.metrics["global_step"])
    tracker.log_dict(nest(final), "evaluation.json")
    return final


def _score(plan: RunPlan, load: ModelSource, tasks: Sequence[EvalTask]) -> Results:
    config, evaluation = plan.config, plan.config.evaluation
    return evaluate_on_worker_resources(
        load, tasks, config.data_dir, evaluation.batch_size, config.scaling, evaluation.first_stage
    )


def checkpoint_reranker(checkpoint: ray.train.Checkpoint) -> Teacher:
    """The reranker a training checkpoint holds, as sentence-transformers' CrossEncoder loads its folder."""
    with checkpoint.as_directory() as directory:
        return load_teacher(str(Path(directory) / MODEL_DIR))
