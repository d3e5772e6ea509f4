"""In-batch-negative losses given the texts' hashes: a candidate with the text of an anchor's own positive (other
than that positive) is left out of the anchor's softmax, across workers too. Checked against a brute force that
compares the texts themselves, on two gloo workers (no Ray) and in one process; without hashes nothing changes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from spawned_workers import SplitBatches, masked_mnrl, trainable_grads
from torch import Tensor
from torch.nn import functional as F

from sbert_ray.losses import CachedMultipleNegativesRankingLoss, MatryoshkaLoss, MultipleNegativesRankingLoss
from sbert_ray.models import SentenceEncoder

ANCHORS = [
    "A man plays a guitar.",
    "Two dogs run in a field.",
    "A woman is cooking.",
    "Kids play football.",
    "A musician is on stage.",
    "The bus is late.",
]
POSITIVES = [
    "Someone plays music.",
    "Animals are running.",
    "A person prepares food.",
    "Children play a sport.",
    "Someone plays music.",  # row 0's positive
    "A bus has not arrived yet.",
]
NEGATIVES = [
    "The stock market fell.",
    "It is raining in Paris.",
    "Children play a sport.",  # row 3's positive
    "The cat sleeps all day.",
    "Nobody is here.",
    "Animals are running.",  # row 1's positive
]
COLUMNS = [ANCHORS, POSITIVES, NEGATIVES]
# Rows 0 and 4 share a positive (each masks the other's), row 5's and row 2's hard negatives are row 1's and row
# 3's positives: 4 masked candidates. Split (3, 3) puts every pair on two workers; (4, 2) keeps rows 2 and 3 on
# one worker and pads worker 1's rows (and hashes) in the gather.
SPLITS = [(3, 3), (4, 2)]
DUPLICATES = 4
# Everything below runs in float64 and differs from the brute force only in the order of sums (per worker and
# all-reduced; a masked score is exp(-inf) = 0 exactly, not a term): sums of < 1e4 terms with absolute sums < 10
# move by < 1e-11 (as in test_losses.test_gathered_loss_and_gradients_equal_the_global_batch), while one candidate
# masked or not moves the loss by > 1e-2 (asserted below).
EXACT = {"atol": 1e-9, "rtol": 1e-7}


def text_hash(text: str) -> int:
    """A 64-bit hash of a text, as the batcher carries it (any stable one: equal texts, equal hashes)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def column_hashes(columns: list[list[str]]) -> list[Tensor]:
    return [torch.tensor([text_hash(text) for text in column]) for column in columns]


def brute_force_loss(encoder: SentenceEncoder, columns: list[list[str]], mask: bool) -> tuple[Tensor, int]:
    """MNRL on one process, anchor by anchor: the log-softmax of its positive among the kept candidates (every
    positive and hard negative, less those whose text equals its positive, other than the positive itself), mean
    over anchors; and how many candidates were left out."""
    anchors, *candidate_columns = columns
    texts = [text for column in candidate_columns for text in column]
    anchor_embeddings = F.normalize(encoder(encoder.tokenize(anchors)), dim=-1)
    candidate_embeddings = F.normalize(encoder(encoder.tokenize(texts)), dim=-1)
    terms, left_out = [], 0
    for i, positive in enumerate(candidate_columns[0]):
        kept = [j for j, text in enumerate(texts) if not (mask and text == positive and j != i)]
        left_out += len(texts) - len(kept)
        scores = 20.0 * candidate_embeddings @ anchor_embeddings[i]
        terms.append(torch.logsumexp(scores[kept], dim=0) - scores[i])
    return torch.stack(terms).mean(), left_out


@pytest.fixture
def encoder(tiny_model_dir: Path) -> SentenceEncoder:
    return SentenceEncoder.load(tiny_model_dir).double()  # eval mode: no dropout


