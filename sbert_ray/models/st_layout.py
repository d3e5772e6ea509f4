"""The sentence-transformers folder layout, read and written so that either library loads the other's models.

modules.json                  [Transformer at "", Pooling at "1_Pooling", Normalize at "2_Normalize"]
sentence_bert_config.json     {"max_seq_length": ..., "do_lower_case": false}
config_sentence_transformers.json   {"model_type": "SentenceTransformer", "truncate_dim": k when set,
                              "prompts": {name: text}, "default_prompt_name": name when there are prompts}
1_Pooling/config.json         pooling flags (the classic format every sentence-transformers version reads), and
                              "include_prompt": false when prompt tokens are left out of pooling
config.json, model.safetensors, tokenizer files   (written by transformers' save_pretrained)

Reading a folder is also where it is checked: module paths stay inside the folder, and weights are safetensors
files whose headers read (pickled PyTorch weights only when the caller allows them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from safetensors import SafetensorError, safe_open
from transformers.utils import cached_file

from sbert_ray.data.records import DataError
from sbert_ray.models.pooling import PoolingMode
from sbert_ray.models.prompts import check_prompts

SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")


class ModelError(DataError):
    """A model folder cannot be used as it is; the message names the file. A kind of DataError, so every entry
    point that reports bad input reports it in one line."""


# Classic 1_Pooling/config.json flags and the newer single "pooling_mode" key, mapped to our modes.
_POOLING_FLAGS: dict[str, PoolingMode] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_POOLING_NAMES: dict[str, PoolingMode] = {mode: mode for mode in _POOLING_FLAGS.values()}


@dataclass(frozen=True)
class StLayout:
    """What a saved sentence-transformers folder says beyond the Hugging Face model itself."""

    transformer_subfolder: str
    pooling: PoolingMode
    normalize: bool
    max_seq_length: int | None  # None: not recorded (sentence-transformers >= 6 keeps it in the tokenizer)
    truncate_dim: int | None  # embeddings are cut to their first truncate_dim values (Matryoshka models)
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before the input
    default_prompt_name: str | None = None  # the prompt an input gets when the caller names none
    include_prompt: bool = True  # pooling includes the prompt's tokens (sentence-transformers' Pooling flag)


def read_st_layout(ref: str) -> StLayout | None:
    """Parse the layout of a local folder or Hub id; None when it has no modules.json (a plain HF model)."""
    modules = _read_json(ref, "modules.json")
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(
        isinstance(m, dict) and isinstance(m.get("type"), str) for m in modules
    ):
        raise ModelError(f"{ref}/modules.json: expected a list of modules, each with a 'type'")
    paths: dict[str, str] = {}
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in {"Transformer", "Pooling", "Normalize"}:
            raise ModelError(
                f"{ref}: modules.json has a {module['type']} module; only Transformer, Pooling and "
                "Normalize are supported"
            )
        paths[kind] = _module_path(ref, kind, module.get("path", ""))
    if "Transformer" not in paths or "Pooling" not in paths:
        raise ModelError(f"{ref}: modules.json needs a Transformer and a Pooling module")
    subfolder = paths["Transformer"]
    st_config = _read_json(ref, _join(subfolder, "sentence_bert_config.json")) or {}
    model_config = _read_json(ref, "config_sentence_transformers.json") or {}
    truncate_dim = model_config.get("truncate_dim")
    if truncate_dim is not None and (not isinstance(truncate_dim, int) or truncate_dim < 1):
        raise ModelError(f"{ref}: config_sentence_transformers.json: truncate_dim must be a positive integer")
    prompts, default_prompt_name = model_config.get("prompts") or {}, model_config.get("default_prompt_name")
    problem = check_prompts(prompts, default_prompt_name) if isinstance(prompts, dict) else "prompts must be a mapping"
    if problem:
        raise ModelError(f"{ref}: config_sentence_transformers.json: {problem}")
    pooling_config = _read_json(ref, _join(paths["Pooling"], "config.json"))
    if pooling_config is None:
        raise ModelError(f"{ref}: the Pooling module has no config.json")
    return StLayout(
        transformer_subfolder=subfolder,
        pooling=_pooling_mode(ref, pooling_config),
        normalize="Normalize" in paths,
        max_seq_length=st_config.get("max_seq_length"),
        truncate_dim=truncate_dim,
        prompts=prompts,
        default_prompt_name=default_prompt_name,
        include_prompt=pooling_config.get("include_prompt", True) is not False,
    )


def write_st_layout(path: Path, layout: StLayout, embedding_dim: int) -> None:
    """Write the sentence-transformers files around a model already saved with save_pretrained at `path` (the
    transformer at the folder's top: ``layout.transformer_subfolder`` is not used)."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if layout.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    _write_json(path / "modules.json", modules)
    _write_json(path / "sentence_bert_config.json", {"max_seq_length": layout.max_seq_length, "do_lower_case": False})
    # Always written, so that saving over a folder never leaves an older truncate_dim or prompt behind.
    model_config: dict[str, Any] = {"model_type": "SentenceTransformer"}
    if layout.truncate_dim:
        model_config["truncate_dim"] = layout.truncate_dim
    if layout.prompts:
        model_config |= {"prompts": layout.prompts, "default_prompt_name": layout.default_prompt_name}
    _write_json(path / "config_sentence_transformers.json", model_config)
    pooling_config = {"word_embedding_dimension": embedding_dim, "pooling_mode_mean_sqrt_len_tokens": False}
    pooling_config |= {flag: mode == layout.pooling for flag, mode in _POOLING_FLAGS.items()}
    if not layout.include_prompt:  # only then: sentence-transformers before 2.4 refuses keys it does not know
        pooling_config["include_prompt"] = False
    (path / "1_Pooling").mkdir(exist_ok=True)
    _write_json(path / "1_Pooling" / "config.json", pooling_config)


def _pooling_mode(ref: str, config: dict[str, Any]) -> PoolingMode:
    if "pooling_mode" in config:
        name = config["pooling_mode"]
        modes = [_POOLING_NAMES[name]] if isinstance(name, str) and name in _POOLING_NAMES else []
    else:
        modes = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
        # Any other true flag (mean_sqrt_len_tokens) is a mode we cannot reproduce.
        if any(value for key, value in config.items() if key.startswith("pooling_mode_") and key not in _POOLING_FLAGS):
            modes = []
    if len(modes) != 1:
        raise ModelError(
            f"{ref}: unsupported pooling config {config}; expected exactly one of {', '.join(_POOLING_NAMES)}"
        )
    return modes[0]


def check_weights(folder: str | Path, allow_pickle: bool = False) -> None:
    """A local model folder holds weights that load: safetensors files whose headers read (every shard of a
    sharded checkpoint), or, only with ``allow_pickle``, PyTorch pickle files (which can run code when loaded)."""
    folder = Path(folder)
    index = folder / SAFE_WEIGHTS[1]
    if index.is_file():
        content = _read_json(str(folder), SAFE_WEIGHTS[1])
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelError(f"{index}: expected a 'weight_map' of tensor name -> shard file")
        for name in set(weight_map.values()):
            _check_inside(folder, name, f"{index}: the shard")
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = [folder / SAFE_WEIGHTS[0]] if (folder / SAFE_WEIGHTS[0]).is_file() else []
    if not files:
        pickled = [name for name in PICKLED_WEIGHTS if (folder / name).is_file()]
        if pickled and allow_pickle:
            return
        if pickled:
            raise ModelError(
                f"{folder / pickled[0]}: only pickled PyTorch weights, which can run code when loaded; convert the "
                "model to safetensors, or allow it (model.allow_unsafe_weights: true) if you trust its source"
            )
        raise ModelError(f"{folder}: no model weights ({SAFE_WEIGHTS[0]}) in this folder")
    for file in files:
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError) as error:  # OSError: a shard the index names is missing
            raise ModelError(f"{file}: not a readable safetensors file ({error})") from None


