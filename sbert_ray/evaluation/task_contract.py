"""The contract of an evaluation task (what ``sbert-ray eval --tasks`` and ``evaluation.final_tasks`` name):
``check(data_dir)`` says before any work whether its data can be had (a ``DataError`` naming the missing file or the
unreachable Hub), ``run(model, data_dir, batch_size)`` scores a model and returns a flat
``{"<entry>/<metric>": number}`` mapping, and ``primary_metric`` names each entry's headline metric. Its own module so
that task families that load heavy libraries (``mteb_tasks``) build on it while ``tasks`` registers them lazily.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from sbert_ray.config import ConfigError
from sbert_ray.data.records import DataError

Results = dict[str, float]  # "<entry>/<metric>" -> value


class EvalTask(ABC):
    primary_metric: ClassVar[str]  # the headline metric of each entry, e.g. spearman_cosine
    path: str | Path | None = None  # the file or folder of a task that reads one (pairs:, afs:, wikisec:)

    def __init__(self, spec: str) -> None:
        self.spec = spec  # as the user wrote it, e.g. "senteval:MR,CR"

    def absolute_spec(self) -> str:
        """The spec with its file or folder made absolute, for processes in other working directories."""
        if not self.path or "://" in str(self.path):  # a URI is the same everywhere
            return self.spec
        return f"{self.spec.partition(':')[0]}:{Path(self.path).expanduser().resolve()}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    @abstractmethod
    def check(self, data_dir=None) -> None:
        """Raise DataError when the task's data cannot be had (missing file, unreachable Hub)."""

    def check_for(self, key: str, data_dir=None) -> None:
        """``check``, its error a ConfigError naming ``key`` (the flag or config key of the task) and the task."""
        try:
            self.check(data_dir)
        except DataError as err:
            raise ConfigError(f"{key}: task {self.spec!r}: {err}") from None

    @abstractmethod
    def run(self, model, data_dir=None, batch_size: int = 64) -> Results:
        """Score ``model`` (anything with a SentenceEncoder-like ``encode``)."""

    @abstractmethod
    def metric_names(self) -> tuple[str, ...]:
        """The metrics each entry's results carry at their top level (what ``evaluation.dev_metric`` may name)."""

    @abstractmethod
    def entries(self) -> tuple[str, ...]:
        """The entries its results will have (the first part of each key), known before any data is read."""

    def entry_scores(self, results: Results, metric: str) -> dict[str, float]:
        """{entry: its value of ``metric``} for the entries of ``results`` that have it."""
        return {
            entry: results[f"{entry}/{metric}"]
            for entry in dict.fromkeys(key.split("/")[0] for key in results)
            if f"{entry}/{metric}" in results
        }

    def primary_scores(self, results: Results) -> dict[str, float]:
        """{entry: its primary metric} for the entries of ``results`` that have one."""
        return self.entry_scores(results, self.primary_metric)
