"""SentenceEncoder: a Hugging Face transformer plus pooling, the SBERT network (paper section 3)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from sbert_ray.models.pooling import Pooling, PoolingMode
from sbert_ray.models.resolve import resolve_model_ref
from sbert_ray.models.st_layout import ModelError, StLayout, check_weights, read_st_layout, write_st_layout

DEFAULT_MAX_SEQ_LENGTH = 128


class SentenceEncoder(nn.Module):
    """Maps sentences to fixed-size vectors: transformer -> pooling -> optional L2 normalisation.

    With `truncate_dim`, `encode` returns the first truncate_dim values of each embedding (after normalisation,
    as sentence-transformers truncates); `forward`, what training sees, stays full size.
    """

    def __init__(
        self,
        transformer: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        pooling: PoolingMode = "mean",
        max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH,
        normalize: bool = False,
        truncate_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.tokenizer = tokenizer
        self.pooling = Pooling(pooling)
        self.max_seq_length = max_seq_length
        self.normalize = normalize
        self.truncate_dim = truncate_dim
        # BERT-style models carry a [CLS] pooler head that sentence pooling never uses. Frozen, it is still
        # saved (so reloading warns about nothing) but DDP does not wait for gradients it never gets.
        pooler = getattr(transformer, "pooler", None)
        if isinstance(pooler, nn.Module):
            pooler.requires_grad_(False)

    @classmethod
    def load(
        cls,
        ref: str | os.PathLike[str],
        pooling: PoolingMode | None = None,
        max_seq_length: int | None = None,
        normalize: bool | None = None,
        allow_unsafe_weights: bool = False,
        truncate_dim: int | None = None,
    ) -> SentenceEncoder:
        """Load a sentence-transformers folder, a plain Hugging Face model (mean pooling) or a Hub id.

        Arguments that are not None override what the saved model says. Like `from_pretrained`, the
        result is in eval mode; call `.train()` before training. Weights load from safetensors files only,
        unless ``allow_unsafe_weights`` (pickled PyTorch files can run code); the model's own code never runs.
        """
        resolved = resolve_model_ref(ref)
        layout = read_st_layout(resolved)
        subfolder = layout.transformer_subfolder if layout else ""
        if Path(resolved).is_dir():  # a bad file is named here, not as a bare SafetensorError from transformers
            check_weights(Path(resolved) / subfolder, allow_pickle=allow_unsafe_weights)
        transformer = AutoModel.from_pretrained(
            resolved,
            subfolder=subfolder,
            use_safetensors=None if allow_unsafe_weights else True,
            trust_remote_code=False,
        )
        tokenizer = AutoTokenizer.from_pretrained(resolved, subfolder=subfolder, trust_remote_code=False)
        if max_seq_length is None:
            max_seq_length = _saved_max_seq_length(layout, tokenizer, transformer)
        limit = position_limit(tokenizer, transformer.config)
        if limit is not None and max_seq_length > limit:
            raise ModelError(f"{ref}: max_seq_length {max_seq_length} is beyond the model's {limit} positions")
        truncate_dim, size = truncate_dim or (layout.truncate_dim if layout else None), transformer.config.hidden_size
        if truncate_dim is not None and truncate_dim > size:
            raise ModelError(f"{ref}: truncate_dim {truncate_dim} is beyond the model's {size} dimensions")
        encoder = cls(
            transformer,
            tokenizer,
            pooling=pooling or (layout.pooling if layout else "mean"),
            max_seq_length=max_seq_length,
            normalize=normalize if normalize is not None else bool(layout and layout.normalize),
            truncate_dim=truncate_dim,
        )
        return encoder.eval()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save in the sentence-transformers layout (loadable by `sentence_transformers.SentenceTransformer`)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.transformer.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        write_st_layout(
            path, self.pooling.mode, self.embedding_dim, self.max_seq_length, self.normalize, self.truncate_dim
        )

    @property
    def embedding_dim(self) -> int:
        """The full size of the embeddings `forward` computes."""
        return self.transformer.config.hidden_size

    @property
    def truncate_dim(self) -> int | None:
        return self._truncate_dim

    @truncate_dim.setter
    def truncate_dim(self, dim: int | None) -> None:
        if dim is not None and not 0 < dim <= self.embedding_dim:
            raise ValueError(f"truncate_dim must be in 1..{self.embedding_dim} (the model's size), got {dim}")
        self._truncate_dim = dim

    @property
    def output_dim(self) -> int:
        """The size of the embeddings `encode` returns."""
        return self.truncate_dim or self.embedding_dim

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def tokenize(self, sentences: Sequence[str]) -> dict[str, Tensor]:
        """Token ids for one batch, padded to its longest sentence and truncated to max_seq_length."""
        batch = self.tokenizer(
            list(sentences),
            padding=True,
            truncation=True,
            max_length=self.max_seq_length,
            return_tensors="pt",
        )
        return dict(batch)

    def forward(self, features: dict[str, Tensor]) -> Tensor:
        """Sentence embeddings [batch, embedding_dim] for tokenized features (on this module's device)."""
        inputs = {name: features[name] for name in self.tokenizer.model_input_names if name in features}
        token_embeddings = self.transformer(**inputs).last_hidden_state
        embeddings = self.pooling(token_embeddings, features["attention_mask"])
        return F.normalize(embeddings, p=2, dim=1) if self.normalize else embeddings

    def encode(
        self,
        sentences: Sequence[str],
        batch_size: int = 32,
        convert_to: Literal["numpy", "torch"] = "numpy",
    ) -> np.ndarray | Tensor:
        """Embeddings [len(sentences), output_dim] in the caller's order, computed without autograd.

        Smart batching (paper Table 7): sentences are sorted by token count, longest first, so each batch
        pads only to its own longest member. Token count rather than character count (as
        sentence-transformers uses) because tokens are what padding costs; the ids are reused for the batches.
        A torch result stays on the module's device.
        """
        if isinstance(sentences, str):
            raise TypeError("encode expects a sequence of sentences, not a single string")
        if convert_to not in ("numpy", "torch"):
            raise ValueError(f"convert_to must be 'numpy' or 'torch', not {convert_to!r}")
        if batch_size < 1:  # range(0, n, -1) is empty: the result would be uninitialised memory
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        embeddings = torch.empty(len(sentences), self.output_dim, device=self.device)
        if len(sentences) > 0:
            was_training = self.training
            self.eval()
            try:
                with torch.inference_mode():
                    self._encode_sorted(list(sentences), batch_size, out=embeddings)
            finally:
                self.train(was_training)
        return embeddings.cpu().numpy() if convert_to == "numpy" else embeddings

    def _encode_sorted(self, sentences: list[str], batch_size: int, out: Tensor) -> None:
        encodings = self.tokenizer(sentences, truncation=True, max_length=self.max_seq_length)
        order = sorted(range(len(sentences)), key=lambda i: -len(encodings["input_ids"][i]))
        for start in range(0, len(order), batch_size):
            indices = order[start : start + batch_size]
            batch = self.tokenizer.pad([{k: encodings[k][i] for k in encodings} for i in indices], return_tensors="pt")
            out[indices] = self({k: v.to(self.device) for k, v in batch.items()})[:, : self.output_dim].float()


def _saved_max_seq_length(
    layout: StLayout | None, tokenizer: PreTrainedTokenizerBase, transformer: PreTrainedModel
) -> int:
    """The saved limit: sentence_bert_config.json, else (sentence-transformers >= 6 folders) the tokenizer's
    model_max_length capped by the position embeddings; a plain Hugging Face model gets the paper's 128."""
    if layout is None:
        return DEFAULT_MAX_SEQ_LENGTH
    if layout.max_seq_length is not None:
        return int(layout.max_seq_length)
    limits = [tokenizer.model_max_length, getattr(transformer.config, "max_position_embeddings", None)]
    return int(min(limit for limit in limits if limit is not None))


def position_limit(tokenizer: PreTrainedTokenizerBase, config) -> int | None:
    """The longest input the model's position embeddings hold; None when the config has none (relative positions).

    RoBERTa-style models (XLM-R, MPNet, ...) number positions from after the padding index, so their 514
    embeddings hold 512 tokens, which their tokenizer's model_max_length says. A model_max_length further below
    is a saved default (sentence-transformers >= 6 keeps max_seq_length there), not a limit.
    """
    positions = getattr(config, "max_position_embeddings", None)
    if positions is None:
        return None
    tokens = tokenizer.model_max_length
    return tokens if positions - 2 <= tokens < positions else positions
