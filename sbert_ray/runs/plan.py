"""A training run resolved once, before the MLflow run opens: the ``RunPlan`` every later phase reads.

    absolute_paths  what depends on this process made absolute (data folder, tracking URI, storage, output, data
                    files, a model folder, the files of evaluation tasks): workers and trials run elsewhere; the
                    evaluation tasks parsed, once for the run (``RunTasks``)
    plan_run        the checks (places, tracking store, model, data, tasks, the final model's folder), --restart's
                    archive, Ray joined, every source counted on the cluster, the workers' resources and paths
                    checked, each stage's step counts -> RunPlan

The plan holds the evaluation tasks parsed, the dev score's task and metric, and the tracking store as a
``TrackingStore``, whose text is masked: the plan's config carries that masked text, so what is logged, written and
printed never holds a password, and the real URI leaves the plan only where an MLflow client is built
(``RunPlan.tracking``). ``RunPlan.worker.to_wire()`` is what the Train workers get (``training.stage_plan``):
primitives only, since Ray Train's controller unpickles it too.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from sbert_ray.config import ConfigError, EvalConfig, StageConfig, TrainConfig
from sbert_ray.data.readers import check_available, resolve_data_dir
from sbert_ray.data.records import DataError
from sbert_ray.evaluation.dev_score import DevSpec, dev_spec
from sbert_ray.evaluation.tasks import EvalTasks, RerankTask, parse_tasks
from sbert_ray.files import check_folder
from sbert_ray.models import check_model
from sbert_ray.models.checks import check_model_files
from sbert_ray.models.load import load_tokenizer
from sbert_ray.models.model_type import ModelType
from sbert_ray.ray_compat import connect_ray
from sbert_ray.runs import owned_paths, record
from sbert_ray.runs.cluster import (
    check_resources,
    cluster_capacity,
    input_errors_unwrapped,
    refuse_unshared_paths,
    resolve_async_dev,
    with_async_dev,
)
from sbert_ray.tracking.errors import TrackingError
from sbert_ray.tracking.mlflow_run import RunLogger, resolve_tracking_uri
from sbert_ray.tracking.store import TrackingStore
from sbert_ray.training.sources import Source, check_prepared, is_path, known_rows, stage_sources, teacher_dimension
from sbert_ray.training.stage_data import count_stages
from sbert_ray.training.stage_plan import StagePlan, WorkerPlan, stage_plans
from sbert_ray.training.storage import is_remote, resolve_storage

logger = logging.getLogger(__name__)
METRICS_SPOOL = "mlflow_pending_metrics.jsonl"  # in the run folder: metrics waiting for the tracking store


@dataclass(frozen=True)
class RunPlan:
    """What preflight resolved, once, for the phases after it."""

    config: TrainConfig  # paths absolute, output_dir filled in, checked; its tracking URI is str(store): masked
    store: TrackingStore  # the tracking store; its real URI only goes where a client is built
    run_dir: str  # <storage>/<name>: checkpoints, record, lease
    tasks: RunTasks  # parsed once: "before", final, and what scores each checkpoint
    sources: tuple[list[Source], ...]  # per stage
    rows: tuple[list[int], ...]  # training examples per stage and source
    stages: tuple[StagePlan, ...]  # per stage: its batch plan's settings and optimizer steps
    previous: record.RunRecord | None  # the record of the run this one resumes; None: a new run
    archived: str | None = None  # --restart: where the previous run folder was kept

    @property
    def steps(self) -> tuple[int, ...]:
        """Optimizer steps per stage."""
        return tuple(stage.total_steps for stage in self.stages)

    def tracking(self, run_id: str) -> dict:
        """Rank 0's ``RunLogger`` arguments for the MLflow run ``run_id``: the one place the real URI leaves."""
        return {"tracking_uri": self.store.uri, "run_id": run_id, "spool": metrics_spool(self.config, run_id)}

    @property
    def worker(self) -> WorkerPlan:
        """What every Train worker needs of the plan; ``worker.to_wire()`` carries it to them as primitives."""
        return WorkerPlan(self.config, self.stages, self.tasks.dev)


