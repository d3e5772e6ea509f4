"""A sweep on the token-authenticated head leaves no placement group behind, even when ASHA stops a trial and Ray
Train's own cleaner cannot find the cluster (see sbert_ray/tuning/placement_groups.py)."""

from __future__ import annotations

import socket

import yaml
from cluster_fixtures import live_placement_groups

from sbert_ray.config import load_config
from sbert_ray.tuning import SweepConfig, run_sweep


def dead_address() -> str:
    with socket.socket() as s:  # a port nothing listens on once this returns
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_asha_sweep_on_token_head_leaves_no_placement_group(connect, tiny_train_config, tmp_path):
    base = yaml.safe_load(tiny_train_config(name="base").read_text())
    base["scaling"] = {"num_workers": 1, "cpus_per_worker": 0.5}
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
