"""A sweep on Ray Tune with Ray Train v2: each trial is a function that fits its own ``TorchTrainer``.

run_sweep (this process)                      MLflow parent run: sweep config, results table, plot, best config
  Tuner(with_resources(run_trial, token CPU))  searcher (random / grid / Optuna TPE) + ASHA on dev_score
    run_trial (one Tune trial)                 run_training(trial config, parent run, TrialGate)
      TorchTrainer -> train_loop_per_worker    MLflow child run; rank 0 waits for Tune's verdict on each report
    tune.report(final scores, finished)        the trial's last result
  [retrain_best]                               run_training(best config, full data, STS suite) -> child run
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search import ConcurrencyLimiter
from ray.tune.search.basic_variant import BasicVariantGenerator
from ray.tune.search.optuna import OptunaSearch

from sbert_ray.config import ConfigError, TrainConfig, dump_yaml, flatten, to_dict
from sbert_ray.ray_compat import connect_ray
from sbert_ray.runs import owned_paths
from sbert_ray.runs.cluster import (
    cluster_capacity,
    refuse_impossible,
    refuse_unshared_paths,
    resolve_async_dev,
    runs_that_fit,
    with_async_dev,
)
from sbert_ray.runs.plan import absolute_paths, masked, prepare, tracking_store, worker_paths
from sbert_ray.runs.progress_lines import SweepProgress
from sbert_ray.runs.train_run import TrainResult, run_training
from sbert_ray.tracking.mlflow_run import environment_tags
from sbert_ray.tracking.model_registry import register_run_model
from sbert_ray.tracking.store import TrackingStore
from sbert_ray.tracking.sweep_run import SweepTracker
from sbert_ray.training.storage import is_remote
from sbert_ray.tuning import trial_results
from sbert_ray.tuning.dev_lag import DEV_STEP, scored_now
from sbert_ray.tuning.placement_groups import RemoveOrphanedPlacementGroups, release_trial_placement_groups
from sbert_ray.tuning.space import METRIC, AshaConfig, SearchSpace, SweepConfig
from sbert_ray.tuning.trial_gate import TrialGate
from sbert_ray.tuning.trial_results import TrialRow

logger = logging.getLogger(__name__)
# A trial's own process only waits on its TorchTrainer; a token CPU share keeps trials from holding the CPUs their
# training workers need (a whole CPU per trial deadlocks small machines).
TRIAL_CPU = 0.01


@dataclass(frozen=True)
class TrialContext:
    space: SearchSpace
    trials_dir: str  # each trial trains as <trials_dir>/<trial id> (checkpoints, final model)
    parent_run_id: str


def run_trial(sampled: dict, context: TrialContext) -> None:
    """One Tune trial: the sampled point of the search space, trained as its own Ray Train run."""
    trial_id = tune.get_context().get_trial_id()
    config = context.space.config(sampled)
    config = dataclasses.replace(
        config,
        name=trial_id,  # same trial id on --resume, so the Train run and its MLflow run continue
        output_dir=str(Path(config.output_dir) / trial_id) if config.output_dir else None,  # one model per trial
        checkpoint=dataclasses.replace(config.checkpoint, storage_path=context.trials_dir),
        # Only the sweep's best model is registered (below), not every trial's.
        tracking=dataclasses.replace(
            config.tracking, run_name=f"trial {trial_id}", registered_model_name=None, alias=None
        ),
    )
    # Each report waits for Tune's verdict; a stop aborts the Train run (trial_gate.py).
    with TrialGate(config.evaluation.async_dev is True, config.scaling.resource_wait_s) as gate:
        try:
            result = run_training(
                config,
                parent_run_id=context.parent_run_id,
                callbacks=[gate.callback],
                report_gate=gate.actor,
                progress=False,
            )
        except Exception:
            if gate.stopped:  # the abort ended fit(): Tune has this trial's last result already
                return
            raise
    # "finished", not "done": Tune reads a reported "done" as the end of the trial and stops it on the spot.
    final = {f"final_{entry}": value for entry, (_, value) in result.headlines.items()}
    tune.report({**scored_now(result.metrics), **final, "finished": True})  # the last checkpoint's own dev score


@dataclass
class SweepResult:
    run_id: str  # the parent MLflow run
    tracking_uri: str  # masked
    path: str  # the Tune experiment: a local folder or a storage URI (s3://...)
    summary: Path  # results table, plot and best config on this machine, also logged to the parent run
    rows: list[TrialRow]
    best: TrialRow | None
    retrained: TrainResult | None
    dev_metric: str  # what each trial's dev_score is (base.evaluation's dev_metric, or its task's primary metric)


@dataclass(frozen=True)
class SweepPlan:
    """A sweep resolved once, before its MLflow run opens."""

    sweep: SweepConfig  # its base config's paths absolute: trials run in their own working directories
    store: TrackingStore
    path: str  # the Tune experiment: <base storage>/<sweep name>
    space: SearchSpace
    extremes: list[TrainConfig]  # the search space's corners: the largest trials, every model and data set
    summary: Path  # on this machine
    dev_metric: str


def run_sweep(sweep: SweepConfig, resume: bool = False) -> SweepResult:
    """Run (or with ``resume`` continue) a sweep; every config and data error surfaces before Ray starts."""
    plan = plan_sweep(sweep, resume)
    with open_sweep_run(plan) as tracker:
        check_cluster(plan.extremes)
        plan = place_dev_scores(plan)
        start = time.perf_counter()
        grid = _tuner(plan, TrialContext(plan.space, f"{plan.path}/trials", tracker.run_id), resume).fit()
        release_trial_placement_groups()  # what stopped trials reserved, before retrain_best needs it
        _end_if_interrupted(tracker, sweep.name, plan.path)
        tracker.log_metrics({"sweep/wall_s": time.perf_counter() - start})
        rows = trial_results.trial_rows(grid, plan.space)
        _close_trial_runs(tracker, rows, f"{plan.path}/trials")
        best = _summarize(tracker, plan, rows)
        retrained = _retrain_or_register(plan, best, tracker)
        return SweepResult(
            tracker.run_id, str(plan.store), plan.path, plan.summary, rows, best, retrained, plan.dev_metric
        )


def plan_sweep(sweep: SweepConfig, resume: bool) -> SweepPlan:
    """Paths absolute, the sweep's folders allowed, every model and data set of the search space checked, and the
    sweep new (or, with ``resume``, there to continue)."""
    base, tasks = absolute_paths(sweep.base)
    sweep = dataclasses.replace(sweep, base=base)
    path = f"{base.checkpoint.storage_path}/{sweep.name}"
    owned_paths.refuse_protected(path, "base.checkpoint.storage_path")  # the sweep's folder
    if base.output_dir:  # each trial's final model goes into a folder of its own under it
        owned_paths.refuse_protected(base.output_dir, "base.output_dir")
    space = SearchSpace(base, sweep.search_space)
    extremes = list(space.extreme_configs())
    _check_data(extremes)
    # Tune's files go to storage; the summary is written here (and logged to MLflow) when storage is remote.
    summary = Path(f"~/sbert-ray/sweeps/{sweep.name}" if is_remote(path) else path).expanduser() / "summary"
    if tune.Tuner.can_restore(path) != resume:
        raise ConfigError(
            f"sweep {sweep.name!r} already exists at {path}: pass --resume to continue it, or choose another name"
            if not resume
            else f"--resume: no sweep to continue at {path}"
        )
    return SweepPlan(sweep, tracking_store(base), path, space, extremes, summary, tasks.dev.metric)


@contextlib.contextmanager
def open_sweep_run(plan: SweepPlan) -> Iterator[SweepTracker]:
    """The sweep's parent MLflow run (resumed with the sweep) with its settings, tags and sweep.yaml."""
    sweep, tracking = plan.sweep, plan.sweep.base.tracking
    with SweepTracker(
        plan.store.uri, tracking.experiment, sweep.name, resume_key=plan.path, wait_s=tracking.wait_s
    ) as tracker:
        print(f"MLflow: {plan.store}  sweep run {tracker.run_id}{' (resumed)' * tracker.resumed}")
        shown = dataclasses.replace(sweep, base=masked(sweep.base, plan.store))
        # One param per searched key (option names may hold characters MLflow refuses in param names).
        settings = flatten(to_dict(dataclasses.replace(shown, search_space={})))
        tracker.log_params(settings | {f"search_space.{k}": json.dumps(v) for k, v in sweep.search_space.items()})
        tracker.set_tags(environment_tags())
        tracker.log_text(dump_yaml(shown), "sweep.yaml")
        yield tracker


