"""Argument similarity: fold splits without topic leaks, fold scores against a direct numpy/scipy computation,
the AFS reader and protocols, the tf-idf baseline against scikit-learn (fine-tuning: tests/test_eval_ray.py)."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from scipy.stats import pearsonr, spearmanr
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.metrics.pairwise import cosine_similarity

from sbert_ray.data.readers import UKP_ASPECT_FOLDS, load_records
from sbert_ray.evaluation import argsim
from sbert_ray.evaluation.baselines import TfidfBaseline
from sbert_ray.models.encoder import SentenceEncoder


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> SentenceEncoder:
    return SentenceEncoder.load(str(tiny_model_dir))


@pytest.mark.parametrize("name", ["ukp-aspect", "bws"])
def test_cross_topic_folds_never_leak_a_topic(data_dir, name):
    records = argsim.load_argsim(name, data_dir)
    folds = argsim.cross_topic_folds(name, records)
    assert len(folds) == (4 if name == "ukp-aspect" else 8)
    tested = []
    for fold in folds:
        train_topics, test_topics = {r.topic for r in fold.train}, {r.topic for r in fold.test}
        assert train_topics and test_topics and not train_topics & test_topics
        tested += [r for r in fold.test]
    # Every pair is tested exactly once over the folds.
    assert sorted(map(repr, tested)) == sorted(map(repr, records))


def test_ukp_folds_are_the_official_split(data_dir):
    records = argsim.load_argsim("ukp-aspect", data_dir)
    for k, fold in enumerate(argsim.cross_topic_folds("ukp-aspect", records)):
        assert {r.topic for r in fold.test} == set(UKP_ASPECT_FOLDS[k]["test"])
        assert {r.topic for r in fold.train}.isdisjoint(UKP_ASPECT_FOLDS[k]["dev"])
        assert len({r.topic for r in fold.train}) == 17
        assert fold.train == list(load_records("ukp-aspect", f"fold{k}/train", data_dir))


def test_kfold_partitions_the_pairs(data_dir):
    records = argsim.load_argsim("bws", data_dir)[:200]
    folds = argsim.kfold_folds(records, k=10)
    assert len(folds) == 10
    for fold in folds:
        assert len(fold.train) + len(fold.test) == 200
        assert not {id(r) for r in fold.train} & {id(r) for r in fold.test}
    assert sum(len(f.test) for f in folds) == 200


def test_unsupervised_scores_match_a_direct_computation(tiny, data_dir):
    records = [r for r in argsim.load_argsim("bws", data_dir) if r.topic in ("Cloning", "Abortion")][::5]
    folds = argsim.cross_topic_folds("bws", records)
    result = argsim.evaluate_folds(tiny, folds)
    expected = []
    for fold in folds:
        a = tiny.encode([r.sentence1 for r in fold.test])
        b = tiny.encode([r.sentence2 for r in fold.test])
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        gold = [r.score for r in fold.test]
        expected.append((pearsonr(gold, cos).statistic * 100, spearmanr(gold, cos).statistic * 100))
        assert result["folds"][fold.name]["pearson_cosine"] == pytest.approx(expected[-1][0], abs=1e-3)
    assert result["pearson_cosine"] == pytest.approx(np.mean([e[0] for e in expected]), abs=1e-3)
    assert result["spearman_cosine"] == pytest.approx(np.mean([e[1] for e in expected]), abs=1e-3)
    assert result["n"] == len(records)


def test_tfidf_baseline_matches_sklearn_cosine(data_dir):
    pairs = argsim.load_argsim("ukp-aspect", data_dir)[:60]
    sentences = list(dict.fromkeys(s for p in pairs for s in (p.sentence1, p.sentence2)))
    vectors = TfidfVectorizer().fit(sentences)
    expected = [
        cosine_similarity(vectors.transform([p.sentence1]), vectors.transform([p.sentence2]))[0, 0] for p in pairs
    ]
    np.testing.assert_allclose(TfidfBaseline().pair_similarities(pairs), expected, atol=1e-12)


def test_afs_reader_and_both_protocols(tmp_path, tiny):
    rng = np.random.default_rng(0)
    words = "gun death penalty marriage law state right people crime vote".split()
    for code in argsim.AFS_TOPICS:
        with (tmp_path / f"ArgPairs_{code}.csv").open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["regression_label", *[f"c{i}" for i in range(1, 9)], "sentence_1", "sentence_2"])
            for i in range(30):
                score = "" if i == 0 else f"{rng.uniform(0, 5):.2f}"  # one unscored pair per file
                s1, s2 = (" ".join(rng.choice(words, 6)) for _ in range(2))
                writer.writerow([score, *["x"] * 8, s1, s2])
    records = argsim.read_afs(tmp_path)
    assert len(records) == 87 and records.dropped == 3
    assert {r.topic for r in records} == set(argsim.AFS_TOPICS.values())
    results = argsim.evaluate_argsim(tiny, "afs", path=str(tmp_path))
    assert set(results) == {"afs-cross-topic", "afs-10fold"}
    assert len(results["afs-cross-topic"]["folds"]) == 3 and len(results["afs-10fold"]["folds"]) == 10
