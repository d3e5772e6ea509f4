"""Sentence encoders: transformer + pooling, model references, random BERTs."""

from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.load import load_encoder
from sbert_ray.models.pooling import POOLING_MODES, Pooling
from sbert_ray.models.random_bert import BERT_SHAPES, build_random_bert, random_bert
from sbert_ray.models.resolve import resolve_model_ref

__all__ = [
    "BERT_SHAPES",
    "POOLING_MODES",
    "Pooling",
    "SentenceEncoder",
    "build_random_bert",
    "load_encoder",
    "random_bert",
    "resolve_model_ref",
]
