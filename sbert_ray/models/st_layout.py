"""The sentence-transformers folder layout, read and written so that either library loads the other's models.

modules.json                  [Transformer at "", Pooling at "1_Pooling", Normalize at "2_Normalize"]
sentence_bert_config.json     {"max_seq_length": ..., "do_lower_case": false}
1_Pooling/config.json         pooling flags (the classic format every sentence-transformers version reads)
config.json, model.safetensors, tokenizer files   (written by transformers' save_pretrained)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers.utils import cached_file

from sbert_ray.models.pooling import PoolingMode

# Classic 1_Pooling/config.json flags and the newer single "pooling_mode" key, mapped to our modes.
_POOLING_FLAGS: dict[str, PoolingMode] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_cls_token": "cls",
}
_POOLING_NAMES: dict[str, PoolingMode] = {"mean": "mean", "max": "max", "cls": "cls"}


@dataclass(frozen=True)
class StLayout:
    """What a saved sentence-transformers folder says beyond the Hugging Face model itself."""

    transformer_subfolder: str
    pooling: PoolingMode
    normalize: bool
    max_seq_length: int | None  # None: not recorded (sentence-transformers >= 6 keeps it in the tokenizer)


def read_st_layout(ref: str) -> StLayout | None:
    """Parse the layout of a local folder or Hub id; None when it has no modules.json (a plain HF model)."""
    modules = _read_json(ref, "modules.json")
    if modules is None:
        return None
    by_kind: dict[str, dict[str, Any]] = {}
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in {"Transformer", "Pooling", "Normalize"}:
            raise ValueError(
                f"{ref}: modules.json has a {module['type']} module; only Transformer, Pooling and "
                "Normalize are supported"
            )
        by_kind[kind] = module
    if "Transformer" not in by_kind or "Pooling" not in by_kind:
        raise ValueError(f"{ref}: modules.json needs a Transformer and a Pooling module")
    subfolder = by_kind["Transformer"]["path"]
    st_config = _read_json(ref, _join(subfolder, "sentence_bert_config.json")) or {}
    pooling_config = _read_json(ref, _join(by_kind["Pooling"]["path"], "config.json"))
    if pooling_config is None:
        raise ValueError(f"{ref}: the Pooling module has no config.json")
    return StLayout(
        transformer_subfolder=subfolder,
        pooling=_pooling_mode(ref, pooling_config),
        normalize="Normalize" in by_kind,
        max_seq_length=st_config.get("max_seq_length"),
    )


def write_st_layout(path: Path, pooling: PoolingMode, embedding_dim: int, max_seq_length: int, normalize: bool) -> None:
    """Write the sentence-transformers files around a model already saved with save_pretrained at `path`."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    _write_json(path / "modules.json", modules)
    _write_json(path / "sentence_bert_config.json", {"max_seq_length": max_seq_length, "do_lower_case": False})
    pooling_config = {"word_embedding_dimension": embedding_dim, "pooling_mode_mean_sqrt_len_tokens": False}
    pooling_config |= {flag: mode == pooling for flag, mode in _POOLING_FLAGS.items()}
    (path / "1_Pooling").mkdir(exist_ok=True)
    _write_json(path / "1_Pooling" / "config.json", pooling_config)


def _pooling_mode(ref: str, config: dict[str, Any]) -> PoolingMode:
    if "pooling_mode" in config:
        name = config["pooling_mode"]
        modes = [_POOLING_NAMES[name]] if name in _POOLING_NAMES else []
    else:
        modes = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
        # Any other true flag (mean_sqrt_len, weightedmean, lasttoken) is a mode we cannot reproduce.
        if any(value for key, value in config.items() if key.startswith("pooling_mode_") and key not in _POOLING_FLAGS):
            modes = []
    if len(modes) != 1:
        raise ValueError(f"{ref}: unsupported pooling config {config}; expected exactly one of mean, max, cls")
    return modes[0]


def _read_json(ref: str, filename: str) -> Any:
    # cached_file reads local folders and Hub repos alike; a missing file gives None rather than an error.
    path = cached_file(ref, filename, _raise_exceptions_for_missing_entries=False)
    if path is None:
        return None
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _join(subfolder: str, filename: str) -> str:
    return f"{subfolder}/{filename}" if subfolder else filename
