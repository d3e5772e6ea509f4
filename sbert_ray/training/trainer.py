"""The ``TorchTrainer`` of the worker loop, as every training run, sweep trial and training benchmark fits it, and
what its end says: a worker's error a restart would meet again, a NaN/inf stop."""

from __future__ import annotations

import os
import time

import ray.data
import ray.train
from ray.train.torch import TorchTrainer

from sbert_ray.evaluation.dev_score import DEV_SCORE
from sbert_ray.training.faults import EndOnDeterministicError, raised_on_a_worker
from sbert_ray.training.stage_plan import WorkerPlan
from sbert_ray.training.validation import dev_validation
from sbert_ray.training.worker import train_loop_per_worker

# Ray Train's controller polls the workers every this many seconds (Ray's default: 2) and takes one report per
# worker per poll, and a worker's ray.train.report waits until its previous report was taken (a queue of one). At
# 2 s every report point after the first stalled training for up to 2 s, and fit() saw the end up to 2 s late.
# A poll is one small actor call per worker.
CONTROLLER_POLL_S = "0.2"


def data_config() -> ray.train.DataConfig:
    """Every stage's datasets split across the workers in one fixed order (deterministic for a seed)."""
    return ray.train.DataConfig(execution_options=ray.data.ExecutionOptions(preserve_order=True))


def torch_trainer(
    plan: WorkerPlan,
    data: tuple[dict, list],
    run_config: ray.train.RunConfig,
    tracking: dict | None = None,
    validation: ray.train.ValidationConfig | None = None,
    report_gate: ray.actor.ActorHandle | None = None,
) -> TorchTrainer:
    """``plan.config.scaling.num_workers`` workers (a [min, max] range: Ray Train v2's elastic scaling policy, which
    restarts the workers at the size the cluster holds from the latest checkpoint) with their CPUs (and GPUs),
    training on ``data`` (the Ray datasets of every stage's sources and what workers need to stream them:
    ``training.stage_data.stage_datasets``); rank 0 logs to the MLflow run ``tracking`` names (``RunLogger``'s
    arguments: tracking URI, run id, spool file for metrics during outages) when one is given; ``validation``: how
    Ray Train scores checkpoints beside the workers (``evaluation.async_dev``: ``training.validation``).
    ``report_gate``: an actor rank 0 waits on after each report (a sweep trial's, ``tuning.trial_gate``).
    Call ``fit()`` right away: the workers time their first optimizer step from now."""
    scaling = plan.config.scaling
    # Read from the environment when fit() starts the controller (which passes it on); a value set by the user stays.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", CONTROLLER_POLL_S)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            # Primitives: Ray Train's controller unpickles this config too, and a TrainConfig would make it
            # import this package (and torch) while the worker processes start beside it.
            "plan": plan.to_wire(),
            "stage_data": data[1],
            "tracking": tracking,
            "report_gate": report_gate,
            "fit_started": time.time(),  # wall clock: workers may be other processes on other nodes
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=scaling.ray_num_workers(),
            use_gpu=scaling.use_gpu,
            resources_per_worker=scaling.resources_per_worker(),
            placement_strategy=scaling.placement_strategy,
        ),
        run_config=run_config,
        validation_config=validation,
        datasets=data[0],
        dataset_config=data_config(),
    )


def run_trainer(
    plan: WorkerPlan,
    data: tuple[dict, list],
    tracking: dict | None,
    callbacks: list | None = None,
    report_gate: ray.actor.ActorHandle | None = None,
) -> TorchTrainer:
    """A training run's trainer: named after the run, on its storage (same name + storage = same run: a
    resubmitted job resumes from its latest checkpoint), keeping its best checkpoints by dev score; rank 0 logs to
    the MLflow run ``tracking`` names (``RunLogger``'s arguments: metrics the store does not take wait in the spool)."""
    config = plan.config
    run_config = ray.train.RunConfig(
        name=config.name,
        storage_path=config.checkpoint.storage_path,
        failure_config=ray.train.FailureConfig(max_failures=config.checkpoint.max_failures),
        callbacks=[EndOnDeterministicError(), *(callbacks or [])],  # these fail once, whatever max_failures
        checkpoint_config=ray.train.CheckpointConfig(
            num_to_keep=config.checkpoint.keep_best, checkpoint_score_attribute=DEV_SCORE, checkpoint_score_order="max"
        ),
    )
    return torch_trainer(plan, data, run_config, tracking, dev_validation(plan, tracking, report_gate), report_gate)


def fit(trainer: TorchTrainer) -> ray.train.Result:
    """``trainer.fit()``; an error a restart would meet again (``training.faults``) raised as its one line, a
    NaN/inf stop as ``TrainingDiverged``."""
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as err:
        fault = raised_on_a_worker(err)
        if fault is None:
            raise
        raise fault from None  # Ray's message around it is the worker's traceback, which Ray's logs keep
    check_diverged(result)
    return result


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the run stopped before writing a checkpoint from the broken weights."""


def check_diverged(result: ray.train.Result) -> None:
    """Raise TrainingDiverged, naming the step and the last good checkpoint, when the workers stopped on a NaN/inf
    loss (they return that, rather than fail: Ray would restart them from the checkpoint into the same NaN)."""
    diverged = (result.return_value or {}).get("diverged")
    if diverged is None:
        return
    if result.checkpoint is None:
        last_good = "no checkpoint was written before it"
    else:
        last_good = f"last good checkpoint: {result.checkpoint.path} (step {result.metrics['global_step']})"
    raise TrainingDiverged(
        f"training stopped: the loss was {diverged['loss']} at step {diverged['step']} (stage {diverged['stage']}); "
        f"{last_good}"
    )
