"""Reranking evaluation: the same numbers as sentence-transformers' CrossEncoderRerankingEvaluator on the same
first-stage candidates, the first stage's numbers equal to the retrieval task's, an agreeing reranker changes
nothing, and ``sbert-ray eval --tasks rerank:... --reranker`` end to end with its refusals."""

import json

import numpy as np
import pytest
from sentence_transformers import CrossEncoder
from sentence_transformers.cross_encoder.evaluation import CrossEncoderRerankingEvaluator

from sbert_ray.cli import main
from sbert_ray.config import ConfigError
from sbert_ray.data import load_records
from sbert_ray.data.retrieval_sets import stsb_retrieval
from sbert_ray.evaluation.reranking import evaluate_reranking, metric_names, reranked_order
from sbert_ray.evaluation.retrieval import evaluate_retrieval, retrieve
from sbert_ray.evaluation.tasks import parse_tasks
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.models.teachers import BiEncoderTeacher, load_teacher

TOP_K = 12  # >= 10: the @10 metrics see as deep as the retrieval evaluator
# Metrics are means over ~55 queries of values in [0, 1]; the reference sums them in another order (float64:
# ~1e-13, so 1e-9 leaves room). The reranker's float32 scores are the same CrossEncoder.predict in other batches
# (rounding ~1e-7): only two candidates within that of each other could swap, moving a mean by ~1/55, far above
# the tolerance; none are, on this set, so the match is exact.
TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return SentenceEncoder.load(str(tiny_model_dir))


@pytest.fixture(scope="module")
def stsb_dev(data_dir):
    return stsb_retrieval(load_records("stsb", "dev", data_dir)[:300])  # ~55 queries, ~300 distinct documents


def reference(cross_encoder_dir, tiny, data, k: int) -> dict[str, float]:
    """sentence-transformers' reranking numbers on our first stage's top k (its samples name documents by text:
    the STSb set's documents are distinct texts), renamed ours (base_ndcg@10 -> ndcg_at_10_first_stage)."""
    found = retrieve(tiny, data, batch_size=32, k=k)
    samples = [
        {
            "query": data.queries[key],
            "positive": [data.corpus[doc] for doc in sorted(data.relevant[key])],
            "documents": [data.corpus[found.corpus.ids[row]] for row in top],
        }
        for key, top in zip(found.query_ids, found.ranked["cosine"][1].tolist(), strict=True)
    ]
    evaluator = CrossEncoderRerankingEvaluator(samples, at_k=10, always_rerank_positives=False, write_csv=False)
    scores = evaluator(CrossEncoder(str(cross_encoder_dir), device="cpu"))
    names = {"base_mrr@10": "mrr_at_10_first_stage", "base_ndcg@10": "ndcg_at_10_first_stage"}
    names |= {"mrr@10": "mrr_at_10_reranked", "ndcg@10": "ndcg_at_10_reranked"}
    return {ours: scores[theirs] for theirs, ours in names.items()}


def test_reranking_matches_cross_encoder_reranking_evaluator(tiny, stsb_dev, tiny_cross_encoder_dir):
    assert len(set(stsb_dev.corpus.values())) == len(stsb_dev.corpus)
    reranker = load_teacher(str(tiny_cross_encoder_dir))
    ours = evaluate_reranking(tiny, reranker, stsb_dev, TOP_K, batch_size=32)
    for key, value in reference(tiny_cross_encoder_dir, tiny, stsb_dev, TOP_K).items():
        assert ours[key] == pytest.approx(value, abs=TOLERANCE), key
    assert set(metric_names()) <= set(ours) and ours["top_k"] == TOP_K
    assert ours["ndcg_at_10_reranked"] != ours["ndcg_at_10_first_stage"]  # the random reranker did reorder
    assert ours["recall_at_10_first_stage"] <= ours["recall_at_k"] < 1  # the candidates bound any reranker


def test_the_first_stage_is_the_retrieval_tasks_ranking(tiny, stsb_dev):
    """A reranker that agrees with the first stage (its own cosine, a bi-encoder teacher) reorders nothing, and the
    numbers before reranking are the retrieval evaluator's on the same top k (k >= 10 for @10 metrics)."""
    retrieval = evaluate_retrieval(tiny, stsb_dev, batch_size=32)
    ours = evaluate_reranking(tiny, BiEncoderTeacher(tiny), stsb_dev, TOP_K, batch_size=32)
    for metric in ("ndcg_at_10", "mrr_at_10", "recall_at_10", "precision_at_1", "accuracy_at_5"):
        assert ours[f"{metric}_first_stage"] == retrieval[f"{metric}_cosine"], metric
        assert ours[f"{metric}_reranked"] == pytest.approx(ours[f"{metric}_first_stage"], abs=TOLERANCE), metric
    assert ours["queries"] == retrieval["queries"] and ours["documents"] == retrieval["documents"]


