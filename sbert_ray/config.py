"""Configs are dataclasses loaded from YAML plus ``key=value`` overrides.

Every key is checked against the dataclass fields (unknown keys are errors naming the dotted key and the file),
values are type-checked (``Literal`` types are choices; a NaN or infinite number is refused anywhere), and
``validate()`` checks choices and ranges, so a bad config fails before any Ray work starts. A stage's ``loss:``
settings are checked against its objective's loss class in the objective registry (``sbert_ray.losses.registry``).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from sbert_ray.losses.registry import OBJECTIVES, loss_settings
from sbert_ray.models.pooling import PoolingMode


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key (and file when known)."""


@dataclass
class ModelConfig:
    # A local folder, a Hub id, or "random:<shape>" (tiny|mini|small|base) for a randomly initialised BERT.
    name: str = "sentence-transformers/all-MiniLM-L6-v2"
    pooling: PoolingMode | None = None  # None keeps the model's own pooling (mean for a plain Hugging Face model)
    max_seq_length: int = 128  # tokens per text; longer texts are truncated (and counted in the training log)
    normalize: bool | None = None  # L2-normalise the embeddings; None keeps the saved model's setting
    # Weights are read from safetensors files only; True also allows pickled PyTorch files (pytorch_model.bin),
    # which can run code when loaded: only for models from a source you trust.
    allow_unsafe_weights: bool = False


@dataclass
class StageConfig:
    """One training stage: a dataset and an objective (the paper trains NLI, then STSb, in two stages)."""

    dataset: str = "stsb"  # a registered name (see sbert_ray.data) or a csv/tsv/jsonl path
    split: str = "train"  # the split of a registered dataset
    columns: dict[str, str] | None = None  # for user files: record field -> column name
    limit: int | None = None  # use only the first N examples (smoke runs); None = all
    errors: Literal["raise", "skip"] = "raise"  # a bad row stops the run, or is skipped, counted and logged
    score_max: float = 5.0  # score targets are score / score_max (STSb's 0-5 -> 0-1, as in the paper)
    objective: str = "regression"  # a name in sbert_ray.losses.registry.OBJECTIVES
    loss: dict[str, Any] = field(default_factory=dict)  # the objective's settings, e.g. {concat: [u, v, "|u-v|"]}
    matryoshka_dims: list[int] | None = None  # train the objective at each of these embedding sizes at once
    matryoshka_weights: list[float] | None = None  # one per size; default 1 each
    epochs: int = 1  # passes over the stage's data
    max_steps: int | None = None  # stop the stage after this many optimizer steps; None = run every epoch
    batch_size: int = 16  # global batch (summed over workers and accumulation steps)
    grad_accum_steps: int = 1  # micro-batches per optimizer step (each worker's share of batch_size split this often)
    learning_rate: float = 2e-5  # AdamW's peak rate, reached after warm-up, then decayed linearly to 0
    adam_eps: float = 1e-6  # AdamW's epsilon
    weight_decay: float = 0.01  # AdamW's decoupled weight decay (not on biases and LayerNorm weights)
    warmup_ratio: float = 0.1  # share of the stage's optimizer steps with a linear warm-up
    max_grad_norm: float = 1.0  # gradients are clipped to this global norm before each step


@dataclass
class EvalConfig:
    dev_dataset: str = "stsb"  # scored on every checkpoint: its Spearman picks the best checkpoints
    dev_split: str = "dev"  # the split of dev_dataset
    dev_limit: int | None = None  # score only the first N dev pairs; None = all
    eval_every: int = 0  # optimizer steps between dev evaluations; 0 = only at the end of each stage
    batch_size: int = 64  # sentences per encoding batch when scoring
    final_tasks: list[str] = field(default_factory=lambda: ["sts"])  # [] skips the final suite
    before_tasks: list[str] = field(default_factory=list)  # tasks scored on the model before training


@dataclass
class ScalingConfig:
    num_workers: int = 1  # Ray Train workers, i.e. data-parallel ranks (each its share of every global batch)
    use_gpu: bool = False  # train on GPUs (NCCL); else on CPUs (gloo)
    cpus_per_worker: float = 1.0  # CPUs Ray reserves for each worker
    gpus_per_worker: float = 1.0  # GPUs Ray reserves for each worker when use_gpu (a fraction only with one worker)
    torch_threads: int | None = None  # per worker; None = cpus_per_worker rounded up
    # Ray placement strategy of the workers: SPREAD puts them on different nodes where it can
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Training arithmetic. auto: on a GPU bf16 autocast where it has bf16 (Ampere and later), else fp16 autocast
    # with a gradient scaler (V100, T4); on CPUs fp32, so published numbers stay exact. Weights and optimizer
    # state stay fp32 in every mode.
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"

    def threads_per_worker(self) -> int:
        """Torch threads of each training worker (and of the evaluation that runs on a worker's resources)."""
        return self.torch_threads or max(1, math.ceil(self.cpus_per_worker))


