"""One way to get the encoder a config names: a saved model, a Hub id, or a randomly initialised BERT."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sbert_ray.models.cross_encoder import CrossEncoderModel
from sbert_ray.models.encoder import DEFAULT_MAX_SEQ_LENGTH, SentenceEncoder
from sbert_ray.models.lora_settings import LoraSettings
from sbert_ray.models.model_type import ModelType
from sbert_ray.models.pooling import PoolingMode
from sbert_ray.models.prompts import check_prompts
from sbert_ray.models.random_bert import bert_tokenizer, random_bert
from sbert_ray.models.resolve import ModelFiles, resolve_model_ref
from sbert_ray.models.st_layout import ModelError

RANDOM_PREFIX = "random:"


def load_encoder(
    name: str,
    pooling: PoolingMode | None = None,
    max_seq_length: int | None = None,
    normalize: bool | None = None,
    seed: int = 0,
    allow_unsafe_weights: bool = False,
    prompts: Mapping[str, str] | None = None,
    default_prompt_name: str | None = None,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    lora: LoraSettings | Mapping[str, Any] | None = None,
    type: ModelType = "bi_encoder",
) -> SentenceEncoder | CrossEncoderModel:
    """``name`` as ``SentenceEncoder.load`` reads it, or for ``random:<shape>`` a freshly initialised BERT (the
    same weights for the same seed, so every data-parallel worker starts equal); with ``type`` cross_encoder the
    reranker ``load_reranker`` loads (``model.type``). Arguments that are not None
    override what a saved model says (``prompts`` replace the saved prompts and their default);
    ``allow_unsafe_weights`` also loads pickled PyTorch weights. ``attn_implementation``: transformers' attention
    kernels (``model.attn_implementation``); ``gradient_checkpointing``: training recomputes each layer's
    activations in the backward pass instead of keeping them (``model.gradient_checkpointing``); ``lora``: the
    transformer trains LoRA adapters only (``model.lora``, its settings or their mapping; ``models.lora``)."""
    if type == "cross_encoder":  # the bi-encoder settings are refused for it by the config (``model.type``)
        return load_reranker(name, max_seq_length, seed, allow_unsafe_weights, attn_implementation)
    if name.startswith(RANDOM_PREFIX):
        encoder = random_bert(
            name.removeprefix(RANDOM_PREFIX),
            seed=seed,
            pooling=pooling or "mean",
            max_seq_length=max_seq_length or DEFAULT_MAX_SEQ_LENGTH,
            normalize=bool(normalize),
            attn_implementation=attn_implementation,
        )
        problem = check_prompts(prompts or {}, default_prompt_name)
        if problem:
            raise ModelError(f"{name}: {problem}")
        encoder.prompts, encoder.default_prompt_name = dict(prompts or {}), default_prompt_name
    else:
        encoder = SentenceEncoder.load(
            name,
            pooling=pooling,
            max_seq_length=max_seq_length,
            normalize=normalize,
            allow_unsafe_weights=allow_unsafe_weights,
            prompts=prompts,
            default_prompt_name=default_prompt_name,
            attn_implementation=attn_implementation,
        )
    if gradient_checkpointing:
        # Non-reentrant: the one that works under DDP and inside cached MNRL's own checkpoints.
        encoder.transformer.activation_checkpointing_enable({"use_reentrant": False})
    if lora is not None:
        from sbert_ray.models.lora import apply_lora  # peft: only for runs that use it

        encoder.transformer = apply_lora(
            encoder.transformer, lora if isinstance(lora, LoraSettings) else LoraSettings(**lora)
        )
    return encoder


def load_reranker(
    name: str,
    max_seq_length: int | None = None,
    seed: int = 0,
    allow_unsafe_weights: bool = False,
    attn_implementation: str = "sdpa",
) -> CrossEncoderModel:
    """The reranker ``name`` names, as ``CrossEncoderModel.load`` reads it, or for ``random:<shape>`` a freshly
    initialised BERT with a one-label head (the same weights for the same seed)."""
    if name.startswith(RANDOM_PREFIX):
        shape, length = name.removeprefix(RANDOM_PREFIX), max_seq_length or DEFAULT_MAX_SEQ_LENGTH
        return CrossEncoderModel.random(shape, seed, length, attn_implementation)
    return CrossEncoderModel.load(name, max_seq_length, allow_unsafe_weights, attn_implementation)


@dataclass(frozen=True)
class TextTokenizer:
    """What tokenising a model's inputs takes (as ``SentenceEncoder`` has it), without the model's weights."""

    tokenizer: Any  # a transformers tokenizer
    max_seq_length: int
    prompts: dict[str, str]
    joins_pairs: bool = False  # a reranker's: the anchor and each other column tokenised as one text pair


def one_tokenizer_thread() -> None:
    """Tokenise on the calling thread in this process from now on. A Ray task or actor that reads or tokenises data
    (training stream, prepare, encode, score) would otherwise start a Rust thread pool as wide as the node in its
    process: N tasks x N threads on an N-core node. Hugging Face tokenizers read the variable at every call. (Set in
    a task's Ray ``runtime_env`` instead, it would keep the task off Ray's pooled workers: a new process per task,
    every pass.)"""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def load_tokenizer(
    name: str,
    max_seq_length: int,
    prompts: Mapping[str, str] | None = None,
    type: ModelType = "bi_encoder",
    **_,
) -> TextTokenizer:
    """The tokenizer of the model ``load_encoder`` would load for the same arguments (its prompts: the saved ones
    unless ``prompts`` replace them; a reranker has none), for processes that only tokenise; the other arguments
    are ignored."""
    pairs = type == "cross_encoder"
    if name.startswith(RANDOM_PREFIX):
        return TextTokenizer(bert_tokenizer(), max_seq_length, dict(prompts or {}), pairs)
    files = ModelFiles.read(resolve_model_ref(name))
    saved = files.layout.prompts if files.layout and not pairs else {}
    return TextTokenizer(files.tokenizer(), max_seq_length, dict(saved if prompts is None else prompts), pairs)