def _module_path(ref: str, kind: str, path: object) -> str:
    """A module's folder as modules.json gives it, if it stays inside the model folder."""
    if not isinstance(path, str):
        raise ModelError(f"{ref}/modules.json: the {kind} module's path must be text, got {path!r}")
    _check_inside(ref, path, f"{ref}/modules.json: the {kind} module's path")
    return path


def _check_inside(ref: str | Path, path: str, what: str) -> None:
    """``path`` (relative, inside the model folder ``ref``) must not climb out of it, by '..', an absolute path or,
    for a local folder, a symbolic link."""
    parts = PurePosixPath(path.replace("\\", "/"))
    outside = parts.is_absolute() or ".." in parts.parts or Path(path).is_absolute()
    root = Path(ref)
    if not outside and root.is_dir():
        outside = not (root / path).resolve().is_relative_to(root.resolve())
    if outside:
        raise ModelError(f"{what} {path!r} leads outside the model folder")


def _read_json(ref: str, filename: str) -> Any:
    # cached_file reads local folders and Hub repos alike; a missing file gives None rather than an error.
    path = cached_file(ref, filename, _raise_exceptions_for_missing_entries=False)
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelError(f"{path}: not valid JSON ({error})") from None


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _join(subfolder: str, filename: str) -> str:
    return f"{subfolder}/{filename}" if subfolder else filename