@pytest.mark.slow  # spawns a two-process group
def test_two_workers_mask_what_the_brute_force_leaves_out(tiny_model_dir: Path, tmp_path: Path) -> None:
    hashes = [[text_hash(text) for text in column] for column in COLUMNS]
    batches = SplitBatches(2, str(tiny_model_dir), str(tmp_path), SPLITS, COLUMNS)
    mp.spawn(masked_mnrl, args=(batches, hashes), nprocs=2, join=True)
    results = torch.load(tmp_path / "results.pt")
    expected = {}
    for mask in (True, False):
        encoder = SentenceEncoder.load(tiny_model_dir).double()
        loss, left_out = brute_force_loss(encoder, COLUMNS, mask)
        loss.backward()
        expected[mask] = {"loss": loss.detach(), "masked": left_out, "grads": trainable_grads(encoder)}
    assert expected[True]["masked"] == DUPLICATES and expected[False]["masked"] == 0
    assert expected[False]["loss"] - expected[True]["loss"] > 1e-2  # the masking has teeth
    for (split, name, mask), result in results.items():
        where = f"split {SPLITS[split]}, {name}, mask_duplicates={mask}"
        torch.testing.assert_close(result["loss"], expected[mask]["loss"], **EXACT, msg=where)
        torch.testing.assert_close(result["grads"], expected[mask]["grads"], **EXACT, msg=where)
        assert int(result["masked"]) == expected[mask]["masked"], where
    assert len(results) == len(SPLITS) * 2 * 2


@pytest.mark.parametrize("cached", [False, True])
def test_one_process_masks_as_the_brute_force(encoder: SentenceEncoder, cached: bool) -> None:
    loss_fn = (
        CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=4)
        if cached
        else MultipleNegativesRankingLoss(encoder)
    )
    features = [encoder.tokenize(column) for column in COLUMNS]
    expected, left_out = brute_force_loss(encoder, COLUMNS, mask=True)
    torch.testing.assert_close(loss_fn(features, text_hashes=column_hashes(COLUMNS)), expected, **EXACT)
    assert int(loss_fn.masked_duplicates) == left_out == DUPLICATES


def _todays_loss(embeddings: list[Tensor]) -> Tensor:
    """MultipleNegativesRankingLoss's formula as it was before hashes existed (one process), on the embeddings the
    loss itself computes: how the encoder is batched (columns stacked in one forward, or mini-batches) moves the
    vectors by rounding on some CPUs, which is not what masking may change."""
    anchors, *columns = embeddings
    candidates = torch.cat(columns)
    scores = 20.0 * F.normalize(anchors, dim=-1) @ F.normalize(candidates, dim=-1).T
    return F.cross_entropy(scores, torch.arange(len(anchors)))


@pytest.mark.parametrize("cached", [False, True])
def test_without_hashes_or_duplicates_the_loss_is_bit_identical(tiny_model_dir: Path, cached: bool) -> None:
    """No hashes, hashes of distinct texts, or duplicates with mask_duplicates off: the very same loss, bit for
    bit, as the formula without masking (float32, as training runs)."""
    encoder = SentenceEncoder.load(tiny_model_dir)
    distinct = [ANCHORS[:4], POSITIVES[:4], NEGATIVES[:2] + NEGATIVES[3:5]]  # no text twice in a candidate column

    def loss(columns, **settings):
        if cached:
            loss_fn = CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=64, **settings)
        else:
            loss_fn = MultipleNegativesRankingLoss(encoder, **settings)
        return loss_fn, [encoder.tokenize(column) for column in columns]

    loss_fn, features = loss(distinct)
    with torch.no_grad():  # the same kernels as with gradients, without the autograd graph
        today = _todays_loss(loss_fn.embed(features))
    assert torch.equal(loss_fn(features), today) and loss_fn.masked_duplicates is None
    assert torch.equal(loss_fn(features, text_hashes=column_hashes(distinct)), today)
    assert int(loss_fn.masked_duplicates) == 0
    unmasked, features = loss(COLUMNS, mask_duplicates=False)
    assert torch.equal(unmasked(features, text_hashes=column_hashes(COLUMNS)), unmasked(features))
    assert unmasked.masked_duplicates is None


def test_matryoshka_passes_the_hashes_to_every_size(encoder: SentenceEncoder) -> None:
    inner = MultipleNegativesRankingLoss(encoder)
    matryoshka = MatryoshkaLoss(inner, [16, 32], [1.0, 0.5])
    features = [encoder.tokenize(column) for column in COLUMNS]
    hashes = column_hashes(COLUMNS)
    embeddings = inner.embed(features)
    expected = sum(
        weight * inner.compute_loss_from_embeddings([e[:, :dim] for e in embeddings], None, hashes)
        for dim, weight in [(16, 1.0), (32, 0.5)]
    )
    torch.testing.assert_close(matryoshka(features, text_hashes=hashes), expected, **EXACT)
    assert int(matryoshka.masked_duplicates) == DUPLICATES
    assert matryoshka(features) > expected + 1e-2  # unmasked
