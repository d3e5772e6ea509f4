"""Faults at spot scale: an error a restart would meet again ends the run once, whatever
``checkpoint.max_failures`` says (``training.faults``), the rest restart it; a SIGTERM (a spot notice) checkpoints
the group before it stops (``training.preemption``)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import local_cluster
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.exceptions
import torch
from cluster_fixtures import train_workers
from mlflow.tracking import MlflowClient

from sbert_ray.config import ConfigError, TrainConfig, from_dict, load_config
from sbert_ray.data.records import DataError
from sbert_ray.runs.train_run import run_training
from sbert_ray.training.faults import DeterministicError, EndOnDeterministicError, WorkerFaults, deterministic_error
from sbert_ray.training.loop import LOG_EVERY
from sbert_ray.training.preemption import GRACE_S
from sbert_ray.training.resume_points import RESUME_FOLDER
from sbert_ray.training.state import STATE_FILE, is_full_state


def two_stage_config() -> TrainConfig:
    stages = [{"dataset": "stsb", "batch_size": 64}, {"dataset": "nli", "batch_size": 256, "grad_accum_steps": 2}]
    return from_dict(TrainConfig, {"stages": stages, "scaling": {"num_workers": 4}, "model": {"max_seq_length": 256}})


def remote(error: Exception) -> ray.exceptions.RayTaskError:
    """``error`` as a worker meets one raised in a Ray Data read task: wrapped by Ray, with Ray's advice after it."""
    return ray.exceptions.RayTaskError("read", "Traceback ...", error).as_instanceof_cause()


@pytest.mark.parametrize(
    "error, line",
    [
        (DataError("/data/part-3.parquet, row 31: score 'n/a' is not a number"), "part-3.parquet, row 31: score"),
        (remote(DataError("/data/a.parquet, row 7: column 'sentence1' is empty\nRay Data retries...")), "row 7:"),
        (ConfigError("/ckpt is a weights-only checkpoint: a run resumes from a full-state one"), "weights-only"),
        (ValueError("training a model whose pooling leaves prompt tokens out ..."), "pooling leaves prompt"),
    ],
)
def test_bad_input_found_on_a_worker_is_deterministic_as_its_one_line(error, line):
    fault = deterministic_error(error, two_stage_config(), stage=0)
    assert fault.bad_input and line in str(fault) and "\n" not in str(fault)


def test_out_of_memory_names_the_batch_the_width_and_what_to_change():
    fault = deterministic_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"), two_stage_config(), 1)
    assert not fault.bad_input
    assert str(fault).startswith(
        "out of device memory in stage 1: stages.1.batch_size 256 on 4 worker(s) is 32 examples per micro-batch, "
        "each of up to model.max_seq_length 256 tokens; raise stages.1.grad_accum_steps"
    )


@pytest.mark.parametrize(
    "error",
    [
        ray.exceptions.ActorDiedError(),  # a worker or its node died
        ConnectionResetError("peer reset"),  # network
        OSError("s3://bucket/run: service unavailable"),  # storage
        RuntimeError("[gloo] Connection closed by peer"),  # a collective whose peer died
        ray.exceptions.GetTimeoutError("GCS"),
    ],
)
def test_infrastructure_faults_restart(error):
    assert deterministic_error(error, two_stage_config(), 0) is None


def test_a_worker_raises_the_deterministic_error_of_the_stage_it_trains():
    faults = WorkerFaults(two_stage_config())
    open_stage = faults.opened(lambda index: f"stage {index} data")
    with pytest.raises(DeterministicError, match="in stage 1: stages.1.batch_size 256"):
        with faults:
            assert open_stage(1) == "stage 1 data"
            raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(OSError):  # an infrastructure fault leaves as it is: Ray restarts the workers
        with faults:
            raise OSError("storage")


def test_the_controller_ends_the_run_on_a_deterministic_error_only():
    """Raised in the callback, Ray Train's failure policy does not retry it (a controller error); the error
    survives the trip from the worker (pickled) with whether it is bad input."""
    fault = pickle.loads(pickle.dumps(DeterministicError("out of device memory", bad_input=False)))
    assert not fault.bad_input
    with pytest.raises(DeterministicError, match="out of device memory"):
        EndOnDeterministicError().after_exception(None, {0: RuntimeError("collateral"), 1: fault})
    EndOnDeterministicError().after_exception(None, {0: ray.exceptions.ActorDiedError()})  # retried: no raise