def plan_run(
    config: TrainConfig,
    tasks: RunTasks,
    store: TrackingStore,
    run_dir: str,
    previous: record.RunRecord | None,
    restart: bool,
) -> RunPlan:
    """Everything checked before the MLflow run opens (``config`` and ``tasks`` as ``absolute_paths`` made them;
    ``store`` its tracking store): data, model, tasks, the final model's folder, the cluster's room for the workers,
    every source counted (and its rows checked) on the cluster. --restart moves the old run aside here."""
    config, sources = _checked(config, tasks, store)
    # Here, not in prepare: a sweep checks its base config there, whose output_dir holds one model per trial.
    owned_paths.refuse_model_folder_over_run(config.output_dir, run_dir)
    owned_paths.check_model_folder(config.output_dir, leaving=run_dir if restart else None)
    archived = None
    if restart:
        archived = _replace_previous(run_dir, previous, store)
        previous = None
    connect_ray()
    with input_errors_unwrapped():  # a bad row found by a read task: our one line, not Ray Data's traceback too
        rows = count_stages(config, sources)
    check_resources(config.scaling)  # workers the cluster cannot hold: refused before the MLflow run and record
    refuse_unshared_paths(worker_paths(config), config.scaling)
    async_dev, why = resolve_async_dev([config], cluster_capacity(), runs=1)
    logger.info(why)
    config = masked(with_async_dev(config, async_dev), store)
    plans = stage_plans(config, rows)
    return RunPlan(config, store, run_dir, tasks, tuple(sources), tuple(rows), plans, previous, archived)


def _replace_previous(run_dir: str, previous: record.RunRecord | None, store: TrackingStore) -> str | None:
    """--restart: keep the old run folder aside (refused when it is not a run), and close the old MLflow run if a
    crash left it running. Returns where the folder went (None: there was none)."""
    moved = record.archive(run_dir)  # first: it refuses a folder that is not a run
    if moved is not None:
        print(f"--restart: the previous run folder is kept at {moved}", flush=True)
    if previous is not None and previous.status != "finished" and previous.tracking_uri == str(store):
        RunLogger(store.uri, previous.mlflow_run_id).close_if_running("KILLED")
    return moved


@dataclass(frozen=True)
class RunTasks:
    """A run's evaluation tasks, parsed once with their files absolute: "before", final, and the dev score's task
    and metric."""

    before: EvalTasks
    final: EvalTasks
    dev: DevSpec

    @classmethod
    def parse(cls, evaluation: EvalConfig, model_type: ModelType = "bi_encoder") -> RunTasks:
        """The tasks ``evaluation`` names (of a ``model_type`` model); an unknown task or metric is a ConfigError
        naming its key."""
        before = parse_tasks(evaluation.before_tasks, key="evaluation.before_tasks", absolute=True)
        reranks = model_type == "cross_encoder"  # its final tasks rerank a first stage's candidates
        final = parse_tasks(evaluation.final_tasks, key="evaluation.final_tasks", absolute=True, reranks=reranks)
        if reranks:
            _check_reranker_final_tasks(final, evaluation.first_stage)
        return cls(before, final, dev_spec(evaluation, absolute=True, model_type=model_type))

    def check(self, data_dir: str | None) -> None:
        """Every task's data, and the dev task's, can be had (a ConfigError naming the key and the task)."""
        self.before.check(data_dir)
        self.final.check(data_dir)
        self.dev.checked(data_dir)


def _check_reranker_final_tasks(final: EvalTasks, first_stage: str | None) -> None:
    """A reranker (no embeddings) scores ``rerank:`` tasks only, which rerank ``first_stage``'s candidates."""
    embedding_tasks = [task.spec for task in final if not isinstance(task, RerankTask)]
    if embedding_tasks:
        raise ConfigError(
            f"evaluation.final_tasks: {embedding_tasks} score embeddings, which model.type cross_encoder has not; "
            "set final_tasks: [] (a reranker's dev score is scored at every checkpoint; its final tasks may "
            "rerank: a retrieval set)"
        )
    if final and first_stage is None:
        raise ConfigError(
            f"evaluation.first_stage: the final tasks {final.specs} rerank a first stage's candidates; name the "
            "bi-encoder that retrieves them (a folder or Hub id)"
        )


