"""``sbert-ray eval``: score a given model (or one of the paper's baselines) on evaluation tasks, optionally as an
MLflow run (params, every number as a metric, ``evaluation.json``, which ``sbert-ray report --run`` reads)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from sbert_ray.config import ConfigError, TrainConfig, check_device_here
from sbert_ray.evaluation.baselines import load_model
from sbert_ray.evaluation.distributed import RayEncoder
from sbert_ray.evaluation.results import nest
from sbert_ray.evaluation.tasks import ArgsimTask, EvalTask, Results, check_tasks
from sbert_ray.evaluation.truncation import evaluate_at_dims
from sbert_ray.models.encoder import Precision
from sbert_ray.progress import progress_bar
from sbert_ray.runs.argsim import finetune_argsim
from sbert_ray.runs.cluster import connect_ray, input_errors_unwrapped
from sbert_ray.tracking.mlflow_run import RunTracker, environment_tags
from sbert_ray.tracking.store import redact_uri


@input_errors_unwrapped()  # on Ray workers (--workers, fine-tuning folds)
def evaluate_model(
    model_ref: str,
    tasks: Sequence[EvalTask],
    data_dir=None,
    batch_size: int = 64,
    baseline: str | None = None,
    finetune: TrainConfig | None = None,
    workers: int = 1,
    device: str | None = None,
    allow_unsafe_weights: bool = False,
    progress: Callable[[EvalTask, float], None] = lambda task, seconds: None,
    tracking_uri: str | None = None,
    experiment: str = "sbert-ray-eval",
    truncate_dims: Sequence[int] = (),
    precision: Precision = "fp32",
) -> Results:
    """What ``sbert-ray eval`` runs: every task's data checked first, then each task scored in this process (or
    encoding spread over ``workers`` Ray actors). With ``finetune``, argument-similarity tasks fine-tune a fresh
    copy of the model per fold first (``runs.argsim``) from that training config. With ``truncate_dims``, every
    task is scored at each of those embedding sizes (entries ``<entry>@<dim>``). ``precision="bf16"`` encodes with
    16-bit weights (``SentenceEncoder.to_precision``). With ``tracking_uri``, the evaluation is an MLflow run of
    ``experiment``."""
    check_tasks(tasks, data_dir, "--tasks")
    if device and workers == 1:  # encoded in this process (Ray workers bring their own GPUs)
        check_device_here(device)
    if precision != "fp32" and (finetune is not None or baseline == "tfidf"):
        raise ConfigError(f"precision {precision!r} encodes with the given model: not with fine-tuning or tf-idf")
    arguments = (model_ref, tasks, data_dir, batch_size, baseline, finetune, workers, device, allow_unsafe_weights)
    if tracking_uri is None:
        return _evaluate(*arguments, progress, truncate_dims, precision)
    run_name = f"eval {model_ref}" + (f" ({baseline})" if baseline else "")
    with RunTracker(tracking_uri, experiment, run_name=run_name) as tracker:
        tracker.set_tags(environment_tags())
        tracker.log_params(
            {
                "model.name": model_ref,
                "tasks": ",".join(task.spec for task in tasks),
                "mode": "finetune" if finetune else "unsupervised",
                "baseline": baseline or "none",
                "data_dir": str(data_dir or "Hugging Face Hub"),
                "batch_size": batch_size,
                "workers": workers,
                "truncate_dims": ",".join(map(str, truncate_dims)) or "none",
                "precision": precision,
            }
        )
        results = _evaluate(*arguments, progress, truncate_dims, precision)
        tracker.log_metrics(results)
        tracker.log_dict(nest(results), "evaluation.json")
        print(f"MLflow run {tracker.run_id} at {redact_uri(tracking_uri)}")
        return results


def _evaluate(
    model_ref,
    tasks,
    data_dir,
    batch_size,
    baseline,
    finetune,
    workers,
    device,
    allow_unsafe_weights,
    progress,
    truncate_dims,
    precision,
) -> Results:
    model = load_model(model_ref, baseline, allow_unsafe_weights)
    if precision != "fp32":  # cast on the device it will run on (its 16-bit type); Ray workers re-cast on theirs
        model.to(device if device and workers == 1 else "cpu").to_precision(precision)
    if truncate_dims:
        if max(truncate_dims) > model.embedding_dim:
            raise ConfigError(f"--truncate-dim {max(truncate_dims)}: the model has {model.embedding_dim} dimensions")
        model.truncate_dim = None  # every size is cut from the full embeddings, whatever the saved model truncates to
    if workers > 1:
        connect_ray()
        model = RayEncoder(model, workers, use_gpu=(device or "").startswith("cuda"))
    elif device:
        model.to(device)
    results: Results = {}
    try:
        for task in progress_bar(tasks, desc="tasks", unit="task"):
            start = time.perf_counter()
            if finetune is not None and isinstance(task, ArgsimTask):
                results |= finetune_argsim(task, finetune, data_dir)
            elif truncate_dims:
                results |= evaluate_at_dims(model, truncate_dims, lambda m, t=task: t.run(m, data_dir, batch_size))
            else:
                results |= task.run(model, data_dir, batch_size)
            progress(task, time.perf_counter() - start)
    finally:
        if workers > 1:
            model.close()
    return results