@dataclass
class CheckpointConfig:
    storage_path: str = "~/sbert-ray/runs"  # stable across jobs so a resubmitted run resumes
    keep_best: int = 2  # checkpoints kept by dev Spearman, besides the latest
    max_failures: int = 2  # worker restarts from the latest checkpoint; -1 = no limit (Ray's meaning)


@dataclass
class TrackingConfig:
    tracking_uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else sqlite under ~/sbert-ray/mlflow
    experiment: str = "sbert-ray"  # the MLflow experiment of the run
    run_name: str | None = None  # the MLflow run's name; None: the config's name
    registered_model_name: str | None = None  # register the final model as a new version of this MLflow model
    alias: str | None = None  # and point this alias (e.g. "champion") at that version
    # How long the driver waits for a tracking store that stopped answering before it gives up (training itself
    # never waits: rank 0 keeps its metrics in a file of the run until the store answers again).
    wait_s: float = 600.0

    def validate(self) -> None:
        """MLflow's rules for registered model names and aliases, checked before any work starts."""
        if not self.wait_s >= 0:  # also refuses NaN
            raise ConfigError(f"tracking.wait_s must be >= 0, got {self.wait_s}")
        name, alias = self.registered_model_name, self.alias
        if name is not None and (not name.strip() or any(c in name for c in "/:")):
            raise ConfigError(f"tracking.registered_model_name: {name!r} must be non-empty without '/' or ':'")
        if alias is None:
            return
        if name is None:
            raise ConfigError("tracking.alias needs tracking.registered_model_name: an alias names a model version")
        if not re.fullmatch(r"[\w-]+", alias) or alias.lower() == "latest" or re.fullmatch(r"[vV]\d+", alias):
            raise ConfigError(
                f"tracking.alias: {alias!r} must be letters, digits, '_' or '-', and not 'latest' or 'v<number>' "
                "(MLflow reserves those for versions)"
            )


@dataclass
class TrainConfig:
    name: str = "sbert"  # the run's name: checkpoints live in <storage_path>/<name>; resubmitting resumes
    seed: int = 42  # seeds torch, numpy and Python on every worker, random model weights and data order
    data_dir: str | None = None  # default: $SBERT_RAY_DATA_DIR, else the Hugging Face Hub
    output_dir: str | None = None  # where the final model is written; default <storage_path>/<name>/final-model
    model: ModelConfig = field(default_factory=ModelConfig)  # the encoder to train
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig()])  # trained in order, in one run
    evaluation: EvalConfig = field(default_factory=EvalConfig)  # dev scoring during training, tasks before and after
    scaling: ScalingConfig = field(default_factory=ScalingConfig)  # workers, their resources and arithmetic
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # where checkpoints live, how many stay
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # the MLflow store, experiment and registry

    def validate(self) -> None:
        """Check what the types cannot say, naming the key; normalises each stage's ``loss`` settings to their declared
        types. Integer and positivity checks come before any arithmetic on the values (a zero worker count must be
        an error here, not a ZeroDivisionError further down)."""
        if not self.name or "/" in self.name or self.name in (".", ".."):
            raise ConfigError(f"name: {self.name!r} must be a folder name (checkpoints live in <storage_path>/<name>)")
        if not 0 <= self.seed < 2**32:
            raise ConfigError(f"seed must be in [0, 2**32), got {self.seed}")
        _at_least("model.max_seq_length", self.model.max_seq_length, 1)
        self._validate_scaling()
        if not self.stages:
            raise ConfigError("stages: at least one training stage is required")
        for i, stage in enumerate(self.stages):
            self._validate_stage(f"stages.{i}", stage)
        evaluation = self.evaluation
        _at_least("evaluation.dev_limit", evaluation.dev_limit, 2, none_means="all dev pairs")  # Spearman needs 2
        _at_least("evaluation.eval_every", evaluation.eval_every, 0)
        _at_least("evaluation.batch_size", evaluation.batch_size, 1)
        _at_least("checkpoint.keep_best", self.checkpoint.keep_best, 1)
        _at_least("checkpoint.max_failures", self.checkpoint.max_failures, -1)
        self.tracking.validate()

    def _validate_scaling(self) -> None:
        scaling = self.scaling
        _at_least("scaling.num_workers", scaling.num_workers, 1)
        _at_least("scaling.torch_threads", scaling.torch_threads, 1, none_means="cpus_per_worker rounded up")
        _greater("scaling.cpus_per_worker", scaling.cpus_per_worker, 0)
        _greater("scaling.gpus_per_worker", scaling.gpus_per_worker, 0)
        gpus = scaling.gpus_per_worker
        if scaling.use_gpu and gpus > 1 and not float(gpus).is_integer():
            raise ConfigError(f"scaling.gpus_per_worker: more than one GPU must be a whole number, got {gpus}")
        if scaling.use_gpu and scaling.num_workers > 1 and gpus < 1:
            # Ray would pack several ranks onto one GPU, and NCCL refuses two ranks on the same device.
            raise ConfigError(
                f"scaling.gpus_per_worker: {gpus} GPU per worker with scaling.num_workers={scaling.num_workers} "
                "would put several workers on one GPU, which NCCL refuses; use 1 or more"
            )

    def _validate_stage(self, key: str, stage: StageConfig) -> None:
        _choice(f"{key}.objective", stage.objective, tuple(OBJECTIVES))
        stage.loss = _loss_settings(f"{key}.loss", stage.objective, stage.loss)
        for name in ("epochs", "batch_size", "grad_accum_steps"):
            _at_least(f"{key}.{name}", getattr(stage, name), 1)
        _matryoshka(key, stage.matryoshka_dims, stage.matryoshka_weights)
        for name in ("limit", "max_steps"):  # 0 is not "no limit": that is null
            _at_least(f"{key}.{name}", getattr(stage, name), 1, none_means="no limit")
        for name in ("learning_rate", "adam_eps", "max_grad_norm", "score_max"):
            _greater(f"{key}.{name}", getattr(stage, name), 0)
        _at_least(f"{key}.weight_decay", stage.weight_decay, 0)
        if not 0 <= stage.warmup_ratio < 1:
            raise ConfigError(f"{key}.warmup_ratio must be in [0, 1), got {stage.warmup_ratio}")
        per_step = self.scaling.num_workers * stage.grad_accum_steps
        if stage.batch_size % per_step:
            raise ConfigError(
                f"{key}.batch_size={stage.batch_size} is the global batch and must be divisible by "
                f"scaling.num_workers * grad_accum_steps = {per_step}"
            )


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, choices))}")


