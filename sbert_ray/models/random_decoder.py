"""Randomly initialised decoder embedders (Qwen3, Qwen2, Llama, Mistral shapes), built offline, for tests of decoder
models (last-token pooling, left padding, instruction prompts) where no Hub model can be fetched."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.pooling import PoolingMode

EOS = "<|endoftext|>"
# The text the byte-level BPE vocabulary is learnt from: any input still tokenises (bytes are in the alphabet);
# these words merely come out as few tokens.
_VOCAB_TEXT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery: "
    "A man is playing a guitar. The quick brown fox jumps over the lazy dog. A woman is slicing an onion. "
    "Two dogs run in the park. A child reads a book under a tree. The weather is sunny and warm today."
)


def decoder_tokenizer(padding_side: str = "left", vocab_size: int = 400):
    """A byte-level BPE tokenizer that ends every input with ``<|endoftext|>`` and pads with it, as
    Qwen3-Embedding's does (its last token, which last-token pooling reads, has attended to the whole input)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator([_VOCAB_TEXT], trainer)
    eos_id = tokenizer.token_to_id(EOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B:1 {EOS}:1", special_tokens=[(EOS, eos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, padding_side=padding_side, model_max_length=512
    )


# transformers model types of the decoder families embedders are built on (Qwen3-Embedding, gte-Qwen2, E5-Mistral,
# Llama-based ones); each with the same small shape.
DECODER_TYPES = ("qwen3", "qwen2", "llama", "mistral", "gemma2")


def random_decoder(
    model_type: str = "qwen3",
    seed: int = 0,
    pooling: PoolingMode = "lasttoken",
    padding_side: str = "left",
    max_seq_length: int = 64,
    prompts: Mapping[str, str] | None = None,
) -> SentenceEncoder:
    """A 2-layer decoder of ``model_type`` (one of DECODER_TYPES; hidden 32, grouped-query attention: 4 query heads
    over 2 key/value heads) with ``decoder_tokenizer``'s vocabulary; ``prompts`` as sentence-transformers' (e.g. a
    ``query`` instruction)."""
    from transformers import AutoModel  # here: importing the package must not load model code

    if model_type not in DECODER_TYPES:
        raise ValueError(f"unknown decoder type {model_type!r}; expected one of {DECODER_TYPES}")
    tokenizer = decoder_tokenizer(padding_side)
    eos_id = tokenizer.eos_token_id
    config = tiny_config(
        model_type,
        tokenizer,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,  # Qwen3's default is 128 whatever the hidden size
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    with torch.random.fork_rng(devices=[]):  # seeded weights without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        transformer = AutoModel.from_config(config)
    return SentenceEncoder(transformer, tokenizer, pooling, max_seq_length, prompts=prompts)


def build_random_decoder(out_dir: str | os.PathLike[str], **options) -> Path:
    """Save ``random_decoder(**options)`` in the sentence-transformers layout at ``out_dir``."""
    random_decoder(**options).save(out_dir)
    return Path(out_dir)


def tiny_config(model_type: str, tokenizer, **options):
    """A transformers config of ``model_type`` (any family: qwen3, llama, xlm-roberta, modernbert, ...) in the tests'
    tiny shape (2 layers, hidden 32, feed-forward 64, 512 positions) over ``tokenizer``'s vocabulary; ``options`` add
    to it or replace it."""
    from transformers import AutoConfig

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 512}
    return AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **(shape | options)
    )
