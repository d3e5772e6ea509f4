"""Flat evaluation results (``{"<entry>/<metric>": number}``) as people read them: a printed table and the
nested JSON file README documents (``{"stsb": {"spearman_cosine": 82.03, "n": 1379}, ...}``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def nest(results: Mapping[str, float]) -> dict[str, Any]:
    """{"a/b/c": 1} -> {"a": {"b": {"c": 1}}}; the inverse of ``config.flatten(nested, sep="/")``."""
    nested: dict[str, Any] = {}
    for key, value in results.items():
        *path, last = key.split("/")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
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
    return f"{value:.4f}" if abs(value) < 1 else f"{value:.2f}"
