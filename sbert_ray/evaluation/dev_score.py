"""The dev score: one number per checkpoint that keeps the best checkpoints, ranks a sweep's trials and drives ASHA.

By default the STSb dev Spearman of the paper (the scored pairs of ``evaluation.dev_dataset`` / ``dev_split``, the
first ``dev_limit`` of them). ``evaluation.dev_task`` names any evaluation task instead (``stsb-retrieval:dev``,
``retrieval:<folder>``, ``pairs:<file>``, ...) and ``evaluation.dev_metric`` one of its metrics (default: the task's
primary metric); a task with several entries (``sts``, ``senteval``) scores the mean of their values. Higher is
better for every metric a task reports. ``evaluation.dev_tasks`` ({task, metric, weight} each) makes the dev score
the weighted mean of several tasks' metrics (a model selected for retrieval and STS at once).

A reranker (``model.type: cross_encoder``) has no embeddings: its dev score is the correlation of its pair scores
(``CrossEncoder.predict``'s sigmoid of the logit) with the dev pairs' gold scores, ``spearman_pair_score`` by
default (or ``pearson_pair_score``). A reranking task may be added beside it as a dev task; none scores one yet.

Ray Train reports carry the score as ``dev_score`` (``DEV_SCORE``); MLflow logs it as ``dev/<metric>`` (with several
dev tasks ``dev/weighted_mean``, beside each task's ``dev/<task>/<metric>``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sbert_ray.config import ConfigError, EvalConfig
from sbert_ray.data.readers import load_records
from sbert_ray.evaluation.sts import evaluate_pair_scores, evaluate_pairs
from sbert_ray.evaluation.tasks import EvalTask, correlation_names, parse_tasks
from sbert_ray.models.model_type import ModelType

DEV_SCORE = "dev_score"  # the key of the dev score in Ray Train reports: keep-best attribute and Tune's metric
DEV_PAIRS_METRIC = "spearman_cosine"  # the default dev metric (of the dev pairs)
DEV_PAIRS_METRICS = correlation_names(("cosine",))  # what the dev pairs are scored by
# A reranker's: the correlations of its pair scores with the gold scores (``sts.evaluate_pair_scores``)
RERANKER_DEV_PAIRS_METRIC = "spearman_pair_score"
RERANKER_DEV_PAIRS_METRICS = correlation_names(("pair_score",))


WEIGHTED_MEAN = "weighted_mean"  # the dev score's name with several dev tasks (dev/weighted_mean)


@dataclass(frozen=True)
class DevPart:
    """One scored part of the dev score: a task (None: the dev pairs), its metric and its weight in the mean."""

    task: EvalTask | None
    metric: str
    weight: float = 1.0
    key: str = "evaluation.dev_task"  # the config key naming the task, for errors

    @property
    def label(self) -> str:
        """The task as logged, dev/<label>/<metric>: its one entry (stsb-dev), or its kind (sts, senteval)."""
        entries = self.task.entries()
        return entries[0] if len(entries) == 1 else self.task.spec.partition(":")[0]


@dataclass(frozen=True)
class DevSpec:
    """What the dev score is, resolved from the config once: its parts (one, unless ``evaluation.dev_tasks``)."""

    parts: tuple[DevPart, ...]

    @property
    def metric(self) -> str:
        """The dev score's name, logged as dev/<metric>: the one part's metric, or the weighted mean of several."""
        return self.parts[0].metric if len(self.parts) == 1 else WEIGHTED_MEAN

    @property
    def reads_dev_pairs(self) -> bool:
        return any(part.task is None for part in self.parts)

    def to_wire(self) -> list[dict]:
        """Primitives, for other processes: each task's spec (absolute where the driver made it so), metric, weight."""
        return [
            {"task": p.task.spec if p.task else None, "metric": p.metric, "weight": p.weight, "key": p.key}
            for p in self.parts
        ]

    @classmethod
    def from_wire(cls, wire: list[dict]) -> DevSpec:
        return cls(tuple(DevPart(_dev_task(p["task"], key=p["key"]), p["metric"], p["weight"], p["key"]) for p in wire))

    def checked(self, data_dir) -> None:
        """Every dev task's data can be had (a ConfigError naming its key and the task)."""
        for part in self.parts:
            if part.task:
                part.task.check_for(part.key, data_dir)


