"""The Ray cluster as runs meet it: a local cluster the command line starts listens on 127.0.0.1 only; workers
the cluster can never hold are refused at once, and workers it holds later are waited for a bounded time."""

from __future__ import annotations

import ipaddress
import threading
import time

import numpy as np
import psutil
import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from sbert_ray.cli import main
from sbert_ray.config import ConfigError, ScalingConfig
from sbert_ray.evaluation.encoder_pool import RayEncoder
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.ray_compat import connect_ray
from sbert_ray.reservations import ResourcesBusy
from sbert_ray.runs.cluster import (
    check_resources,
    refuse_impossible,
    refuse_unshared_paths,
    workers_may_leave_this_machine,
)


def listening_addresses(process: psutil.Process) -> dict[str, set[str]]:
    """Each listening TCP socket's address of ``process`` and its descendants, by process name."""
    names = {child.pid: child.name() for child in process.children(recursive=True)} | {process.pid: "driver"}
    found: dict[str, set[str]] = {}
    for connection in psutil.net_connections(kind="tcp"):
        if connection.pid in names and connection.status == psutil.CONN_LISTEN:
            found.setdefault(names[connection.pid], set()).add(connection.laddr.ip)
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.cluster
def test_the_local_cluster_we_start_listens_on_loopback_only(monkeypatch):
    """GCS, raylet, workers, agents, dashboard and metrics export: no socket on another interface (Ray's default
    is every interface, and the machine's outward address as the node's). The run's shared cluster (``local_ray``)
    is shut down first, so that this is the cluster ``connect_ray`` starts; the next test that needs one starts it
    anew."""
    ray.shutdown()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("SBERT_RAY_NODE_IP", raising=False)
    connect_ray()
    try:
        listening = listening_addresses(psutil.Process())
        assert {"gcs_server", "raylet"} <= set(listening), listening
        assert {name: ips for name, ips in listening.items() if not all(map(is_loopback, ips))} == {}
        assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
        assert ray.get(ray.remote(lambda: ray.util.get_node_ip_address()).remote()) == "127.0.0.1"
    finally:
        ray.shutdown()


@pytest.mark.cluster
def test_workers_the_cluster_can_never_hold_are_refused_at_once(local_ray, tiny_train_config, capsys):
    """The 2-CPU cluster: 1000 workers, or one worker of 3 CPUs, can never be placed (Ray Train would retry every
    60 s for ever); refused before the MLflow run or the run record, naming the numbers."""
    with pytest.raises(ConfigError, match=r"scaling.num_workers=1000 workers of 1 CPU \(PACK\): this cluster can "
                       r"hold at most 2 \(its nodes: 1 x 2 CPU\)"):  # fmt: skip
        refuse_impossible(ScalingConfig(num_workers=1000))
    with pytest.raises(ConfigError, match="STRICT_SPREAD.*at most 1"):
        refuse_impossible(ScalingConfig(num_workers=2, cpus_per_worker=0.5, placement_strategy="STRICT_SPREAD"))
    with pytest.raises(ConfigError, match=r"one worker needs 1 CPU, 1 GPU, more than any node of this cluster"):
        refuse_impossible(ScalingConfig(use_gpu=True))
    refuse_impossible(ScalingConfig(num_workers=4, cpus_per_worker=0.5))  # fits

    config = tiny_train_config(name="too-big")
    start = time.monotonic()
    assert main(["train", str(config), "scaling.cpus_per_worker=3", "scaling.resource_wait_s=600"]) == 2
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err
    assert (
        "sbert-ray train: error: scaling: one worker needs 3 CPU, more than any node of this cluster (1 x 2 CPU)" in err
    )
    assert not (config.parent / "runs").exists() and not (config.parent / "mlflow.db").exists()


@pytest.mark.cluster
def test_a_local_cluster_reads_this_machines_paths(local_ray, tmp_path):
    """One machine: workers it can hold never leave it, so a path on its own disk is fine; workers no node of it
    can hold would run on machines an autoscaler starts, which could not read the path."""
    assert not workers_may_leave_this_machine(ScalingConfig())
    refuse_unshared_paths({"data_dir": str(tmp_path)}, ScalingConfig())
    assert workers_may_leave_this_machine(ScalingConfig(cpus_per_worker=3))
    with pytest.raises(ConfigError, match=rf"data_dir={tmp_path}: on this machine's own disk"):
        refuse_unshared_paths({"data_dir": str(tmp_path)}, ScalingConfig(cpus_per_worker=3))


