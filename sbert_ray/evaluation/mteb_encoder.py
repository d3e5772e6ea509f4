"""An sbert-ray encoder as the ``mteb`` library's encoder (its ``EncoderProtocol``): mteb's tasks hand it batches
of texts, and it encodes them with whatever sbert-ray gives tasks: a ``SentenceEncoder`` in this process, or the
Ray encoder pool of ``eval --workers N`` (token-budget batches spread over the workers).

mteb asks for queries and documents by ``prompt_type``; they get the model's query and document prompts as
sentence-transformers' ``encode_query`` / ``encode_document`` choose them (``models.prompts``), anything else the
model's default prompt. Similarity is cosine, as every sbert-ray task scores.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import numpy as np

from sbert_ray.models.prompts import document_prompt_name, query_prompt_name

if TYPE_CHECKING:
    from mteb import TaskMetadata
    from mteb.models.model_meta import ModelMeta
    from torch.utils.data import DataLoader

# Encoded to tell models apart (``model_fingerprint``): different words, lengths and punctuation.
PROBE = (
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog, twice!",
    "Stocks fell sharply on Monday after the central bank raised interest rates by half a point.",
    "Wer nicht wagt, der nicht gewinnt.",
)


def model_fingerprint(encoder) -> str:
    """What the model computes, as a short hash: its prompts and its embeddings of ``PROBE``, so any change to the
    weights, pooling, normalisation, truncation or precision gives another fingerprint, and so do wrappers that
    change embeddings (``--truncate-dim``). The mteb results and embedding cache of a model are keyed by it."""
    embeddings = np.ascontiguousarray(encoder.encode(list(PROBE), batch_size=len(PROBE), convert_to="numpy"))
    digest = hashlib.sha256(json.dumps(encoder.prompts, sort_keys=True).encode())
    digest.update(str(embeddings.shape).encode())
    digest.update(embeddings.astype(np.float32).tobytes())
    return digest.hexdigest()[:16]


def mteb_model_name(model_ref: str) -> str:
    """mteb's ``organization/model`` name for a model reference: a Hub id as it is, a local folder as ``local/<its
    name>`` (mteb refuses a name without an organization)."""
    parts = [part for part in model_ref.replace("\\", "/").split("/") if part not in ("", ".", "..")]
    if len(parts) == 2 and not model_ref.startswith(("/", ".", "~")):
        return "/".join(parts)
    return f"local/{parts[-1] if parts else 'model'}"


class MtebEncoder:
    """mteb's ``EncoderProtocol`` over an sbert-ray encoder (anything with ``encode(sentences, batch_size,
    convert_to, prompt_name)`` and ``prompts``), its results filed under ``name`` at ``revision``."""

    def __init__(self, encoder, name: str, revision: str) -> None:
        self.encoder, self.name, self.revision = encoder, name, revision

    @property
    def mteb_model_meta(self) -> ModelMeta:
        from mteb.models.model_meta import ModelMeta, ScoringFunction

        return ModelMeta.create_empty(
            {
                "name": self.name,
                "revision": self.revision,
                "framework": ["PyTorch"],
                "similarity_fn_name": ScoringFunction.COSINE,
                "modalities": ["text"],
            }
        )

    def prompt_name(self, prompt_type) -> str | None:
        """The model's prompt for mteb's ``prompt_type`` (query, document or None); None: the default prompt."""
        kind = getattr(prompt_type, "value", prompt_type)
        if kind == "query":
            return query_prompt_name(self.encoder.prompts)
        if kind == "document":
            return document_prompt_name(self.encoder.prompts)
        return None

    def encode(
        self,
        inputs: DataLoader,
        *,
        task_metadata: TaskMetadata,
        hf_split: str,
        hf_subset: str,
        prompt_type=None,
        batch_size: int = 32,
        **kwargs: Any,
    ) -> np.ndarray:
        texts = [text for batch in inputs for text in batch["text"]]
        return self.encoder.encode(
            texts, batch_size=batch_size, convert_to="numpy", prompt_name=self.prompt_name(prompt_type)
        )

    def similarity(self, embeddings1, embeddings2):
        from mteb.similarity_functions import cos_sim

        return cos_sim(embeddings1, embeddings2)

    def similarity_pairwise(self, embeddings1, embeddings2):
        from mteb.similarity_functions import pairwise_cos_sim

        return pairwise_cos_sim(embeddings1, embeddings2)