def dev_spec(evaluation: EvalConfig, absolute: bool = False, model_type: ModelType = "bi_encoder") -> DevSpec:
    """The dev tasks and metrics of ``evaluation``, or a ConfigError naming the key (an unknown task or metric, or a
    dev task that is not exactly one task). Reads no data. ``absolute``: each task's file or folder made absolute.
    ``model_type``: the model scored (``model.type``), whose dev pairs have their own metrics."""
    if not evaluation.dev_tasks:
        dev_task = evaluation.dev_task
        return DevSpec((_dev_part("evaluation.dev_task", dev_task, evaluation, absolute, model_type=model_type),))
    parts = tuple(
        _dev_part(f"evaluation.dev_tasks.{i}", entry.task, evaluation, absolute, entry.metric, entry.weight)
        for i, entry in enumerate(evaluation.dev_tasks)
    )
    names = [(part.label, part.metric) for part in parts]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated:
        raise ConfigError(f"evaluation.dev_tasks: {'/'.join(repeated)} is named twice; name each task and metric once")
    return DevSpec(parts)


def _dev_part(
    key: str,
    spec: str | None,
    evaluation: EvalConfig,
    absolute: bool,
    metric: str | None = None,
    weight: float = 1.0,
    model_type: ModelType = "bi_encoder",
) -> DevPart:
    """One dev task (``spec``; None: the dev pairs) and its metric: ``metric``, else evaluation.dev_metric, else the
    task's primary metric (the dev pairs': the model type's)."""
    task_key = f"{key}.task" if evaluation.dev_tasks else key
    task = _dev_task(spec, absolute, task_key)
    reranker = model_type == "cross_encoder"
    pairs_metrics, pairs_metric = (
        (RERANKER_DEV_PAIRS_METRICS, RERANKER_DEV_PAIRS_METRIC) if reranker else (DEV_PAIRS_METRICS, DEV_PAIRS_METRIC)
    )
    known = task.metric_names() if task else pairs_metrics
    metric = metric or evaluation.dev_metric or (task.primary_metric if task else pairs_metric)
    if metric not in known:
        model = " (a reranker's)" if reranker else ""
        scored = f"task {task.spec!r}" if task else f"the dev pairs of {evaluation.dev_dataset!r}{model}"
        metric_key = f"{key}.metric" if evaluation.dev_tasks else "evaluation.dev_metric"
        raise ConfigError(f"{metric_key}: {metric!r} is not a metric of {scored}; choose from {', '.join(known)}")
    return DevPart(task, metric, weight, task_key)


def _dev_task(spec: str | None, absolute: bool = False, key: str = "evaluation.dev_task") -> EvalTask | None:
    """The one task of a dev task's spec (None: the dev pairs score)."""
    if spec is None:
        return None
    tasks = parse_tasks(spec, key=key, absolute=absolute)
    if len(tasks) != 1:
        raise ConfigError(f"{key}: one task, got {len(tasks)} ({spec!r})")
    return tasks[0]


class DevScorer:
    """Scores an encoder on the dev set: ``scores(encoder)`` are the dev score's MLflow metrics, ``key`` the one of
    them that is the dev score."""

    def __init__(self, evaluation: EvalConfig, data_dir=None, spec: DevSpec | None = None) -> None:
        self.spec = spec or dev_spec(evaluation)  # ``spec``: as the driver resolved it (``runs.plan``)
        self.key = f"dev/{self.spec.metric}"
        self.data_dir, self.batch_size = data_dir, evaluation.batch_size
        self.pairs = None
        if self.spec.reads_dev_pairs:  # read once: the dev pairs are scored at every checkpoint
            pairs = load_records(evaluation.dev_dataset, evaluation.dev_split, data_dir)
            self.pairs = pairs[: evaluation.dev_limit] if evaluation.dev_limit else pairs

    def scores(self, encoder) -> dict[str, float]:
        """{dev/<metric>: the dev score}; with several dev tasks also each one's dev/<label>/<metric>, of which the
        dev score is the weighted mean."""
        values = [self._score(part, encoder) for part in self.spec.parts]
        if len(values) == 1:
            return {self.key: values[0]}
        weights = [part.weight for part in self.spec.parts]
        each = {f"dev/{part.label}/{part.metric}": value for part, value in zip(self.spec.parts, values, strict=True)}
        return {**each, self.key: float(np.average(values, weights=weights))}

    def _score(self, part: DevPart, encoder) -> float:
        """A task with several entries (sts, senteval) scores the mean of their values."""
        if part.task is None and part.metric in RERANKER_DEV_PAIRS_METRICS:
            return evaluate_pair_scores(encoder, self.pairs, batch_size=self.batch_size)[part.metric]
        if part.task is None:
            return evaluate_pairs(encoder, self.pairs, batch_size=self.batch_size)[part.metric]
        results = part.task.run(encoder, self.data_dir, self.batch_size)
        return float(np.mean(list(part.task.entry_scores(results, part.metric).values())))
