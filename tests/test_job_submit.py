"""The product path end to end: `ray start --head`, `ray job submit` of jobs/train.py, an `mlflow server` on
127.0.0.1, and a finished run whose model loads in sentence-transformers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from sentence_transformers import SentenceTransformer

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_url(url: str, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:  # it answers (e.g. 401 without the cluster token): it is up
            return
        except OSError:
            assert time.time() < deadline, f"{url} did not come up"
            time.sleep(0.5)


def start(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # so teardown can stop the whole process group
        env={**os.environ, **env},
    )


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    server = start(
        [
            str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination", str(root / "artifacts"),
        ],
        root / "server.log",
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
    )  # fmt: skip
    try:
        wait_for_url(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(server)


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A real head node, as `ray start --head` on a cluster machine; --block keeps it in our process group."""
    root = tmp_path_factory.mktemp("ray-head")
    dashboard = free_port()
    head = start(
        [
            str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2", "--port", str(free_port()),
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
            "--include-dashboard", "true", "--disable-usage-stats",
        ],
        root / "head.log",
        RAY_AUTH_MODE="token",
    )  # fmt: skip
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for_url(f"{address}/api/version", timeout=120)
        yield address
    finally:
        stop(head)


def test_ray_job_submit_trains_and_logs_to_mlflow_server(
    ray_head, mlflow_server, tiny_train_config, tmp_path, monkeypatch
):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # the job CLI and client authenticate with the cluster's token
    config = tiny_train_config(name="submitted", tracking_uri=mlflow_server)
    submission_id = f"sbert-ray-test-{int(time.time())}"
    command = [
        str(BIN / "ray"), "job", "submit", "--address", ray_head, "--submission-id", submission_id,
        "--working-dir", str(REPO), "--", sys.executable, "jobs/train.py", str(config),
    ]  # fmt: skip
    deadline = time.time() + 120
    while True:  # a fresh head's job agent takes a moment; Ray says "No available agent ... try again later"
        submit = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if "No available agent" not in submit.stderr or time.time() > deadline:
            break
        time.sleep(2)
    output = submit.stdout + submit.stderr
    assert submit.returncode == 0 and f"Job '{submission_id}' succeeded" in output, output[-4000:]
    assert "MLflow run" in output

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("sbert-ray")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["ray_job_id"] == submission_id
    for key in ("train/loss", "dev/spearman_cosine", "final/stsb/spearman_cosine"):
        assert key in run.data.metrics
    model_dir = client.download_artifacts(run.info.run_id, "model", str(tmp_path))
    embeddings = SentenceTransformer(model_dir, device="cpu").encode(["a sentence", "another one"])
    assert embeddings.shape == (2, 32)
