"""cluster.yaml passes the Ray cluster launcher's own checks, exactly as `ray up` runs them (without starting any
cloud machine), and keeps the cluster closed: token authentication everywhere, nothing on a public address."""

from __future__ import annotations

from pathlib import Path

import yaml
from local_cluster import REPO
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = (REPO / "cluster.yaml").read_text()


def validated(text: str) -> dict:
    config = prepare_config(yaml.safe_load(text))
    validate_config(config)  # the launcher's JSON schema (raises on any unknown or mistyped key)
    return config


def test_cluster_yaml_passes_ray_up_validation_and_is_secure():
    config = validated(CLUSTER_YAML)
    head_type = config["head_node_type"]
    gpu_types = {name: kind for name, kind in config["available_node_types"].items() if name != head_type}
    assert config["available_node_types"][head_type]["resources"] == {"CPU": 0}
    for gpu in gpu_types.values():
        assert gpu["node_config"]["InstanceType"].startswith(("g", "p"))  # a GPU instance family
        assert gpu["min_workers"] == 0 < gpu["max_workers"]  # autoscaling from zero
    markets = [gpu["node_config"].get("InstanceMarketOptions", {}).get("MarketType") for gpu in gpu_types.values()]
    assert sorted(markets, key=str) == [None, "spot"]  # an on-demand group and a spot group

    head_start = " ".join(config["head_start_ray_commands"])
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "0.0.0.0" not in head_start + worker_start
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in worker_start
    assert config["file_mounts"]["/home/ubuntu/.ray/auth_token"] == "~/.ray/auth_token"  # the same token everywhere
    assert "mlflow server --host $(hostname -I" in head_start  # the private address
    # Runs in PostgreSQL (its URI, password included, from a 0600 file, not on a command line); artifacts on S3.
    assert "MLFLOW_BACKEND_STORE_URI=$(cat ~/.sbert-ray/mlflow-db-uri)" in head_start
    assert "--backend-store-uri" not in head_start and "sqlite" not in head_start
    assert "--artifacts-destination s3://" in head_start
    assert any("psycopg2" in c for c in config["setup_commands"])
    assert any("chmod 600" in c and "mlflow-db-uri" in c for c in config["setup_commands"])
    assert "MLFLOW_TRACKING_URI=http://" in head_start and "MLFLOW_TRACKING_URI=http://" in worker_start
    assert any("pip install -e '/home/ubuntu/sbert-ray" in c for c in config["setup_commands"])


def test_the_container_option_passes_validation_when_uncommented():
    """The commented docker: block is a working option: with its lines uncommented the launcher accepts it."""
    lines = CLUSTER_YAML.splitlines()
    start = lines.index("#docker:")
    block = [start] + [i for i in range(start + 1, len(lines)) if lines[i].startswith("#  ")]
    assert block == list(range(start, start + len(block))) and len(block) > 2
    uncommented = [line[1:] if i in block else line for i, line in enumerate(lines)]
    docker = validated("\n".join(uncommented))["docker"]
    assert docker["image"] and docker["container_name"] == "sbert-ray"


def cluster_job_configs() -> list[Path]:
    """The job configs meant for cluster.yaml: those that train on GPUs."""
    return [path for path in sorted((REPO / "jobs" / "configs").glob("*.yaml")) if "use_gpu: true" in path.read_text()]


def test_cluster_job_configs_survive_spot_reclaims_and_pack_each_run_on_a_node():
    """On the cluster: checkpoints on S3 (any node resumes), restarts without limit (spot nodes come and go), a
    run's workers on one 8-GPU node (NVLink, not the network, carries the all-reduce)."""
    configs = cluster_job_configs()
    assert len(configs) >= 6
    for path in configs:
        raw = yaml.safe_load(path.read_text())
        base = raw.get("base", raw)  # a sweep's trials start from its base
        assert base["checkpoint"]["max_failures"] == -1, path.name
        assert base["checkpoint"]["storage_path"].startswith("s3://"), path.name
        assert base["scaling"]["placement_strategy"] == "STRICT_PACK", path.name
        assert not base["model"]["name"].startswith(("/", ".", "~")) and "data_dir" not in base  # Hub ids
