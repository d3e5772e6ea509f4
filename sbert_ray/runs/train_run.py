"""One training run: check the config, open the MLflow run, score the model "before", fit the ``TorchTrainer``,
keep the final model, score it, log everything. ``sbert-ray train``, every sweep trial and every
argument-similarity fold run through ``run_training``, which reads as its phases:

    preflight   paths made absolute and evaluation tasks parsed (once: the ``TrainPlan``); the run's lease
                (runs.run_lease: one process per run); its record (runs.record): new, resumed, finished or refused;
                tracking store reachable; data, model, tasks checked; Ray: the workers' resources refused if the
                cluster can never hold them                                    (no MLflow yet; nothing trained)
    open_run    MLflow run (params, tags, config.yaml; the tracking URI masked everywhere), record written
    (stages)    each stage's sources as lazy Ray datasets: read, tokenised and split as the workers stream them
                (training.stage_data; counted in preflight)
    score       "before" tasks: a Ray task on a worker's resources, on the configured model (runs.scoring)
    fit         TorchTrainer(train_loop_per_worker, the config as a plain dict) .fit() -> Result; divergence check
    finish      final model swapped into output_dir; final tasks on the checkpoint's model; model card, artifacts,
                registry, plots -> TrainResult (scores from Ray, never read back from MLflow); record finished

MLflow outages: rank 0 keeps metrics the store does not take in a file (``metrics_spool``) and sends them when it
answers again; after training the driver waits up to ``tracking.wait_s`` for it, then logs the rest and ends the
run FINISHED.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import ray
import ray.train
from ray.train.torch import TorchTrainer

from sbert_ray.config import ConfigError, EvalConfig, StageConfig, TrainConfig, dump_yaml, flatten, to_dict
from sbert_ray.data.readers import check_available, resolve_data_dir
from sbert_ray.data.records import DataError
from sbert_ray.evaluation.dev_score import DEV_SCORE, DevSpec, dev_spec
from sbert_ray.evaluation.results import nest
from sbert_ray.evaluation.tasks import EvalTask, Results, check_tasks, parse_tasks, primary_scores
from sbert_ray.files import check_folder
from sbert_ray.models import check_model, load_encoder
from sbert_ray.models.model_card import ModelCardInfo, StageInfo, write_model_card
from sbert_ray.progress import quiet
from sbert_ray.ray_compat import connect_ray
from sbert_ray.runs import owned_paths, record
from sbert_ray.runs.cluster import check_resources, input_errors_unwrapped, refuse_unshared_paths
from sbert_ray.runs.progress_lines import TrainingProgress
from sbert_ray.runs.run_lease import run_lease
from sbert_ray.runs.scoring import ModelSource, evaluate_on_worker_resources
from sbert_ray.tracking.errors import TrackingError
from sbert_ray.tracking.mlflow_run import (
    NAME_TAG,
    RunLogger,
    RunTracker,
    environment_tags,
    plot_curves,
    resolve_tracking_uri,
)
from sbert_ray.tracking.model_registry import log_sentence_transformer, model_uri
from sbert_ray.tracking.store import check_reachable, redact_uri, warn_if_password
from sbert_ray.training.faults import EndOnDeterministicError, raised_on_a_worker
from sbert_ray.training.sources import Source, is_path, known_rows, stage_sources
from sbert_ray.training.stage_data import StageData, count_stages, planned_steps, stage_datasets
from sbert_ray.training.state import MODEL_DIR
from sbert_ray.training.storage import is_remote, resolve_storage
from sbert_ray.training.trainer import torch_trainer
from sbert_ray.training.validation import checkpoint_model, dev_validation

logger = logging.getLogger(__name__)
METRICS_SPOOL = "mlflow_pending_metrics.jsonl"  # in the run folder: metrics waiting for the tracking store


@dataclass
class TrainResult:
    run_id: str
    tracking_uri: str  # masked when the run had already finished (read back from its record)
    artifact_uri: str
    model_dir: str
    before: Results  # flat "<entry>/<metric>" scores of evaluation.before_tasks
    final: Results  # ... of evaluation.final_tasks, on the final model
    headlines: dict[str, tuple[str, float]]  # final entry -> (primary metric, value)
    metrics: dict  # the last checkpoint's report: global_step, dev_score, ...
    already_finished: bool = False  # the run had finished with this config before: nothing was trained or logged


def absolute_paths(config: TrainConfig) -> TrainConfig:
    """Everything that depends on this process made absolute: the data folder ($SBERT_RAY_DATA_DIR), the tracking
    URI ($MLFLOW_TRACKING_URI), and every path (storage, output, user data files, a local model folder, the files of
    evaluation tasks) against the working directory. Ray Train workers and Tune trials run in other directories."""
    if config.data_dir and not Path(config.data_dir).expanduser().is_dir():
        raise ConfigError(f"data_dir: {config.data_dir} is not a directory")
    data_dir = resolve_data_dir(config.data_dir)
    model, evaluation = config.model, config.evaluation
    return dataclasses.replace(
        config,
        data_dir=str(data_dir.resolve()) if data_dir else None,
        output_dir=_absolute(config.output_dir) if config.output_dir else None,
        model=dataclasses.replace(model, name=_absolute(model.name) if _is_folder(model.name) else model.name),
        stages=[_absolute_data(stage) for stage in config.stages],
        evaluation=dataclasses.replace(
            evaluation,
            before_tasks=_absolute_tasks(evaluation, "before_tasks"),
            final_tasks=_absolute_tasks(evaluation, "final_tasks"),
            dev_task=_absolute_dev_task(evaluation),
        ),
        checkpoint=dataclasses.replace(config.checkpoint, storage_path=resolve_storage(config.checkpoint.storage_path)),
        tracking=dataclasses.replace(config.tracking, tracking_uri=resolve_tracking_uri(config.tracking.tracking_uri)),
    )


def _absolute_dev_task(evaluation: EvalConfig) -> str | None:
    """``evaluation.dev_task`` with its files made absolute, once the task and ``dev_metric`` are known to exist."""
    task = dev_spec(evaluation).task
    return task.absolute_spec() if task else None


def _absolute_tasks(evaluation: EvalConfig, key: str) -> list[str]:
    """``evaluation.<key>`` parsed (an unknown task is named with its key) and its files made absolute."""
    return [task.absolute_spec() for task in parse_tasks(getattr(evaluation, key), key=f"evaluation.{key}")]


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _absolute_data(stage: StageConfig) -> StageConfig:
    """The stage's local data paths made absolute (object-storage URIs and registered names stay)."""
    local = lambda spec: _absolute(spec) if is_path(spec) and "://" not in spec else spec  # noqa: E731
    datasets = stage.datasets and [dataclasses.replace(d, path=d.path and local(d.path)) for d in stage.datasets]
    return dataclasses.replace(stage, dataset=local(stage.dataset), datasets=datasets)


