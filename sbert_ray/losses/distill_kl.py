"""Listwise distillation (as in RocketQAv2, Ren et al. 2021): the student's softmax over a query's positive and n
negatives is pulled towards the teacher's, in KL divergence, both at one temperature."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import Triplet
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.losses.margin_mse import student_scores
from sbert_ray.models.encoder import SentenceEncoder


class DistillKLDivLoss(EncoderLoss):
    """T² · KL(softmax(t / T) ‖ softmax(s / T)), averaged over the batch; s = [q·p, q·n_1..n], t the teacher's.

    Columns are [query, positive, negative_1..n]; the labels are the teacher's scores [t_p, t_n1..t_nn] per row
    (``score_positive``, ``score_negative_1..n``). T² keeps the gradient's size independent of the temperature
    (Hinton et al. 2015).
    """

    record_types = (Triplet,)
    user_file_kind = "triplet"
    label_field = "scores"

    def __init__(self, encoder: SentenceEncoder, temperature: float = 1.0) -> None:
        super().__init__(encoder)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = temperature

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        student = F.log_softmax(student_scores(self, embeddings) / self.temperature, dim=1)
        teacher = F.log_softmax(self._labels(labels).to(student.dtype) / self.temperature, dim=1)
        return F.kl_div(student, teacher, reduction="batchmean", log_target=True) * self.temperature**2
