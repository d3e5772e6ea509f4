"""Checks a run makes on its model before any cluster work: it exists, its folder is sound, its weight files read,
and the configured ``max_seq_length`` fits its position embeddings. Reads configs and file headers only."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, BertConfig

from sbert_ray.models.encoder import position_limit
from sbert_ray.models.load import RANDOM_PREFIX
from sbert_ray.models.random_bert import BERT_SHAPES
from sbert_ray.models.resolve import resolve_model_ref
from sbert_ray.models.st_layout import ModelError, check_weights, read_st_layout


def check_model(name: str, max_seq_length: int, allow_unsafe_weights: bool = False) -> int:
    """A ModelError naming ``model.name`` or ``model.max_seq_length`` (and the file at fault) for a model a
    training config names that could not be trained; else the model's embedding size.

    ``name`` as in ``model.name``: a local folder, a Hub id or ``random:<shape>``. A missing local folder or an
    unknown offline id stays a FileNotFoundError (as ``resolve_model_ref`` raises it).
    """
    if name.startswith(RANDOM_PREFIX):
        shape = name.removeprefix(RANDOM_PREFIX)
        if shape not in BERT_SHAPES:
            raise ModelError(f"model.name: unknown random BERT shape {shape!r}; choose from {', '.join(BERT_SHAPES)}")
        limit = BertConfig().max_position_embeddings  # what random_bert builds
        size = BERT_SHAPES[shape][1]
    else:
        resolved = resolve_model_ref(name)
        try:
            layout = read_st_layout(resolved)
            subfolder = layout.transformer_subfolder if layout else ""
            if Path(resolved).is_dir():
                check_weights(Path(resolved) / subfolder, allow_pickle=allow_unsafe_weights)
            config = AutoConfig.from_pretrained(resolved, subfolder=subfolder, trust_remote_code=False)
            tokenizer = AutoTokenizer.from_pretrained(resolved, subfolder=subfolder, trust_remote_code=False)
        except (OSError, ValueError) as error:  # ours (ModelError), or transformers' for a folder it cannot read
            raise ModelError(f"model.name: {error}") from None
        limit, size = position_limit(tokenizer, config), config.hidden_size
    if limit is not None and max_seq_length > limit:
        raise ModelError(
            f"model.max_seq_length: {max_seq_length} is beyond the {limit} positions of {name!r}; use at most {limit}"
        )
    return size