def absolute_paths(config: TrainConfig) -> tuple[TrainConfig, RunTasks]:
    """Everything that depends on this process made absolute: the data folder ($SBERT_RAY_DATA_DIR), the tracking
    URI ($MLFLOW_TRACKING_URI), and every path (storage, output, user data files, a local model folder, the files of
    evaluation tasks) against the working directory. Ray Train workers and Tune trials run in other directories.
    The evaluation tasks are parsed here, once for the run; the config names them by their absolute specs."""
    if config.data_dir and not Path(config.data_dir).expanduser().is_dir():
        raise ConfigError(f"data_dir: {config.data_dir} is not a directory")
    data_dir = resolve_data_dir(config.data_dir)
    model, evaluation = config.model, config.evaluation
    tasks = RunTasks.parse(evaluation, model.type)
    absolute = dataclasses.replace(
        config,
        data_dir=str(data_dir.resolve()) if data_dir else None,
        output_dir=_absolute(config.output_dir) if config.output_dir else None,
        model=dataclasses.replace(model, name=_absolute(model.name) if _is_folder(model.name) else model.name),
        stages=[_absolute_data(stage) for stage in config.stages],
        evaluation=dataclasses.replace(
            evaluation,
            before_tasks=tasks.before.specs,
            final_tasks=tasks.final.specs,
            first_stage=_absolute(first) if (first := evaluation.first_stage) and _is_folder(first) else first,
            **_absolute_dev_tasks(evaluation, tasks.dev),
        ),
        checkpoint=dataclasses.replace(config.checkpoint, storage_path=resolve_storage(config.checkpoint.storage_path)),
        tracking=dataclasses.replace(config.tracking, tracking_uri=resolve_tracking_uri(config.tracking.tracking_uri)),
    )
    return absolute, tasks


def _absolute_dev_tasks(evaluation: EvalConfig, dev: DevSpec) -> dict:
    """The config's dev task, or each of its dev tasks, by its absolute spec."""
    specs = [part.task.spec if part.task else None for part in dev.parts]
    if not evaluation.dev_tasks:
        return {"dev_task": specs[0]}
    return {"dev_tasks": [dataclasses.replace(e, task=s) for e, s in zip(evaluation.dev_tasks, specs, strict=True)]}


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _absolute_data(stage: StageConfig) -> StageConfig:
    """The stage's local data paths made absolute (object-storage URIs and registered names stay)."""
    local = lambda spec: _absolute(spec) if is_path(spec) and "://" not in spec else spec  # noqa: E731
    datasets = stage.datasets and [dataclasses.replace(d, path=d.path and local(d.path)) for d in stage.datasets]
    return dataclasses.replace(stage, dataset=local(stage.dataset), datasets=datasets)


def _is_folder(name: str) -> bool:
    return not name.startswith("random:") and Path(name).expanduser().is_dir()


def tracking_store(config: TrainConfig) -> TrackingStore:
    """The tracking store of a config ``absolute_paths`` made (its URI resolved)."""
    return TrackingStore(config.tracking.tracking_uri)


def masked(config: TrainConfig, store: TrackingStore) -> TrainConfig:
    """``config`` as it is logged, written and printed: its tracking URI masked (``store``: the config's own)."""
    shown = str(store) if config.tracking.tracking_uri else None
    return dataclasses.replace(config, tracking=dataclasses.replace(config.tracking, tracking_uri=shown))


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


def metrics_spool(config: TrainConfig, run_id: str) -> str:
    """Where rank 0 keeps the metrics the tracking store did not take: in the run folder; with object storage
    (no appends there) in a local folder of rank 0's node, which the driver reads when it runs on that node."""
    storage = config.checkpoint.storage_path
    if is_remote(storage):
        return f"~/sbert-ray/pending-metrics/{run_id}.jsonl"
    return f"{storage}/{config.name}/{METRICS_SPOOL}"


def prepare(config: TrainConfig) -> tuple[TrainConfig, list[list[Source]]]:
    """Fill in what depends on where the run lives, and check the storage and output folders, the tracking store,
    data, model and evaluation tasks before Ray starts. Returns the config and each stage's sources (listed, not
    read: they are counted on the cluster, then streamed)."""
    config, tasks = absolute_paths(config)
    return _checked(config, tasks, tracking_store(config))