def test_equal_reranker_scores_keep_the_first_stage_order():
    scores = np.array([[0.9, 0.5, 0.5, 0.1], [0.3, 0.3, 0.3, 0.3], [0.1, 0.2, 0.2, 0.3]], dtype=np.float32)
    assert reranked_order(scores).tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [3, 1, 2, 0]]


def write_toy_beir(folder):
    folder.mkdir(parents=True)
    texts = ["a cat sat on the mat", "dogs bark at night", "the stock market fell", "rain in spring", "puppies howl"]
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"_id": f"d{k}", "text": t}) + "\n" for k, t in enumerate(texts))
    )
    queries = [("q1", "where did the cat sit?"), ("q2", "what do dogs do at night?"), ("q3", "markets")]
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": k, "text": t}) + "\n" for k, t in queries))
    (folder / "qrels").mkdir()
    (folder / "qrels" / "test.tsv").write_text(
        "query-id\tcorpus-id\tscore\nq1\td0\t1\nq2\td1\t1\nq2\td4\t1\nq3\td2\t1\n"
    )
    return folder


def test_eval_cli_reranks_a_retrieval_set_into_json_and_mlflow(
    tmp_path, tiny_model_dir, tiny_cross_encoder_dir, capsys
):
    from mlflow.tracking import MlflowClient

    folder, output, uri = write_toy_beir(tmp_path / "toy"), tmp_path / "results.json", f"sqlite:///{tmp_path / 'm.db'}"
    argv = ["eval", "--model", str(tiny_model_dir), "--tasks", f"rerank:{folder}", "--output", str(output)]
    argv += ["--reranker", str(tiny_cross_encoder_dir), "--top-k", "3", "--mlflow", "--tracking-uri", uri]
    assert main(argv) == 0
    results = json.loads(output.read_text())["toy-rerank"]
    assert results["top_k"] == 3 and results["queries"] == 3 and results["documents"] == 5
    assert 0 < results["ndcg_at_10_reranked"] <= 1
    assert "ndcg_at_10_reranked" in capsys.readouterr().out  # the primary metric in the printed table
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sbert-ray-eval").experiment_id])
    assert run.data.params["reranker"] == str(tiny_cross_encoder_dir) and run.data.params["top_k"] == "3"
    assert run.data.metrics["toy-rerank/ndcg_at_10_reranked"] == pytest.approx(results["ndcg_at_10_reranked"])


@pytest.mark.parametrize(
    "extra, tasks, message",
    [
        ([], "rerank:{folder}", "pass --reranker PATH"),
        (["--reranker", "{missing}"], "retrieval:{folder}", "--tasks names none"),
        (["--reranker", "{missing}"], "rerank:{folder}", "--reranker {missing}"),
        (["--reranker", "{model}"], "rerank:{folder}/nope", "no such folder"),
    ],
)
def test_eval_cli_refuses_bad_reranking_before_encoding(tmp_path, tiny_model_dir, capsys, extra, tasks, message):
    values = {"folder": write_toy_beir(tmp_path / "toy"), "missing": tmp_path / "no-model", "model": tiny_model_dir}
    argv = ["eval", "--model", str(tiny_model_dir), "--tasks", tasks.format(**values)]
    assert main([*argv, *(arg.format(**values) for arg in extra)]) == 2
    err = capsys.readouterr().err
    assert message.format(**values) in err and "Traceback" not in err


def test_rerank_task_specs(data_dir):
    [stsb, beir] = parse_tasks("rerank:stsb-retrieval:dev,rerank:./some/beir-folder", reranks=True)
    assert stsb.entries() == ("stsb-retrieval-dev-rerank",) and beir.entries() == ("beir-folder-rerank",)
    assert stsb.primary_metric == "ndcg_at_10_reranked" and stsb.primary_metric in stsb.metric_names()
    stsb.check(data_dir)


def test_a_rerank_task_outside_eval_is_refused_when_parsed():
    with pytest.raises(ConfigError, match="evaluation.final_tasks: task 'rerank:stsb-retrieval' needs a reranker"):
        parse_tasks(["stsb", "rerank:stsb-retrieval"], key="evaluation.final_tasks")
