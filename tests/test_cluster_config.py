"""cluster.yaml passes the Ray cluster launcher's own checks, exactly as `ray up` runs them (without starting any
cloud machine), and keeps the cluster closed: token authentication everywhere, nothing on a public address."""

from __future__ import annotations

import yaml
from local_cluster import REPO
from ray.autoscaler._private.util import prepare_config, validate_config


def test_cluster_yaml_passes_ray_up_validation_and_is_secure():
    config = prepare_config(yaml.safe_load((REPO / "cluster.yaml").read_text()))
    validate_config(config)  # the launcher's JSON schema (raises on any unknown or mistyped key)

    head_type = config["head_node_type"]
    (gpu_type,) = [name for name in config["available_node_types"] if name != head_type]
    gpu = config["available_node_types"][gpu_type]
    assert gpu["node_config"]["InstanceType"].startswith(("g", "p"))  # a GPU instance family
    assert gpu["min_workers"] < gpu["max_workers"]  # autoscaling
    assert config["available_node_types"][head_type]["resources"] == {"CPU": 0}

    head_start = " ".join(config["head_start_ray_commands"])
    worker_start = " ".join(config["worker_start_ray_commands"])
    assert "0.0.0.0" not in head_start + worker_start
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in worker_start
    assert config["file_mounts"]["/home/ubuntu/.ray/auth_token"] == "~/.ray/auth_token"  # the same token everywhere
    assert "mlflow server --host $(hostname -I" in head_start  # the private address
    assert "--artifacts-destination s3://" in head_start and "--backend-store-uri sqlite:///" in head_start
    assert "MLFLOW_TRACKING_URI=http://" in head_start and "MLFLOW_TRACKING_URI=http://" in worker_start
    assert any("pip install -e '/home/ubuntu/sbert-ray" in c for c in config["setup_commands"])
