"""`sbert-ray bench encode` end to end on a tiny model, bf16 encoding against fp32, batch padding, FLOP counts.

No timing asserts: speed targets are met in benchmark runs, not in tests.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from sbert_ray import cli
from sbert_ray.bench.flops import ForwardFlops
from sbert_ray.models import SentenceEncoder

SENTENCES = ["A man is playing a guitar.", "Hi", "Two dogs run in the park.", "Sentence embeddings map text"]
RECORD_KEYS = {
    "impl": str,
    "precision": str,
    "smart_batching": bool,
    "batch_size": int,
    "workers": int,
    "threads_per_worker": int,
    "sentences_per_s": float,
    "sentences_per_s_min": float,
    "sentences_per_s_max": float,
    "sentences_per_cpu_s": float,
    "spearman": float,
    "padded_tokens": int,
    "utilisation": float,
}


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> SentenceEncoder:
    return SentenceEncoder.load(tiny_model_dir)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture
def keep_torch_threads():
    """`--threads` sets torch's thread count for the whole process; later tests get theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow  # a whole benchmark: eight timed configurations, twice
def test_bench_encode_writes_records_and_an_mlflow_run(
    tmp_path: Path, data_dir: Path, keep_torch_threads, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # the optional packages missing, whatever is installed
    output, tracking_uri = tmp_path / "bench.json", f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = ["bench", "encode", "--model", "random:tiny", "--data-dir", str(data_dir), "--limit", "40"]
    argv += ["--batch-sizes", "8", "--repeats", "2", "--output", str(output), "--tracking-uri", tracking_uri]
    # One thread: tiny ops on two threads of a busy 2-core machine mostly wait on each other.
    assert cli.main([*argv, "--threads", "1"]) == 0

    records = json.loads(output.read_text())
    skipped = [record for record in records if "skipped" in record]
    assert {(r["impl"], r["precision"], r["cast"], r["batch_size"]) for r in skipped} == {
        ("sentence-transformers", "fp32", cast, 8) for cast in ("onnx", "onnx-int8")
    }  # rows that cannot run, with the reason
    assert all("needs optimum-onnx and onnxruntime" in r["skipped"] for r in skipped), skipped
    records = [record for record in records if "skipped" not in record]
    # one batch size (each is timed alike; a second doubled the test's time): ours fp32, bf16 autocast, bf16 weights,
    # each sorted and unsorted; theirs fp32 and bf16
    assert len(records) == 3 * 2 + 2
    for record in records:
        for key, kind in RECORD_KEYS.items():
            assert isinstance(record[key], kind), (key, record[key])
        assert record["impl"] in ("sbert-ray", "sentence-transformers") and record["precision"] in ("fp32", "bf16")
        assert record["workers"] == 1 and record["threads_per_worker"] == 1 and record["sentences"] == 40
        assert record["spearman_pairs"] == 40  # --limit: as many STSb test pairs scored as sentences timed
        assert record["model"] == "random:tiny" and len(record["seconds"]) == len(record["cpu_seconds"]) == 2
        assert record["sentences_per_s_min"] <= record["sentences_per_s"] <= record["sentences_per_s_max"]
        assert record["padded_tokens"] >= record["tokens"] > 40 and 0 < record["utilisation"]
    by_key = {(r["impl"], r["precision"], r["cast"], r["smart_batching"], r["batch_size"]): r for r in records}
    batch_size = 8
    reference = by_key["sentence-transformers", "fp32", "none", True, batch_size]
    assert reference["speedup_vs_reference_fp32"] == reference["speedup_vs_reference_fp32_cpu"] == 1.0
    fastest = max(r["sentences_per_s"] for r in records if r["impl"] == "sentence-transformers" and
                  r["batch_size"] == batch_size)  # fmt: skip
    assert by_key["sbert-ray", "fp32", "none", True, batch_size]["speedup_vs_fastest_reference"] == (
        pytest.approx(by_key["sbert-ray", "fp32", "none", True, batch_size]["sentences_per_s"] / fastest)
    )
    for precision, cast in (("fp32", "none"), ("bf16", "autocast"), ("bf16", "weights")):
        ordered = by_key["sbert-ray", precision, cast, True, batch_size]
        unordered = by_key["sbert-ray", precision, cast, False, batch_size]
        # Sorted batches are cut by the token budget (batch size x max_seq_length): on 40 sentences that is one
        # or two large batches, which may pad more than 5 unsorted batches of 8; both see the same tokens.
        assert ordered["tokens"] == unordered["tokens"] and ordered["padded_tokens"] >= ordered["tokens"]
        assert ordered["smart_batching_speedup_cpu"] is not None and unordered["smart_batching_speedup"] is None
        assert abs(ordered["spearman_delta_vs_fp32"]) < 1.0  # x100 Spearman, bf16 vs fp32 on STSb test
    ours = by_key["sbert-ray", "fp32", "none", True, batch_size]
    # Same model; embeddings equal to ~1e-6 can swap only near-tied ranks: Spearman x100 moves < 1e-3.
    assert ours["spearman"] == pytest.approx(reference["spearman"], abs=1e-3)

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("sbert-ray-bench")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["sbert-ray/fp32/sorted/bs8/sentences_per_s"] == pytest.approx(
        by_key["sbert-ray", "fp32", "none", True, 8]["sentences_per_s"]
    )
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"bench_encode.json", "bench_encode.png"} <= artifacts


