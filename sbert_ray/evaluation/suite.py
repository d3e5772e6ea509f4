"""Task registry behind ``sbert-ray eval --tasks``: each task name maps to a function returning {dataset: metrics}."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from sbert_ray.config import ConfigError
from sbert_ray.evaluation import argsim, senteval, sts, triplets

TaskFn = Callable[..., dict[str, dict]]

TASKS: dict[str, TaskFn] = {
    "sts": lambda encoder, data_dir, options: sts.run_sts_suite(
        encoder, data_dir, batch_size=options["batch_size"], similarities=options["similarities"]
    ),
}
for _name in sts.STS_DATASETS:  # every STS dataset on its own, e.g. --tasks stsb,sickr
    TASKS[_name] = lambda encoder, data_dir, options, _name=_name: sts.run_sts_suite(
        encoder,
        data_dir,
        datasets=(_name,),
        batch_size=options["batch_size"],
        similarities=options["similarities"],
    )


for _name in argsim.ARGSIM_DATASETS:  # afs:<folder> reads the AFS csv files from there
    TASKS[_name] = lambda encoder, data_dir, options, _name=_name: argsim.evaluate_argsim(
        encoder,
        _name,
        data_dir,
        mode=options.get("mode", "unsupervised"),
        batch_size=options["batch_size"],
        train_config=options.get("train_config"),
        path=options.get("argument"),
    )
for _name in triplets.TRIPLET_DATASETS:  # wikisec:<file.csv> reads a Sentence1/2/3 CSV
    TASKS[_name] = lambda encoder, data_dir, options, _name=_name: {
        _name: triplets.evaluate_triplets(
            encoder, triplets.load_triplets(_name, data_dir, options.get("argument")), options["batch_size"]
        )
    }
TASKS["senteval"] = lambda encoder, data_dir, options: senteval.run_senteval(  # senteval:MR,CR picks tasks
    encoder,
    data_dir,
    tasks=options["argument"].split(",") if options.get("argument") else senteval.SENTEVAL_TASKS,
    batch_size=options["batch_size"],
)

# The primary metric of an entry: the first of these it has (each evaluator's headline number).
PRIMARY_METRICS = ("spearman_cosine", "accuracy_euclidean", "accuracy")


def format_results(results: dict[str, dict]) -> str:
    """Every number: one line per entry (primary metric first), an indented line per nested part (folds, subsets)."""

    def numbers(metrics: dict) -> str:
        keys = sorted(
            (k for k, v in metrics.items() if isinstance(v, int | float)), key=lambda k: k != primary_metric(metrics)
        )
        return "  ".join(f"{k} {_number(metrics[k])}" for k in keys)

    lines = []
    for name, metrics in results.items():
        lines.append(f"{name:<16} {numbers(metrics)}")
        for part, parts in ((k, v) for k, v in metrics.items() if isinstance(v, dict)):
            lines += [f"  {part}/{sub:<20} {numbers(m)}" for sub, m in parts.items()]
    return "\n".join(lines)


def primary_metric(metrics: dict) -> str | None:
    """The entry's headline metric (for logging and tables), None for an entry without one."""
    return next((key for key in PRIMARY_METRICS if key in metrics), None)


def metric_items(results: dict[str, dict], prefix: str) -> dict[str, float]:
    """Every top-level number as ``<prefix>/<dataset>/<metric>``: how results are logged to MLflow."""
    return {
        f"{prefix}/{name}/{key}": value
        for name, metrics in results.items()
        for key, value in metrics.items()
        if isinstance(value, int | float)
    }


def primary_scores(results: dict[str, dict]) -> dict[str, float]:
    """{dataset: its primary metric's value} for the entries that have one."""
    return {name: m[key] for name, m in results.items() if (key := primary_metric(m)) is not None}


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"


def parse_tasks(spec: str) -> list[str]:
    """Comma-separated task names; ``name:argument`` passes an argument (a path, or SentEval task names, whose
    own commas continue it: ``senteval:MR,CR,bws`` = SentEval MR and CR, then bws)."""
    tasks: list[str] = []
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        if tasks and ":" in tasks[-1] and token.partition(":")[0] not in TASKS:
            tasks[-1] += f",{token}"
        else:
            tasks.append(token)
    unknown = [t for t in tasks if t.partition(":")[0] not in TASKS]
    if unknown or not tasks:
        raise ConfigError(f"unknown task {unknown or spec!r}; choose from {', '.join(TASKS)}")
    return tasks


def run_tasks(
    encoder, tasks: list[str], data_dir=None, batch_size: int = 64, similarities=("cosine",), **options
) -> dict:
    """Every task's {entry: metrics}; extra options (mode, train_config) go to the tasks that use them."""
    results: dict[str, dict] = {}
    for task in tasks:
        name, _, argument = task.partition(":")
        task_options = {"batch_size": batch_size, "similarities": tuple(similarities), "argument": argument}
        results.update(TASKS[name](encoder, data_dir, task_options | options))
    return results


def write_json(results: dict, path: str | Path) -> None:
    """Write via a temporary file and rename, so a crash never leaves a truncated results file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)
