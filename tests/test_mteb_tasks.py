"""``mteb:`` tasks: mteb's own task objects scored on sbert-ray models, offline, on local copies of their Hub data
sets (SBERT_RAY_HUB_MIRROR, as tests/test_hub.py), each in its repository's files and columns:

- ``mteb/stsbenchmark-sts`` (STSBenchmark) rebuilt from the local STSb files: train / validation / test.jsonl.gz with
  split, genre, dataset, year, sid, score 0-5, sentence1, sentence2;
- ``mteb/scifact`` (SciFact, retrieval) holding a retrieval set built from STSb dev pairs, in the layout
  tests/test_retrieval_hub.py checks (configs corpus / queries / default);
- ``mteb/imdb`` (ImdbClassification) holding movie-review sentences of SentEval's MR, text and label 0/1, in train
  and test splits."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_hub import card, jsonl_gz
from test_retrieval_hub import jsonl, qrels_rows

from sbert_ray.cli import main
from sbert_ray.data import HUB_MIRROR_ENV, load_records
from sbert_ray.data.retrieval_sets import stsb_retrieval
from sbert_ray.evaluation.mteb_encoder import PROBE, MtebEncoder, model_fingerprint
from sbert_ray.evaluation.mteb_tasks import local_data
from sbert_ray.models.encoder import SentenceEncoder

mteb = pytest.importorskip("mteb")

FILE_ROUNDING = 0.5e-6 + 1e-12  # mteb writes scores rounded to 6 decimals
RETRIEVAL_ROUNDING = 0.5e-5 + 1e-12  # and computes nDCG, MAP, recall, precision, hit rate rounded to 5
STSB_SPLITS = {"train": "train", "dev": "validation", "test": "test"}  # ours -> the Hub repository's


@pytest.fixture(scope="module")
def mirror(tmp_path_factory, data_dir) -> Path:
    root = tmp_path_factory.mktemp("mteb-mirror")
    copy_stsbenchmark(root / "mteb" / "stsbenchmark-sts", data_dir)
    copy_scifact(root / "mteb" / "scifact", data_dir)
    copy_imdb(root / "mteb" / "imdb", data_dir)
    return root


def copy_stsbenchmark(folder: Path, data_dir: Path) -> None:
    for ours, theirs in STSB_SPLITS.items():
        rows = [
            {"split": theirs, "genre": "", "dataset": "", "year": "", "sid": str(k), "score": pair.score}
            | {"sentence1": pair.sentence1, "sentence2": pair.sentence2}
            for k, pair in enumerate(load_records("stsb", ours, data_dir))
        ]
        jsonl_gz(folder / f"{theirs}.jsonl.gz", rows)


def copy_scifact(folder: Path, data_dir: Path) -> None:
    configs = {"corpus": "corpus.jsonl", "queries": "queries.jsonl"}
    card(folder, {"default": {"test": "qrels/test.jsonl"}, **{name: {name: path} for name, path in configs.items()}})
    retrieval = stsb_retrieval(load_records("stsb", "dev", data_dir)[:300])
    jsonl(folder / "corpus.jsonl", [{"_id": key, "title": "", "text": text} for key, text in retrieval.corpus.items()])
    jsonl(folder / "queries.jsonl", [{"_id": key, "text": text} for key, text in retrieval.queries.items()])
    # the relevant pairs only: qrels_rows' extra irrelevant judgement is of q0 and d0, which is q0's relevant
    # document here, and mteb (a dict by document) keeps the later of the two
    jsonl(folder / "qrels" / "test.jsonl", [row for row in qrels_rows(retrieval) if row["score"] > 0])


def copy_imdb(folder: Path, data_dir: Path) -> None:
    reviews = data_dir / "senteval-transfer" / "MR"
    positive, negative = (
        (reviews / f"rt-polarity.{kind}").read_text("latin-1").splitlines() for kind in ("pos", "neg")
    )
    rows = [row for k in range(300) for row in ({"text": negative[k], "label": 0}, {"text": positive[k], "label": 1})]
    jsonl(folder / "train.jsonl", rows[:400])
    jsonl(folder / "test.jsonl", rows[400:])


@pytest.fixture
def offline(monkeypatch, mirror) -> Path:
    monkeypatch.setenv(HUB_MIRROR_ENV, str(mirror))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return mirror


def eval_cli(model_dir: Path, tasks: str, output: Path, *extra: str, data_dir: Path | None = None) -> dict:
    data = ["--data-dir", str(data_dir)] if data_dir else []
    argv = ["eval", "--model", str(model_dir), "--tasks", tasks, *data, "--output", str(output), "--quiet", *extra]
    assert main(argv) == 0
    return json.loads(output.read_text())


def mteb_in_one_process(model, task_name: str):
    """``mteb.evaluate`` on ``model`` (an mteb encoder or a SentenceTransformer), no result cache: mteb's number."""
    with local_data([mteb.get_task(task_name)]) as tasks:
        [result] = mteb.evaluate(model, tasks, cache=None, show_progress_bar=False, co2_tracker=False).task_results
    return result.scores["test"][0]


