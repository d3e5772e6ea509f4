"""A config file and ``key=value`` overrides to a validated config; every error names the file (or
``<overrides>``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from sbert_ray.config.conversion import ConfigError, from_dict
from sbert_ray.config.overrides import apply_override, refuse_repeated_overrides
from sbert_ray.config.safe_yaml import parse_yaml, yaml_problem
from sbert_ray.config.schema import TrainConfig


def load_config(path: str | Path | None, overrides: list[str] = (), cls: type = TrainConfig) -> Any:
    """Read ``path`` (YAML), apply ``key=value`` overrides (dotted keys, YAML values), build and validate."""
    raw: dict[str, Any] = {}
    source = "<overrides>"
    if path is not None:
        source = str(path)
        raw = _read_config_file(path)
    try:
        refuse_repeated_overrides(overrides)
        for item in overrides:
            apply_override(raw, item)
        _check_finite(raw)
        config = from_dict(cls, raw)
        config.validate()
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return config


def _read_config_file(path: str | Path) -> dict[str, Any]:
    try:
        raw = parse_yaml(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the config: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}, {yaml_problem(err)}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    if not raw:  # nothing but comments, or `{}`: training every default is never what was meant
        raise ConfigError(f"{path}: the config is empty (no keys: {{}}, only comments or nothing); give a key")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys")
    return raw


def _check_finite(data: Any, prefix: str = "") -> None:
    """NaN and infinities (YAML .nan, .inf, 1e400) are never a meaningful setting; the message names the key."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key}: {v} is not a finite number")
        _check_finite(v, key)
