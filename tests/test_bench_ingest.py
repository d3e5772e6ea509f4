"""`sbert-ray bench ingest --local`: the input pipeline timed alone (read, tokenise, window batching, collate) in
this process without Ray, for a raw source and its prepared folder side by side, beside a short training run's
pairs/s; the records as JSON, on stdout and in MLflow. No timing is asserted, only that the numbers are there and
consistent."""

from __future__ import annotations

import csv
import itertools
import json
import os
from pathlib import Path

import pytest
import ray
from mlflow.tracking import MlflowClient
from test_prepared_sources import write_prepared

from sbert_ray import ray_compat
from sbert_ray.cli import main
from sbert_ray.config import StageConfig
from sbert_ray.models import load_encoder


def test_bench_ingest_times_a_raw_source_and_its_prepared_folder_beside_the_training_step(
    data_dir: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --local joins no cluster (a test before this one may have left the suite's own running: checked by the calls)
    for module, name in ((ray_compat, "connect_ray"), (ray, "init")):
        monkeypatch.setattr(module, name, lambda *args, **kwargs: pytest.fail("bench ingest --local started Ray"))
    raw, prepared = tmp_path / "raw", tmp_path / "prepared"
    raw.mkdir()
    with open(raw / "part-0.csv", "w", newline="") as out:  # 64 STSb training pairs
        writer = csv.writer(out)
        writer.writerow(["score", "sentence1", "sentence2"])
        lines = (data_dir / "stsb" / "sts-train.csv").read_text().splitlines()
        writer.writerows(line.split("\t")[4:7] for line in itertools.islice(lines, 64))
    write_prepared(raw, prepared, StageConfig(dataset=str(raw)), load_encoder("random:tiny"), "random:tiny")
    output, tracking_uri = tmp_path / "ingest.json", f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = [
        "bench", "ingest", "--model", "random:tiny", "--dataset", str(raw), "--prepared", str(prepared), "--local",
        "--batch-size", "16", "--batches", "6", "--repeats", "2", "--train-steps", "2", "--data-dir", str(data_dir),
        "--target-pairs-per-s", "10000", "--output", str(output), "--tracking-uri", tracking_uri,
        "--experiment", "bench",
    ]  # fmt: skip
    assert main(argv) == 0

    records = json.loads(output.read_text())
    assert json.loads(capsys.readouterr().out) == records  # stdout is the JSON alone
    assert [(r["mode"], r["source"], r["rows"]) for r in records] == [("local", "raw", 64), ("local", "prepared", 64)]
    for record in records:
        assert record["pairs_per_run"] == 6 * 16  # 4 batches a pass: the timed stream goes on into the second pass
        assert len(record["ingest_pairs_per_s_runs"]) == 2 and record["time_to_first_batch_s"] > 0
        assert record["ingest_pairs_per_s_after_first_batch"] > 0
        assert record["ingest_vs_target"] == pytest.approx(record["ingest_pairs_per_s"] / 10000)
        per_cpu = record["ingest_pairs_per_s"] / record["ingest_cpus"]  # this process's CPU-seconds per second
        assert 0 < record["ingest_cpus"] <= os.cpu_count() + 0.5
        assert record["ingest_pairs_per_s_per_cpu"] == pytest.approx(per_cpu)
        assert record["cpus_per_target"] == pytest.approx(10000 / per_cpu)
    raw_record, _ = records
    assert raw_record["train_pairs_per_s"] > 0 and records[1]["train_pairs_per_s"] is None  # timed once
    assert raw_record["ingest_vs_train"] == pytest.approx(
        raw_record["ingest_pairs_per_s"] / raw_record["train_pairs_per_s"]
    )

    client = MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("bench").experiment_id])
    for record in records:
        logged = run.data.metrics[f"local/{record['source']}/ingest_pairs_per_s_per_cpu"]
        assert logged == pytest.approx(record["ingest_pairs_per_s_per_cpu"])
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["bench_ingest.json"]


def test_bench_ingest_refuses_a_single_training_step(data_dir: Path, capsys) -> None:
    argv = ["bench", "ingest", "--model", "random:tiny", "--data-dir", str(data_dir), "--local", "--no-mlflow",
            "--train-steps", "1"]  # fmt: skip
    assert main(argv) == 2
    assert "--train-steps must be 0" in capsys.readouterr().err


def test_bench_ingest_through_the_cluster_streams_what_the_local_path_does(local_ray, data_dir: Path) -> None:
    """The cluster mode reads and tokenises in Ray Data's tasks and consumes the stream here, as a Train worker
    consumes its shard: the same rows and the same pairs per run as the Ray-free path."""
    from sbert_ray.bench.ingest_speed import IngestBenchSettings, run_ingest_bench

    settings = IngestBenchSettings(model="random:tiny", data_dir=str(data_dir), limit=64, batches=6)
    on_ray = run_ingest_bench(settings, repeats=1, local=False)
    local = run_ingest_bench(settings, repeats=1, local=True)
    assert on_ray["mode"] == "ray" and on_ray["train_pairs_per_s"] is None
    assert on_ray["ingest_cpus"] == 2  # per CPU of the session's 2-CPU cluster
    assert (on_ray["rows"], on_ray["pairs_per_run"]) == (local["rows"], local["pairs_per_run"]) == (64, 96)