def _is_folder(name: str) -> bool:
    return not name.startswith("random:") and Path(name).expanduser().is_dir()


def worker_paths(config: TrainConfig) -> dict[str, str]:
    """The local paths (absolute) the training workers read or write, by key: a model folder (every worker loads
    it), the data folder (rank 0 scores the dev set from it, read tasks read registered datasets from it), the
    stages' data files (read by Ray Data tasks on any node), checkpoint storage (every worker reports to it)."""
    paths = {"model.name": config.model.name} if _is_folder(config.model.name) else {}
    if config.data_dir:
        paths["data_dir"] = config.data_dir
    for i, stage in enumerate(config.stages):
        named = [(f"stages.{i}.datasets.{j}", d.path) for j, d in enumerate(stage.datasets or [])]
        for key, spec in named or [(f"stages.{i}.dataset", stage.dataset)]:
            if spec and is_path(spec) and "://" not in spec:
                paths[key] = spec
    if not is_remote(config.checkpoint.storage_path):
        paths["checkpoint.storage_path"] = config.checkpoint.storage_path
    return paths


def redacted(config: TrainConfig) -> TrainConfig:
    """``config`` as it is logged, written and printed: the tracking URI without its password."""
    tracking = config.tracking
    uri = tracking.tracking_uri and redact_uri(tracking.tracking_uri)
    return dataclasses.replace(config, tracking=dataclasses.replace(tracking, tracking_uri=uri))


def prepare(config: TrainConfig) -> tuple[TrainConfig, list[list[Source]]]:
    """Fill in what depends on where the run lives, and check the storage and output folders, the tracking store,
    data, model and evaluation tasks before Ray starts. Returns the config and each stage's sources (listed, not
    read: they are counted on the cluster, then streamed)."""
    config = absolute_paths(config)
    return _checked(config, *evaluation_tasks(config))


