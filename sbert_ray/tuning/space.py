"""Sweep configs: a base training config, a search space over its dotted keys, and how Tune searches it.

    search_space:
      stages.0.learning_rate: {loguniform: [1.0e-5, 1.0e-4]}
      model.pooling: {choice: [mean, max, cls]}
      stages.0:                                  # a mapping value updates the mapping at that key, so an objective
        choice:                                  # is chosen together with the data it needs (named options)
          regression-stsb: {dataset: stsb, objective: regression}
          softmax-nli: {dataset: nli-offline, objective: softmax, concat: [u, v, "|u-v|"]}

Keys are the MLflow param names of a training run (``flatten`` of the config). Tune samples a *label* per key (the
value itself for a number or string, the option name or the option's JSON for anything else), so every searcher,
Optuna included, sees plain categorical values; ``SearchSpace.config`` turns labels back into a ``TrainConfig``.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ray import tune

from sbert_ray.config import ConfigError, EvalConfig, TrainConfig, check_folder_name, from_dict, to_dict
from sbert_ray.evaluation.dev_score import DEV_SCORE

KINDS = ("choice", "grid", "loguniform", "uniform")
SEARCHES = ("random", "grid", "optuna")  # random: Tune's variant generator (grid keys crossed, others sampled)
SCHEDULERS = ("asha", "fifo")
# What every trial reports: the dev score of base.evaluation (dev_task/dev_metric, or dev_tasks); higher is better.
METRIC = DEV_SCORE


@dataclass
class AshaConfig:
    grace_period: int = 1  # optimizer steps before a trial can be stopped (the first rung); a multiple of eval_every
    reduction_factor: float = 3.0  # each rung keeps the best 1/reduction_factor of the trials that reach it
    max_t: int = 1_000_000  # the highest rung, in steps; trials are never stopped for reaching it


@dataclass
class SweepConfig:
    name: str = "sweep"  # the Tune experiment: <base.checkpoint.storage_path>/<name>; --resume continues it
    base: TrainConfig = field(default_factory=TrainConfig)  # what every trial starts from (its name is replaced)
    search_space: dict[str, dict[str, Any]] = field(default_factory=dict)  # dotted key -> {kind: options}
    num_samples: int = 1  # trials to sample; with grid keys, repetitions of the whole grid
    search: str = "random"  # random or grid (Tune's variant generator), optuna (TPE)
    scheduler: str = "asha"  # asha: stop trials early on the dev metric; fifo: run every trial to the end
    asha: AshaConfig = field(default_factory=AshaConfig)  # the ASHA scheduler's rungs
    # Default: as many trials as the cluster's CPUs / GPUs fit, counting the nodes its autoscaler may still start
    # where it publishes its maximum (else the nodes it has at the start: set this on a `ray up` cluster)
    max_concurrent_trials: int | None = None
    retrain_best: bool = False  # retrain the best config on the full training data, score the STS suite

    def validate(self) -> None:
        try:
            self.base.validate()
        except ConfigError as err:
            raise ConfigError(f"base.{err}") from None
        if self.base.scaling.elastic:
            raise ConfigError(
                f"base.scaling.num_workers: {self.base.scaling.num_workers} is elastic; a sweep's trials train at a "
                "fixed size (concurrent trials are sized from it, and a trial that grew would take another's "
                "workers): give one number"
            )
        check_folder_name("name", self.name, "a sweep lives in <base.checkpoint.storage_path>/<name>")
        if self.search not in SEARCHES:
            raise ConfigError(f"search: {self.search!r} is not one of {', '.join(SEARCHES)}")
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"scheduler: {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
        if self.num_samples < 1 or (self.max_concurrent_trials is not None and self.max_concurrent_trials < 1):
            raise ConfigError("num_samples and max_concurrent_trials must be >= 1")
        if self.asha.grace_period < 1 or self.asha.reduction_factor <= 1 or self.asha.max_t < self.asha.grace_period:
            raise ConfigError("asha: needs grace_period >= 1, reduction_factor > 1 and max_t >= grace_period")
        space = SearchSpace(self.base, self.search_space)
        kinds = {p.kind for p in space.params}
        if self.search == "grid" and kinds - {"grid"}:
            raise ConfigError("search: grid needs every search_space key to be a grid")
        if self.search == "optuna" and "grid" in kinds:
            raise ConfigError("search: optuna samples its own points; use choice instead of grid")
        dev = _dev_settings(self.base.evaluation)
        for config in space.extreme_configs():  # every combination of options builds a valid training config
            if config.scaling.elastic:
                raise ConfigError("search_space: scaling.num_workers must stay one number (sweeps are not elastic)")
            if _dev_settings(config.evaluation) != dev:
                raise ConfigError(
                    "search_space: trials are ranked by one dev score, scored one way; set evaluation.dev_task, "
                    "dev_metric, dev_tasks, async_dev, dev_resources and dev_workers in base, not in the search space"
                )


def _dev_settings(evaluation: EvalConfig) -> tuple:
    """What the dev score is and where it is computed, as the config sets it."""
    return (
        evaluation.dev_task,
        evaluation.dev_metric,
        evaluation.dev_tasks,
        evaluation.async_dev,
        evaluation.dev_resources,
        evaluation.dev_workers,
    )


@dataclass(frozen=True)
class Param:
    key: str  # a dotted training-config key, e.g. stages.0.learning_rate
    kind: str  # one of KINDS
    options: dict[Any, Any]  # choice / grid: label -> value; empty for ranges
    bounds: tuple[float, float] = (0.0, 0.0)  # loguniform / uniform: [low, high]

    @classmethod
    def parse(cls, key: str, spec: Any) -> Param:
        where = f"search_space.{key}"
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise ConfigError(f"{where}: expected one of {{{' | '.join(KINDS)}: ...}}, got {spec!r}")
        ((kind, arg),) = spec.items()
        if kind in ("choice", "grid"):
            if isinstance(arg, dict):
                options = {str(name): value for name, value in arg.items()}
            elif isinstance(arg, list):
                options = {_label(value): value for value in arg}
            else:
                raise ConfigError(f"{where}.{kind}: expected a list or a mapping of named options, got {arg!r}")
            if not options:
                raise ConfigError(f"{where}.{kind}: needs at least one option")
            return cls(key, kind, options)
        if not (isinstance(arg, list) and len(arg) == 2 and all(_is_number(v) for v in arg)):
            raise ConfigError(f"{where}.{kind}: expected [low, high], got {arg!r}")
        low, high = (float(v) for v in arg)
        if not low < high or (kind == "loguniform" and low <= 0):
            raise ConfigError(f"{where}.{kind}: needs {'0 < ' if kind == 'loguniform' else ''}low < high, got {arg}")
        return cls(key, kind, {}, (low, high))

    def domain(self) -> Any:
        """What Tune samples for this key."""
        if self.kind == "choice":
            return tune.choice(list(self.options))
        if self.kind == "grid":
            return tune.grid_search(list(self.options))
        return (tune.loguniform if self.kind == "loguniform" else tune.uniform)(*self.bounds)

    def value(self, sampled: Any) -> Any:
        """The config value for what Tune sampled (a label for choice / grid)."""
        return self.options[sampled] if self.options else sampled

    def extremes(self) -> list[Any]:
        """Labels that cover what this key can take: every option, or both ends of a range."""
        return list(self.options) if self.options else list(self.bounds)


class SearchSpace:
    """The base config plus the searched keys; builds each trial's ``TrainConfig`` from what Tune sampled."""

    def __init__(self, base: TrainConfig, spec: dict[str, dict[str, Any]]):
        self.base = base
        # A whole mapping (stages.0) applies before keys inside it (stages.0.batch_size), which then win.
        self.params = sorted((Param.parse(k, v) for k, v in spec.items()), key=lambda p: p.key.count("."))

    def param_space(self) -> dict[str, Any]:
        return {p.key: p.domain() for p in self.params}

    def config(self, sampled: dict[str, Any]) -> TrainConfig:
        raw = to_dict(self.base)
        for param in self.params:
            _set(raw, param.key, param.value(sampled[param.key]))
        config = from_dict(TrainConfig, raw)
        config.validate()
        return config

    def grid_size(self) -> int:
        """Points of the grid keys crossed: the trials of one sample (num_samples repeats them)."""
        return math.prod(len(p.options) for p in self.params if p.kind == "grid")

    def extreme_configs(self) -> Iterator[TrainConfig]:
        """The config of every combination of extremes (checks all options and sizes the trials before Ray runs)."""
        keys = [p.key for p in self.params]
        for combination in itertools.product(*(p.extremes() for p in self.params)):
            sampled = dict(zip(keys, combination, strict=True))
            try:
                yield self.config(sampled)
            except ConfigError as err:
                raise ConfigError(f"search_space at {sampled}: {err}") from None


def _set(raw: dict[str, Any], key: str, value: Any) -> None:
    """raw[a][b][0][c] = value for key a.b.0.c; a mapping value updates the mapping already there."""
    *path, last = key.split(".")
    node: Any = raw
    for part in path:
        node = node[_slot(node, part, key)]
    slot = _slot(node, last, key)
    node[slot] = {**node[slot], **value} if isinstance(value, dict) and isinstance(node[slot], dict) else value


def _slot(node: Any, part: str, key: str) -> str | int:
    if isinstance(node, dict) and part in node:
        return part
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return int(part)
    raise ConfigError(f"search_space: {key!r} is not a key of the training config (no {part!r} there)")


def _label(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool) else json.dumps(value)


def _is_number(value: Any) -> bool:
    if isinstance(value, str):  # YAML reads 1e-5 (without a dot) as a string
        try:
            float(value)
        except ValueError:
            return False
        return True
    return isinstance(value, int | float) and not isinstance(value, bool)
