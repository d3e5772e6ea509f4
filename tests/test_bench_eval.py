"""`sbert-ray bench eval`: one evaluation timed in this process, on 1 and 2 Ray workers and by
sentence-transformers' evaluator; the records as JSON, on stdout and in MLflow. No timing is asserted, only that
the numbers are there, consistent with each other, and that every layout scored what one process scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from sbert_ray import ray_compat
from sbert_ray.cli import main
from sbert_ray.data.readers import load_records


def test_bench_eval_on_one_and_two_workers_scores_what_one_process_scores(
    local_ray, tiny_model_dir: Path, data_dir: Path, tmp_path: Path, capsys
) -> None:
    output, tracking_uri = tmp_path / "eval.json", f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = [
        "bench", "eval", "--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--tasks", "stsb",
        "--workers", "1,2", "--repeats", "1", "--output", str(output), "--tracking-uri", tracking_uri,
        "--experiment", "bench",
    ]  # fmt: skip
    assert main(argv) == 0

    records = json.loads(output.read_text())
    assert json.loads(capsys.readouterr().out) == records  # stdout is the JSON alone
    layouts = [(r["impl"], r["workers"]) for r in records]
    assert layouts == [("sbert-ray", 0), ("sbert-ray", 1), ("sbert-ray", 2), ("sentence-transformers", 0)]
    ours, reference = records[:3], records[3]
    pairs = load_records("stsb", "test", data_dir)
    distinct = len({text for pair in pairs for text in (pair.sentence1, pair.sentence2)})
    assert {r["texts"] for r in records} == {distinct}  # each distinct sentence once, in every layout
    assert all(r["scores_equal_one_process"] for r in ours)
    assert ours[1]["scaling_efficiency"] == 1.0
    assert ours[2]["scaling_efficiency"] == pytest.approx(ours[1]["seconds"] / ours[2]["seconds"] / 2)
    assert ours[2]["speedup_vs_reference"] == pytest.approx(reference["seconds"] / ours[2]["seconds"])
    # The same Spearman from both libraries' embeddings (float32 kernels differ by ~1e-6; x100 points).
    assert reference["primary"].keys() == ours[0]["primary"].keys() == {"stsb/spearman_cosine"}
    assert reference["primary_mean"] == pytest.approx(ours[0]["primary_mean"], abs=1e-2)

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("bench").experiment_id])
    assert run.data.metrics["sbert-ray/workers2/texts_per_s"] == pytest.approx(ours[2]["texts_per_s"])
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["bench_eval.json"]


def test_bench_eval_refuses_an_unknown_task_before_ray(
    tiny_model_dir: Path, data_dir: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_compat, "connect_ray", lambda: pytest.fail("connected to Ray before the input was checked"))
    argv = ["bench", "eval", "--model", str(tiny_model_dir), "--data-dir", str(data_dir), "--tasks", "stsb,nope",
            "--no-mlflow"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--tasks" in err and "nope" in err
