"""Sentence encoders: transformer + pooling, model references, random BERTs, pre-flight model checks."""

from sbert_ray.models.checks import check_model
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.load import load_encoder
from sbert_ray.models.pooling import POOLING_MODES, Pooling
from sbert_ray.models.random_bert import BERT_SHAPES, build_random_bert, random_bert
from sbert_ray.models.resolve import resolve_model_ref
from sbert_ray.models.st_layout import ModelError

__all__ = [
    "BERT_SHAPES",
    "POOLING_MODES",
    "ModelError",
    "Pooling",
    "SentenceEncoder",
    "build_random_bert",
    "check_model",
    "load_encoder",
    "random_bert",
    "resolve_model_ref",
]
