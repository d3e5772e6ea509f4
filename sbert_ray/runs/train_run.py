"""One training run: check the config, open the MLflow run, score the model "before", fit the ``TorchTrainer``,
keep the final model, score it, log everything. ``sbert-ray train``, every sweep trial and every
argument-similarity fold run through ``run_training``, which reads as its phases:

    preflight   paths made absolute; the run's lease (runs.run_lease: one process per run); its record
                (runs.record): new, resumed, finished or refused; then the run resolved once (runs.plan: tasks
                parsed, tracking store, data, model checked, sources counted, step counts, the workers' resources
                and paths)                                                     (no MLflow yet; nothing trained)
    open_run    MLflow run (params, tags, config.yaml; the tracking URI masked everywhere), record written
    (stages)    each stage's sources as lazy Ray datasets: read, tokenised and split as the workers stream them
                (training.stage_data; counted in preflight)
    score       "before" tasks: a Ray task on a worker's resources, on the configured model (runs.scoring)
    fit         TorchTrainer(train_loop_per_worker, plan.worker.to_wire()) .fit() -> Result; divergence check
    finish      final model swapped into output_dir; final tasks on the checkpoint's model; model card, artifacts,
                registry, plots -> TrainResult (scores from Ray, never read back from MLflow); record finished

MLflow outages: rank 0 keeps metrics the store does not take in a file (``metrics_spool``) and sends them when it
answers again; after training the driver waits up to ``tracking.wait_s`` for it, then logs the rest and ends the
run FINISHED.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray
import ray.train

from sbert_ray.config import TrainConfig, dump_yaml, flatten, to_dict
from sbert_ray.evaluation.tasks import Results
from sbert_ray.files import check_folder
from sbert_ray.progress import quiet
from sbert_ray.runs import record
from sbert_ray.runs.final_model import log_final_model, model_card_info, save_final_model
from sbert_ray.runs.plan import RunPlan, absolute_paths, plan_run, tracking_store
from sbert_ray.runs.progress_lines import TrainingProgress
from sbert_ray.runs.run_lease import run_lease
from sbert_ray.runs.scoring import score_before, score_final
from sbert_ray.tracking.errors import TrackingError
from sbert_ray.tracking.mlflow_run import NAME_TAG, RunTracker, environment_tags, plot_curves
from sbert_ray.training.stage_data import stage_datasets
from sbert_ray.training.trainer import TrainingDiverged, fit, run_trainer


@dataclass
class TrainResult:
    run_id: str
    tracking_uri: str  # masked
    artifact_uri: str  # masked
    model_dir: str
    before: Results  # flat "<entry>/<metric>" scores of evaluation.before_tasks
    final: Results  # ... of evaluation.final_tasks, on the final model
    headlines: dict[str, tuple[str, float]]  # final entry -> (primary metric, value)
    metrics: dict  # the last checkpoint's report: global_step, dev_score, ...
    already_finished: bool = False  # the run had finished with this config before: nothing was trained or logged
    # before entry -> (primary metric, value); empty in the record of a run finished by an older sbert-ray
    before_headlines: dict[str, tuple[str, float]] = dataclasses.field(default_factory=dict)


def run_training(
    config: TrainConfig,
    parent_run_id: str | None = None,
    callbacks: list | None = None,
    restart: bool = False,
    progress: bool = True,
    report_gate: ray.actor.ActorHandle | None = None,
) -> TrainResult:
    """Run one training job, resume it, or (finished before with this config) return its result without training;
    ``restart`` trains anew, keeping the old run folder aside (see ``runs.record``). Under a sweep,
    ``parent_run_id`` nests the MLflow run under the sweep's run, ``callbacks`` go to the ``TorchTrainer`` and rank
    0 waits on ``report_gate`` after each report (a sweep trial's ``tuning.trial_gate``). ``progress`` prints a
    line per report point (off under --quiet). Another process running the same name on the same storage is
    refused (``runs.run_lease``)."""
    config, tasks = absolute_paths(config)
    store, run_dir = tracking_store(config), f"{config.checkpoint.storage_path}/{config.name}"
    check_folder(config.checkpoint.storage_path, "checkpoint.storage_path")  # before the lease is written there
    with run_lease(run_dir):
        previous = record.previous_run(run_dir, config, str(store), restart)
        if previous is not None and previous.status == "finished" and not restart:
            return _finished(previous.result)
        plan = plan_run(config, tasks, store, run_dir, previous, restart)
        callbacks = list(callbacks or [])
        if progress and not quiet():
            callbacks.append(TrainingProgress(list(plan.steps)))
        return _train(plan, parent_run_id, callbacks, report_gate)


def _finished(saved: dict) -> TrainResult:
    """The result a finished run's record keeps (JSON: its pairs came back as lists)."""
    pairs = {key: {k: tuple(v) for k, v in saved.get(key, {}).items()} for key in ("headlines", "before_headlines")}
    return TrainResult(**saved | pairs | {"already_finished": True})


def _train(plan: RunPlan, parent_run_id: str | None, callbacks: list, report_gate=None) -> TrainResult:
    """The phases after preflight, in the run's MLflow run; the record is marked finished at the end."""
    trained = False
    try:
        with open_run(plan, parent_run_id) as (tracker, run_record):
            data = stage_datasets(plan.config, list(plan.sources), list(plan.rows))
            before = score_before(plan, tracker)
            result, train_seconds = fit_run(plan, data, tracker, run_record, callbacks, report_gate)
            save_final_model(
                result.checkpoint,
                Path(plan.config.output_dir),
                run=plan.config.name,
                run_dir=plan.run_dir,
                mlflow_run_id=tracker.run_id,
            )
            trained = True
            train_result = finish(plan, result, train_seconds, before, tracker)
    except TrackingError as err:
        if not trained:
            raise
        raise TrackingError(
            f"{err}. Training finished: the final model is at {plan.config.output_dir}. Run the same command again "
            "when the tracking store answers: it resumes this run (no training steps) and logs what is missing"
        ) from None
    record.finish(run_record, dataclasses.asdict(train_result), plan.run_dir)
    return train_result


@contextlib.contextmanager
def open_run(plan: RunPlan, parent_run_id: str | None) -> Iterator[tuple[RunTracker, record.RunRecord]]:
    """The run's MLflow run (new, or the one ``plan.previous`` resumes) with its params, tags and config.yaml,
    and its record written to the run folder. The plan's config shows its tracking URI masked already."""
    config = plan.config
    with RunTracker(
        plan.store.uri,
        config.tracking.experiment,
        run_name=config.tracking.run_name or config.name,
        parent_run_id=parent_run_id,
        run_id=plan.previous.mlflow_run_id if plan.previous else None,
        wait_s=config.tracking.wait_s,
    ) as tracker:
        tracker.spool = Path(plan.tracking(tracker.run_id)["spool"]).expanduser()  # flushed after training
        run_record = plan.previous or record.new_record(config, tracker.run_id, str(plan.store))
        run_record.save(plan.run_dir)
        print(f"MLflow: {plan.store}  run {tracker.run_id}{' (resumed)' if tracker.resumed else ''}", flush=True)
        print(f"MLflow artifacts: {tracker.artifact_store}", flush=True)
        tracker.log_params(flatten(to_dict(config)))
        tracker.set_tags(environment_tags() | {NAME_TAG: plan.run_dir})
        tracker.log_text(dump_yaml(config), "config.yaml")
        yield tracker, run_record


def fit_run(
    plan: RunPlan,
    data: tuple[dict[str, ray.data.Dataset], list],
    tracker: RunTracker,
    run_record: record.RunRecord,
    callbacks: list,
    report_gate: ray.actor.ActorHandle | None = None,
) -> tuple[ray.train.Result, float]:
    """The ``TorchTrainer`` fitted (resuming from the run's latest checkpoint); a NaN/inf stop is recorded and
    raised, an error a restart would meet again (``training.faults``) raised as its one line. Returns the result
    and the seconds ``fit`` took."""
    start = time.perf_counter()
    trainer = run_trainer(plan.worker, data, plan.tracking(tracker.run_id), callbacks, report_gate)
    try:
        result = fit(trainer)
    except TrainingDiverged as err:
        record.diverged(run_record, str(err), plan.run_dir)
        raise
    return result, time.perf_counter() - start


def finish(
    plan: RunPlan, result: ray.train.Result, train_seconds: float, before: Results, tracker: RunTracker
) -> TrainResult:
    """The final model (already in ``output_dir``) scored, carded, logged and registered; the curves plotted."""
    final = score_final(plan, result, tracker)
    log_final_model(plan, model_card_info(plan, result.metrics, train_seconds, final, tracker), tracker)
    tracker.flush(wait_s=plan.config.tracking.wait_s)  # the plots read the metric history back
    dev_metric = plan.tasks.dev.metric
    plot_curves(tracker, {"train/loss": "plots/loss.png", f"dev/{dev_metric}": f"plots/dev_{dev_metric}.png"})
    return TrainResult(
        run_id=tracker.run_id,
        tracking_uri=str(plan.store),
        artifact_uri=str(tracker.artifact_store),
        model_dir=plan.config.output_dir,
        before=before,
        final=final,
        headlines=plan.tasks.final.primary_scores(final),
        metrics=dict(result.metrics),
        before_headlines=plan.tasks.before.primary_scores(before),
    )
