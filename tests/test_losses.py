"""Objectives: hand-computed values, gradients reaching the encoder, equality with sentence-transformers'
losses on the same model, and the cross-worker gather of MultipleNegativesRankingLoss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import losses as st_losses
from spawned_workers import SplitBatches, gathered_mnrl, trainable_grads
from torch import Tensor

from sbert_ray.config import StageConfig
from sbert_ray.data.records import NLI_LABELS, LabelledPair, ScoredPair
from sbert_ray.losses import (
    OBJECTIVES,
    AnglELoss,
    CoSENTLoss,
    CosineSimilarityLoss,
    DistillKLDivLoss,
    EncoderLoss,
    MarginMSELoss,
    MatryoshkaLoss,
    MSELoss,
    MultipleNegativesRankingLoss,
    SoftmaxLoss,
    TripletLoss,
)
from sbert_ray.models import SentenceEncoder
from sbert_ray.training.sources import record_columns

ANCHORS = ["A man plays a guitar.", "Two dogs run in a field.", "A woman is cooking.", "Kids play football."]
POSITIVES = ["Someone plays music.", "Animals are running.", "A person prepares food.", "Children play a sport."]
NEGATIVES = ["The stock market fell.", "It is raining in Paris.", "A car is parked.", "The cat sleeps all day."]


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> SentenceEncoder:
    return SentenceEncoder.load(tiny_model_dir)  # eval mode: no dropout, so both libraries agree


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> SentenceTransformer:
    return SentenceTransformer(str(tiny_model_dir), device="cpu").eval()


def _features(encoder: SentenceEncoder, *columns: list[str]) -> list[dict[str, Tensor]]:
    return [encoder.tokenize(column) for column in columns]


def _assert_matches_reference_and_trains_encoder(
    ours: EncoderLoss, theirs: torch.nn.Module, features: list[dict[str, Tensor]], labels: Tensor
) -> None:
    ours.zero_grad()
    loss = ours(features, labels)
    assert loss.dim() == 0
    # Two implementations of one formula in float32 on losses of ~0.1-20: rounding differs by a few ulps (1e-6).
    torch.testing.assert_close(loss, theirs(features, labels), atol=1e-5, rtol=1e-5)
    loss.backward()
    trainable = [p for p in ours.encoder.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)


# --- SoftmaxLoss ---------------------------------------------------------------------------------------


def test_softmax_loss_by_hand(encoder: SentenceEncoder) -> None:
    loss = SoftmaxLoss(encoder, num_labels=3, concat=("|u-v|",))
    classifier = torch.nn.Linear(2, 3, bias=False)
    classifier.weight.data = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    loss.classifier = classifier
    u, v = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    # |u−v| = (1, 1) -> logits (1, 2, 0); label 1 -> −log softmax = log(e¹ + e² + e⁰) − 2
    expected = math.log(math.e + math.e**2 + 1) - 2
    assert loss.compute_loss_from_embeddings([u, v], torch.tensor([1])).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("concat", "st_flags"),
    [
        (("u", "v", "|u-v|"), (True, True, False)),
        (("u", "v", "|u-v|", "u*v"), (True, True, True)),
        (("|u-v|",), (False, True, False)),
        (("u", "v", "u*v"), (True, False, True)),
    ],
)
def test_softmax_loss_matches_sentence_transformers(
    encoder: SentenceEncoder,
    reference: SentenceTransformer,
    concat: tuple[str, ...],
    st_flags: tuple[bool, bool, bool],
) -> None:
    ours = SoftmaxLoss(encoder, num_labels=3, concat=concat)
    rep, difference, multiplication = st_flags
    theirs = st_losses.SoftmaxLoss(reference, encoder.embedding_dim, 3, rep, difference, multiplication)
    theirs.classifier.load_state_dict(ours.classifier.state_dict())
    features = _features(encoder, ANCHORS, POSITIVES)
    labels = torch.tensor([0, 1, 2, 1])
    _assert_matches_reference_and_trains_encoder(ours, theirs, features, labels)
    assert ours.classifier.weight.grad is not None


def test_softmax_loss_rejects_unknown_concat(encoder: SentenceEncoder) -> None:
    with pytest.raises(ValueError, match="u-v"):
        SoftmaxLoss(encoder, concat=("u", "u-v"))


# --- CosineSimilarityLoss ------------------------------------------------------------------------------


def test_cosine_similarity_loss_by_hand(encoder: SentenceEncoder) -> None:
    u = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    v = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    scores = torch.tensor([0.5, 0.25])
    # cos = (1/√2, 0) against (0.5, 0.25)
    expected = ((1 / math.sqrt(2) - 0.5) ** 2 + 0.25**2) / 2
    value = CosineSimilarityLoss(encoder).compute_loss_from_embeddings([u, v], scores)
    assert value.item() == pytest.approx(expected)


def test_cosine_similarity_loss_matches_sentence_transformers(
    encoder: SentenceEncoder, reference: SentenceTransformer
) -> None:
    features = _features(encoder, ANCHORS, POSITIVES)
    scores = torch.tensor([0.9, 0.2, 0.6, 0.0])
    theirs = st_losses.CosineSimilarityLoss(reference)
    _assert_matches_reference_and_trains_encoder(CosineSimilarityLoss(encoder), theirs, features, scores)


def test_regression_targets_are_scaled_and_range_checked_once() -> None:
    stage = StageConfig(dataset="pairs.csv", objective="regression", score_max=5.0)
    (columns,) = record_columns([ScoredPair("a", "b", 4.0), ScoredPair("c", "d", 0.0)], stage, "pairs.csv")
    assert columns.texts == [["a", "c"], ["b", "d"]] and columns.labels.tolist() == pytest.approx([0.8, 0.0])
    with pytest.raises(ValueError, match=r"^pairs.csv: scores outside \[0, score_max=5.0\]"):
        list(record_columns([ScoredPair("a", "b", 42.0), ScoredPair("c", "d", 0.0)], stage, "pairs.csv"))


def test_mnrl_keeps_entailed_pairs_and_objectives_refuse_other_records() -> None:
    pairs = [LabelledPair("p", "h1", NLI_LABELS.index("entailment")), LabelledPair("p", "h2", 0)]
    (columns,) = record_columns(pairs, StageConfig(dataset="nli", objective="mnrl"), "nli")
    assert columns.to_arrow().to_pydict() == {"text_0": ["p"], "text_1": ["h1"]}
    with pytest.raises(ValueError, match="objective 'triplet' needs Triplet"):
        list(record_columns(pairs, StageConfig(dataset="nli", objective="triplet"), "nli"))


def test_every_registered_objective_declares_what_it_trains_on() -> None:
    for name, loss in OBJECTIVES.items():
        assert loss.record_types and loss.user_file_kind in ("scored", "labelled", "triplet", "sentence"), name
        assert loss.label_field in (None, "label", "score", "scores", "vector"), name


# --- TripletLoss ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("distance", "expected"),
    [
        # triplet 1: a=(0,0) p=(3,4) n=(0,1); triplet 2: a=(0,0) p=(1,0) n=(0,3); margin 1
        ("euclidean", (max(5 - 1 + 1, 0) + max(1 - 3 + 1, 0)) / 2),
        ("manhattan", (max(7 - 1 + 1, 0) + max(1 - 3 + 1, 0)) / 2),
    ],
)
def test_triplet_loss_by_hand(encoder: SentenceEncoder, distance: str, expected: float) -> None:
    anchor = torch.zeros(2, 2)
    positive = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    negative = torch.tensor([[0.0, 1.0], [0.0, 3.0]])
    loss = TripletLoss(encoder, distance=distance)
    assert loss.margin == 1.0
    assert loss.compute_loss_from_embeddings([anchor, positive, negative]).item() == pytest.approx(expected)


def test_cosine_triplet_loss_by_hand(encoder: SentenceEncoder) -> None:
    anchor, positive, negative = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([[3.0, 3.0]])
    # cosine distances: a–p = 1, a–n = 1 − 1/√2
    expected = 1 - (1 - 1 / math.sqrt(2)) + 0.5
    value = TripletLoss(encoder, distance="cosine", margin=0.5).compute_loss_from_embeddings(
        [anchor, positive, negative]
    )
    assert value.item() == pytest.approx(expected)


@pytest.mark.parametrize("distance", ["euclidean", "cosine", "manhattan"])
def test_triplet_loss_matches_sentence_transformers(
    encoder: SentenceEncoder, reference: SentenceTransformer, distance: str
) -> None:
    # Embeddings of an untrained model are close together; a large margin keeps every triplet active.
    margin = 1.0 if distance == "cosine" else 50.0
    metric = getattr(st_losses.TripletDistanceMetric, distance.upper())
    theirs = st_losses.TripletLoss(reference, distance_metric=metric, triplet_margin=margin)
    features = _features(encoder, ANCHORS, POSITIVES, NEGATIVES)
    ours = TripletLoss(encoder, distance=distance, margin=margin)
    _assert_matches_reference_and_trains_encoder(ours, theirs, features, torch.zeros(len(ANCHORS)))


# --- MultipleNegativesRankingLoss ----------------------------------------------------------------------


def test_multiple_negatives_ranking_loss_by_hand(encoder: SentenceEncoder) -> None:
    anchors = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    positives = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # scaled cosines: row 1 (20, 20/√2), target 0; row 2 (0, 20/√2), target 1
    s = 20 / math.sqrt(2)
    expected = ((math.log(math.exp(20) + math.exp(s)) - 20) + (math.log(1 + math.exp(s)) - s)) / 2
    value = MultipleNegativesRankingLoss(encoder).compute_loss_from_embeddings([anchors, positives])
    assert value.item() == pytest.approx(expected, rel=1e-4)  # float32 log-sum-exp of e^20-sized terms


@pytest.mark.parametrize("with_hard_negatives", [False, True])
def test_multiple_negatives_ranking_loss_matches_sentence_transformers(
    encoder: SentenceEncoder, reference: SentenceTransformer, with_hard_negatives: bool
) -> None:
    columns = [ANCHORS, POSITIVES, NEGATIVES] if with_hard_negatives else [ANCHORS, POSITIVES]
    theirs = st_losses.MultipleNegativesRankingLoss(reference, scale=20.0)
    ours = MultipleNegativesRankingLoss(encoder, scale=20.0)
    _assert_matches_reference_and_trains_encoder(ours, theirs, _features(encoder, *columns), None)


@pytest.mark.slow  # spawns a two-process group
# symmetric: each worker's positives rank all anchors too; dims: Matryoshka's sizes, every one from one gather
@pytest.mark.parametrize("symmetric, dims", [(False, None), (True, None), (True, [32, 16])])
def test_gathered_loss_and_gradients_equal_the_global_batch(
    encoder: SentenceEncoder, tiny_model_dir: Path, tmp_path: Path, symmetric: bool, dims: list[int] | None
) -> None:
    """Every worker's rows padded beyond its real ones (``gathered_mnrl``): the padding changes nothing."""
    splits = [(2, 2), (3, 1)]  # equal shards, and a smaller last batch on one worker
    columns = [ANCHORS, POSITIVES, NEGATIVES]
    batches = SplitBatches(2, str(tiny_model_dir), str(tmp_path), splits, columns)
    mp.spawn(gathered_mnrl, args=(batches, symmetric, dims), nprocs=2, join=True)

    single = MultipleNegativesRankingLoss(SentenceEncoder.load(tiny_model_dir).double(), symmetric=symmetric)
    if dims:
        single = MatryoshkaLoss(single, dims)
    expected_loss = single(_features(encoder, ANCHORS, POSITIVES, NEGATIVES))
    expected_loss.backward()
    expected_grads = trainable_grads(single.encoder)
    for index in range(len(splits)):
        result = torch.load(tmp_path / f"result{index}.pt")
        # The same terms summed in another order (per worker, then all-reduced), all in float64: sums of < 1e4
        # terms with absolute sums < 10 move by < 1e-11 (float32 moved them by 1e-7, machine-dependent).
        torch.testing.assert_close(result["loss"], expected_loss.detach(), atol=1e-9, rtol=1e-7)
        torch.testing.assert_close(result["grads"], expected_grads, atol=1e-9, rtol=1e-7)


