"""Checks a run makes on its model before any cluster work: it exists, its folder is sound, its weight files read,
and the configured ``max_seq_length`` leaves room for text after its special tokens and fits its position
embeddings. Reads configs and file headers only."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

from transformers import AutoConfig, BertConfig

from sbert_ray.models.encoder import max_seq_length_problem
from sbert_ray.models.load import RANDOM_PREFIX
from sbert_ray.models.lora_settings import LoraSettings
from sbert_ray.models.model_type import ModelType
from sbert_ray.models.prompts import check_prompts
from sbert_ray.models.random_bert import BERT_SHAPES, bert_tokenizer
from sbert_ray.models.resolve import ModelFiles, resolve_model_ref
from sbert_ray.models.st_layout import ModelError


def check_model(
    name: str,
    max_seq_length: int,
    allow_unsafe_weights: bool = False,
    prompts: dict[str, str] | None = None,
    default_prompt_name: str | None = None,
    attn_implementation: str = "sdpa",
    lora: LoraSettings | None = None,
    model_type: ModelType = "bi_encoder",
) -> int:
    """A ModelError naming ``model.name`` or ``model.max_seq_length`` (and the file at fault) for a model a
    training config names that could not be trained; else the model's embedding size.

    ``name`` as in ``model.name``: a local folder, a Hub id or ``random:<shape>``. A missing local folder or an
    unknown offline id stays a FileNotFoundError (as ``resolve_model_ref`` raises it). ``prompts`` and
    ``default_prompt_name`` as in the config: a default must name one of the prompts the model will have.
    ``attn_implementation``: flash_attention_2 needs the flash-attn package, which the workers' image shares with
    this process; whether their GPUs run it is checked where they load the model (``check_attention``).
    ``lora``: ``model.lora``, whose target modules must be linear modules of the model. ``model_type``:
    ``model.type``; a reranker's (cross_encoder) classification head, where the model has one, has one label.
    """
    if attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ModelError(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package (pip install flash-attn), "
            "which is not installed; use sdpa"
        )
    layout = None
    shape = _random_shape(name, "model.name")
    if shape is not None:
        tokenizer, config = bert_tokenizer(), BertConfig()  # what random_bert builds (positions included)
        size = BERT_SHAPES[shape][1]
    else:
        resolved = resolve_model_ref(name)
        with _errors_named("model.name"):  # ours (ModelError), or transformers' for a folder it cannot read
            files = ModelFiles.read(resolved)
            files.check_weights(allow_pickle=allow_unsafe_weights)
            config = AutoConfig.from_pretrained(resolved, subfolder=files.subfolder, trust_remote_code=False)
            tokenizer, layout = files.tokenizer(), files.layout
        size = config.hidden_size
        if model_type == "cross_encoder":
            _check_reranker_head(config, name)
    problem = max_seq_length_problem(max_seq_length, tokenizer, config, name)
    if problem:
        raise ModelError(f"model.max_seq_length: {problem}")
    if prompts is None and default_prompt_name is not None:  # the model's saved prompts stay
        problem = check_prompts(layout.prompts if layout else {}, default_prompt_name)
        if problem:
            raise ModelError(f"model.default_prompt_name: {problem} of {name!r}")
    if lora is not None:
        _check_lora(config, lora)
    return size


def check_model_files(name: str, key: str) -> None:
    """A ModelError naming ``key`` unless ``name`` (a folder, a Hub id or ``random:<shape>``) is a model whose
    folder and weight files read: a model the run only loads to score with (``evaluation.first_stage``)."""
    if _random_shape(name, key) is None:
        with _errors_named(key):
            ModelFiles.read(resolve_model_ref(name)).check_weights(allow_pickle=False)


def _random_shape(name: str, key: str) -> str | None:
    """The shape of a ``random:<shape>`` name (a ModelError naming ``key`` for an unknown one); None for others."""
    if not name.startswith(RANDOM_PREFIX):
        return None
    shape = name.removeprefix(RANDOM_PREFIX)
    if shape not in BERT_SHAPES:
        raise ModelError(f"{key}: unknown random BERT shape {shape!r}; choose from {', '.join(BERT_SHAPES)}")
    return shape


@contextmanager
def _errors_named(key: str) -> Iterator[None]:
    """A model folder that does not read (an OSError or ValueError) as a ModelError naming ``key``."""
    try:
        yield
    except (OSError, ValueError) as error:
        raise ModelError(f"{key}: {error}") from None


def _check_reranker_head(config, name: str) -> None:
    """A sequence-classification model trains as a reranker only with one label (``CrossEncoderModel``); a plain
    encoder gets a new one-label head."""
    classifies = any(arch.endswith("ForSequenceClassification") for arch in config.architectures or ())
    if classifies and config.num_labels != 1:
        raise ModelError(
            f"model.name: {name!r} classifies into {config.num_labels} labels; a reranker (model.type cross_encoder) "
            "scores with one"
        )


def _check_lora(config, lora: LoraSettings) -> None:
    if importlib.util.find_spec("peft") is None:
        raise ModelError("model.lora needs the peft package (pip install 'sbert-ray[models]'), which is not installed")
    from sbert_ray.models.lora import check_target_modules  # peft: only for runs that use it

    check_target_modules(config, lora)
