"""``key=value`` overrides on the command line: dotted keys into the raw mapping, YAML values."""

from __future__ import annotations

import collections.abc
from typing import Any

import yaml

from sbert_ray.config.conversion import ConfigError
from sbert_ray.config.safe_yaml import parse_yaml, yaml_problem


def refuse_repeated_overrides(overrides: collections.abc.Sequence[str]) -> None:
    """``key=1 key=2``: which one the user meant is unknown, so neither is taken (as for a key twice in YAML)."""
    seen: dict[str, str] = {}
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in seen:
            raise ConfigError(f"override {key!r} is given twice ({seen[key]!r}, {item!r}); give it once")
        seen[key] = item


def apply_override(raw: dict[str, Any], item: str) -> None:
    """``a.b.0.c=value`` sets raw['a']['b'][0]['c'] = yaml(value). A list index must name an existing item, or
    the one just past the end (which appends: ``stages.1.dataset=...`` on a one-stage config adds a stage)."""
    key, sep, value = item.partition("=")
    if not sep or "" in key.split("."):
        raise ConfigError(f"override {item!r} is not of the form key=value (key: dotted names, e.g. model.pooling)")
    try:
        parsed = parse_yaml(value) if value != "" else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key!r}: {value!r} is not a YAML value ({yaml_problem(err)})") from None
    except RecursionError:
        raise ConfigError(f"override {key!r}: {value!r} is nested too deeply") from None
    parts = key.split(".")
    node: Any = raw
    for part, following in zip(parts, parts[1:], strict=False):
        node = _child(node, part, key, [] if following.isdigit() else {})
    _set_child(node, parts[-1], key, parsed)


def _child(node: Any, part: str, key: str, empty: list | dict) -> Any:
    """node[part], created as ``empty`` when missing or null (e.g. ``columns: null`` then ``columns.label=gold``)."""
    if isinstance(node, dict):
        if node.get(part) is None:
            node[part] = empty
        return node[part]
    if isinstance(node, list):
        index = _index(node, part, key)
        if index == len(node):
            node.append(empty)
        return node[index]
    raise ConfigError(f"override {key!r}: cannot set {part!r} inside a {type(node).__name__} value ({node!r})")


def _set_child(node: Any, part: str, key: str, value: Any) -> None:
    if isinstance(node, dict):
        node[part] = value
    elif isinstance(node, list):
        index = _index(node, part, key)
        node[index : index + 1] = [value]  # the index past the end appends
    else:
        raise ConfigError(f"override {key!r}: cannot set {part!r} inside a {type(node).__name__} value ({node!r})")


def _index(node: list, part: str, key: str) -> int:
    if not part.isdigit():
        raise ConfigError(f"override {key!r}: {part!r} must be a list index")
    index = int(part)
    if index > len(node):
        existing = f"0..{len(node) - 1} change an existing item, " if node else ""
        raise ConfigError(
            f"override {key!r}: index {index} is past the end of a list of {len(node)} "
            f"({existing}{len(node)} appends one)"
        )
    return index
