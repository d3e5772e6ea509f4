"""Randomly initialised BERTs of named sizes, for tests and from-scratch runs.

Their vocabulary is bert-base-uncased's: the file ``$SBERT_RAY_BERT_VOCAB`` names (a GPU machine's carry folder,
``scripts/gpu_carry.py``), else the one shipped with the offline all-MiniLM-L6-v2 package."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import BertConfig

from sbert_ray.models.encoder import DEFAULT_MAX_SEQ_LENGTH, SentenceEncoder, check_attention
from sbert_ray.models.pooling import PoolingMode
from sbert_ray.models.resolve import packaged_model_dir

if TYPE_CHECKING:
    from transformers import BertTokenizer

VOCAB_ENV = "SBERT_RAY_BERT_VOCAB"  # a vocab.txt in place of the packaged model's (whose weights need not be there)

# (layers, hidden size, attention heads, feed-forward size). "tiny" is test-sized; the others follow
# Google's BERT miniatures (Turc et al. 2019) and BERT-base.
BERT_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 32, 2, 64),
    "mini": (4, 256, 4, 1024),
    "small": (4, 512, 8, 2048),
    "base": (12, 768, 12, 3072),
}


def build_random_bert(
    out_dir: str | os.PathLike[str],
    shape: str = "tiny",
    vocab_file: str | os.PathLike[str] | None = None,
    seed: int = 0,
    pooling: PoolingMode = "mean",
    max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH,
) -> Path:
    """Save a randomly initialised BERT encoder in the sentence-transformers layout at `out_dir`."""
    random_bert(shape, vocab_file, seed, pooling, max_seq_length).save(out_dir)
    return Path(out_dir)


def bert_tokenizer(vocab_file: str | os.PathLike[str] | None = None) -> BertTokenizer:
    """The tokenizer of a random BERT: WordPiece over ``vocab_file``, by default bert-base-uncased's vocabulary
    (``$SBERT_RAY_BERT_VOCAB``, else the packaged model's)."""
    from transformers import BertTokenizer

    if vocab_file is None:
        vocab_file = os.environ.get(VOCAB_ENV) or packaged_vocab()
    # `vocab=` (not `vocab_file=`): transformers 5 silently ignores vocab_file and builds a 5-token vocab.
    return BertTokenizer(vocab=str(vocab_file), do_lower_case=True)


def packaged_vocab() -> Path:
    """bert-base-uncased's vocabulary as the offline all-MiniLM-L6-v2 package ships it."""
    return packaged_model_dir("sentence-transformers/all-MiniLM-L6-v2") / "vocab.txt"


def random_bert(
    shape: str = "tiny",
    vocab_file: str | os.PathLike[str] | None = None,
    seed: int = 0,
    pooling: PoolingMode = "mean",
    max_seq_length: int = DEFAULT_MAX_SEQ_LENGTH,
    normalize: bool = False,
    attn_implementation: str = "sdpa",
) -> SentenceEncoder:
    """A randomly initialised BERT encoder, built in memory (Train workers other than rank 0 cannot save one:
    transformers writes files only on the main process of a distributed group).

    The vocabulary is `vocab_file` (one WordPiece per line, lower-cased input) or, by default, bert-base-uncased's
    (``bert_tokenizer``).
    """
    from transformers import BertModel  # here: importing the package must not load model code

    if shape not in BERT_SHAPES:
        raise ValueError(f"unknown BERT shape {shape!r}; expected one of {sorted(BERT_SHAPES)}")
    tokenizer = bert_tokenizer(vocab_file)
    config = bert_config(shape, tokenizer, attn_implementation=check_attention(attn_implementation))
    with torch.random.fork_rng(devices=[]):  # seeded weights without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        transformer = BertModel(config)
    return SentenceEncoder(transformer, tokenizer, pooling, max_seq_length, normalize)


def bert_config(shape: str, tokenizer: BertTokenizer, **settings) -> BertConfig:
    layers, hidden, heads, intermediate = BERT_SHAPES[shape]
    return BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        pad_token_id=tokenizer.pad_token_id,
        **settings,
    )


def build_random_cross_encoder(out_dir: str | os.PathLike[str], shape: str = "tiny", seed: int = 0) -> Path:
    """Save a randomly initialised BERT reranker (one label: a sequence-classification head) in
    sentence-transformers' CrossEncoder layout at ``out_dir``, so ``CrossEncoder(out_dir)`` loads it."""
    from sentence_transformers import CrossEncoder
    from transformers import BertForSequenceClassification

    if shape not in BERT_SHAPES:
        raise ValueError(f"unknown BERT shape {shape!r}; expected one of {sorted(BERT_SHAPES)}")
    tokenizer = bert_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # BERT's initialisation (std 0.02) gives every pair nearly the same score; wider weights spread the scores
        # over (0, 1), so comparisons of scores compare different numbers.
        model = BertForSequenceClassification(bert_config(shape, tokenizer, num_labels=1, initializer_range=0.5))
    with tempfile.TemporaryDirectory() as plain:  # a Hugging Face model folder, which CrossEncoder loads as such
        model.save_pretrained(plain)
        tokenizer.save_pretrained(plain)
        CrossEncoder(plain, device="cpu").save(str(out_dir))
    return Path(out_dir)