@pytest.mark.cluster
def test_workers_held_by_other_work_are_waited_for_then_refused_naming_what_is_missing(local_ray):
    scaling = ScalingConfig(num_workers=2, cpus_per_worker=1, resource_wait_s=3)
    other = placement_group([{"CPU": 1.5}])  # another run holding most of the cluster
    assert other.wait(timeout_seconds=30)
    try:
        start = time.monotonic()
        with pytest.raises(ResourcesBusy) as busy:
            check_resources(scaling)
        assert 3 <= time.monotonic() - start < 15
        assert str(busy.value) == (
            "scaling: 2 workers of 1 CPU (PACK) were not free within scaling.resource_wait_s=3 s: they need 2 CPU, "
            "0.5 CPU of 2 CPU are free now (missing 1.5 CPU); other work holds the rest"
        )
    finally:
        remove_placement_group(other)
    check_resources(scaling)  # free again: no wait
    deadline = time.monotonic() + 10  # the probe released what it reserved (Ray updates its accounting shortly)
    while ray.available_resources().get("CPU") != 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == 2


@pytest.mark.parametrize(
    "workers, device, holds",
    [("8", "cpu", "8 of 1 CPU each, but this cluster can hold at most 2"), ("2", "cuda", "2 of 1 CPU, 1 GPU each")],
)
def test_encode_eval_and_mine_refuse_replicas_the_cluster_never_holds_with_one_line(
    local_ray, tiny_model_dir, tmp_path, capsys, workers, device, holds
):
    """More --workers than the cluster's CPUs, or cuda on a cluster without GPUs: Ray would wait for ever."""
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("anchor,positive\na cat,a kitten\nthe sun,a star\n")
    options = ["--model", str(tiny_model_dir), "--workers", workers, "--device", device]
    commands = {
        "encode": ["encode", *options, "--input", str(pairs), "--column", "anchor", "--output", str(tmp_path / "e")],
        "eval": ["eval", *options, "--tasks", f"pairs:{tmp_path / 'flat.csv'}"],
        "mine": ["mine", *options, "--pairs", str(pairs), "--output", str(tmp_path / "m")],
    }
    (tmp_path / "flat.csv").write_text("sentence1,sentence2,score\na cat,a dog,1\nthe sun,a car,3\nx,y,2\n")
    for name, command in commands.items():
        start = time.monotonic()
        assert main(command) == 2, name
        err = capsys.readouterr().err  # progress bars of the model's loading, then the error's one line
        assert time.monotonic() - start < 60, name  # at once: no wait for the replicas
        assert f"{name}: error: --workers {workers} encoder replicas: {holds}" in err.splitlines()[-1], (name, err)
        assert "Traceback" not in err, (name, err)


def test_an_encoder_pool_waits_a_bounded_time_for_cpus_other_work_holds(local_ray, tiny_model_dir):
    """The replicas of eval, mine and retrieval (``RayEncoder``) wait for CPUs other work holds for at most
    --resource-wait-s, then stop naming what is missing; CPUs freed within the wait are taken and the pool runs."""
    encoder = SentenceEncoder.load(str(tiny_model_dir))
    other = placement_group([{"CPU": 1.5}])  # another job holding most of the cluster
    assert other.wait(timeout_seconds=30)
    try:
        start = time.monotonic()
        with pytest.raises(ResourcesBusy) as busy:
            RayEncoder(encoder, num_workers=2, resource_wait_s=2)
        assert 2 <= time.monotonic() - start < 15
        assert str(busy.value) == (
            "--workers 2 encoder replicas of 1 CPU were not free within --resource-wait-s=2 s: they need 2 CPU, "
            "0.5 CPU of 2 CPU are free now (missing 1.5 CPU); other work holds the rest"
        )
        threading.Timer(3, remove_placement_group, [other]).start()  # the other job ends a moment later
        start = time.monotonic()
        with RayEncoder(encoder, num_workers=2, resource_wait_s=60) as pool:
            assert time.monotonic() - start >= 2.5  # it waited for the CPUs
            sentences = ["a cat sits", "the sun", "rain falls on the town"]
            np.testing.assert_array_equal(pool.encode(sentences, batch_size=2), encoder.encode(sentences, batch_size=2))
    finally:
        remove_placement_group(other)