def count_encoded(monkeypatch, encoder_class) -> list[int]:
    """How many texts each call of ``encoder_class.encode`` embeds, call by call, from now on."""
    counts: list[int] = []
    encode = encoder_class.encode

    def counting(self, inputs, *args, **kwargs):
        embeddings = encode(self, inputs, *args, **kwargs)
        counts.append(len(embeddings))
        return embeddings

    monkeypatch.setattr(encoder_class, "encode", counting)
    return counts


def rank_flip_bound(values: np.ndarray, scale: float = 1.0) -> float:
    """How far a Spearman correlation over ``values`` can move when they are computed again with float32 rounding
    in another order: only values within a few float32 ulps of each other can swap ranks, and each swap of two
    ranks changes sum(d^2) by at most 2n, so rho (6 sum(d^2) / (n (n^2 - 1))) by at most 12 / (n^2 - 1)."""
    ordered = np.sort(values.astype(np.float64))
    close = 8 * np.finfo(np.float32).eps * np.abs(ordered).max()
    swaps = int((np.searchsorted(ordered, ordered + close, side="right") - np.arange(len(ordered)) - 1).sum())
    n = len(values)
    return scale * 12 * max(swaps, 1) / (n * n - 1)


def test_cli_mteb_stsbenchmark_equals_mteb_evaluate_and_our_stsb(offline, tiny_model_dir, data_dir, tmp_path, capsys):
    results = eval_cli(tiny_model_dir, "mteb:STSBenchmark,stsb", tmp_path / "results.json", data_dir=data_dir)
    assert f"mteb result files: {tmp_path / 'mteb' / 'results'}" in capsys.readouterr().out
    ours = results["STSBenchmark"]

    # mteb.evaluate in one process on the same encoder: the very embeddings and mteb's own scoring, so equal up to
    # the rounding of mteb's result files (6 decimals), which our numbers are read from.
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    reference = mteb_in_one_process(MtebEncoder(encoder, "local/tiny", "reference"), "STSBenchmark")
    for metric in ("main_score", "cosine_spearman", "cosine_pearson", "euclidean_spearman", "manhattan_spearman"):
        assert ours[metric] == pytest.approx(reference[metric], abs=FILE_ROUNDING), metric

    # Our own stsb task: the same 1,379 test pairs and embeddings; mteb reports 0-1, we x100. The cosines are
    # computed apart (sklearn in float64 there, torch here), so near-equal ones may swap ranks.
    sentences = load_records("stsb", "test", data_dir)
    first = encoder.encode([p.sentence1 for p in sentences], batch_size=64)
    second = encoder.encode([p.sentence2 for p in sentences], batch_size=64)
    cosines = (first * second).sum(1) / np.linalg.norm(first, axis=1) / np.linalg.norm(second, axis=1)
    assert results["stsb"]["n"] == len(sentences) == 1379
    tolerance = rank_flip_bound(cosines, scale=100) + 100 * FILE_ROUNDING
    assert results["stsb"]["spearman_cosine"] == pytest.approx(100 * ours["cosine_spearman"], abs=tolerance)

    # mteb's files beside results.json, in mteb's cache layout (mteb.ResultCache reads them back)
    fingerprint = model_fingerprint(encoder)
    folder = tmp_path / "mteb" / "results" / f"local__{tiny_model_dir.name}" / fingerprint
    written = mteb.ResultCache(tmp_path / "mteb").load_task_result(
        "STSBenchmark", f"local/{tiny_model_dir.name}", fingerprint
    )
    assert (folder / "STSBenchmark.json").is_file() and written.get_score() == ours["main_score"]