def evaluation_tasks(config: TrainConfig) -> tuple[tuple[EvalTask, ...], tuple[EvalTask, ...], DevSpec]:
    """``evaluation.before_tasks``, ``final_tasks`` and the dev score's task and metric of a config
    ``absolute_paths`` made (and checked)."""
    evaluation = config.evaluation
    before, final = tuple(parse_tasks(evaluation.before_tasks)), tuple(parse_tasks(evaluation.final_tasks))
    return before, final, dev_spec(evaluation)


def _checked(
    config: TrainConfig, before_tasks: Sequence[EvalTask], final_tasks: Sequence[EvalTask], dev: DevSpec
) -> tuple[TrainConfig, list[list[Source]]]:
    """``prepare`` of an absolute config and its parsed tasks: places, tracking store, model, data, in this order."""
    storage = config.checkpoint.storage_path
    # The final model is copied here from the last checkpoint (a download when storage is remote).
    output_dir = config.output_dir or (
        _absolute(f"~/sbert-ray/models/{config.name}") if is_remote(storage) else f"{storage}/{config.name}/final-model"
    )
    config = dataclasses.replace(config, output_dir=output_dir)
    owned_paths.refuse_protected(f"{storage}/{config.name}", "checkpoint.storage_path")  # the run folder
    check_folder(storage, "checkpoint.storage_path")
    check_folder(output_dir, "output_dir")
    warn_if_password(config.tracking.tracking_uri)
    try:
        check_reachable(config.tracking.tracking_uri)
    except TrackingError as err:
        raise ConfigError(f"tracking.tracking_uri: {err}") from None
    _check_model(config)
    _check_datasets(config, {"before_tasks": before_tasks, "final_tasks": final_tasks}, dev.task)
    sources = [
        [_counted(source, stage, config.data_dir) for source in stage_sources(stage, i)]
        for i, stage in enumerate(config.stages)
    ]
    return config, sources


def _counted(source: Source, stage: StageConfig, data_dir: str) -> Source:
    """The source with its count where that needs no cluster (``known_rows``: a registered dataset read here,
    which checks that it suits the objective; parquet footers, which tell missing columns and texts), so bad data
    stops the run before Ray and the count before training does not read it again. Other files are counted, and
    every row checked, on the cluster."""
    try:
        return dataclasses.replace(source, rows=known_rows(source, stage, data_dir))
    except DataError as err:
        raise ConfigError(f"{source.key}: {err}") from None


def _check_model(config: TrainConfig) -> None:
    model = config.model
    model_size = check_model(
        model.name,
        model.max_seq_length,
        model.allow_unsafe_weights,
        model.prompts,
        model.default_prompt_name,
        model.attn_implementation,
        model.lora,
    )
    for i, stage in enumerate(config.stages):
        if stage.matryoshka_dims and max(stage.matryoshka_dims) > model_size:
            raise ConfigError(
                f"stages.{i}.matryoshka_dims: {max(stage.matryoshka_dims)} exceeds the model's {model_size}"
            )


def _check_datasets(config: TrainConfig, tasks: dict[str, Sequence[EvalTask]], dev_task: EvalTask | None) -> None:
    """Every evaluation task's data, the dev set and each stage's dataset are there (nothing read in full yet)."""
    data_dir = config.data_dir
    for key, parsed in tasks.items():
        check_tasks(parsed, data_dir, f"evaluation.{key}")
    if dev_task:
        check_tasks([dev_task], data_dir, "evaluation.dev_task")
    datasets = (
        [] if dev_task else [("evaluation.dev_dataset", config.evaluation.dev_dataset, config.evaluation.dev_split)]
    )
    for i, stage in enumerate(config.stages):
        named = [(d.name, d.split) for d in stage.datasets or []] or [(stage.dataset, stage.split)]
        datasets += [(f"stages.{i}", name, split) for name, split in named if name and not is_path(name)]
    for key, name, split in datasets:
        try:
            check_available(name, split, data_dir)
        except DataError as err:
            raise ConfigError(f"{key}: {err}") from None


def metrics_spool(config: TrainConfig, run_id: str) -> str:
    """Where rank 0 keeps the metrics the tracking store did not take: in the run folder; with object storage
    (no appends there) in a local folder of rank 0's node, which the driver reads when it runs on that node."""
    storage = config.checkpoint.storage_path
    if is_remote(storage):
        return f"~/sbert-ray/pending-metrics/{run_id}.jsonl"
    return f"{storage}/{config.name}/{METRICS_SPOOL}"


