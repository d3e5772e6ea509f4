"""``sbert-ray eval``: score a given model (or one of the paper's baselines) on evaluation tasks, optionally as an
MLflow run (params, every number as a metric, ``evaluation.json``, which ``sbert-ray report --run`` reads)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sbert_ray.config import RESOURCE_WAIT_S, ConfigError, TrainConfig, check_device_here
from sbert_ray.evaluation.baselines import load_model
from sbert_ray.evaluation.encoder_pool import RayEncoder, replica_resources
from sbert_ray.evaluation.mteb_encoder import mteb_model_name
from sbert_ray.evaluation.mteb_tasks import DEFAULT_MTEB_DIR, MtebOutput, MtebTask
from sbert_ray.evaluation.results import nest
from sbert_ray.evaluation.tasks import RERANK_TOP_K, ArgsimTask, EvalTask, EvalTasks, RerankTask, Results
from sbert_ray.evaluation.truncation import evaluate_at_dims
from sbert_ray.models.encoder import Precision
from sbert_ray.models.st_layout import ModelError
from sbert_ray.models.teachers import Teacher, load_teacher
from sbert_ray.progress import progress_bar
from sbert_ray.ray_compat import connect_ray
from sbert_ray.runs.argsim_folds import finetune_argsim
from sbert_ray.runs.cluster import input_errors_unwrapped, refuse_impossible_encoders
from sbert_ray.tracking.mlflow_run import RunTracker, environment_tags
from sbert_ray.tracking.store import TrackingStore


@dataclass(frozen=True)
class EvalRequest:
    """What ``sbert-ray eval`` scores and how, checked on creation (before any data or model is read). With
    ``finetune``, argument-similarity tasks fine-tune a fresh copy of the model per fold first (``runs.argsim_folds``)
    from that training config. With ``truncate_dims``, every task is scored at each of those embedding sizes
    (entries ``<entry>@<dim>``). ``precision="bf16"`` encodes with 16-bit weights (``SentenceEncoder.to_precision``).
    With a tracking ``store``, the evaluation is an MLflow run of ``experiment``. ``mteb:`` tasks file mteb's result
    files and their embedding cache under ``mteb_dir``. ``rerank:`` tasks take the model as their first stage and
    ``reranker`` (a ``models.teachers`` teacher's folder or Hub id) to reorder its top ``top_k``."""

    model_ref: str
    tasks: EvalTasks
    data_dir: Path | None = None
    batch_size: int = 64
    baseline: str | None = None  # avg | cls | tfidf: one of the paper's baselines from the model's backbone
    finetune: TrainConfig | None = None
    workers: int = 1  # encode on this many Ray actors
    device: str | None = None
    allow_unsafe_weights: bool = False
    truncate_dims: Sequence[int] = ()
    precision: Precision = "fp32"
    store: TrackingStore | None = None  # its URI goes only to MLflow; shown masked
    experiment: str = "sbert-ray-eval"
    resource_wait_s: float = RESOURCE_WAIT_S  # for the --workers replicas' CPUs/GPUs while other work holds them
    mteb_dir: Path = DEFAULT_MTEB_DIR
    reranker: str | None = None
    top_k: int = RERANK_TOP_K

    def __post_init__(self) -> None:
        if self.baseline == "tfidf" and (
            self.finetune is not None or not all(isinstance(t, ArgsimTask) for t in self.tasks)
        ):
            raise ConfigError(
                "--baseline tfidf scores argument-similarity tasks (afs, ukp-aspect, bws) unsupervised only"
            )
        scores_given_model = self.finetune is None and self.baseline != "tfidf"
        if self.truncate_dims and not scores_given_model:
            raise ConfigError("--truncate-dim scores the model's own embeddings: not with --mode finetune or tfidf")
        if self.precision != "fp32" and not scores_given_model:
            raise ConfigError(
                f"precision {self.precision!r} encodes with the given model: not with fine-tuning or tf-idf"
            )
        reranks = any(isinstance(task, RerankTask) for task in self.tasks)
        if reranks and self.reranker is None:
            raise ConfigError("rerank: tasks reorder the model's top k with a reranker: pass --reranker PATH")
        if self.reranker is not None and not reranks:
            raise ConfigError("--reranker reorders the top k of rerank: tasks; --tasks names none")
        if self.device and self.workers == 1:  # encoded in this process (Ray workers bring their own GPUs)
            check_device_here(self.device)


@input_errors_unwrapped()  # on Ray workers (--workers, fine-tuning folds)
def evaluate_model(
    request: EvalRequest, progress: Callable[[EvalTask, float], None] = lambda task, seconds: None
) -> Results:
    """What ``sbert-ray eval`` runs: every task's data checked first, then each task scored in this process (or
    encoding spread over ``request.workers`` Ray actors); ``progress`` hears of each task scored and its time."""
    request.tasks.check(request.data_dir)
    if request.store is None:
        return _evaluate(request, progress)
    run_name = f"eval {request.model_ref}" + (f" ({request.baseline})" if request.baseline else "")
    with RunTracker(request.store.uri, request.experiment, run_name=run_name) as tracker:
        tracker.set_tags(environment_tags())
        tracker.log_params(
            {
                "model.name": request.model_ref,
                "tasks": ",".join(task.spec for task in request.tasks),
                "mode": "finetune" if request.finetune else "unsupervised",
                "baseline": request.baseline or "none",
                "data_dir": str(request.data_dir or "Hugging Face Hub"),
                "batch_size": request.batch_size,
                "workers": request.workers,
                "truncate_dims": ",".join(map(str, request.truncate_dims)) or "none",
                "precision": request.precision,
                "reranker": request.reranker or "none",
                "top_k": request.top_k,
            }
        )
        results = _evaluate(request, progress)
        tracker.log_metrics(results)
        tracker.log_dict(nest(results), "evaluation.json")
        if any(isinstance(task, MtebTask) for task in request.tasks):  # mteb's own files of the model, beside ours
            tracker.log_artifacts(_mteb_output(request).model_results, "mteb")
        print(f"MLflow run {tracker.run_id} at {request.store}")
        return results


def _evaluate(request: EvalRequest, progress: Callable[[EvalTask, float], None]) -> Results:
    device, workers, dims = request.device, request.workers, request.truncate_dims
    reranker = _load_reranker(request.reranker, device if workers == 1 else None)
    model = load_model(request.model_ref, request.baseline, request.allow_unsafe_weights)
    if request.precision != "fp32":  # cast on the device it will run on (its 16-bit type); Ray workers re-cast
        model.to(device if device and workers == 1 else "cpu").to_precision(request.precision)
    if dims:
        if max(dims) > model.embedding_dim:
            raise ConfigError(f"--truncate-dim {max(dims)}: the model has {model.embedding_dim} dimensions")
        model.truncate_dim = None  # every size is cut from the full embeddings, whatever the saved model truncates to
    if workers > 1:
        connect_ray()
        use_gpu = (device or "").startswith("cuda")
        refuse_impossible_encoders(replica_resources(use_gpu), workers)
        model = RayEncoder(model, workers, use_gpu=use_gpu, resource_wait_s=request.resource_wait_s)
    elif device:
        model.to(device)
    results: Results = {}
    try:
        for task in progress_bar(request.tasks, desc="tasks", unit="task"):
            start = time.perf_counter()
            if request.finetune is not None and isinstance(task, ArgsimTask):
                results |= finetune_argsim(task, request.finetune, request.data_dir)
            elif dims:
                results |= evaluate_at_dims(model, dims, lambda m, t=task: _score(t, m, request, reranker))
            else:
                results |= _score(task, model, request, reranker)
            progress(task, time.perf_counter() - start)
    finally:
        if workers > 1:
            model.close()
    return results


def _load_reranker(model_ref: str | None, device: str | None) -> Teacher | None:
    """The ``--reranker`` teacher, on ``device`` (the first stage's, when it runs in this process), before the
    first stage loads: a wrong folder is named before any encoding."""
    if model_ref is None:
        return None
    try:
        reranker = load_teacher(model_ref)
    except (ModelError, OSError) as error:
        raise ConfigError(f"--reranker {model_ref}: {error}") from None
    return reranker.to(device) if device else reranker


def _score(task: EvalTask, model, request: EvalRequest, reranker: Teacher | None = None) -> Results:
    """``task.run``; an mteb task also hears where its result files go and which model they are filed under, a
    rerank task its reranker and top k."""
    if isinstance(task, RerankTask):
        return task.run(model, request.data_dir, request.batch_size, reranker, request.top_k)
    if isinstance(task, MtebTask):
        return task.run(model, request.data_dir, request.batch_size, _mteb_output(request))
    return task.run(model, request.data_dir, request.batch_size)


def _mteb_output(request: EvalRequest) -> MtebOutput:
    return MtebOutput(request.mteb_dir, mteb_model_name(request.model_ref))
