"""The product path end to end: `ray start --head`, `ray job submit` of jobs/train.py, an `mlflow server` on
127.0.0.1, and a finished run whose model loads in sentence-transformers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from process_helpers import BIN, free_port, start, stop, wait_for_url
from sentence_transformers import SentenceTransformer

REPO = Path(__file__).resolve().parents[1]


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
            # Fixed defaults (agent 52365, client 10001) collide with any other cluster on the machine.
            "--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port", str(free_port()),
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
    (run,) = client.search_runs([experiment.experiment_id], f"tags.ray_job_id = '{submission_id}'")  # a shared server
    assert run.info.status == "FINISHED"
    assert run.data.tags["ray_job_id"] == submission_id
    for key in ("train/loss", "dev/spearman_cosine", "final/stsb/spearman_cosine"):
        assert key in run.data.metrics
    model_dir = client.download_artifacts(run.info.run_id, "model", str(tmp_path))
    embeddings = SentenceTransformer(model_dir, device="cpu").encode(["a sentence", "another one"])
    assert embeddings.shape == (2, 32)
