"""Prompts: named texts put before the input, as sentence-transformers' ``prompts`` / ``default_prompt_name``
(E5's "query: " / "passage: ", BGE's and nomic's instructions).

A prompt is prepended to the text as it is (``prompt + text``, no space added). Pooling includes its tokens unless
the model's pooling says ``include_prompt: false`` (sentence-transformers' ``Pooling.include_prompt``, set by
INSTRUCTOR-style models); then the first ``prompt_length`` tokens (the prompt with the leading [CLS], without the
trailing [SEP]: ``prompt_length``) are left out of the pooled vector. A batch carries the count in its features as
``prompt_length``, as sentence-transformers' batches do.

Which prompt goes where follows sentence-transformers' ``encode_query`` / ``encode_document``: queries get the
prompt named ``query``; documents the first of ``document``, ``passage``, ``corpus`` that the model has; an input
with neither gets the default prompt (``default_prompt_name``), if any.
"""

from __future__ import annotations

from collections.abc import Mapping

QUERY_PROMPT_NAMES = ("query",)
DOCUMENT_PROMPT_NAMES = ("document", "passage", "corpus")


def query_prompt_name(prompts: Mapping[str, str]) -> str | None:
    """The prompt ``encode_query`` uses: ``query`` if the model has one (else None: the default prompt applies)."""
    return next((name for name in QUERY_PROMPT_NAMES if name in prompts), None)


def document_prompt_name(prompts: Mapping[str, str]) -> str | None:
    """The prompt ``encode_document`` uses: the first of ``document``, ``passage``, ``corpus`` the model has."""
    return next((name for name in DOCUMENT_PROMPT_NAMES if name in prompts), None)


def prompt_for_column(prompts: Mapping[str, str], column_index: int) -> str:
    """The prompt text for a training column: the anchor (column 0) gets the query prompt, every other column
    (positives, negatives, the second sentence of a pair) the document prompt; '' when the model has none."""
    name = query_prompt_name(prompts) if column_index == 0 else document_prompt_name(prompts)
    return prompts[name] if name is not None else ""


def resolve_prompt(
    prompts: Mapping[str, str], default_prompt_name: str | None, prompt: str | None, prompt_name: str | None
) -> str:
    """The prompt text an ``encode`` call uses ('' for none): ``prompt`` as given, else the prompt named
    ``prompt_name``, else the default prompt. Giving both is refused (sentence-transformers warns and drops the
    name); an unknown name is a ValueError listing the model's prompts."""
    if prompt is not None and prompt_name is not None:
        raise ValueError(f"give a prompt or a prompt name, not both (prompt {prompt!r}, prompt_name {prompt_name!r})")
    if prompt is not None:
        return prompt
    name = prompt_name if prompt_name is not None else default_prompt_name
    if name is None:
        return ""
    if name not in prompts:
        known = ", ".join(map(repr, prompts)) or "none"
        raise ValueError(f"unknown prompt name {name!r}; the model's prompts: {known}")
    return prompts[name]


def check_prompts(prompts: Mapping[str, str], default_prompt_name: str | None) -> str | None:
    """Why ``prompts`` and ``default_prompt_name`` do not fit together, or None."""
    if not all(isinstance(name, str) and isinstance(text, str) for name, text in prompts.items()):
        return f"prompts must map names to texts, got {dict(prompts)!r}"
    if default_prompt_name is not None and default_prompt_name not in prompts:
        known = ", ".join(map(repr, prompts)) or "none"
        return f"default_prompt_name {default_prompt_name!r} is not one of the prompts ({known})"
    return None
