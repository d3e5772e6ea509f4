"""An ASHA sweep on the token-authenticated head, with its Tune results and checkpoints on object storage and its dev
scores off the training ranks (evaluation.async_dev: auto places a scorer beside the one trial at a time): ASHA
stops the weak trial on its lagged score, the sweep's rows, MLflow parent and child runs and summary files say so,
and no placement group is left behind, even when Ray Train's own cleaner cannot find the cluster (see
sbert_ray/tuning/placement_groups.py). That ASHA stops the same trials inline and lagged: test_tuning.py."""

from __future__ import annotations

import csv
import logging
import socket

import pytest
import yaml
from cluster_fixtures import live_placement_groups
from local_cluster import BUCKET
from mlflow.tracking import MlflowClient

from sbert_ray.config import load_config
from sbert_ray.runs.sweep import run_sweep
from sbert_ray.tuning import SweepConfig
from sbert_ray.tuning.space import METRIC


def dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on once this returns
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_asha_sweep_on_token_head_leaves_no_placement_group(
    connect, s3_server, tiny_train_config, tmp_path, monkeypatch, caplog
):
    for key, value in {**s3_server.env, "HOME": str(tmp_path)}.items():  # the driver reaches S3 like the cluster
        monkeypatch.setenv(key, value)
    base = yaml.safe_load(tiny_train_config(name="base").read_text())
    base["scaling"] = {"num_workers": 1, "cpus_per_worker": 0.5}
    base["evaluation"]["async_dev"] = "auto"  # the default (the fixture's runs score inline)
    base["checkpoint"]["storage_path"] = f"s3://{BUCKET}/sweeps"
    path = tmp_path / "sweep.yaml"
    sweep = {
        "name": "pg-cleanup",
        "base": base,
        # One trial at a time in grid order: at step 4 "cls" is far behind "mean" and ASHA stops it (at its step-8
        # report, which carries the step-4 score).
        "search_space": {"model.pooling": {"grid": ["mean", "cls"]}},
        "scheduler": "asha",
        "asha": {"grace_period": 4, "reduction_factor": 2},
        "max_concurrent_trials": 1,
    }
    path.write_text(yaml.safe_dump(sweep))
    # What a head killed without `ray stop` leaves on a machine: the "latest cluster" file names a dead GCS, and
    # Ray Train's PlacementGroupCleaner (which has no address) dies on its first check.
    address_file = connect.ray_tmpdir / "ray" / "ray_current_cluster"
    own_address = address_file.read_text()
    address_file.write_text(dead_address())
    caplog.set_level(logging.INFO, logger="sbert_ray.runs.sweep")
    try:
        result = run_sweep(load_config(path, cls=SweepConfig))
    finally:
        address_file.write_text(own_address)

    assert live_placement_groups() == {}  # the stopped trial's Train group was freed before the sweep returned
    # 2 CPUs: one trial (0.5 + its token 0.01) and a scorer of 1 CPU beside it.
    assert "evaluation.async_dev=auto: dev scores off the training ranks, on 1 CPU beside the training" in caplog.text

    stored = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix="sweeps/")["Contents"]}
    assert any(key.startswith("sweeps/pg-cleanup/experiment_state-") for key in stored)  # Tune's own results
    for row in result.rows:  # each trial's checkpoints
        trial_keys = sorted(key for key in stored if f"/{row.trial_id}/" in key)
        assert any(key.startswith(f"sweeps/pg-cleanup/trials/{row.trial_id}/checkpoint_") for key in stored), (
            row.status,
            trial_keys,
        )
    assert result.path == f"s3://{BUCKET}/sweeps/pg-cleanup"
    assert (result.summary / "best_config.yaml").exists() and result.summary.is_relative_to(tmp_path)

    # The sweep's results: rows, the MLflow parent run and one child run per trial, the summary files.
    rows = {r.sampled["model.pooling"]: r for r in result.rows}
    assert {k: r.status for k, r in rows.items()} == {"mean": "finished", "cls": "stopped"}
    assert rows["mean"].global_step == 96 // 8 and rows["cls"].global_step == 8  # one report past the rung
    assert result.best is rows["mean"]

    client = MlflowClient(result.tracking_uri)
    parent = client.get_run(result.run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["sweep/trials_stopped"] == 1 and parent.data.metrics["sweep/trials_finished"] == 1
    assert parent.data.metrics[f"best/{METRIC}"] == pytest.approx(rows["mean"].dev_score)
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {
        "sweep.yaml",
        "results.csv",
        "results.md",
        "dev_score_vs_learning_rate.png",
        "best_config.yaml",
    } <= artifacts

    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{result.run_id}'"
    )
    by_id = {run.info.run_id: run for run in children}
    assert sorted(by_id) == sorted(r.run_id for r in result.rows)  # one child run per trial
    assert {k: by_id[r.run_id].info.status for k, r in rows.items()} == {"mean": "FINISHED", "cls": "KILLED"}
    assert by_id[rows["mean"].run_id].info.end_time <= by_id[rows["cls"].run_id].info.start_time  # one at a time
    finished = by_id[rows["mean"].run_id]
    assert finished.data.params["model.pooling"] == "mean"
    assert [m.step for m in client.get_metric_history(finished.info.run_id, "dev/spearman_cosine")] == [4, 8, 12]
    # ASHA stopped "cls" at its step-8 report (on step 4's score): it trained no further, so no dev score past its
    # step-8 checkpoint's (whose scoring may or may not finish as the trial ends) reached its run.
    stopped = client.get_metric_history(rows["cls"].run_id, "dev/spearman_cosine")
    assert [m.step for m in stopped] in ([4], [4, 8])
    assert rows["cls"].dev_score == pytest.approx(stopped[0].value)  # Tune's last result: the lagged step-4 score
    assert finished.data.metrics["final/stsb/spearman_cosine"] == pytest.approx(rows["mean"].final["stsb"])

    best_config = load_config(result.summary / "best_config.yaml")
    assert best_config.model.pooling == "mean" and best_config.stages[0].limit == 96
    with (result.summary / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(row["model.pooling"], row["status"]) for row in table] == [("mean", "finished"), ("cls", "stopped")]
    assert {"dev_score", "final stsb", "mlflow_run", "error"} <= set(table[0])