def test_one_forward_embeds_every_column_as_separate_forwards_would(encoder: SentenceEncoder) -> None:
    """EncoderLoss.embed pads the columns to the widest and runs the encoder once; the attention mask hides the
    extra padding, so each column's embeddings are those of its own forward."""
    features = _features(encoder, ANCHORS, ["Short.", "Tiny.", "A bit longer sentence than the others.", "Ok."])
    assert features[0]["input_ids"].shape[1] != features[1]["input_ids"].shape[1]  # padding is exercised
    loss = CosineSimilarityLoss(encoder)
    for joint, separate in zip(loss.embed(features), [encoder(column) for column in features], strict=True):
        # The same float32 math on a wider padded batch (other kernel blocking): a few ulps of values below ~4.
        torch.testing.assert_close(joint, separate, atol=1e-5, rtol=1e-5)


# --- Losses on scored pairs and a teacher's scores, against sentence-transformers in float64 -----------------------


def _random_columns(columns: int, rows: int = 8, dim: int = 16) -> list[Tensor]:
    generator = torch.Generator().manual_seed(columns * 1000 + dim)
    return [torch.randn(rows, dim, dtype=torch.float64, generator=generator) for _ in range(columns)]


def _assert_equals_reference_in_float64(
    ours: EncoderLoss, theirs: torch.nn.Module, columns: list[Tensor], labels: Tensor | None, terms: int, size: float
) -> None:
    """The same loss and the same gradient w.r.t. every embedding, from the same float64 embeddings and labels.

    The two implementations add up the same ``terms`` values, each at most ``size``, in other orders (one sorts and
    takes cumulative log-sum-exps, the other masks a matrix, ...). Reordering a sum of n terms moves it by at most
    (n - 1) * eps * (the sum of their absolute values), so the two differ by at most 2 * terms * eps * terms * size
    (1e-10 to 1e-5 of losses of order 1 to 100 here), while a wrong term or factor moves them by 1e-2 at least."""
    tolerance = 2 * terms * torch.finfo(torch.float64).eps * terms * size
    results = []
    for loss in (ours, theirs):
        leaves = [column.clone().requires_grad_() for column in columns]
        value = loss.compute_loss_from_embeddings(leaves, labels)
        results.append((value.detach(), torch.autograd.grad(value, leaves)))
    (our_loss, our_grads), (their_loss, their_grads) = results
    assert our_loss.dtype == torch.float64 and our_loss.abs() > 1e-3  # a loss that could differ
    torch.testing.assert_close(our_loss, their_loss, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(our_grads, their_grads, atol=tolerance, rtol=tolerance)


# Scores with ties: tied pairs are not ordered, so they add no term.
STS_SCORES = torch.tensor([0.9, 0.2, 0.6, 0.0, 0.6, 1.0, 0.4, 0.2], dtype=torch.float64)


@pytest.mark.parametrize("dim", [16, 15])  # 15: AnglE pads an odd embedding to split it into halves
@pytest.mark.parametrize(("ours", "theirs"), [(CoSENTLoss, st_losses.CoSENTLoss), (AnglELoss, st_losses.AnglELoss)])
def test_cosent_and_angle_equal_sentence_transformers(reference, encoder, ours, theirs, dim: int) -> None:
    for scale in (20.0, 7.5):
        mine, reference_loss = ours(encoder, scale=scale), theirs(reference, scale=scale)
        # 64 ordered-or-not pairs of scaled similarity differences, each at most 2 * scale
        columns = _random_columns(2, dim=dim)
        _assert_equals_reference_in_float64(mine, reference_loss, columns, STS_SCORES, 64, 2 * scale)


@pytest.mark.parametrize("with_hard_negatives", [False, True])
def test_symmetric_mnrl_equals_sentence_transformers(reference, encoder, with_hard_negatives: bool) -> None:
    columns = _random_columns(3 if with_hard_negatives else 2)
    theirs = st_losses.MultipleNegativesSymmetricRankingLoss(reference, scale=12.0)
    ours = MultipleNegativesRankingLoss(encoder, scale=12.0, symmetric=True)
    _assert_equals_reference_in_float64(ours, theirs, columns, None, 8 * 8 * len(columns), 12.0)


@pytest.mark.parametrize("negatives", [1, 3])
def test_margin_mse_equals_sentence_transformers(reference, encoder, negatives: int) -> None:
    """Teacher scores per row [positive, negative_1..n], as the sources give them; ST turns them into margins too."""
    columns = _random_columns(2 + negatives)
    teacher = torch.randn(8, 1 + negatives, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 5
    # 8 * n squared differences of margins of dot products of 16 terms each (|x| < 5: dot products < 400)
    _assert_equals_reference_in_float64(
        MarginMSELoss(encoder), st_losses.MarginMSELoss(reference), columns, teacher, 8 * negatives * 16, 400.0**2
    )


@pytest.mark.parametrize(("negatives", "temperature"), [(1, 1.0), (3, 1.0), (3, 4.0)])
def test_distill_kl_equals_sentence_transformers(reference, encoder, negatives: int, temperature: float) -> None:
    columns = _random_columns(2 + negatives)
    teacher = torch.randn(8, 1 + negatives, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 5
    theirs = st_losses.DistillKLDivLoss(reference, temperature=temperature)
    ours = DistillKLDivLoss(encoder, temperature=temperature)
    # 8 rows of log-softmaxes over 1 + n dot products of 16 terms each, each below 400
    _assert_equals_reference_in_float64(ours, theirs, columns, teacher, 8 * (1 + negatives) * 16, 400.0)


def test_teacher_score_losses_refuse_rows_without_a_negative(encoder) -> None:
    for loss in (MarginMSELoss(encoder), DistillKLDivLoss(encoder)):
        with pytest.raises(ValueError, match="expects a query, a positive and negatives, got 2 columns"):
            loss.compute_loss_from_embeddings(_random_columns(2), torch.zeros(8, 1))


class _OneTeacherVectorPerRow(torch.nn.Module):
    """sentence-transformers' MSELoss as its forward calls it: a [rows, dim] label is the target of every column."""

    def __init__(self, loss: st_losses.MSELoss) -> None:
        super().__init__()
        self.loss = loss

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor) -> Tensor:
        return self.loss.compute_loss_from_embeddings(embeddings, [labels] * len(embeddings))


@pytest.mark.parametrize("texts", [1, 2])  # a text (compression), or a text and its translation (multilingual)
def test_mse_equals_sentence_transformers(reference, encoder, texts: int) -> None:
    columns = _random_columns(texts)
    teacher = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    theirs = _OneTeacherVectorPerRow(st_losses.MSELoss(reference))
    # 8 rows x 16 values x the columns of squared differences of values below 5 in size (each below 100)
    _assert_equals_reference_in_float64(MSELoss(encoder), theirs, columns, teacher, 8 * 16 * texts, 100.0)


def test_mse_on_the_model_equals_sentence_transformers_forward_and_trains_the_encoder(encoder, reference) -> None:
    """Through both forwards: sentence-transformers' own broadcasting of one teacher vector per row to each column."""
    teacher = torch.randn(len(ANCHORS), encoder.embedding_dim, generator=torch.Generator().manual_seed(6))
    features = _features(encoder, ANCHORS, POSITIVES)
    _assert_matches_reference_and_trains_encoder(MSELoss(encoder), st_losses.MSELoss(reference), features, teacher)


def test_mse_by_hand_and_a_teacher_of_another_size_is_refused(encoder) -> None:
    text, translation = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[1.0, 2.0]])
    # text: ((1-1)² + (0-2)²) / 2 = 2; translation: (1 + 4) / 2 = 2.5; the mean over the columns
    assert MSELoss(encoder).compute_loss_from_embeddings([text, translation], teacher).item() == pytest.approx(2.25)
    with pytest.raises(ValueError, match="the teacher's embeddings have 3 dimensions, the student's 2"):
        MSELoss(encoder).compute_loss_from_embeddings([text], torch.zeros(1, 3))
