"""Two Ray nodes on one machine, with real servers: an elastic job (1 to 2 workers) submitted with `ray job submit`
spreads its 2 workers over both nodes, checkpoints to s3:// (a real S3-compatible server), logs to an `mlflow
server` that keeps artifacts in the same store; the second node is killed after the first checkpoint and the job
resumes from the object-store checkpoint on the 1 worker the head holds, with the configured global batch, and
finishes with the full step count on the loss curve of the recipe."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import local_cluster
import numpy as np
import pyarrow.parquet as pq
import pytest
import ray.data
import torch
import yaml
from local_cluster import BIN, BUCKET, REPO
from mlflow.tracking import MlflowClient
from sentence_transformers import SentenceTransformer
from test_training_loop import train

from sbert_ray.config import ScalingConfig, TrainConfig, from_dict
from sbert_ray.data.readers import load_records
from sbert_ray.models.encoder import SentenceEncoder
from sbert_ray.ray_compat import TaskPoolFollowingCluster
from sbert_ray.runs.encode_corpus import EncodeRequest, encode_corpus
from sbert_ray.training.loop import LOG_EVERY, LocalReporter

# 3200 pairs / global batch 8: long enough that the node dies mid-training (at 200 steps the run had trained all of
# them before Ray Train restarted it on one worker, which then resumed from the last checkpoint: 2026-12-06)
STEPS = 400
EVAL_EVERY = 50
# pytest-xdist runs this module's tests in one process: they share its second node (and its loss, last)
pytestmark = pytest.mark.xdist_group("two-node cluster")
GLOBAL_BATCH = 8  # tiny_train_config's
PROGRESS_LINE = re.compile(r"TrainController.*stage 1/1  step \d+/")  # runs.progress_lines
WORKER_CPUS = 1.5  # each node (the head's 2 CPUs, the second node's 2) holds one training worker


@pytest.fixture(scope="module")
def second_node(token_head, tmp_path_factory):
    node = local_cluster.add_node(token_head, tmp_path_factory.mktemp("node"), cpus=2)
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


def test_the_read_tasks_cap_follows_the_cluster_from_one_pass_to_the_next(connect, request):
    """``ray_compat.TaskPoolFollowingCluster``, the training stream's cap on its read-and-tokenise tasks: one
    dataset, two passes of 8 one-second zero-CPU tasks (as the stream's), the first on the head's 2 CPUs, the second
    once the second node (2 more) has joined: at most 2 run at once, then more than 2. First in this module: the
    second node joins here."""

    def slow_task(batch: dict) -> dict:
        started = time.time()
        time.sleep(1)
        return {"started": [started], "ended": [time.time()]}

    tasks = ray.data.range(8, override_num_blocks=8).map_batches(
        slow_task, batch_size=None, num_cpus=0, compute=TaskPoolFollowingCluster(8)
    )

    def most_at_once() -> int:
        spans = tasks.take_all()
        return max(sum(s["started"] <= t["started"] < s["ended"] for s in spans) for t in spans)

    assert ray.cluster_resources()["CPU"] == 2
    assert most_at_once() <= 2
    request.getfixturevalue("second_node")
    deadline = time.monotonic() + 60
    while ray.cluster_resources().get("CPU") != 4:
        assert time.monotonic() < deadline, "the second node's CPUs never reached this driver"
        time.sleep(0.5)
    assert most_at_once() > 2


def test_encode_spreads_over_two_nodes_and_writes_every_row_once(
    connect, second_node, tiny_model_dir, data_dir, tmp_path
):
    """`sbert-ray encode` over STSb and SICK sentences with 3 encoder actors, more than the head's 2 CPUs hold (the
    second node has 2 more): every input line comes back once, with SentenceEncoder.encode's vector. Runs before
    the training test below, which kills the second node."""
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
    config["scaling"] |= {"num_workers": [1, 2], "cpus_per_worker": WORKER_CPUS, "torch_threads": 1}
    config["scaling"]["placement_strategy"] = "SPREAD"
    config["checkpoint"] = {"storage_path": f"s3://{BUCKET}/runs", "max_failures": 2}
    config["tracking"]["tracking_uri"] = mlflow_server
    path = tmp_path / "multinode.yaml"
    path.write_text(yaml.safe_dump(config))

    env = {**os.environ, **token_head.env, "PATH": f"{BIN}:{os.environ['PATH']}"}
    submission_id = f"multinode-{int(time.time())}"
    # Until the head's health checks declare the killed node dead, Ray Train's elastic policy still counts its CPUs
    # and asks for 2 workers again; each such try waits this long for a placement that cannot come (60 s by default).
    start_timeout = json.dumps({"env_vars": {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"}})
    command = [
        "ray", "job", "submit", "--address", token_head.dashboard, "--submission-id", submission_id,
        "--working-dir", str(REPO), "--runtime-env-json", start_timeout, "--", sys.executable, "jobs/train.py",
        str(path),
    ]  # fmt: skip
    job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    # Ray Train's controller registers a report's checkpoint before it runs the callbacks, one of which prints the
    # progress line: once a line is out, a checkpoint is registered (objects in the store alone are not enough).
    registered = threading.Event()

    def follow_output() -> None:
        for line in job.stdout:
            lines.append(line)
            if PROGRESS_LINE.search(line):
                registered.set()

    follower = threading.Thread(target=follow_output, daemon=True)
    follower.start()
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

        while not registered.wait(0.2):
            assert time.time() < deadline and job.poll() is None, "no checkpoint was registered"
        before_kill = checkpoints()
        os.killpg(second_node.pid, signal.SIGKILL)  # the node and every process on it, at once
        assert len(checkpoints()) < STEPS // EVAL_EVERY, "training ended before the node was killed"
        job.wait(timeout=600)
        follower.join(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    output = "".join(lines)
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
    log_points = logged_points(client, run.info.run_id)
    assert_elastic_recipe(log_points, resumed_from, reference_run(config))

    # The model reaches MLflow (stored in the object store) and the driver (from the last checkpoint on S3).
    logged = SentenceTransformer(client.download_artifacts(run.info.run_id, "model", str(tmp_path)), device="cpu")
    downloaded = SentenceTransformer(
        os.path.join(token_head.env["HOME"], "sbert-ray", "models", "multinode"), device="cpu"
    )
    sentences = ["a sentence", "another one"]
    assert (logged.encode(sentences) == downloaded.encode(sentences)).all()
    assert any(key.startswith("mlflow/") for key in (o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"]))


def logged_points(client: MlflowClient, run_id: str) -> list[dict]:
    """The run's training log points in the order they were logged (a resumed run logs again the steps it
    retrains): step, worker count, loss, learning rate and rank 0's examples of the source since its start."""
    run = client.get_run(run_id)
    (samples,) = [name for name in run.data.metrics if name.startswith("data/") and name.endswith("/samples")]
    names = {"workers": "train/workers", "loss": "train/loss", "lr": "train/learning_rate", "samples": samples}
    points: dict[tuple[int, int], dict] = {}
    for key, name in names.items():
        for metric in client.get_metric_history(run_id, name):
            points.setdefault((metric.timestamp, metric.step), {"step": metric.step})[key] = metric.value
    return [point for _, point in sorted(points.items())]


