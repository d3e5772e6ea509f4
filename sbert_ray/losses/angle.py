"""AnglE (Li & Li 2024): CoSENT on an angle similarity, whose gradient does not vanish where the cosine
saturates near ±1."""

from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F

from sbert_ray.losses.cosent import CoSENTLoss


class AnglELoss(CoSENTLoss):
    """CoSENT with sim = |cos(u, v) + sin(u, v)|: each embedding read as a complex vector (first half real, second
    half imaginary) after L2 normalisation, as sentence-transformers' ``pairwise_angle_sim`` does."""

    def similarity(self, u: Tensor, v: Tensor) -> Tensor:
        u, v = F.normalize(F.pad(u, (0, u.shape[-1] % 2)), dim=-1), F.normalize(F.pad(v, (0, v.shape[-1] % 2)), dim=-1)
        u_real, u_imaginary = u.chunk(2, dim=-1)
        v_real, v_imaginary = v.chunk(2, dim=-1)
        cosines = (u * v).sum(-1)
        sines = (u_imaginary * v_real - u_real * v_imaginary).sum(-1)
        return (cosines + sines).abs()