def check_cluster(extremes: list[TrainConfig]) -> None:
    """Ray joined; trials whose workers the cluster can never hold, or whose paths its other machines cannot read,
    refused before any trial starts."""
    connect_ray()
    for scaling in {repr(extreme.scaling): extreme.scaling for extreme in extremes}.values():
        refuse_impossible(scaling)  # a trial of workers the cluster can never hold would wait for ever
    for extreme in extremes:  # trials and their workers may run on other machines, which must read these
        refuse_unshared_paths(worker_paths(extreme), extreme.scaling)


def place_dev_scores(plan: SweepPlan) -> SweepPlan:
    """The sweep with ``base.evaluation.async_dev`` decided for every trial (``resolve_async_dev``: auto is off the
    training ranks where the cluster holds a dev scorer beside each concurrent trial), said in the log."""
    base, sweep = plan.space.base, plan.sweep
    async_dev, why = resolve_async_dev(plan.extremes, cluster_capacity(), sweep.max_concurrent_trials, TRIAL_CPU)
    logger.info(why)
    space = SearchSpace(with_async_dev(base, async_dev), sweep.search_space)
    return dataclasses.replace(plan, space=space, extremes=[with_async_dev(c, async_dev) for c in plan.extremes])


def _tuner(plan: SweepPlan, context: TrialContext, resume: bool) -> tune.Tuner:
    """The sweep's Tuner: restored with ``resume`` (finished and failed trials stay as they are; interrupted ones
    restart and resume training), else new."""
    trainable = tune.with_resources(tune.with_parameters(run_trial, context=context), {"cpu": TRIAL_CPU})
    if resume:
        return tune.Tuner.restore(plan.path, trainable=trainable)
    return _new_tuner(plan.sweep, plan.space, plan.extremes, trainable)


