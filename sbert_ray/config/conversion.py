"""Plain mappings (YAML, overrides, the dict a worker receives) to config dataclasses and back, and the
``ConfigError`` every config check raises. Every key is checked against the dataclass fields (an unknown key is an
error naming the dotted key) and every value against its field's type (``Literal`` types are choices)."""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import types
import typing
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key (and file when known)."""


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a plain mapping, rejecting unknown keys and wrongly typed values."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {where}{unknown[0]!r} (known: {', '.join(sorted(names))})")
    kwargs = {
        name: convert_value(hints[name], value, f"{prefix}.{name}" if prefix else name) for name, value in data.items()
    }
    return cls(**kwargs)


def convert_value(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        check_choice(key, value, typing.get_args(tp))
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        choices = [a for a in inner if typing.get_origin(a) is Literal]
        if len(inner) > 1 and isinstance(value, str) and choices:  # e.g. bool | Literal["auto"]: a word is a choice
            inner = choices
        elif len(inner) > 1:  # e.g. int | list[int]: the alternative of the value's kind
            listed = [a for a in inner if typing.get_origin(a) is list]
            inner = listed if isinstance(value, list) and listed else [a for a in inner if a not in listed]
        return convert_value(inner[0], value, key)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (list, collections.abc.Sequence):
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [convert_value(inner, v, f"{key}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, inner = typing.get_args(tp)
        if inner is str:  # e.g. column names, which YAML may read as numbers
            return {str(k): str(v) for k, v in value.items()}
        return {str(k): convert_value(inner, v, f"{key}.{k}") for k, v in value.items()}
    if tp is float and (isinstance(value, str) or isinstance(value, int | float) and not isinstance(value, bool)):
        try:  # YAML reads "2e-5" (no dot) as a string
            number = float(value)
        except (ValueError, OverflowError):
            number = None
        if number is not None and math.isfinite(number):
            return number
        if number is not None:
            raise ConfigError(f"{key}: {value!r} is not a finite number")
    if tp is Any or (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        return value
    raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def flatten(data: Any, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """{'a': {'b': 1}, 'l': [{'c': 2}]} -> {'a.b': 1, 'l.0.c': 2}: configs as MLflow params and sweep keys, and
    (with sep="/") nested evaluation results as flat ``entry/metric`` keys. Lists of plain values stay values."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else None
    if items is None or (isinstance(data, list) and not any(isinstance(v, dict | list) for v in data)):
        return {prefix: data}
    flat: dict[str, Any] = {}
    for k, v in items:
        flat.update(flatten(v, f"{prefix}{sep}{k}" if prefix else str(k), sep))
    return flat


def dump_yaml(config: Any) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