@pytest.mark.parametrize(
    ("argument", "value", "message"),
    [
        ("--batch-sizes", "8,x", "argument --batch-sizes: expected distinct positive sizes"),
        ("--precisions", "fp16", "argument --precisions: expected distinct values from fp32,bf16, got 'fp16'"),
        ("--smart-batching", "on,on", "argument --smart-batching: expected distinct values from on,off"),
        ("--limit", "0", "argument --limit: must be >= 1, got 0"),
    ],
)
def test_bench_encode_rejects_bad_options(argument: str, value: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses it: nothing is loaded or timed
        cli.main(["bench", "encode", "--model", "random:tiny", argument, value, "--no-mlflow"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_bf16_embeddings_are_close_to_fp32(encoder: SentenceEncoder) -> None:
    fp32 = encoder.encode(SENTENCES)
    autocast = encoder.encode(SENTENCES, precision="bf16")
    half = copy.deepcopy(encoder).to_precision("bf16")
    assert half.dtype == torch.bfloat16 and half.precision == "bf16" and encoder.precision == "fp32"
    weights = half.encode(SENTENCES)
    for embeddings in (autocast, weights):
        assert embeddings.dtype == np.float32 and not np.array_equal(embeddings, fp32)  # really computed in bf16
        assert _cosines(embeddings, fp32).min() > 0.99
    with pytest.raises(ValueError, match="fp32 weights"):
        half.encode(SENTENCES, precision="fp32")
    with pytest.raises(ValueError, match="precision"):
        encoder.encode(SENTENCES, precision="fp16")


def test_unsorted_batches_give_the_same_embeddings(encoder: SentenceEncoder) -> None:
    np.testing.assert_allclose(
        encoder.encode(SENTENCES, batch_size=3, smart_batching=False),
        encoder.encode(SENTENCES, batch_size=3),
        atol=1e-5,  # the same float32 math at other padded widths: ulps of values below ~4 (~1e-6)
        rtol=1e-5,
    )


@pytest.mark.parametrize("side", ["right", "left"])
def test_numpy_padding_matches_the_tokenizer(encoder: SentenceEncoder, side: str) -> None:
    padded_encoder = copy.copy(encoder)
    padded_encoder.tokenizer = copy.deepcopy(encoder.tokenizer)
    padded_encoder.tokenizer.padding_side = side
    ids = padded_encoder.token_ids(SENTENCES)
    batch = [2, 0, 1]
    ours = padded_encoder._padded(ids, batch, [len(ids["input_ids"][i]) for i in batch])
    theirs = padded_encoder.tokenizer([SENTENCES[i] for i in batch], padding=True, return_tensors="pt")
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name])


def test_forward_flops_match_the_bert_formula(encoder: SentenceEncoder) -> None:
    config = encoder.transformer.config
    hidden, intermediate, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    batch, length = 3, 7
    per_layer = batch * length * (4 * hidden**2 + 2 * hidden * intermediate) + 2 * batch * length**2 * hidden
    pooler = batch * hidden**2  # BERT's [CLS] pooler runs in every forward
    expected = 2 * (layers * per_layer + pooler)  # a multiply-add is 2 FLOPs
    assert ForwardFlops(encoder.transformer)([(batch, length)]) == expected


def test_eval_precision_bf16_scores_like_fp32(tiny_model_dir: Path, data_dir: Path, tmp_path: Path, capsys) -> None:
    scores = {}
    for precision in ("fp32", "bf16"):
        output = tmp_path / f"{precision}.json"
        argv = ["eval", "--model", str(tiny_model_dir), "--tasks", "stsb", "--data-dir", str(data_dir)]
        assert cli.main([*argv, "--precision", precision, "--output", str(output)]) == 0
        assert f"precision: {precision}" in capsys.readouterr().out
        scores[precision] = json.loads(output.read_text())["stsb"]["spearman_cosine"]
    assert scores["bf16"] != scores["fp32"] and scores["bf16"] == pytest.approx(scores["fp32"], abs=0.5)
