"""Each checkpoint's dev score beside training (``evaluation.async_dev``): Ray Train's checkpoint validation runs
``score_dev`` in a Ray task on ``evaluation.dev_resources`` (a CPU, or a share of a GPU) while the workers go on;
with ``evaluation.dev_workers`` N, its encoding over N scorers of those resources each (a large dev corpus)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import ray
import ray.train
import torch

from sbert_ray.config import EvalConfig, from_dict, to_dict
from sbert_ray.data.readers import resolve_data_dir
from sbert_ray.evaluation.dev_score import DEV_SCORE, DevScorer, DevSpec
from sbert_ray.evaluation.encoder_pool import RayEncoder
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.cross_encoder import CrossEncoderModel
from sbert_ray.models.model_type import ModelType
from sbert_ray.reservations import call_reserved, resources_text
from sbert_ray.tracking.errors import TrackingError
from sbert_ray.training.stage_plan import WorkerPlan
from sbert_ray.training.state import MODEL_DIR

log = logging.getLogger(__name__)


def checkpoint_model(
    checkpoint: ray.train.Checkpoint, model_type: ModelType = "bi_encoder"
) -> SentenceEncoder | CrossEncoderModel:
    """The model a training checkpoint holds (local or object storage alike), of ``model_type`` (``model.type``)."""
    with checkpoint.as_directory() as directory:
        if model_type == "cross_encoder":
            return CrossEncoderModel.load(Path(directory) / MODEL_DIR)
        return SentenceEncoder.load(Path(directory) / MODEL_DIR)


def dev_validation(
    plan: WorkerPlan, tracking: dict | None, report_gate: ray.actor.ActorHandle | None = None
) -> ray.train.ValidationConfig | None:
    """With ``evaluation.async_dev`` (resolved to true by the driver): Ray Train's checkpoint validation, which
    scores each checkpoint a report asks it to (``ray.train.report(..., validation=ValidationTaskConfig({"step":
    ...}))``) with ``score_dev`` in a Ray task on ``evaluation.dev_resources`` (``score_dev_when_free``), one at a
    time, and merges the returned ``dev_score`` into that checkpoint's metrics (keep_best ranks it then; until then
    Ray keeps it). ``tracking``: the run's (see ``RunLogger``), where each score is logged at its checkpoint's step.
    ``report_gate``: a sweep trial's (``tuning.trial_gate``), told each score for the trial's next report to Tune.
    The dev task and metric are the ones ``plan`` carries (resolved by the driver), as primitives."""
    config = plan.config
    if config.evaluation.async_dev is not True:
        return None
    resources = config.evaluation.dev_resources
    dev = {
        "evaluation": to_dict(config.evaluation),
        "data_dir": config.data_dir,
        "spec": plan.dev.to_wire(),
        "model_type": config.model.type,
    }
    place = {
        "device": "cuda" if resources.get("GPU") else "cpu",
        "threads": max(1, math.ceil(resources["CPU"])),
        "resources": resources,  # reserved for each score (``score_dev_when_free``), per scorer
        "workers": config.evaluation.dev_workers,
        "wait_s": config.scaling.resource_wait_s,
    }
    if tracking:  # straight to the store (rank 0's spool file is rank 0's), waiting out an outage as the driver does
        tracking = {"tracking_uri": tracking["tracking_uri"], "run_id": tracking["run_id"]}
        tracking["wait_s"] = config.tracking.wait_s
    return ray.train.ValidationConfig(
        score_dev_when_free,
        ray.train.ValidationTaskConfig({"dev": dev, "place": place, "tracking": tracking, "gate": report_gate}),
        # Starts at once, holding nothing, outside the caller's placement group (a Tune trial's holds its token CPU).
        ray_remote_kwargs={"num_cpus": 0, "scheduling_strategy": "DEFAULT"},
    )


def score_dev_when_free(
    checkpoint: ray.train.Checkpoint,
    step: int,
    dev: dict,
    place: dict,
    tracking: dict | None,
    gate: ray.actor.ActorHandle | None,
) -> dict:
    """``score_dev`` on ``place["resources"]`` (``evaluation.dev_workers`` scorers of them: their placement group),
    waited for at most ``place["wait_s"]`` (``scaling.resource_wait_s``); Ray Train's own task would wait for ever
    while other work holds them. Past the wait the validation fails with ``ResourcesBusy`` naming what is missing
    (Ray Train logs it; that checkpoint goes unscored, training goes on). A sweep trial's gate gets the score, or
    None for one that failed (its next report to Tune goes without)."""
    resources, arguments = place["resources"], (checkpoint, step, dev, place, tracking)
    what = f"evaluation.async_dev: the dev score of step {step} on {resources_text(resources)}"
    scored = None
    try:
        if place["workers"] > 1:  # the scorers reserve their own resources
            scored = score_dev(*arguments)
        else:
            scored = call_reserved(score_dev, arguments, resources, place["wait_s"], what)
        return scored
    finally:
        if gate is not None:
            gate.dev_scored.remote(step, scored and scored[DEV_SCORE])


def score_dev(checkpoint: ray.train.Checkpoint, step: int, dev: dict, place: dict, tracking: dict | None) -> dict:
    """The dev score of a checkpoint's model (``evaluation.dev_task``/``dev_metric`` or ``dev_tasks``; by default the
    STSb dev Spearman x100), logged to the run as ``dev/<metric>`` (and each dev task's) at ``step``; a store that
    stays away for the tracking section's wait_s loses that point, the score still counts."""
    evaluation, spec = from_dict(EvalConfig, dev["evaluation"]), DevSpec.from_wire(dev["spec"])
    scorer = DevScorer(evaluation, resolve_data_dir(dev["data_dir"]), spec)
    model = checkpoint_model(checkpoint, dev["model_type"])
    if place["workers"] > 1:  # whole batches dealt round-robin to the scorers (``RayEncoder``)
        keys = ("evaluation.dev_workers", "scaling.resource_wait_s")  # named if the scorers are not free in time
        with RayEncoder(
            model, place["workers"], resource_wait_s=place["wait_s"], replica=place["resources"], keys=keys
        ) as pool:
            scores = scorer.scores(pool)
    else:
        torch.set_num_threads(place["threads"])
        scores = scorer.scores(model.to(place["device"]))
    score = scores[scorer.key]
    if tracking:
        # Here: the final scores' task imports this module too (checkpoint_model), where nothing is logged and
        # importing mlflow would cost its start a second or more.
        from sbert_ray.tracking.mlflow_run import RunLogger

        try:
            RunLogger(**tracking).log_metrics(scores, step=step)
        except TrackingError as err:
            log.warning("dev score %.2f of step %d not logged: %s", score, step, err)
    return {DEV_SCORE: score}