def build_trainer(
    config: TrainConfig,
    data: tuple[dict[str, ray.data.Dataset], StageData],
    tracking_uri: str,
    run_id: str,
    callbacks: list | None = None,
    report_gate: ray.actor.ActorHandle | None = None,
) -> TorchTrainer:
    tracking = {"tracking_uri": tracking_uri, "run_id": run_id, "spool": metrics_spool(config, run_id)}
    return torch_trainer(
        config,
        data,
        ray.train.RunConfig(
            # Same name + storage = same run: a resubmitted job resumes from its latest checkpoint.
            name=config.name,
            storage_path=config.checkpoint.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=config.checkpoint.max_failures),
            callbacks=[EndOnDeterministicError(), *(callbacks or [])],  # these fail once, whatever max_failures
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=config.checkpoint.keep_best,
                checkpoint_score_attribute=DEV_SCORE,
                checkpoint_score_order="max",
            ),
        ),
        # Rank 0's RunLogger: metrics the tracking store does not take wait in the spool file of the run.
        tracking,
        dev_validation(config, tracking),
        report_gate,
    )


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


@dataclass(frozen=True)
class TrainPlan:
    """What preflight resolved, once, for the phases after it."""

    config: TrainConfig  # paths absolute, output_dir filled in, checked
    run_dir: str  # <storage>/<name>: checkpoints, record, lease
    before_tasks: tuple[EvalTask, ...]
    final_tasks: tuple[EvalTask, ...]
    dev: DevSpec  # what scores each checkpoint (the worker resolves the same from the config)
    sources: tuple[list[Source], ...]  # per stage
    rows: tuple[list[int], ...]  # training examples per stage and source
    steps: tuple[int, ...]  # optimizer steps per stage
    previous: record.RunRecord | None  # the record of the run this one resumes; None: a new run


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
    config = absolute_paths(config)
    run_dir = f"{config.checkpoint.storage_path}/{config.name}"
    check_folder(config.checkpoint.storage_path, "checkpoint.storage_path")  # before the lease is written there
    with run_lease(run_dir):
        previous = record.previous_run(run_dir, config, redact_uri(config.tracking.tracking_uri), restart)
        if previous is not None and previous.status == "finished" and not restart:
            saved = previous.result | {"headlines": {k: tuple(v) for k, v in previous.result["headlines"].items()}}
            return TrainResult(**saved | {"already_finished": True})
        plan = preflight(config, run_dir, previous, restart)
        callbacks = list(callbacks or [])
        if progress and not quiet():
            callbacks.append(TrainingProgress(list(plan.steps)))
        return _train(plan, parent_run_id, callbacks, report_gate)


def preflight(config: TrainConfig, run_dir: str, previous: record.RunRecord | None, restart: bool) -> TrainPlan:
    """Everything checked before the MLflow run opens (``config`` made absolute): tracking store, data, model,
    tasks, the final model's folder, the cluster's room for the workers, every source counted (and its rows
    checked) on the cluster. --restart moves the old run aside here."""
    before_tasks, final_tasks, dev = evaluation_tasks(config)  # parsed once for the whole run
    config, sources = _checked(config, before_tasks, final_tasks, dev)
    # Here, not in prepare: a sweep checks its base config there, whose output_dir holds one model per trial.
    owned_paths.refuse_model_folder_over_run(config.output_dir, run_dir)
    owned_paths.check_model_folder(config.output_dir, leaving=run_dir if restart else None)
    if restart:
        _replace_previous(run_dir, previous, config.tracking.tracking_uri)
        previous = None
    connect_ray()
    with input_errors_unwrapped():  # a bad row found by a read task: our one line, not Ray Data's traceback too
        rows = count_stages(config, sources)
    check_resources(config.scaling)  # workers the cluster cannot hold: refused before the MLflow run and record
    refuse_unshared_paths(worker_paths(config), config.scaling)
    steps = tuple(planned_steps(config, i, n)[1] for i, n in enumerate(rows))
    return TrainPlan(config, run_dir, before_tasks, final_tasks, dev, tuple(sources), tuple(rows), steps, previous)


