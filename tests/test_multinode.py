"""Two Ray nodes on one machine, with real servers: a job submitted with `ray job submit` spreads its 2 workers over
both nodes, checkpoints to s3:// (a real S3-compatible server), logs to an `mlflow server` that keeps artifacts
in the same store; the second node is killed after the first checkpoint and the job resumes from the
object-store checkpoint on the head and finishes with the full step count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import local_cluster
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from local_cluster import BIN, BUCKET, REPO
from mlflow.tracking import MlflowClient
from sentence_transformers import SentenceTransformer

from sbert_ray.data.readers import load_records
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.runs.encode_corpus import EncodeRequest, encode_corpus

STEPS = 400  # 3200 pairs / global batch 8: long enough that the node dies mid-training
EVAL_EVERY = 50


@pytest.fixture(scope="module")
def second_node(token_head, tmp_path_factory):
    node = local_cluster.add_node(token_head, tmp_path_factory.mktemp("node"), cpus=1)
    local_cluster.wait_for_nodes(token_head, 2)
    yield node
    local_cluster.stop(node)
    token_head.nodes.remove(node)


def actors(head: local_cluster.Head, class_name: str) -> list[dict]:
    """The actors of this class, live or dead, from the head's state API (with the cluster token)."""
    query = f"filter_keys=class_name&filter_predicates=%3D&filter_values={urllib.parse.quote(class_name)}&detail=1"
    request = urllib.request.Request(
        f"{head.dashboard}/api/v0/actors?{query}", headers={"Authorization": f"Bearer {head.token_path.read_text()}"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)["data"]["result"]["result"]


def train_workers(head: local_cluster.Head) -> list[dict]:
    """The live Ray Train workers."""
    return [actor for actor in actors(head, "RayTrainWorker") if actor["state"] == "ALIVE"]


def test_encode_spreads_over_two_nodes_and_writes_every_row_once(
    connect, second_node, tiny_model_dir, data_dir, tmp_path
):
    """`sbert-ray encode` over STSb and SICK sentences with 3 encoder actors on the head's 2 CPUs and the second
    node's 1: every input line comes back once, with SentenceEncoder.encode's vector. Runs before the training
    test below, which kills the second node."""
    texts = [
        text
        for name, split in (("stsb", "test"), ("sickr", "trial"))
        for pair in load_records(name, split, data_dir)
        for text in (pair.sentence1, pair.sentence2)
    ]
    corpus = tmp_path / "stsb-sick.txt"
    corpus.write_text("\n".join(texts) + "\n")
    result = encode_corpus(
        EncodeRequest(str(tiny_model_dir), str(corpus), tmp_path / "out", workers=3, block_bytes=1 << 15)
    )
    encoders = actors(connect, "MapWorker(MapBatches(_EmbedRows))")  # Ray Data's actors, one per encoder
    assert len({actor["node_id"] for actor in encoders}) == 2, encoders

    table = pq.read_table(tmp_path / "out").sort_by("id")
    assert result.rows == table.num_rows == len(texts)
    assert table.column("id").to_pylist() == list(range(len(texts)))  # every row exactly once
    assert table.column("text").to_pylist() == texts
    vectors = np.array(table.column("vector").to_pylist(), dtype=np.float32)
    np.testing.assert_allclose(vectors, SentenceEncoder.load(str(tiny_model_dir)).encode(texts), atol=1e-5)


def test_job_spreads_over_two_nodes_checkpoints_to_s3_and_survives_losing_a_node(
    token_head, second_node, mlflow_server, s3_server, tiny_train_config, tmp_path
):
    config = yaml.safe_load(tiny_train_config(name="multinode", limit=8 * STEPS, eval_every=EVAL_EVERY).read_text())
    config["evaluation"]["dev_limit"] = 50
    config["scaling"]["placement_strategy"] = "SPREAD"
    config["checkpoint"] = {"storage_path": f"s3://{BUCKET}/runs", "max_failures": 2}
    config["tracking"]["tracking_uri"] = mlflow_server
    path = tmp_path / "multinode.yaml"
    path.write_text(yaml.safe_dump(config))

    env = {**os.environ, **token_head.env, "PATH": f"{BIN}:{os.environ['PATH']}"}
    submission_id = f"multinode-{int(time.time())}"
    command = [
        "ray", "job", "submit", "--address", token_head.dashboard, "--submission-id", submission_id,
        "--working-dir", str(REPO), "--", sys.executable, "jobs/train.py", str(path),
    ]  # fmt: skip
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    s3 = s3_server.client()
    try:
        deadline = time.time() + 240
        while len(workers := train_workers(token_head)) < 2:
            assert time.time() < deadline and job.poll() is None, "the 2 training workers did not start"
            time.sleep(1)
        assert len({worker["node_id"] for worker in workers}) == 2  # SPREAD: one worker on each node

        def checkpoints() -> set[str]:
            listing = s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/multinode/checkpoint_")
            return {obj["Key"].split("/")[2] for obj in listing.get("Contents", [])}

        while not (before_kill := checkpoints()):
            assert time.time() < deadline and job.poll() is None, "no checkpoint reached the object store"
            time.sleep(0.5)
        os.killpg(second_node.pid, signal.SIGKILL)  # the node and every process on it, at once
        assert len(checkpoints()) < STEPS // EVAL_EVERY, "training ended before the node was killed"
        output, _ = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0 and f"Job '{submission_id}' succeeded" in output, output[-4000:]

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("sbert-ray")
    (run,) = client.search_runs([experiment.experiment_id], f"tags.ray_job_id = '{submission_id}'")
    assert run.info.status == "FINISHED"
    assert "train/resumed_from_step" in run.data.metrics, output[-6000:]  # logged by a worker that restored one
    resumed_from = run.data.metrics["train/resumed_from_step"]
    assert resumed_from % EVAL_EVERY == 0 and 0 < resumed_from < STEPS
    dev_steps = [m.step for m in client.get_metric_history(run.info.run_id, "dev/spearman_cosine")]
    assert dev_steps[-1] == STEPS and "final/stsb/spearman_cosine" in run.data.metrics
    assert len(checkpoints() - before_kill) >= 1  # written after the node was lost

    # The model reaches MLflow (stored in the object store) and the driver (from the last checkpoint on S3).
    logged = SentenceTransformer(client.download_artifacts(run.info.run_id, "model", str(tmp_path)), device="cpu")
    downloaded = SentenceTransformer(
        os.path.join(token_head.env["HOME"], "sbert-ray", "models", "multinode"), device="cpu"
    )
    sentences = ["a sentence", "another one"]
    assert (logged.encode(sentences) == downloaded.encode(sentences)).all()
    assert any(key.startswith("mlflow/") for key in (o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]))
