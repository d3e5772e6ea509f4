"""Sentence encoders: transformer + pooling, model references, random BERTs (and rerankers) and decoders, teachers,
pre-flight model checks.

The names below load with their module on first use (PEP 562): the config imports ``models.pooling_mode`` to check
``model.pooling``, and a config error must answer without importing torch and transformers.
"""

import importlib

_EXPORTS = {
    "sbert_ray.models.checks": ("check_model",),
    "sbert_ray.models.encoder": ("SentenceEncoder",),
    "sbert_ray.models.load": ("load_encoder",),
    "sbert_ray.models.pooling": ("Pooling",),
    "sbert_ray.models.pooling_mode": ("POOLING_MODES",),
    # Not the function random_bert: its module's name shadows it once imported (sbert_ray.models.random_bert).
    "sbert_ray.models.random_bert": ("BERT_SHAPES", "build_random_bert", "build_random_cross_encoder"),
    "sbert_ray.models.random_decoder": ("build_random_decoder",),
    "sbert_ray.models.resolve": ("resolve_model_ref",),
    "sbert_ray.models.st_layout": ("ModelError",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