POISONED_CONFIG = """
name: poisoned
data_dir: {data_dir}
model:
  name: random:tiny
stages:
  - dataset: {shard}
    objective: regression
    batch_size: 8
evaluation:
  dev_limit: 20
  eval_every: 2
  final_tasks: []
  async_dev: false
scaling:
  num_workers: 1
  cpus_per_worker: 0.5
checkpoint:
  storage_path: {tmp}/runs
  max_failures: -1
tracking:
  tracking_uri: sqlite:///{tmp}/mlflow.db
"""


def test_a_bad_row_mid_shard_ends_the_run_once_under_unlimited_restarts(local_ray, data_dir, tmp_path):
    """One unparsable score in row 31 of a 48-row parquet shard (its footer looks fine, so training starts) under
    ``max_failures: -1``: the CLI exits once, naming file and row in one line, the MLflow run FAILED; before,
    Ray replayed the pass into the same row without end."""
    shard = tmp_path / "scores.parquet"
    scores = [str(i % 5) for i in range(48)]
    scores[30] = "n/a"
    texts = {f"sentence{c}": [f"sentence {c} of pair {i}" for i in range(48)] for c in (1, 2)}
    pq.write_table(pa.table(texts | {"score": scores}), shard)
    config = tmp_path / "poisoned.yaml"
    config.write_text(POISONED_CONFIG.format(data_dir=data_dir, shard=shard, tmp=tmp_path))
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "RAY_ADDRESS": local_ray}  # the session's cluster
    run = subprocess.run(
        [str(local_cluster.BIN / "sbert-ray"), "train", str(config), "--quiet"],
        capture_output=True, text=True, env=env, timeout=900,  # the bound: replayed, it would never end
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-3000:]
    # (Above it, Ray's console shows the workers' and the controller's logs, tracebacks included, as for any run.)
    line = f"sbert-ray train: error: {shard}, row 31: unparsable score 'n/a'"
    assert run.stderr.splitlines().count(line) == 1, run.stderr[-3000:]
    assert (run.stdout + run.stderr).count("Attempting to start training worker group") == 1  # never restarted
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("sbert-ray").experiment_id])
    assert mlflow_run.info.status == "FAILED"


def test_sigterm_to_one_worker_checkpoints_every_rank_at_the_next_loss_read_and_resumes_there(
    local_ray, tiny_train_config
):
    """A spot node's notice, as SIGTERM to one of two workers mid-stage: the group writes a full-state checkpoint
    at the next loss read (within LOG_EVERY steps, seconds after the signal), stops, and Ray restarts it from
    there: no step is trained twice (each logged once) and the run finishes."""
    path = tiny_train_config(name="preempted", limit=4800, eval_every=0)  # 600 steps, one report point at the end
    config = load_config(path, ["evaluation.final_tasks=[]"])
    outcome: dict = {}
    driver = threading.Thread(target=lambda: outcome.update(result=run_training(config, progress=False)))
    driver.start()
    client, deadline = MlflowClient(config.tracking.tracking_uri), time.time() + 900  # a hang guard (a loaded host)
    while True:  # until rank 0 has logged 50 steps (well inside the stage)
        experiment = client.get_experiment_by_name("sbert-ray")
        runs = experiment and client.search_runs([experiment.experiment_id])
        logged = runs and [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
        if logged and max(logged) >= 50:
            break
        assert time.time() < deadline and driver.is_alive(), "training logged no steps"
        time.sleep(0.2)
    (signalled, *_) = sorted(train_workers(), key=lambda p: p.pid, reverse=True)
    signalled.send_signal(signal.SIGTERM)
    sent = time.time()
    driver.join(timeout=600)
    assert outcome["result"].metrics["global_step"] == 600

    run_id = runs[0].info.run_id
    (resumed,) = client.get_metric_history(run_id, "train/resumed_from_step")
    stopped_at = int(resumed.value)
    assert max(logged) < stopped_at < 600 and stopped_at % LOG_EVERY == 0
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == list(range(LOG_EVERY, 601, LOG_EVERY))  # none trained twice: nothing lost but the step
    # The stop's full state is a resume point (complete: its marker written), kept as one of the two newest
    points = Path(config.checkpoint.storage_path) / config.name / RESUME_FOLDER
    saved = points / f"step-{stopped_at:09d}"
    assert (points / f"{saved.name}.json").is_file() and is_full_state(saved)
    assert json.loads((saved / STATE_FILE).read_text())["global_step"] == stopped_at
    assert (saved / STATE_FILE).stat().st_mtime - sent < GRACE_S
    assert not signalled.is_running()
