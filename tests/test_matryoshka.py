"""Matryoshka: the wrapped loss summed over embedding prefixes (by hand and against sentence-transformers), models
saved and loaded truncated in both libraries, evaluation at several sizes in one run, and a Ray Train run of
cached multiple-negatives ranking under Matryoshka on two workers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import losses as st_losses
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator
from sentence_transformers.sentence_transformer.modules import Normalize
from torch.nn import functional as F

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, load_config
from sbert_ray.data import load_records
from sbert_ray.losses import (
    CachedMultipleNegativesRankingLoss,
    CosineSimilarityLoss,
    EncoderLoss,
    MatryoshkaLoss,
    MultipleNegativesRankingLoss,
    SoftmaxLoss,
    TripletLoss,
)
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.random_bert import random_bert
from sbert_ray.models.st_layout import ModelError
from sbert_ray.runs.train_run import run_training
from sbert_ray.training.resume_points import RESUME_FOLDER

ANCHORS = ["A girl rides a bike.", "The chef slices onions.", "A crowd watches fireworks.", "He fixes the roof."]
POSITIVES = ["A child is cycling.", "Vegetables are being cut.", "People look at the sky.", "A man repairs a house."]
NEGATIVES = ["The bike is in the shop.", "Nobody is cooking.", "The street is empty.", "He is asleep in bed."]
DIMS, WEIGHTS = [32, 16, 8], [1.0, 0.5, 0.25]  # the tiny BERT has 32 dimensions


@pytest.fixture
def encoder(tiny_model_dir: Path) -> SentenceEncoder:
    return SentenceEncoder.load(tiny_model_dir)


def _by_hand(inner: EncoderLoss, embeddings: list[torch.Tensor], labels, normalize: bool) -> torch.Tensor:
    total = torch.tensor(0.0)
    for dim, weight in zip(DIMS, WEIGHTS, strict=True):
        prefixes = [F.normalize(e[:, :dim], dim=1) if normalize else e[:, :dim] for e in embeddings]
        total = total + weight * inner.compute_loss_from_embeddings(prefixes, labels)
    return total


@pytest.mark.parametrize(
    ("objective", "normalize"),
    [("mnrl", False), ("regression", False), ("triplet", False), ("triplet", True), ("softmax", False)],
)
def test_loss_is_the_weighted_sum_over_prefixes(encoder: SentenceEncoder, objective: str, normalize: bool):
    encoder.normalize = normalize  # a normalising encoder's prefixes are normalised again
    inner, columns, labels = {
        "mnrl": (MultipleNegativesRankingLoss(encoder), [ANCHORS, POSITIVES, NEGATIVES], None),
        "regression": (CosineSimilarityLoss(encoder), [ANCHORS, POSITIVES], torch.tensor([0.9, 0.1, 0.5, 0.7])),
        "triplet": (TripletLoss(encoder), [ANCHORS, POSITIVES, NEGATIVES], None),
        "softmax": (SoftmaxLoss(encoder), [ANCHORS, POSITIVES], torch.tensor([0, 1, 2, 1])),
    }[objective]
    loss = MatryoshkaLoss(inner, DIMS, WEIGHTS)
    features = [encoder.tokenize(column) for column in columns]
    value = loss(features, labels)
    embeddings = [encoder(f) for f in features]
    # The same float32 embeddings and terms, summed as the loss sums them: a few ulps of a loss below ~10.
    torch.testing.assert_close(value, _by_hand(inner, embeddings, labels, normalize), atol=1e-6, rtol=1e-6)
    value.backward()
    assert all(p.grad is not None for p in encoder.parameters() if p.requires_grad)
    # Each size's term is a real term: dropping a size changes the loss.
    assert not torch.isclose(value, MatryoshkaLoss(inner, DIMS[:2], WEIGHTS[:2])(features, labels))


@pytest.mark.parametrize("objective", ["mnrl", "regression"])
def test_matches_sentence_transformers(encoder: SentenceEncoder, tiny_model_dir: Path, objective: str):
    """Cosine-based losses do not see the prefix normalisation sentence-transformers adds: same numbers."""
    reference = SentenceTransformer(str(tiny_model_dir), device="cpu").eval()
    if objective == "mnrl":
        ours, theirs = MultipleNegativesRankingLoss(encoder), st_losses.MultipleNegativesRankingLoss(reference)
        columns, labels = [ANCHORS, POSITIVES, NEGATIVES], None
    else:
        ours, theirs = CosineSimilarityLoss(encoder), st_losses.CosineSimilarityLoss(reference)
        columns, labels = [ANCHORS, POSITIVES], torch.tensor([0.9, 0.1, 0.5, 0.7])
    theirs = st_losses.MatryoshkaLoss(reference, theirs, DIMS, WEIGHTS)
    features = [encoder.tokenize(column) for column in columns]
    # One formula, two float32 implementations (theirs normalises each prefix first): logits scaled by 20 carry
    # ~20 x 1e-7 of rounding into a loss of ~2-10, so 1e-5 leaves a margin of ~5.
    torch.testing.assert_close(
        MatryoshkaLoss(ours, DIMS, WEIGHTS)(features, labels), theirs(features, labels), atol=1e-5, rtol=1e-5
    )


def test_over_cached_mnrl_gives_the_uncached_gradients(encoder: SentenceEncoder):
    encoder.double()  # exact math in another summation order: compared in float64 (see test_cached_mnrl.py)
    features = [encoder.tokenize(column) for column in (ANCHORS, POSITIVES, NEGATIVES)]
    grads = []
    for inner in (
        MultipleNegativesRankingLoss(encoder),
        CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=3),
    ):
        encoder.zero_grad()
        MatryoshkaLoss(inner, DIMS, WEIGHTS)(features).backward()
        grads.append({k: p.grad.clone() for k, p in encoder.named_parameters() if p.requires_grad})
    # Reordering sums of < 1e4 terms with absolute sums < 10 in float64 moves them by < 1e-11 (float32 moved one
    # token_type_embeddings gradient by 2.7e-6 on another CPU, beyond any fixed float32 tolerance).
    torch.testing.assert_close(grads[1], grads[0], atol=1e-9, rtol=1e-7)


def test_softmax_gets_a_classifier_per_size_and_checkpoints_hold_one_encoder(encoder: SentenceEncoder):
    loss = MatryoshkaLoss(SoftmaxLoss(encoder, num_labels=3), DIMS)
    assert [loss.loss.prefix_classifiers[str(d)].in_features for d in (16, 8)] == [3 * 16, 3 * 8]
    state = loss.state_dict()
    assert not any(key.startswith("loss.") for key in state)  # the wrapped loss's own names, its encoder once
    head = {k: v.clone() for k, v in state.items() if not k.startswith("encoder.")}
    assert sorted(head) == [
        "classifier.bias",
        "classifier.weight",
        "prefix_classifiers.16.bias",
        "prefix_classifiers.16.weight",
        "prefix_classifiers.8.bias",
        "prefix_classifiers.8.weight",
    ]
    # Restoring the head into a fresh wrapped loss (what a resumed worker does) gives the same classifiers.
    fresh = MatryoshkaLoss(SoftmaxLoss(encoder, num_labels=3), DIMS)
    missing, unexpected = fresh.load_state_dict(head, strict=False)
    assert not unexpected and all(key.startswith("encoder.") for key in missing)
    torch.testing.assert_close(fresh.loss.prefix_classifiers["8"].weight, head["prefix_classifiers.8.weight"])


@pytest.mark.parametrize(
    ("dims", "weights", "message"),
    [([64], None, "1..32"), ([16, 16], None, "distinct"), ([16, 8], [1.0], "one weight per size")],
)
def test_rejects_sizes_that_cannot_work(encoder: SentenceEncoder, dims, weights, message):
    with pytest.raises(ValueError, match=message):
        MatryoshkaLoss(MultipleNegativesRankingLoss(encoder), dims, weights)


def test_stage_config_rejects_bad_sizes_before_ray(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"stages\.0\.matryoshka_weights: one weight per size"):
        load_config(None, ["stages.0.matryoshka_dims=[32, 16]", "stages.0.matryoshka_weights=[1.0]"])
    with pytest.raises(ConfigError, match=r"stages\.0\.matryoshka_dims: expected distinct positive"):
        load_config(None, ["stages.0.matryoshka_dims=[0]"])


# --- truncated models ------------------------------------------------------------------------------------------


def test_truncate_dim_round_trips_with_sentence_transformers(encoder: SentenceEncoder, tmp_path: Path):
    sentences = ANCHORS + POSITIVES
    # Ours saved truncated: sentence-transformers loads it truncated and encodes the same numbers.
    encoder.truncate_dim = 16
    encoder.save(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config_sentence_transformers.json").read_text())["truncate_dim"] == 16
    theirs = SentenceTransformer(str(tmp_path / "ours"), device="cpu")
    assert theirs.truncate_dim == 16
    ours = encoder.encode(sentences)
    assert ours.shape == (8, 16)
    np.testing.assert_allclose(theirs.encode(sentences), ours, atol=1e-6)
    # Theirs saved truncated (and normalising, which truncation follows): we load it truncated.
    theirs.truncate_dim = 8
    theirs.append(Normalize())
    theirs.save(str(tmp_path / "theirs"))
    loaded = SentenceEncoder.load(tmp_path / "theirs")
    assert loaded.truncate_dim == 8 and loaded.normalize
    np.testing.assert_allclose(loaded.encode(sentences), theirs.encode(sentences), atol=1e-6)
    # Saving without truncation over a truncated folder leaves no stale truncate_dim behind.
    loaded.truncate_dim = None
    loaded.save(tmp_path / "theirs")
    assert SentenceTransformer(str(tmp_path / "theirs"), device="cpu").truncate_dim is None


@pytest.mark.parametrize(("truncate_dim", "message"), [("16", "positive integer"), (64, "beyond the model's 32")])
def test_a_bad_saved_truncate_dim_names_the_folder(tiny_model_dir: Path, tmp_path: Path, truncate_dim, message):
    SentenceEncoder.load(tiny_model_dir).save(tmp_path / "model")
    (tmp_path / "model" / "config_sentence_transformers.json").write_text(json.dumps({"truncate_dim": truncate_dim}))
    with pytest.raises(ModelError, match=f"{tmp_path / 'model'}.*{message}"):
        SentenceEncoder.load(tmp_path / "model")


def test_eval_scores_each_size_as_sentence_transformers_truncates(tiny_model_dir: Path, data_dir: Path, tmp_path: Path):
    # The first 300 pairs of STSb test, in a data folder of their own: the real reader, a quarter of the encoding.
    small = tmp_path / "data" / "stsb"
    small.mkdir(parents=True)
    lines = (data_dir / "stsb" / "sts-test.csv").read_text(encoding="utf-8").splitlines(keepends=True)
    (small / "sts-test.csv").write_text("".join(lines[:300]), encoding="utf-8")
    output = tmp_path / "results.json"
    code = main(["eval", "--model", str(tiny_model_dir), "--tasks", "stsb", "--truncate-dim", "32,16,8"]
                + ["--data-dir", str(small.parent), "--output", str(output)])  # fmt: skip
    assert code == 0
    results = json.loads(output.read_text())
    assert list(results) == ["stsb@32", "stsb@16", "stsb@8"]
    pairs = load_records("stsb", "test", small.parent)
    reference = SentenceTransformer(str(tiny_model_dir), device="cpu")
    for dim in (32, 16, 8):
        reference.truncate_dim = dim
        evaluator = EmbeddingSimilarityEvaluator(
            [p.sentence1 for p in pairs], [p.sentence2 for p in pairs], [p.score for p in pairs]
        )
        expected = evaluator(reference)["spearman_cosine"] * 100
        assert results[f"stsb@{dim}"]["spearman_cosine"] == pytest.approx(expected, abs=0.01)
        assert results[f"stsb@{dim}"]["n"] == len(pairs) == 300
    assert results["stsb@8"]["spearman_cosine"] != pytest.approx(results["stsb@32"]["spearman_cosine"], abs=0.01)
    # A size the model does not have is refused before anything is encoded.
    assert main(["eval", "--model", str(tiny_model_dir), "--tasks", "stsb", "--truncate-dim", "64"]) == 2


# --- training ------------------------------------------------------------------------------------------------


def test_two_workers_train_cached_mnrl_under_matryoshka(local_ray, tiny_train_config):
    """The training loop as it is (no_sync accumulation, checkpoints) with cached MNRL inside Matryoshka, the
    encoder sharded by FSDP (scaling.strategy: fsdp): dev scoring, checkpoints and the final model gathered whole."""
    overrides = [
        "scaling.strategy=fsdp",
        "stages.0.dataset=nli-triplets",
        "stages.0.split=dev",
        "stages.0.objective=cached_mnrl",
        "stages.0.loss.mini_batch_size=2",
        "stages.0.matryoshka_dims=[32, 16, 8]",
        "stages.0.grad_accum_steps=2",
        "stages.0.max_steps=4",
        "evaluation.final_tasks=[]",
    ]
    config = load_config(tiny_train_config(name="matryoshka", limit=64, eval_every=2), overrides)
    result = run_training(config)

    run = MlflowClient(result.tracking_uri).get_run(result.run_id)
    assert run.info.status == "FINISHED" and np.isfinite(run.data.metrics["train/loss"])
    assert result.metrics["global_step"] == 4
    # The checkpoint's objective head holds nothing beyond the encoder (MNRL has no head): no second encoder copy.
    run_dir = Path(config.checkpoint.storage_path) / "matryoshka"
    checkpoints = sorted(run_dir.glob(f"{RESUME_FOLDER}/step-*/training.pt"))  # the full states, beside Ray's models
    assert checkpoints and torch.load(checkpoints[-1], weights_only=True)["head"] == {}
    trained = SentenceEncoder.load(result.model_dir).transformer.embeddings.word_embeddings.weight
    initial = random_bert("tiny", seed=config.seed).transformer.embeddings.word_embeddings.weight
    assert not torch.allclose(trained, initial)
