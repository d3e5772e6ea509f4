"""Triplet accuracy and SentEval classification against direct numpy / scikit-learn computations on small data;
the SentEval readers against the official counts; distributed encoding identical to one process."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_score

from sbert_ray.data.readers import load_records
from sbert_ray.evaluation import senteval, triplets
from sbert_ray.models.encoder import SentenceEncoder


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> SentenceEncoder:
    return SentenceEncoder.load(str(tiny_model_dir))


def test_triplet_accuracy_matches_numpy(tiny, data_dir):
    sample = load_records("nli-triplets", "test", data_dir)[:120]
    result = triplets.evaluate_triplets(tiny, sample)
    a, p, n = (tiny.encode([getattr(t, side) for t in sample]) for side in ("anchor", "positive", "negative"))
    euclidean = np.linalg.norm(a - p, axis=1) < np.linalg.norm(a - n, axis=1)

    def cos(x, y):
        return (x * y).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(y, axis=1)

    assert result["accuracy_euclidean"] == pytest.approx(euclidean.mean(), abs=1e-12)
    assert result["accuracy_cosine"] == pytest.approx((cos(a, p) > cos(a, n)).mean(), abs=1e-12)
    assert result["n"] == 120


def test_wikisec_csv(tmp_path, tiny):
    path = tmp_path / "test.csv"
    path.write_text(
        "Sentence1,Sentence2,Sentence3\n"
        '"The war began in 1914.","It ended in 1918.","The species eats insects."\n'
        '"He was born in Paris.","His father was a baker.","The album sold well."\n'
    )
    loaded = triplets.load_triplets("wikisec", path=str(path))
    assert [t.anchor for t in loaded] == ["The war began in 1914.", "He was born in Paris."]
    assert triplets.evaluate_triplets(tiny, loaded)["n"] == 2


@pytest.mark.parametrize(
    ("task", "count", "splits"),
    [
        ("MR", 10662, None),
        ("CR", 3775, None),
        ("SUBJ", 10000, None),
        ("MPQA", 10606, None),
        ("SST2", 70042, {"train": 67349, "dev": 872, "test": 1821}),
        ("TREC", 5952, {"train": 5452, "test": 500}),
        ("MRPC", 5801, {"train": 4076, "test": 1725}),
    ],
)
def test_senteval_readers_give_the_official_counts(data_dir, task, count, splits):
    data = senteval.load_task(task, data_dir / "senteval-transfer")
    assert len(data.texts) == len(data.labels) == count
    if splits is None:
        assert data.splits is None and set(data.labels) == {0, 1}
    else:
        assert {s: int((data.splits == s).sum()) for s in splits} == splits
    if task == "TREC":
        assert len(set(data.labels)) == 6
    if task == "MRPC":
        assert all(len(t) == 2 and t[0] and t[1] for t in data.texts)


def _small_task(tmp_path, n_per_class: int = 40) -> None:
    """A tiny MR-style task: label = file, sentences about two clearly different things."""
    rng = np.random.default_rng(0)
    good, bad = "great superb lovely wonderful fine".split(), "awful dull boring terrible poor".split()
    (tmp_path / "senteval-transfer" / "MR").mkdir(parents=True)
    for words, file in ((good, "rt-polarity.pos"), (bad, "rt-polarity.neg")):
        lines = [" ".join(rng.choice(words + ["the", "film", "was"], 5)) for _ in range(n_per_class)]
        (tmp_path / "senteval-transfer" / "MR" / file).write_text("\n".join(lines) + "\n")


def test_cross_validation_matches_sklearn_at_the_chosen_c(tmp_path, tiny):
    _small_task(tmp_path)
    data = senteval.load_task("MR", tmp_path / "senteval-transfer")
    x = tiny.encode([t[0] for t in data.texts]).astype(np.float64)
    # With a one-value grid there is nothing to select: the result must equal plain 10-fold CV at that C.
    result = senteval.run_senteval(tiny, tmp_path, tasks=["MR"], c_grid=[1.0])["MR"]
    outer = StratifiedKFold(10, shuffle=True, random_state=1111)
    model = LogisticRegression(C=1.0, max_iter=senteval.MAX_ITER, random_state=1111)
    expected = cross_val_score(model, x, data.labels, cv=outer).mean() * 100
    assert result["accuracy"] == pytest.approx(expected, abs=1e-9)
    assert result["n"] == 80


def test_split_task_selects_c_on_dev_and_scores_test(tiny):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(90, 4))
    labels = (x[:, 0] + 0.3 * rng.normal(size=90) > 0).astype(int)
    splits = np.array(["train"] * 50 + ["dev"] * 20 + ["test"] * 20)
    data = senteval.TaskData([("s",)] * 90, labels, splits)
    result = senteval.classify(x, data, seed=0)
    dev_scores = {
        c: LogisticRegression(C=c, max_iter=2000).fit(x[:50], labels[:50]).score(x[50:70], labels[50:70])
        for c in senteval.C_GRID
    }
    best = max(senteval.C_GRID, key=lambda c: (dev_scores[c], -senteval.C_GRID.index(c)))
    expected = LogisticRegression(C=best, max_iter=2000).fit(x[:50], labels[:50]).score(x[70:], labels[70:]) * 100
    assert result["accuracy"] == pytest.approx(expected)


def test_pair_features_are_abs_difference_and_product(tiny):
    texts = [("a cat sat", "a dog ran"), ("hello there", "a cat sat")]
    u = tiny.encode([t[0] for t in texts]).astype(np.float64)
    v = tiny.encode([t[1] for t in texts]).astype(np.float64)
    np.testing.assert_allclose(senteval.features(tiny, texts), np.hstack([np.abs(u - v), u * v]), atol=1e-6)