def _retrain_or_register(plan: SweepPlan, best: TrialRow | None, tracker: SweepTracker) -> TrainResult | None:
    """``retrain_best``: the best config trained again on all its data (that run registers its model itself);
    else the best trial's model registered when the base config names a registered model."""
    sweep, tracking = plan.sweep, plan.sweep.base.tracking
    if best is None:
        return None
    if sweep.retrain_best:
        return run_training(_retrain_config(best.config, sweep.name, plan.path), parent_run_id=tracker.run_id)
    if tracking.registered_model_name:
        tracker.call(register_run_model, plan.store.uri, best.run_id, tracking.registered_model_name, tracking.alias)
    return None


def _new_tuner(sweep: SweepConfig, space: SearchSpace, extremes: list[TrainConfig], trainable) -> tune.Tuner:
    # Each searcher limits concurrency itself: Tune ignores max_concurrent_trials for BasicVariantGenerator.
    concurrency = sweep.max_concurrent_trials or max_concurrent_trials(extremes)
    searcher = (
        ConcurrencyLimiter(OptunaSearch(seed=sweep.base.seed), max_concurrent=concurrency)  # TPE by default
        if sweep.search == "optuna"
        else BasicVariantGenerator(max_concurrent=concurrency, random_state=sweep.base.seed)
    )
    scheduler = asha_scheduler(sweep.asha) if sweep.scheduler == "asha" else None  # None: FIFO, every trial ends
    return tune.Tuner(
        trainable,
        param_space=space.param_space(),
        tune_config=tune.TuneConfig(
            metric=METRIC,
            mode="max",
            search_alg=searcher,
            scheduler=scheduler,
            num_samples=sweep.num_samples,
            trial_dirname_creator=_trial_dirname,
        ),
        run_config=tune.RunConfig(
            name=sweep.name,
            storage_path=sweep.base.checkpoint.storage_path,
            failure_config=tune.FailureConfig(max_failures=0),  # Ray Train already restarts failed workers
            # Stopped trials' Train groups (see placement_groups.py); a bar of trials done / running / pending.
            callbacks=[RemoveOrphanedPlacementGroups(), SweepProgress(sweep.num_samples * space.grid_size())],
        ),
    )


def asha_scheduler(asha: AshaConfig) -> ASHAScheduler:
    return ASHAScheduler(
        # Rungs in optimizer steps (as eval_every and the MLflow metric steps) of the checkpoint each dev score is
        # of: a lagged score (async_dev) is compared at its own step, as inline (tuning.dev_lag).
        time_attr=DEV_STEP,
        grace_period=asha.grace_period,
        reduction_factor=asha.reduction_factor,
        max_t=asha.max_t,
        stop_last_trials=False,  # a trial always ends on its own final evaluation
    )


def max_concurrent_trials(extremes: list[TrainConfig]) -> int:
    """As many trials as the cluster fits at its largest (``runs_that_fit``), sized by the largest trial of the
    search space."""
    return runs_that_fit(extremes, driver_cpus=TRIAL_CPU)


def _trial_dirname(trial) -> str:
    return trial.trial_id


