"""Teachers that score (query, passage) pairs (``sbert-ray score``): a cross-encoder / reranker, run as
sentence-transformers' ``CrossEncoder`` runs it (its saved activation, sigmoid for one label), or a bi-encoder's
cosine between the query's and the passage's embeddings (our ``SentenceEncoder``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from sbert_ray.models.resolve import resolve_model_ref
from sbert_ray.models.st_layout import ModelError

if TYPE_CHECKING:
    from sentence_transformers import CrossEncoder

    from sbert_ray.models.encoder import SentenceEncoder


class CrossEncoderTeacher:
    """A reranker with one output: its ``predict`` score of each pair."""

    kind = "cross-encoder"

    def __init__(self, model: CrossEncoder):
        self.model = model

    def to(self, device: str) -> CrossEncoderTeacher:
        self.model.to(device)
        return self

    def score(self, queries: list[str], passages: list[list[str]], batch_size: int) -> np.ndarray:
        """[len(passages), len(queries)]: each passage column's pairs with the queries, all in one ``predict``."""
        pairs = [(query, column[row]) for column in passages for row, query in enumerate(queries)]
        scores = self.model.predict(pairs, batch_size=batch_size, show_progress_bar=False, convert_to_numpy=True)
        return scores.reshape(len(passages), len(queries))


class BiEncoderTeacher:
    """A bi-encoder: the cosine of each pair's embeddings."""

    kind = "bi-encoder"

    def __init__(self, encoder: SentenceEncoder):
        self.encoder = encoder

    def to(self, device: str) -> BiEncoderTeacher:
        # Re-cast on the worker's own device: "bf16" weights become float16 on GPUs without bfloat16.
        self.encoder = self.encoder.to(device).to_precision(self.encoder.precision)
        return self

    def score(self, queries: list[str], passages: list[list[str]], batch_size: int) -> np.ndarray:
        """[len(passages), len(queries)]: each passage column's cosines with the queries (each query encoded once)."""
        query, passage = (
            torch.nn.functional.normalize(self.encoder.encode(texts, batch_size=batch_size, convert_to="torch"), dim=-1)
            for texts in (queries, [text for column in passages for text in column])
        )
        return (passage.view(len(passages), *query.shape) * query).sum(dim=-1).cpu().numpy()


Teacher = CrossEncoderTeacher | BiEncoderTeacher


def load_teacher(model_ref: str) -> Teacher:
    """The teacher at ``model_ref`` on the CPU: a cross-encoder folder (sentence-transformers' CrossEncoder layout,
    or a Hugging Face ``...ForSequenceClassification`` model) or a bi-encoder; anything else is a ModelError
    naming the folder."""
    resolved = resolve_model_ref(model_ref)
    if _is_cross_encoder(resolved):
        return CrossEncoderTeacher(_cross_encoder(model_ref, resolved))
    from sbert_ray.models.load import load_encoder

    try:
        return BiEncoderTeacher(load_encoder(resolved))
    except (ModelError, OSError, ValueError) as error:
        raise ModelError(
            f"--model {model_ref}: neither a cross-encoder (a ...ForSequenceClassification config.json, or "
            f"config_sentence_transformers.json of a CrossEncoder) nor a bi-encoder ({error})"
        ) from None


def _is_cross_encoder(resolved: str) -> bool:
    folder = Path(resolved)
    if not folder.is_dir():  # a Hub id: its config, as transformers reads it
        from transformers import AutoConfig

        try:
            return _classifies(AutoConfig.from_pretrained(resolved, trust_remote_code=False).to_dict())
        except OSError:
            return False
    st_config, config = (folder / name for name in ("config_sentence_transformers.json", "config.json"))
    if st_config.is_file() and _json(st_config).get("model_type") == "CrossEncoder":
        return True
    return config.is_file() and _classifies(_json(config))


def _classifies(config: dict) -> bool:
    return any(name.endswith("ForSequenceClassification") for name in config.get("architectures") or ())


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ModelError(f"{path}: not readable JSON ({error})") from None
    return data if isinstance(data, dict) else {}


def _cross_encoder(model_ref: str, resolved: str) -> CrossEncoder:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(resolved, device="cpu")
    if model.num_labels != 1:
        raise ModelError(
            f"--model {model_ref}: a cross-encoder with {model.num_labels} labels; a teacher scores pairs with one"
        )
    return model