def _loss_settings(key: str, objective: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The stage's loss settings checked against (and converted to) the loss class's keyword arguments."""
    declared = loss_settings(objective)
    unknown = sorted(set(settings) - set(declared))
    if unknown:
        known = ", ".join(declared) or "none"
        raise ConfigError(f"unknown key {key}.{unknown[0]!r} for objective {objective!r} (its settings: {known})")
    return {name: _convert(declared[name][0], value, f"{key}.{name}") for name, value in settings.items()}


def _at_least(key: str, value: float | None, low: float, none_means: str | None = None) -> None:
    if value is None and none_means:
        return
    if value < low:
        unset = f" (leave it out or null for {none_means})" if none_means else ""
        raise ConfigError(f"{key} must be >= {low}, got {value}{unset}")


def _greater(key: str, value: float, low: float) -> None:
    if not value > low:
        raise ConfigError(f"{key} must be > {low}, got {value}")


def _matryoshka(key: str, dims: list[int] | None, weights: list[float] | None) -> None:
    """Sizes and weights as far as they can be checked without the model (the run checks the model's size)."""
    if dims is None:
        if weights is not None:
            raise ConfigError(f"{key}.matryoshka_weights needs {key}.matryoshka_dims")
        return
    if not dims or min(dims) < 1 or len(set(dims)) != len(dims):
        raise ConfigError(f"{key}.matryoshka_dims: expected distinct positive sizes, got {dims}")
    if weights is not None and len(weights) != len(dims):
        raise ConfigError(f"{key}.matryoshka_weights: one weight per size in {dims}, got {weights}")


# ---------------------------------------------------------------------------------------------- loading


def load_config(path: str | Path | None, overrides: list[str] = (), cls: type = TrainConfig) -> Any:
    """Read ``path`` (YAML), apply ``key=value`` overrides (dotted keys, YAML values), build and validate."""
    raw: dict[str, Any] = {}
    source = "<overrides>"
    if path is not None:
        source = str(path)
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{path}: cannot read the config: {err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: invalid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys")
    try:
        for item in overrides:
            apply_override(raw, item)
        _check_finite(raw)
        config = from_dict(cls, raw)
        config.validate()
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return config


def apply_override(raw: dict[str, Any], item: str) -> None:
    """``a.b.0.c=value`` sets raw['a']['b'][0]['c'] = yaml(value). A list index must name an existing item, or
    the one just past the end (which appends: ``stages.1.dataset=...`` on a one-stage config adds a stage)."""
    key, sep, value = item.partition("=")
    if not sep or "" in key.split("."):
        raise ConfigError(f"override {item!r} is not of the form key=value (key: dotted names, e.g. model.pooling)")
    try:
        parsed = yaml.safe_load(value) if value != "" else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key!r}: {value!r} is not a YAML value ({err.__class__.__name__})") from None
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


def _check_finite(data: Any, prefix: str = "") -> None:
    """NaN and infinities (YAML .nan, .inf, 1e400) are never a meaningful setting; the message names the key."""
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key}: {v} is not a finite number")
        _check_finite(v, key)


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
        name: _convert(hints[name], value, f"{prefix}.{name}" if prefix else name) for name, value in data.items()
    }
    return cls(**kwargs)


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        _choice(key, value, typing.get_args(tp))
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (list, collections.abc.Sequence):
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_convert(inner, v, f"{key}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, inner = typing.get_args(tp)
        if inner is str:  # e.g. column names, which YAML may read as numbers
            return {str(k): str(v) for k, v in value.items()}
        return {str(k): _convert(inner, v, f"{key}.{k}") for k, v in value.items()}
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