@pytest.mark.parametrize("task_name", ["SciFact", "ImdbClassification"])
def test_retrieval_and_classification_equal_mteb_evaluate(offline, tiny_model_dir, tmp_path, task_name):
    ours = eval_cli(tiny_model_dir, f"mteb:{task_name}", tmp_path / "results.json")[task_name]
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    reference = mteb_in_one_process(MtebEncoder(encoder, "local/tiny", "reference"), task_name)
    numbers = [key for key, value in reference.items() if isinstance(value, float) and math.isfinite(value)]
    undefined = [key for key, value in reference.items() if isinstance(value, float) and not math.isfinite(value)]
    assert len(numbers) > 5 and ours["main_score"] == pytest.approx(reference["main_score"], abs=FILE_ROUNDING)
    assert {key: ours[key] for key in numbers} == pytest.approx(
        {key: reference[key] for key in numbers}, abs=FILE_ROUNDING
    )
    assert all(ours[key] is None for key in undefined)  # NaN (a constant input to a correlation): null in JSON


def test_scifact_equals_our_retrieval_task_on_the_same_copy(offline, tiny_model_dir, tmp_path):
    """mteb's retrieval (pytrec_eval) and ours (sentence-transformers' metrics) on one copy of mteb/scifact: the
    same top 10 (one exact cosine search), so the same nDCG@10, up to the rounding of mteb's files."""
    results = eval_cli(tiny_model_dir, "mteb:SciFact,retrieval:mteb/scifact", tmp_path / "results.json")
    assert results["scifact"]["queries"] == 58
    ours, theirs = results["scifact"], results["SciFact"]
    assert theirs["ndcg_at_10"] == pytest.approx(ours["ndcg_at_10_cosine"], abs=RETRIEVAL_ROUNDING)
    assert theirs["mrr_at_10"] == pytest.approx(ours["mrr_at_10_cosine"], abs=FILE_ROUNDING)
    assert theirs["hit_rate_at_1"] == pytest.approx(ours["accuracy_at_1_cosine"], abs=RETRIEVAL_ROUNDING)


def test_stsbenchmark_through_sentence_transformers_agrees(offline, tiny_model_dir, tmp_path):
    """The same model loaded by sentence-transformers and run by mteb's own wrapper: its embeddings are computed
    in other batches (other padding, other float rounding), so the Spearman may move by rank swaps only."""
    from sentence_transformers import SentenceTransformer

    ours = eval_cli(tiny_model_dir, "mteb:STSBenchmark", tmp_path / "results.json")["STSBenchmark"]
    reference = mteb_in_one_process(SentenceTransformer(str(tiny_model_dir), device="cpu"), "STSBenchmark")
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    pairs = [json.loads(line) for line in gzip.open(offline / "mteb/stsbenchmark-sts/test.jsonl.gz", "rt")]
    first, second = (encoder.encode([row[key] for row in pairs]) for key in ("sentence1", "sentence2"))
    cosines = (first * second).sum(1) / np.linalg.norm(first, axis=1) / np.linalg.norm(second, axis=1)
    tolerance = rank_flip_bound(cosines) + FILE_ROUNDING
    assert ours["cosine_spearman"] == pytest.approx(reference["cosine_spearman"], abs=tolerance)


def test_a_second_run_reads_results_and_a_rerun_reads_the_embedding_cache(
    offline, tiny_model_dir, tmp_path, monkeypatch
):
    encoded = count_encoded(monkeypatch, MtebEncoder)
    first = eval_cli(tiny_model_dir, "mteb:STSBenchmark", tmp_path / "results.json")
    pairs = [json.loads(line) for line in gzip.open(offline / "mteb/stsbenchmark-sts/test.jsonl.gz", "rt")]
    firsts = {row["sentence1"] for row in pairs}
    # The first sentences, then the second ones not among them: the cache already holds those (PROBE, which
    # fingerprints the model, is encoded outside mteb)
    assert encoded == [len(pairs), sum(row["sentence2"] not in firsts for row in pairs)]

    encoded.clear()
    assert eval_cli(tiny_model_dir, "mteb:STSBenchmark", tmp_path / "results.json") == first
    assert encoded == []  # the result file is read

    [result_file] = (tmp_path / "mteb" / "results").rglob("STSBenchmark.json")
    result_file.unlink()
    assert eval_cli(tiny_model_dir, "mteb:STSBenchmark", tmp_path / "results.json") == first
    assert encoded == []  # scored again from the cached embeddings
    assert result_file.is_file()


