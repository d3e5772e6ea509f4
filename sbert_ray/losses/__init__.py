"""Training objectives; each owns the encoder so that DDP wraps the loss module. ``OBJECTIVES`` names them."""

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
from sbert_ray.losses.registry import OBJECTIVES, build_loss, loss_settings
from sbert_ray.losses.reranker_bce import RerankerBCELoss
from sbert_ray.losses.reranker_mnrl import RerankerMNRLoss
from sbert_ray.losses.softmax import CONCAT_FEATURES, SoftmaxLoss
from sbert_ray.losses.triplet import DISTANCES, TripletLoss

__all__ = [
    "CONCAT_FEATURES",
    "DISTANCES",
    "OBJECTIVES",
    "AnglELoss",
    "CachedMultipleNegativesRankingLoss",
    "CoSENTLoss",
    "CosineSimilarityLoss",
    "DistillKLDivLoss",
    "EncoderLoss",
    "MSELoss",
    "MarginMSELoss",
    "MatryoshkaLoss",
    "MultipleNegativesRankingLoss",
    "RerankerBCELoss",
    "RerankerMNRLoss",
    "SoftmaxLoss",
    "TripletLoss",
    "build_loss",
    "loss_settings",
]
