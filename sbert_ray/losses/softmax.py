"""Classification objective (SBERT section 3): softmax(W_t · (u, v, |u−v|)) with cross-entropy, used for NLI."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from sbert_ray.data.records import NLI_LABELS, LabelledPair
from sbert_ray.losses.base import EncoderLoss
from sbert_ray.models.encoder import SentenceEncoder

ConcatPart = Literal["u", "v", "|u-v|", "u*v"]
# The vectors Table 6 ablates, by the names used there.
CONCAT_FEATURES: dict[ConcatPart, Callable[[Tensor, Tensor], Tensor]] = {
    "u": lambda u, v: u,
    "v": lambda u, v: v,
    "|u-v|": lambda u, v: torch.abs(u - v),
    "u*v": lambda u, v: u * v,
}


class SoftmaxLoss(EncoderLoss):
    """Cross-entropy of a linear classifier over the concatenation `concat` of the two sentence embeddings.

    The classifier W_t ∈ R^{k·n × num_labels} lives here, not in the encoder: it is trained but not saved.
    Features are concatenated in the order given; the default (u, v, |u−v|) is the paper's best (Table 6).
    """

    record_types = (LabelledPair,)
    user_file_kind = "labelled"
    has_head = True
    label_field = "label"

    def __init__(
        self,
        encoder: SentenceEncoder,
        concat: Sequence[ConcatPart] = ("u", "v", "|u-v|"),
        num_labels: int = len(NLI_LABELS),
    ) -> None:
        super().__init__(encoder)
        unknown = [name for name in concat if name not in CONCAT_FEATURES]
        if not concat or unknown or len(set(concat)) != len(concat):
            raise ValueError(f"concat must be distinct names from {list(CONCAT_FEATURES)}, got {list(concat)}")
        self.concat = tuple(concat)
        self.classifier = nn.Linear(len(self.concat) * encoder.embedding_dim, num_labels, device=encoder.device)
        self.prefix_classifiers = nn.ModuleDict()  # by embedding size, under MatryoshkaLoss

    def prepare_for_dims(self, dims: Sequence[int]) -> None:
        # One classifier per embedding size, as Matryoshka representation learning trains its classification
        # heads; the full size keeps `classifier`.
        for dim in dims:
            if dim != self.encoder.embedding_dim:
                self.prefix_classifiers[str(dim)] = nn.Linear(
                    len(self.concat) * dim, self.classifier.out_features, device=self.encoder.device
                )

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        u, v = self._columns(embeddings, 2)
        features = torch.cat([CONCAT_FEATURES[name](u, v) for name in self.concat], dim=1)
        size = str(u.shape[1])
        classifier = self.prefix_classifiers[size] if size in self.prefix_classifiers else self.classifier
        return F.cross_entropy(classifier(features), self._labels(labels))
