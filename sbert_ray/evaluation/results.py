"""Flat evaluation results (``{"<entry>/<metric>": number}``) as people read them: a printed table and the
nested JSON file README documents (``{"stsb": {"spearman_cosine": 82.03, "n": 1379}, ...}``).

A metric that has no value (a correlation over constant scores) is an ``Undefined``: NaN with the reason. As a
float it goes wherever scores go (MLflow, Ray, the printed table says "undefined"); the JSON shows it as null,
with the reason beside it: ``{"stsb": {"spearman_cosine": null, "undefined": {"spearman_cosine": "..."}}}``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

UNDEFINED_KEY = "undefined"  # in an entry of the nested JSON: metric -> why it has no value


class Undefined(float):
    """NaN that says why the metric has none."""

    reason: str

    def __new__(cls, reason: str) -> Undefined:
        value = super().__new__(cls, math.nan)
        value.reason = reason
        return value

    def __reduce__(self) -> tuple:  # Ray and Tune pickle results
        return Undefined, (self.reason,)

    def __repr__(self) -> str:
        return f"Undefined({self.reason!r})"


def nest(results: Mapping[str, float]) -> dict[str, Any]:
    """{"a/b/c": 1} -> {"a": {"b": {"c": 1}}}, the inverse of ``config.flatten(nested, sep="/")``, as JSON holds
    it: a NaN or infinite metric is null, and its reason is under the entry's "undefined" mapping."""
    nested: dict[str, Any] = {}
    for key, value in results.items():
        *path, last = key.split("/")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        if isinstance(value, float) and not math.isfinite(value):
            node[last] = None
            node.setdefault(UNDEFINED_KEY, {})[last] = getattr(value, "reason", f"not a number ({value})")
        else:
            node[last] = value
    return nested


def format_results(results: Mapping[str, float], primary: Mapping[str, str]) -> str:
    """Every number: a line per entry (its primary metric first) and an indented line per nested part (an STS
    sub-set, an argument-similarity fold). ``primary``: entry -> its primary metric."""
    groups: dict[str, dict[str, float]] = {}
    for key, value in results.items():
        head, _, metric = key.rpartition("/")
        groups.setdefault(head, {})[metric] = value
    lines = []
    for head, metrics in groups.items():
        entry = head.split("/")[0]
        first = primary.get(entry)
        keys = sorted(metrics, key=lambda k: k != first)
        numbers = "  ".join(f"{k} {_number(metrics[k])}" for k in keys)
        name = head if head == entry else f"  {head.removeprefix(entry + '/')}"
        lines.append(f"{name:<28} {numbers}")
    return "\n".join(lines)


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return "undefined"
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"