def _train(plan: TrainPlan, parent_run_id: str | None, callbacks: list, report_gate=None) -> TrainResult:
    """The phases after preflight, in the run's MLflow run; the record is marked finished at the end."""
    trained = False
    try:
        with open_run(plan, parent_run_id) as (tracker, run_record):
            data = stage_datasets(plan.config, list(plan.sources), list(plan.rows))
            before = score_before(plan, tracker)
            result, train_seconds = fit(plan, data, tracker, run_record, callbacks, report_gate)
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
    tracking_uri = redact_uri(plan.config.tracking.tracking_uri)
    record.finish(run_record, dataclasses.asdict(train_result) | {"tracking_uri": tracking_uri}, plan.run_dir)
    return train_result


@contextlib.contextmanager
def open_run(plan: TrainPlan, parent_run_id: str | None) -> Iterator[tuple[RunTracker, record.RunRecord]]:
    """The run's MLflow run (new, or the one ``plan.previous`` resumes) with its params, tags and config.yaml,
    and its record written to the run folder."""
    config, tracking_uri = plan.config, plan.config.tracking.tracking_uri
    with RunTracker(
        tracking_uri,
        config.tracking.experiment,
        run_name=config.tracking.run_name or config.name,
        parent_run_id=parent_run_id,
        run_id=plan.previous.mlflow_run_id if plan.previous else None,
        wait_s=config.tracking.wait_s,
    ) as tracker:
        tracker.spool = Path(metrics_spool(config, tracker.run_id)).expanduser()  # flushed after training
        run_record = plan.previous or record.new_record(config, tracker.run_id, redact_uri(tracking_uri))
        run_record.save(plan.run_dir)
        print(
            f"MLflow: {redact_uri(tracking_uri)}  run {tracker.run_id}{' (resumed)' if tracker.resumed else ''}",
            flush=True,
        )
        print(f"MLflow artifacts: {redact_uri(tracker.artifact_uri)}", flush=True)
        tracker.log_params(flatten(to_dict(redacted(config))))
        tracker.set_tags(environment_tags() | {NAME_TAG: plan.run_dir})
        tracker.log_text(dump_yaml(redacted(config)), "config.yaml")
        yield tracker, run_record


def score_before(plan: TrainPlan, tracker: RunTracker) -> Results:
    """``evaluation.before_tasks`` on the configured model, logged as ``before/<entry>/<metric>``."""
    if not plan.before_tasks:
        return {}
    config = plan.config
    load = functools.partial(load_encoder, **to_dict(config.model), seed=config.seed)
    before = _score(plan, load, plan.before_tasks)
    tracker.log_metrics({f"before/{key}": value for key, value in before.items()})
    return before


def _score(plan: TrainPlan, load: ModelSource, tasks: Sequence[EvalTask]) -> Results:
    config = plan.config
    return evaluate_on_worker_resources(load, tasks, config.data_dir, config.evaluation.batch_size, config.scaling)


def fit(
    plan: TrainPlan,
    data: tuple[dict[str, ray.data.Dataset], StageData],
    tracker: RunTracker,
    run_record: record.RunRecord,
    callbacks: list,
    report_gate: ray.actor.ActorHandle | None = None,
) -> tuple[ray.train.Result, float]:
    """The ``TorchTrainer`` fitted (resuming from the run's latest checkpoint); a NaN/inf stop is recorded and
    raised, an error a restart would meet again (``training.faults``) raised as its one line. Returns the result
    and the seconds ``fit`` took."""
    start = time.perf_counter()
    tracking_uri = plan.config.tracking.tracking_uri
    trainer = build_trainer(plan.config, data, tracking_uri, tracker.run_id, callbacks, report_gate)
    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as err:
        fault = raised_on_a_worker(err)
        if fault is None:
            raise
        raise fault from None  # Ray's message around it is the worker's traceback, which Ray's logs keep
    train_seconds = time.perf_counter() - start
    try:
        check_diverged(result)
    except TrainingDiverged as err:
        record.diverged(run_record, str(err), plan.run_dir)
        raise
    return result, train_seconds


