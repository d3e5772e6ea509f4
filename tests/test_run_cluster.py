"""The Ray cluster as runs meet it: a local cluster the command line starts listens on 127.0.0.1 only."""

from __future__ import annotations

import ipaddress

import psutil
import pytest
import ray

from sbert_ray.runs.cluster import connect_ray


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
    is every interface, and the machine's outward address as the node's)."""
    assert not ray.is_initialized()
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
