"""The objective registry: a stage's ``objective`` name -> its loss class.

Adding an objective is one loss module (a subclass of ``EncoderLoss`` declaring the records it trains on) plus one
line here. Config validation, record checks, user-file reading and loss construction all read this table; a
stage's ``loss:`` mapping holds the keyword settings of the class's constructor. A stage's ``matryoshka_dims``
wraps whichever objective it names (``MatryoshkaLoss``), so it is a stage key, not an objective.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from sbert_ray.losses.angle import AnglELoss
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.losses.cached_multiple_negatives_ranking import CachedMultipleNegativesRankingLoss
from sbert_ray.losses.cosent import CoSENTLoss
from sbert_ray.losses.cosine_similarity import CosineSimilarityLoss
from sbert_ray.losses.distill_kl import DistillKLDivLoss
from sbert_ray.losses.margin_mse import MarginMSELoss
from sbert_ray.losses.matryoshka import MatryoshkaLoss
from sbert_ray.losses.mse import MSELoss
from sbert_ray.losses.multiple_negatives_ranking import MultipleNegativesRankingLoss
from sbert_ray.losses.reranker_bce import RerankerBCELoss
from sbert_ray.losses.reranker_mnrl import RerankerMNRLoss
from sbert_ray.losses.softmax import SoftmaxLoss
from sbert_ray.losses.triplet import TripletLoss
from sbert_ray.models.encoder import SentenceEncoder

OBJECTIVES: dict[str, type[EncoderLoss]] = {
    "softmax": SoftmaxLoss,
    "regression": CosineSimilarityLoss,
    "triplet": TripletLoss,
    "mnrl": MultipleNegativesRankingLoss,
    "cached_mnrl": CachedMultipleNegativesRankingLoss,
    "cosent": CoSENTLoss,
    "angle": AnglELoss,
    "margin_mse": MarginMSELoss,
    "distill_kl": DistillKLDivLoss,
    "mse": MSELoss,
    "reranker_bce": RerankerBCELoss,  # model.type: cross_encoder
    "reranker_mnrl": RerankerMNRLoss,  # model.type: cross_encoder
}


def loss_settings(objective: str) -> dict[str, tuple[Any, Any]]:
    """{setting: (type, default)}: the keyword arguments of the objective's loss after the encoder."""
    loss = OBJECTIVES[objective]
    hints = typing.get_type_hints(loss.__init__)
    parameters = list(inspect.signature(loss.__init__).parameters.values())[2:]  # after self, encoder
    return {p.name: (hints[p.name], p.default) for p in parameters}


def build_loss(
    objective: str,
    encoder: SentenceEncoder,
    settings: Mapping[str, Any],
    matryoshka_dims: Sequence[int] | None = None,
    matryoshka_weights: Sequence[float] | None = None,
) -> EncoderLoss:
    """The loss module of a stage; it owns the encoder (and a head such as softmax's), so DDP wraps it whole.
    With ``matryoshka_dims`` the objective is trained at each of those embedding sizes (``MatryoshkaLoss``)."""
    loss = OBJECTIVES[objective](encoder, **settings)
    return MatryoshkaLoss(loss, matryoshka_dims, matryoshka_weights) if matryoshka_dims else loss