def reference_run(job_config: dict) -> dict[int, dict[str, float]]:
    """The recipe trained without Ray in this process on one worker (what the elastic job trains after its resize:
    the same global batch, schedule and step count, the batches cut for one worker): its log points by step."""
    config = from_dict(TrainConfig, job_config | {"checkpoint": {}, "tracking": {}})
    config.scaling = ScalingConfig(num_workers=[1, 2], torch_threads=torch.get_num_threads())  # this process's
    reporter = LocalReporter()
    train(config, reporter)
    return {step: metrics for step, metrics in reporter.logged if "train/loss" in metrics}


def assert_elastic_recipe(points: list[dict], resumed_from: float, reference: dict[int, dict[str, float]]) -> None:
    """2 workers until the node was lost, 1 from the resume to the last step; every optimizer step of either
    size trained the configured global batch; the learning rate is the schedule's at each global step; the loss
    curve stays within the tolerance of the recipe's (``LOSS_BLOCKS``)."""
    workers = [int(point["workers"]) for point in points]
    assert [size for size, _ in itertools.groupby(workers)] == [2, 1] and points[-1]["step"] == STEPS
    resized = workers.index(1)
    assert points[resized]["step"] == resumed_from + LOG_EVERY  # the first log point of the resumed worker
    for size in (2, 1):  # examples per step: rank 0's between two log points of one worker, times the workers
        per_step = [
            (later["samples"] - earlier["samples"]) * size / (later["step"] - earlier["step"])
            for earlier, later in itertools.pairwise(points)
            if earlier["workers"] == later["workers"] == size and later["samples"] > earlier["samples"]
        ]
        assert per_step and set(per_step) == {GLOBAL_BATCH}, (size, per_step)
    assert reference.keys() == {point["step"] for point in points}  # the full step count
    # The schedule is a function of the global step (LambdaLR): the same value, bit for bit, at every log point.
    assert [point["lr"] for point in points] == [reference[point["step"]]["train/learning_rate"] for point in points]
    assert_loss_within_tolerance({point["step"]: point["loss"] for point in points}, reference)


LOSS_BLOCKS = 5  # log windows (of 10 steps) per compared block: one evaluation interval


def assert_loss_within_tolerance(losses: dict[int, float], reference: dict[int, dict[str, float]]) -> None:
    """Block means of the run's loss curve (the last value logged at each step: after the resize, the resumed
    worker's) against the reference's. Both runs train the recipe from the same initial weights but on other
    batches (other worker counts cut the data otherwise), so they differ by the sampling noise of the batches:
    a logged loss is the mean of 10 steps x 8 examples, whose spread ``sigma`` around the curve is estimated from
    the reference's consecutive windows (sd of their differences / sqrt 2; an overestimate where the curve still
    falls). A block mean of ``LOSS_BLOCKS`` windows has sd sigma / sqrt(LOSS_BLOCKS), the difference of two
    runs' sqrt 2 times that; the tolerance is 4 of those sds (a false alarm about once in 16,000 blocks). It is
    far narrower than what training changes: a resize that restarted the schedule or lost the weights fails."""
    steps = sorted(reference)
    ref = np.array([reference[step]["train/loss"] for step in steps])
    run = np.array([losses[step] for step in steps])
    sigma = np.std(np.diff(ref)) / np.sqrt(2)
    tolerance = 4 * np.sqrt(2 / LOSS_BLOCKS) * sigma
    blocks = len(steps) // LOSS_BLOCKS
    ref_blocks, run_blocks = (v[: blocks * LOSS_BLOCKS].reshape(blocks, LOSS_BLOCKS).mean(1) for v in (ref, run))
    assert tolerance < (ref_blocks[0] - ref_blocks[-1]) / 2, (tolerance, ref_blocks)  # the check can fail
    assert np.abs(run_blocks - ref_blocks).max() <= tolerance, (tolerance, run_blocks, ref_blocks)
