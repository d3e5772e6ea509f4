"""Our STS evaluator against sentence-transformers' EmbeddingSimilarityEvaluator on the same model and data."""

import json

import numpy as np
import pytest
from scipy.stats import spearmanr
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

from sbert_ray.cli import main
from sbert_ray.data import load_records, load_sts_subsets
from sbert_ray.evaluation.sts import STS_DATASETS, evaluate_pairs, run_sts_suite
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.resolve import resolve_model_ref


def reference_scores(model_dir, pairs):
    evaluator = EmbeddingSimilarityEvaluator(
        [p.sentence1 for p in pairs],
        [p.sentence2 for p in pairs],
        [p.score for p in pairs],
        similarity_fn_names=["cosine", "manhattan", "euclidean", "dot"],
    )
    return evaluator(SentenceTransformer(str(model_dir), device="cpu"))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return SentenceEncoder.load(str(tiny_model_dir))


@pytest.mark.slow  # encodes every STS set whole (38 k sentences) and three of them again
def test_every_sts_dataset_is_scored_whole_and_each_layout_agrees_with_reference(tiny, tiny_model_dir, data_dir):
    """Every dataset is scored on all its pairs; one of each layout (a year's concatenated sub-sets, STSb's and
    SICK's files) equals sentence-transformers' evaluator for every similarity and correlation. The other years
    share STS12's layout and code path: their reference run would double the test's time and prove nothing more."""
    ours = run_sts_suite(tiny, data_dir, similarities=("cosine", "manhattan", "euclidean", "dot"))
    assert list(ours) == list(STS_DATASETS)
    for name, metrics in ours.items():
        if name.startswith("sts1"):
            pairs = [p for subset in load_sts_subsets(name, data_dir).values() for p in subset]
        else:
            pairs = load_records(name, "test", data_dir)
        assert metrics["n"] == len(pairs)
        if name not in ("sts12", "stsb", "sickr"):
            continue
        reference = reference_scores(tiny_model_dir, pairs)
        for sim in ("cosine", "manhattan", "euclidean", "dot"):
            for corr in ("spearman", "pearson"):
                assert metrics[f"{corr}_{sim}"] == pytest.approx(reference[f"{corr}_{sim}"] * 100, abs=0.01), (
                    name,
                    corr,
                    sim,
                )


def test_sts_year_is_concatenated_with_subsets(tiny, data_dir):
    result = run_sts_suite(tiny, data_dir, datasets=("sts13",))["sts13"]
    subsets = load_sts_subsets("sts13", data_dir)
    assert set(result["subsets"]) == set(subsets)
    assert sum(m["n"] for m in result["subsets"].values()) == result["n"] == 1500
    # The concatenated score is not the average of the sub-set scores (the paper's point about SentEval).
    averaged = np.mean([m["spearman_cosine"] for m in result["subsets"].values()])
    assert result["spearman_cosine"] != pytest.approx(averaged, abs=1e-6)
    one = evaluate_pairs(tiny, subsets["FNWN"])
    assert one["spearman_cosine"] == pytest.approx(result["subsets"]["FNWN"]["spearman_cosine"], abs=1e-6)


@pytest.mark.slow  # the real MiniLM on 800 sentences, twice
def test_minilm_stsb_matches_reference(minilm_ref, data_dir):
    """The packaged all-MiniLM-L6-v2 on STSb test: ours vs sentence-transformers, to 0.01 points."""
    pairs = load_records("stsb", "test", data_dir)[:400]
    ours = evaluate_pairs(SentenceEncoder.load(minilm_ref), pairs)
    model = SentenceTransformer(resolve_model_ref(minilm_ref), device="cpu")
    emb1 = model.encode([p.sentence1 for p in pairs])
    emb2 = model.encode([p.sentence2 for p in pairs])
    cos = (emb1 * emb2).sum(1) / np.linalg.norm(emb1, axis=1) / np.linalg.norm(emb2, axis=1)
    expected = spearmanr([p.score for p in pairs], cos).statistic * 100
    assert ours["spearman_cosine"] == pytest.approx(expected, abs=0.01)
    assert ours["spearman_cosine"] > 70  # a sentence-tuned model, unlike the random tiny one


def test_cli_eval_writes_json(tiny_model_dir, data_dir, tmp_path, capsys):
    out = tmp_path / "results.json"
    code = main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--tasks",
            "stsb,sickr",
            "--data-dir",
            str(data_dir),
            "--output",
            str(out),
        ]
    )
    assert code == 0
    results = json.loads(out.read_text())
    assert set(results) == {"stsb", "sickr"}
    assert results["stsb"]["n"] == 1379 and results["sickr"]["n"] == 4927
    assert {"spearman_cosine", "pearson_cosine"} <= set(results["stsb"])
    assert "stsb" in capsys.readouterr().out


def test_cli_rejects_unknown_task(tiny_model_dir):
    assert main(["eval", "--model", str(tiny_model_dir), "--tasks", "sts,nope"]) == 2


def test_cli_eval_logs_an_mlflow_run_that_report_reads(tiny_model_dir, data_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = ["--model", str(tiny_model_dir), "--tasks", "stsb", "--data-dir", str(data_dir)]
    assert main(["eval", *args, "--mlflow", "--tracking-uri", uri, "--output", str(tmp_path / "r.json")]) == 0
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sbert-ray-eval").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["tasks"] == "stsb"
    written = json.loads((tmp_path / "r.json").read_text())
    assert run.data.metrics["stsb/spearman_cosine"] == pytest.approx(written["stsb"]["spearman_cosine"])
    assert main(["report", f"--run={run.info.run_id}", "--tracking-uri", uri, "--out", str(tmp_path / "rep")]) == 0
    assert f"{written['stsb']['spearman_cosine']:.2f}" in (tmp_path / "rep" / "report.md").read_text()