def _checked(config: TrainConfig, tasks: RunTasks, store: TrackingStore) -> tuple[TrainConfig, list[list[Source]]]:
    """``prepare`` of an absolute config, its parsed tasks and its tracking store: places, tracking store, model,
    data, in this order."""
    storage = config.checkpoint.storage_path
    # The final model is copied here from the last checkpoint (a download when storage is remote).
    output_dir = config.output_dir or (
        _absolute(f"~/sbert-ray/models/{config.name}") if is_remote(storage) else f"{storage}/{config.name}/final-model"
    )
    config = dataclasses.replace(config, output_dir=output_dir)
    owned_paths.refuse_protected(f"{storage}/{config.name}", "checkpoint.storage_path")  # the run folder
    check_folder(storage, "checkpoint.storage_path")
    check_folder(output_dir, "output_dir")
    try:
        store.check()
    except TrackingError as err:
        raise ConfigError(f"tracking.tracking_uri: {err}") from None
    model_size = _check_model(config)
    _check_datasets(config, tasks)
    listed = [stage_sources(stage, i) for i, stage in enumerate(config.stages)]
    _check_prepared(config, listed)
    sources = [
        [_counted(source, stage, config.data_dir, model_size) for source in stage_listed]
        for stage, stage_listed in zip(config.stages, listed, strict=True)
    ]
    return config, sources


def _check_prepared(config: TrainConfig, sources: list[list[Source]]) -> None:
    """Prepared sources were tokenised as this run would tokenise them (``training.sources.check_prepared``)."""
    if not any(source.manifest for listed in sources for source in listed):
        return
    tokens = load_tokenizer(**dataclasses.asdict(config.model))
    for stage, listed in zip(config.stages, sources, strict=True):
        check_prepared(listed, stage, tokens.tokenizer, tokens.max_seq_length, tokens.prompts, tokens.joins_pairs)


def _counted(source: Source, stage: StageConfig, data_dir: str, model_size: int) -> Source:
    """The source with its count where that needs no cluster (``known_rows``: a registered dataset read here,
    which checks that it suits the objective; parquet footers, which tell missing columns and texts), so bad data
    stops the run before Ray and the count before training does not read it again. Other files are counted, and
    every row checked, on the cluster. A teacher's embeddings are checked against the model's size here too (by the
    first row: the rows after it must have its size, which the cluster checks as it reads them)."""
    try:
        counted = dataclasses.replace(source, rows=known_rows(source, stage, data_dir))
        teacher_size = teacher_dimension(source, stage)
    except DataError as err:
        raise ConfigError(f"{source.key}: {err}") from None
    if teacher_size is not None and teacher_size != model_size:
        raise ConfigError(
            f"{source.key}: {source.files[0]}: the teacher's embeddings have {teacher_size} dimensions and the "
            f"model's {model_size}; objective {stage.objective!r} needs one size"
        )
    return counted


def _check_model(config: TrainConfig) -> int:
    """The model's embedding size, once it is known to train, and the first stage's files (a ModelError names the
    key at fault)."""
    model = config.model
    model_size = check_model(
        model.name,
        model.max_seq_length,
        model.allow_unsafe_weights,
        model.prompts,
        model.default_prompt_name,
        model.attn_implementation,
        model.lora,
        model.type,
    )
    if config.evaluation.first_stage is not None:  # a reranker's final tasks retrieve with it
        check_model_files(config.evaluation.first_stage, "evaluation.first_stage")
    for i, stage in enumerate(config.stages):
        if stage.matryoshka_dims and max(stage.matryoshka_dims) > model_size:
            raise ConfigError(
                f"stages.{i}.matryoshka_dims: {max(stage.matryoshka_dims)} exceeds the model's {model_size}"
            )
    return model_size


def _check_datasets(config: TrainConfig, tasks: RunTasks) -> None:
    """Every evaluation task's data, the dev set and each stage's dataset are there (nothing read in full yet)."""
    data_dir = config.data_dir
    tasks.check(data_dir)
    datasets = (
        []
        if not tasks.dev.reads_dev_pairs
        else [("evaluation.dev_dataset", config.evaluation.dev_dataset, config.evaluation.dev_split)]
    )
    for i, stage in enumerate(config.stages):
        named = [(d.name, d.split) for d in stage.datasets or []] or [(stage.dataset, stage.split)]
        datasets += [(f"stages.{i}", name, split) for name, split in named if name and not is_path(name)]
    for key, name, split in datasets:
        try:
            check_available(name, split, data_dir)
        except DataError as err:
            raise ConfigError(f"{key}: {err}") from None