def finish(
    plan: TrainPlan, result: ray.train.Result, train_seconds: float, before: Results, tracker: RunTracker
) -> TrainResult:
    """The final model (already in ``output_dir``) scored, carded, logged and registered; the curves plotted."""
    config, tracking = plan.config, plan.config.tracking
    final = score_final(plan, result, tracker)
    write_model_card(config.output_dir, model_card_info(plan, result.metrics, train_seconds, final, tracker))
    tracker.log_artifacts(config.output_dir, "model")
    tracker.call(
        log_sentence_transformer,
        tracking.tracking_uri,
        tracker.run_id,
        config.output_dir,
        tracking.registered_model_name,
        tracking.alias,
    )
    tracker.flush(wait_s=tracking.wait_s)  # the plots read the metric history back
    dev_metric = plan.dev.metric
    plot_curves(tracker, {"train/loss": "plots/loss.png", f"dev/{dev_metric}": f"plots/dev_{dev_metric}.png"})
    return TrainResult(
        run_id=tracker.run_id,
        tracking_uri=tracking.tracking_uri,
        artifact_uri=tracker.artifact_uri,
        model_dir=config.output_dir,
        before=before,
        final=final,
        headlines=primary_scores(plan.final_tasks, final),
        metrics=dict(result.metrics),
    )


def score_final(plan: TrainPlan, result: ray.train.Result, tracker: RunTracker) -> Results:
    """``evaluation.final_tasks`` on the last checkpoint's model, logged at the last step and as evaluation.json."""
    if not plan.final_tasks:
        return {}
    final = _score(plan, functools.partial(checkpoint_model, result.checkpoint), plan.final_tasks)
    tracker.log_metrics({f"final/{key}": value for key, value in final.items()}, step=result.metrics["global_step"])
    tracker.log_dict(nest(final), "evaluation.json")
    return final


def _replace_previous(run_dir: str, previous: record.RunRecord | None, tracking_uri: str) -> None:
    """--restart: keep the old run folder aside (refused when it is not a run), and close the old MLflow run if a
    crash left it running."""
    moved = record.archive(run_dir)  # first: it refuses a folder that is not a run
    if moved is not None:
        print(f"--restart: the previous run folder is kept at {moved}", flush=True)
    if previous is not None and previous.status != "finished" and previous.tracking_uri == redact_uri(tracking_uri):
        RunLogger(tracking_uri, previous.mlflow_run_id).close_if_running("KILLED")


def model_card_info(
    plan: TrainPlan, metrics: dict, train_seconds: float, final: Results, tracker: RunTracker
) -> ModelCardInfo:
    """What the final model's card says beyond its folder: data and settings per stage, hardware, time, scores."""
    config, tracking = plan.config, plan.config.tracking
    return ModelCardInfo(
        base_model=config.model.name,
        stages=[_stage_info(*stage) for stage in zip(config.stages, map(sum, plan.rows), plan.steps, strict=True)],
        hardware=metrics.get("hardware", "unknown"),
        num_workers=config.scaling.max_workers,
        train_seconds=train_seconds,
        results=final,
        primary_metrics={entry: metric for entry, (metric, _) in primary_scores(plan.final_tasks, final).items()},
        name=config.name,
        mlflow_run_id=tracker.run_id,
        tracking_uri=redact_uri(tracker.tracking_uri),
        mlflow_model_uri=model_uri(tracker.run_id, tracking.registered_model_name, tracking.alias),
        registered_model_name=tracking.registered_model_name,
    )


def _stage_info(stage: StageConfig, examples: int, steps: int) -> StageInfo:
    return StageInfo(
        objective=stage.objective,
        dataset=stage.dataset,
        split=stage.split,
        n_examples=examples,
        loss=stage.loss,
        batch_size=stage.batch_size,
        learning_rate=stage.learning_rate,
        epochs=stage.epochs,
        steps=steps,
        hyperparameters={
            "warmup_ratio": stage.warmup_ratio,
            "weight_decay": stage.weight_decay,
            "adam_eps": stage.adam_eps,
            "max_grad_norm": stage.max_grad_norm,
            "grad_accum_steps": stage.grad_accum_steps,
        },
    )


def save_final_model(checkpoint: ray.train.Checkpoint, output_dir: Path, **run: str) -> None:
    """Copy the model of the last checkpoint into a staging folder beside ``output_dir``, mark it as ours (naming
    ``run``: name, folder, MLflow run) and swap it in: a crash never leaves a partial folder at ``output_dir``, and
    our previous model there stays until the new one is in place (``owned_paths.replace_model``)."""
    with owned_paths.staging_beside(output_dir) as staging:
        with checkpoint.as_directory() as directory:
            shutil.copytree(Path(directory) / MODEL_DIR, staging / MODEL_DIR)
        owned_paths.write_model_marker(staging / MODEL_DIR, **run)
        owned_paths.replace_model(staging / MODEL_DIR, output_dir, staging)
