"""Task registry behind ``sbert-ray eval --tasks``: each task name maps to a function returning {dataset: metrics}."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from sbert_ray.evaluation import sts

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


def parse_tasks(spec: str) -> list[str]:
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task {unknown or spec!r}; choose from {', '.join(TASKS)}")
    return tasks


def run_tasks(encoder, tasks: list[str], data_dir=None, batch_size: int = 64, similarities=("cosine",)) -> dict:
    options = {"batch_size": batch_size, "similarities": tuple(similarities)}
    results: dict[str, dict] = {}
    for task in tasks:
        results.update(TASKS[task](encoder, data_dir, options))
    return results


def write_json(results: dict, path: str | Path) -> None:
    """Write via a temporary file and rename, so a crash never leaves a truncated results file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)