def _check_data(extremes: list[TrainConfig]) -> None:
    """Read each distinct model (and input length) + training data + dev set of the search space once (a dataset
    that does not fit its objective, or a length the model cannot take, fails here, not in a trial)."""
    seen = set()
    for config in extremes:
        stages = [(s.dataset, s.split, s.columns, s.limit, s.objective) for s in config.stages]
        key = repr((config.model.name, config.model.max_seq_length, stages))
        if key not in seen:
            seen.add(key)
            prepare(config)


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep: Tune saved its state and stopped every trial; ``--resume`` continues it."""


def _end_if_interrupted(tracker: SweepTracker, name: str, path: str) -> None:
    """Tune answers Ctrl-C by saving its state, stopping the trials and returning from ``fit`` as if done (the
    grid it returns reads every stopped trial TERMINATED); its saved state still holds them unfinished. Then the
    sweep is not over: no summary is written and no best is chosen, and the runs of the trials that were training
    end KILLED (their training resumes with the sweep). A trial training at Ctrl-C may have ended its run FAILED
    already, as Tune tore its fit down (as a stopped trial's may: ``_close_trial_runs``); its saved state holds it
    unfinished, not ERROR: it was interrupted, KILLED too (CI of c3febb4 saw it FAILED)."""
    trials = tune.ExperimentAnalysis(path).trials
    unfinished = {trial.trial_id for trial in trials if trial.status not in ("TERMINATED", "ERROR")}
    if not unfinished:
        return
    for run_name, (run_id, status) in tracker.child_runs().items():  # named <trials dir>/<trial id>
        if status == "RUNNING" or (status == "FAILED" and run_name.rsplit("/", 1)[-1] in unfinished):
            tracker.close_child(run_id, stopped=True)
    raise SweepInterrupted(f"sweep {name!r} interrupted; its state is saved at {path}: continue it with --resume")


def _close_trial_runs(tracker: SweepTracker, rows: list[TrialRow], trials_dir: str) -> None:
    """Note each trial's MLflow run in its row; end the runs of trials that were stopped or died (still RUNNING).
    A stopped trial's run may also have ended FAILED: while Tune tears the trial down, its Train controller dies
    under the running fit, which then raises before the trial's process exits. The scheduler stopped it: KILLED."""
    children = tracker.child_runs()
    for row in rows:
        run_id, status = children.get(f"{trials_dir}/{row.trial_id}", ("", ""))
        row.run_id = run_id
        if status == "RUNNING" or (row.status == "stopped" and status == "FAILED"):
            tracker.close_child(run_id, stopped=row.status == "stopped")


def _summarize(tracker: SweepTracker, plan: SweepPlan, rows: list[TrialRow]) -> TrialRow | None:
    """Results table (CSV + markdown), dev-vs-learning-rate plot and the best config, on disk and in the parent."""
    sweep, space, out = plan.sweep, plan.space, plan.summary
    out.mkdir(parents=True, exist_ok=True)
    records = trial_results.table(rows, space)
    trial_results.write_csv(records, out / "results.csv")
    (out / "results.md").write_text(trial_results.markdown(records))
    plot = out / "dev_score_vs_learning_rate.png"
    trial_results.plot_dev_vs_learning_rate(rows, plot, sweep.name, plan.dev_metric)
    best = trial_results.best_row(rows)
    counts = {status: sum(r.status == status for r in rows) for status in ("finished", "stopped", "error")}
    tracker.log_metrics({f"sweep/trials_{status}": n for status, n in counts.items()})
    if best is not None:
        (out / "best_config.yaml").write_text(dump_yaml(masked(best.config, plan.store)))
        tracker.log_metrics({f"best/{METRIC}": best.dev_score})
        tracker.set_tags({"best_trial": best.trial_id, "best_run_id": best.run_id})
    tracker.log_artifacts(out)
    print(trial_results.markdown(records))
    return best


def _retrain_config(best: TrainConfig, sweep_name: str, path: str) -> TrainConfig:
    """The best trial's config on all of its training data (no limit, no step cap), scored on the STS suite (a
    reranker on its own final tasks, which rerank: the suite scores embeddings)."""
    return dataclasses.replace(
        best,
        name="best-retrained",
        output_dir=str(Path(best.output_dir) / "best-retrained") if best.output_dir else None,
        stages=[dataclasses.replace(s, limit=None, max_steps=None) for s in best.stages],
        evaluation=dataclasses.replace(
            best.evaluation, final_tasks=["sts"] if best.model.type == "bi_encoder" else best.evaluation.final_tasks
        ),
        checkpoint=dataclasses.replace(best.checkpoint, storage_path=path),
        tracking=dataclasses.replace(best.tracking, run_name=f"{sweep_name} best, retrained"),
    )
