"""Configs are dataclasses (``schema``) loaded from YAML (``safe_yaml``, ``loader``) plus ``key=value`` overrides
(``overrides``), converted from and to plain mappings (``conversion``); ``devices`` reads ``--device``.

Every key is checked against the dataclass fields (unknown keys are errors naming the dotted key and the file),
values are type-checked (a NaN or infinite number is refused anywhere), and ``validate()`` checks choices and
ranges, so a bad config fails before any Ray work starts. The names below are what the rest of the package imports.
"""

from sbert_ray.config.conversion import ConfigError, dump_yaml, flatten, from_dict, to_dict
from sbert_ray.config.devices import check_device_here, parse_device
from sbert_ray.config.loader import load_config
from sbert_ray.config.overrides import apply_override
from sbert_ray.config.safe_yaml import parse_yaml
from sbert_ray.config.schema import (
    RESOURCE_WAIT_S,
    DatasetSource,
    EvalConfig,
    ModelConfig,
    ScalingConfig,
    StageConfig,
    TrainConfig,
    check_folder_name,
)

__all__ = [
    "RESOURCE_WAIT_S",
    "ConfigError",
    "DatasetSource",
    "EvalConfig",
    "ModelConfig",
    "ScalingConfig",
    "StageConfig",
    "TrainConfig",
    "apply_override",
    "check_device_here",
    "check_folder_name",
    "dump_yaml",
    "flatten",
    "from_dict",
    "load_config",
    "parse_device",
    "parse_yaml",
    "to_dict",
]
