"""A sweep on the token-authenticated head, with its Tune results and checkpoints on object storage, leaves no
placement group behind, even when ASHA stops a trial and Ray Train's own cleaner cannot find the cluster (see
sbert_ray/tuning/placement_groups.py)."""

from __future__ import annotations

import socket

import yaml
from cluster_fixtures import live_placement_groups
from local_cluster import BUCKET

from sbert_ray.config import load_config
from sbert_ray.runs.sweep import run_sweep
from sbert_ray.tuning import SweepConfig


def dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on once this returns
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_asha_sweep_on_token_head_leaves_no_placement_group(
    connect, s3_server, tiny_train_config, tmp_path, monkeypatch
):
    for key, value in {**s3_server.env, "HOME": str(tmp_path)}.items():  # the driver reaches S3 like the cluster
        monkeypatch.setenv(key, value)
    base = yaml.safe_load(tiny_train_config(name="base").read_text())
    base["scaling"] = {"num_workers": 1, "cpus_per_worker": 0.5}
    base["checkpoint"]["storage_path"] = f"s3://{BUCKET}/sweeps"
    path = tmp_path / "sweep.yaml"
    sweep = {
        "name": "pg-cleanup",
        "base": base,
        # One trial at a time in grid order: at step 4 "cls" is far behind "mean" and ASHA stops it.
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
    try:
        result = run_sweep(load_config(path, cls=SweepConfig))
    finally:
        address_file.write_text(own_address)

    assert {r.sampled["model.pooling"]: r.status for r in result.rows} == {"mean": "finished", "cls": "stopped"}
    assert live_placement_groups() == {}

    stored = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix="sweeps/")["Contents"]}
    assert any(key.startswith("sweeps/pg-cleanup/experiment_state-") for key in stored)  # Tune's own results
    for row in result.rows:  # each trial's checkpoints
        assert any(key.startswith(f"sweeps/pg-cleanup/trials/{row.trial_id}/checkpoint_") for key in stored)
    assert result.path == f"s3://{BUCKET}/sweeps/pg-cleanup"
    assert (result.summary / "best_config.yaml").exists() and result.summary.is_relative_to(tmp_path)
