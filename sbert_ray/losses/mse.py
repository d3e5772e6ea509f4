"""Embedding distillation (Reimers & Gurevych 2020, "Making Monolingual Sentence Embeddings Multilingual"): the
student's embedding of a text is regressed onto a teacher's embedding of it, for model compression; with a
translation beside the text, the student's embedding of the translation is regressed onto the same teacher vector,
which carries the teacher's vector space over to another language."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from sbert_ray.data.records import Sentence
from sbert_ray.losses.base import EncoderLoss


class MSELoss(EncoderLoss):
    """mean over columns c of MSE(s_c, t): the mean squared difference per embedding value, s_c the student's
    embedding of column c, t the teacher's embedding of the row's text (sentence-transformers' ``MSELoss``, whose
    one teacher vector per row is compared with every column).

    Columns are [text] or [text, translation]; the label is the teacher's vector of each row's text (a parquet
    source's ``vector`` column, as ``sbert-ray encode`` writes it), of the student's embedding size.
    """

    record_types = (Sentence,)
    user_file_kind = "sentence"
    label_field = "vector"

    def compute_loss_from_embeddings(
        self, embeddings: Sequence[Tensor], labels: Tensor | None, text_hashes: Sequence[Tensor] | None = None
    ) -> Tensor:
        teacher = self._labels(labels).to(embeddings[0].dtype)
        if teacher.shape[-1] != embeddings[0].shape[-1]:
            raise ValueError(
                f"MSELoss: the teacher's embeddings have {teacher.shape[-1]} dimensions, the student's "
                f"{embeddings[0].shape[-1]}"
            )
        return torch.stack([F.mse_loss(student, teacher) for student in embeddings]).mean()
