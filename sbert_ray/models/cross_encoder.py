"""CrossEncoderModel: a reranker, a Hugging Face sequence-classification transformer with one label that reads a
(query, passage) pair as the tokenizer's text pair and scores it with one logit.

Saved in the layout sentence-transformers 5.x writes for a ``CrossEncoder`` (and 6.x still loads): the Hugging Face
model and tokenizer (``max_seq_length`` as the tokenizer's ``model_max_length``, where ``CrossEncoder`` reads its
``max_length``), and in ``config.json`` a ``sentence_transformers`` entry naming the activation ``predict`` applies
to the logit: a sigmoid, which maps it to (0, 1), as ``BinaryCrossEntropyLoss`` trains it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from sbert_ray.models.encoder import DEFAULT_MAX_SEQ_LENGTH, check_attention, load_pretrained, max_seq_length_problem
from sbert_ray.models.resolve import ModelFiles, resolve_model_ref
from sbert_ray.models.st_layout import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SIGMOID = "torch.nn.modules.activation.Sigmoid"  # sentence-transformers' name of predict's activation


class CrossEncoderModel(nn.Module):
    """One logit per (query, passage) pair. ``forward`` takes pairs tokenised together (``tokenize_pairs``, or a
    training batch's pair columns, ``training.batches.tokenize_texts``) and returns the logits [batch]; ``predict``
    returns sentence-transformers' ``CrossEncoder.predict`` scores (the sigmoid of the logits)."""

    joins_pairs: ClassVar[bool] = True  # training tokenises (query, passage) pairs, not texts alone
    prompts: ClassVar[dict[str, str]] = {}  # a reranker puts no prompt before its inputs

    def __init__(self, transformer: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_seq_length: int) -> None:
        super().__init__()
        if transformer.config.num_labels != 1:
            raise ModelError(f"a reranker scores with one label; this model has {transformer.config.num_labels}")
        self.transformer = transformer
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        # A reranker's forward runs eager (``SentenceEncoder.compile_for_training`` is the bi-encoder's); the
        # training loop and the checkpoints' host copies ask, as they ask a bi-encoder.
        self._compiled_forward = None
        self.compiled = False

    @classmethod
    def random(
        cls,
        shape: str,
        seed: int = 0,
        max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH,
        attn_implementation: str = "sdpa",
    ) -> CrossEncoderModel:
        """A randomly initialised BERT of ``shape`` (``models.random_bert.BERT_SHAPES``) with a one-label head,
        the same weights for the same seed."""
        from transformers import BertForSequenceClassification

        from sbert_ray.models.random_bert import BERT_SHAPES, bert_config, bert_tokenizer

        if shape not in BERT_SHAPES:
            raise ModelError(f"unknown BERT shape {shape!r}; expected one of {sorted(BERT_SHAPES)}")
        tokenizer = bert_tokenizer()
        config = bert_config(shape, tokenizer, num_labels=1, attn_implementation=check_attention(attn_implementation))
        with torch.random.fork_rng(devices=[]):  # seeded weights without disturbing the caller's RNG stream
            torch.manual_seed(seed)
            return cls(BertForSequenceClassification(config), tokenizer, max_seq_length).eval()

    @classmethod
    def load(
        cls,
        ref: str | os.PathLike[str],
        max_seq_length: int | None = None,
        allow_unsafe_weights: bool = False,
        attn_implementation: str = "sdpa",
    ) -> CrossEncoderModel:
        """A reranker folder (ours, sentence-transformers' ``CrossEncoder`` layout, or a plain Hugging Face
        ``...ForSequenceClassification`` model with one label) or Hub id, in fp32 and eval mode; a plain encoder
        (a bi-encoder's folder too) gets a new, randomly initialised one-label head. Safetensors
        weights only unless ``allow_unsafe_weights``. ``max_seq_length`` None keeps the saved one."""
        from transformers import AutoConfig, AutoModelForSequenceClassification

        files = ModelFiles.read(resolve_model_ref(ref))
        files.check_weights(allow_pickle=allow_unsafe_weights)
        config = AutoConfig.from_pretrained(files.path, subfolder=files.subfolder, trust_remote_code=False)
        if not any(name.endswith("ForSequenceClassification") for name in config.architectures or ()):
            config.num_labels = 1  # a plain encoder: its new head scores with one label
        transformer = load_pretrained(
            AutoModelForSequenceClassification, files, config, allow_unsafe_weights, attn_implementation, str(ref)
        )
        tokenizer = files.tokenizer()
        if max_seq_length is None:
            max_seq_length = min(tokenizer.model_max_length, config.max_position_embeddings)
        problem = max_seq_length_problem(max_seq_length, tokenizer, config, str(ref))
        if problem:
            raise ModelError(f"max_seq_length {problem}")
        return cls(transformer, tokenizer, max_seq_length).eval()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Save in sentence-transformers' ``CrossEncoder`` layout (see the module's docstring)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.transformer.save_pretrained(path)
        self.tokenizer.model_max_length = self.max_seq_length
        self.tokenizer.save_pretrained(path)
        config = json.loads((path / "config.json").read_text())
        config["sentence_transformers"] = {"activation_fn": SIGMOID}
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def tokenize_pairs(self, queries: Sequence[str], passages: Sequence[str]) -> dict[str, Tensor]:
        """One batch of pairs as ``CrossEncoder.predict`` tokenises them: padded, the pair truncated longest
        first to ``max_seq_length``."""
        batch = self.tokenizer(
            list(queries), list(passages), padding=True, truncation=True, max_length=self.max_seq_length,
            return_tensors="pt",
        )  # fmt: skip
        return {name: tensor.to(self.device) for name, tensor in batch.items()}

    def forward(self, features: dict[str, Tensor], padded: bool = True) -> Tensor:
        """The logits [batch] of tokenised pairs, in at least float32. ``padded`` is the bi-encoder's flag (the
        mask may be left out); a reranker always passes the mask. Training batches carry no token type ids: they
        are rebuilt here from the separator tokens (``pair_token_types``)."""
        inputs = {name: features[name] for name in self.tokenizer.model_input_names if name in features}
        if "token_type_ids" in self.tokenizer.model_input_names and "token_type_ids" not in inputs:
            inputs["token_type_ids"] = pair_token_types(
                inputs["input_ids"], inputs["attention_mask"], self.tokenizer.sep_token_id
            )
        logits = self.transformer(**inputs).logits.view(-1)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def predict(self, pairs: Sequence[tuple[str, str]], batch_size: int = 32) -> np.ndarray:
        """``CrossEncoder.predict``'s scores: the sigmoid of each pair's logit, in the pairs' order."""
        was_training = self.training
        self.eval()
        scores = []
        try:
            with torch.inference_mode():
                for start in range(0, len(pairs), batch_size):
                    queries, passages = zip(*pairs[start : start + batch_size], strict=True)
                    scores.append(torch.sigmoid(self(self.tokenize_pairs(queries, passages))).cpu())
        finally:
            self.train(was_training)
        return torch.cat(scores).numpy() if scores else np.zeros(0, dtype=np.float32)


def pair_token_types(input_ids: Tensor, attention_mask: Tensor, sep_token_id: int) -> Tensor:
    """The token type ids a BERT-style tokenizer gives a text pair ``[CLS] query [SEP] passage [SEP]``: 0 up to and
    including the first separator, 1 after it, 0 on padding. Rebuilt on the device, so that training's tokenised
    columns need not carry a third array beside the ids and the mask."""
    separator = (input_ids == sep_token_id).long()
    after_first = (separator.cumsum(dim=1) - separator).clamp(max=1)
    return after_first * attention_mask.long()