def test_a_changed_model_is_filed_apart(tiny_model_dir):
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    before = model_fingerprint(encoder)
    encoder.prompts = {"query": "query: "}
    with_prompt = model_fingerprint(encoder)
    encoder.truncate_dim = 16
    assert len({before, with_prompt, model_fingerprint(encoder)}) == 3
    assert len(PROBE) >= 2


def test_queries_and_documents_get_their_prompts(tiny_model_dir):
    encoder = SentenceEncoder.load(str(tiny_model_dir), prompts={"query": "query: ", "passage": "passage: "})
    adapter = MtebEncoder(encoder, "local/tiny", "x")
    from mteb.types import PromptType

    assert adapter.prompt_name(PromptType.query) == "query"
    assert adapter.prompt_name(PromptType.document) == "passage"
    assert adapter.prompt_name(None) is None


@pytest.mark.parametrize("tasks", ["mteb:STSBenchmarkX", "mteb:STSBenchmark,Nope", "mteb:"])
def test_a_bad_mteb_task_is_one_line_naming_it(tiny_model_dir, tasks, capsys):
    assert main(["eval", "--model", str(tiny_model_dir), "--tasks", tasks, "--workers", "2"]) == 2  # no Ray started
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "--tasks" in error
    assert tasks.rpartition(",")[2].removeprefix("mteb:") in error


def test_a_benchmark_names_its_tasks():
    from sbert_ray.evaluation.tasks import parse_tasks

    [task] = parse_tasks("mteb:MTEB(eng, v2)")
    assert "STSBenchmark" in task.entries() and len(task.entries()) > 20
    [same] = parse_tasks("mteb:MTEB(eng,v2)")
    assert same.entries() == task.entries()


def test_mteb_on_two_ray_workers_gives_the_single_process_numbers(
    local_ray, offline, tiny_model_dir, tmp_path, monkeypatch
):
    from sbert_ray.evaluation.encoder_pool import RayEncoder

    single = eval_cli(tiny_model_dir, "mteb:STSBenchmark", tmp_path / "one" / "results.json")
    pooled = count_encoded(monkeypatch, RayEncoder)
    spread = eval_cli(tiny_model_dir, "mteb:STSBenchmark", tmp_path / "two" / "results.json", "--workers", "2")
    assert pooled[0] == len(PROBE) and sum(pooled[1:]) > 1379  # mteb's texts went through the pool
    assert spread == single
    # The pool's embeddings are one process's bit for bit: the same fingerprint, so the same place in mteb's layout
    assert [p.relative_to(tmp_path / "two") for p in (tmp_path / "two").rglob("STSBenchmark.json")] == [
        p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("STSBenchmark.json")
    ]


def test_a_task_without_a_local_copy_is_refused_naming_it(offline, tiny_model_dir, capsys):
    assert main(["eval", "--model", str(tiny_model_dir), "--tasks", "mteb:SICK-R"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "mteb/sickr-sts" in error and "SICK-R" in error


def test_an_updated_copy_is_read_anew(tmp_path, data_dir, tiny_model_dir, monkeypatch):
    """datasets caches a local folder by its name (huggingface/datasets#2956) and mteb's retrieval loader passes
    no cache folder: a copy's files changed in place must still be what is scored (hub.mirror_copies_cached_apart)."""
    copy = tmp_path / "mteb" / "scifact"
    copy_scifact(copy, data_dir)
    monkeypatch.setenv(HUB_MIRROR_ENV, str(tmp_path))
    adapter = MtebEncoder(SentenceEncoder.load(str(tiny_model_dir)), "local/tiny", "x")
    whole = mteb_in_one_process(adapter, "SciFact")
    qrels = copy / "qrels" / "test.jsonl"
    qrels.write_text("".join(qrels.read_text().splitlines(keepends=True)[:10]))
    assert mteb_in_one_process(adapter, "SciFact")["ndcg_at_10"] != whole["ndcg_at_10"]


def test_an_mlflow_run_carries_the_numbers_and_mtebs_files(offline, tiny_model_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    results = eval_cli(
        tiny_model_dir, "mteb:STSBenchmark", tmp_path / "results.json", "--mlflow", "--tracking-uri", uri
    )
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("sbert-ray-eval").experiment_id])
    assert run.data.metrics["STSBenchmark/main_score"] == results["STSBenchmark"]["main_score"]
    fingerprint = model_fingerprint(SentenceEncoder.load(str(tiny_model_dir)))
    files = [item.path for item in client.list_artifacts(run.info.run_id, f"mteb/{fingerprint}")]
    assert f"mteb/{fingerprint}/STSBenchmark.json" in files
