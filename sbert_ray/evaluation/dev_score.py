"""The dev score: one number per checkpoint that keeps the best checkpoints, ranks a sweep's trials and drives ASHA.

By default the STSb dev Spearman of the paper (the scored pairs of ``evaluation.dev_dataset`` / ``dev_split``, the
first ``dev_limit`` of them). ``evaluation.dev_task`` names any evaluation task instead (``stsb-retrieval:dev``,
``retrieval:<folder>``, ``pairs:<file>``, ...) and ``evaluation.dev_metric`` one of its metrics (default: the task's
primary metric); a task with several entries (``sts``, ``senteval``) scores the mean of their values. Higher is
better for every metric a task reports.

Ray Train reports carry the score as ``dev_score`` (``DEV_SCORE``); MLflow logs it as ``dev/<metric>``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sbert_ray.config import ConfigError, EvalConfig
from sbert_ray.data.readers import load_records
from sbert_ray.evaluation.sts import evaluate_pairs
from sbert_ray.evaluation.tasks import EvalTask, correlation_names, parse_tasks

DEV_SCORE = "dev_score"  # the key of the dev score in Ray Train reports: keep-best attribute and Tune's metric
DEV_PAIRS_METRIC = "spearman_cosine"  # the default dev metric (of the dev pairs)
DEV_PAIRS_METRICS = correlation_names(("cosine",))  # what the dev pairs are scored by


@dataclass(frozen=True)
class DevSpec:
    """What the dev score is, resolved from the config once: a task (None: the dev pairs) and its metric."""

    task: EvalTask | None
    metric: str

    def to_wire(self) -> dict:
        """Primitives, for other processes: the task's spec (absolute where the driver made it so) and the metric."""
        return {"task": self.task.spec if self.task else None, "metric": self.metric}

    @classmethod
    def from_wire(cls, wire: dict) -> DevSpec:
        return cls(_dev_task(wire["task"]), wire["metric"])


def dev_spec(evaluation: EvalConfig, absolute: bool = False) -> DevSpec:
    """The dev task and metric of ``evaluation``, or a ConfigError naming the key (an unknown task or metric, or a
    dev_task that is not exactly one task). Reads no data. ``absolute``: the task's file or folder made absolute."""
    task = _dev_task(evaluation.dev_task, absolute)
    known = task.metric_names() if task else DEV_PAIRS_METRICS
    metric = evaluation.dev_metric or (task.primary_metric if task else DEV_PAIRS_METRIC)
    if metric not in known:
        scored = f"task {task.spec!r}" if task else f"the dev pairs of {evaluation.dev_dataset!r}"
        raise ConfigError(
            f"evaluation.dev_metric: {metric!r} is not a metric of {scored}; choose from {', '.join(known)}"
        )
    return DevSpec(task, metric)


def _dev_task(spec: str | None, absolute: bool = False) -> EvalTask | None:
    """The one task of ``evaluation.dev_task`` (None: the dev pairs score)."""
    if spec is None:
        return None
    tasks = parse_tasks(spec, key="evaluation.dev_task", absolute=absolute)
    if len(tasks) != 1:
        raise ConfigError(f"evaluation.dev_task: one task, got {len(tasks)} ({spec!r})")
    return tasks[0]


class DevScorer:
    """Scores an encoder on the dev set: ``score(encoder)`` is the dev score, ``metric`` its name."""

    def __init__(self, evaluation: EvalConfig, data_dir=None, spec: DevSpec | None = None) -> None:
        spec = spec or dev_spec(evaluation)  # ``spec``: as the driver resolved it (``runs.plan``)
        self.task, self.metric, self.data_dir = spec.task, spec.metric, data_dir
        self.batch_size = evaluation.batch_size
        self.pairs = None
        if self.task is None:  # read once: the dev pairs are scored at every checkpoint
            pairs = load_records(evaluation.dev_dataset, evaluation.dev_split, data_dir)
            self.pairs = pairs[: evaluation.dev_limit] if evaluation.dev_limit else pairs

    def score(self, encoder) -> float:
        if self.task is None:
            return evaluate_pairs(encoder, self.pairs, batch_size=self.batch_size)[self.metric]
        values = self.task.entry_scores(self.task.run(encoder, self.data_dir, self.batch_size), self.metric)
        return float(np.mean(list(values.values())))
