"""Session-wide real servers and one token-authenticated Ray cluster, started as scripts/local_cluster.py does:
an S3-compatible object store (moto's server), an `mlflow server` with its artifacts in that store, and a Ray
head started with README's own job-submission commands in a fresh HOME. Tests that need a second node add it. And
what tests read of a cluster: its placement groups, Train workers, registered checkpoints and resume points."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import local_cluster
import psutil
import pytest
import ray
from ray._raylet import AuthenticationTokenLoader, Config

from sbert_ray.training.resume_points import RESUME_FOLDER

NO_STATE_API = local_cluster.NO_STATE_API  # explained in scripts/local_cluster.py, whose clusters need it too


@pytest.fixture(scope="session")
def _local_ray_at_exit() -> Iterator[None]:
    yield
    ray.shutdown()


@pytest.fixture
def local_ray(_local_ray_at_exit) -> Iterator[str]:
    """The run's one local 2-CPU cluster, started by the first test that asks for it and kept for the next ones
    (a start costs ~10 s); its GCS address, for CLI drivers a test starts in a subprocess (as RAY_ADDRESS: they
    join it instead of starting their own). A ``connect`` test shuts it down to join the token head; the next test
    starts it anew."""
    if not ray.is_initialized():
        # Set while its raylet starts, NO_STATE_API reaches every worker process, of every driver that joins it.
        with pytest.MonkeyPatch.context() as env:  # (ray.init's own changes to os.environ stay)
            for key, value in {**NO_STATE_API, **local_cluster.MANY_SHORT_FITS}.items():
                env.setenv(key, value)
            ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[local_cluster.S3Server]:
    server = local_cluster.start_s3(tmp_path_factory.mktemp("s3"))
    yield server
    local_cluster.stop(server.process)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, s3_server) -> Iterator[str]:
    """The tracking URI of an `mlflow server` on 127.0.0.1 whose artifacts live in the object store."""
    process, uri = local_cluster.start_mlflow(tmp_path_factory.mktemp("mlflow-server"), s3_server)
    yield uri
    local_cluster.stop(process)


@pytest.fixture(scope="session")
def token_head(tmp_path_factory, s3_server) -> Iterator[local_cluster.Head]:
    """A 2-CPU head started by README's recipe (token generated in a fresh HOME, dashboard on 127.0.0.1); its
    processes reach the object store, as cloud nodes reach S3."""
    env = {**s3_server.env, **local_cluster.MANY_SHORT_FITS}
    head = local_cluster.start_head(tmp_path_factory.mktemp("ray-head"), env, cpus=2)
    yield head
    local_cluster.stop_cluster(head)


@pytest.fixture
def connect(token_head, monkeypatch) -> Iterator[local_cluster.Head]:
    """This process as a driver of ``token_head``, presenting its token (as `ray job submit`'s jobs do)."""
    ray.shutdown()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token_head.token_path))
    refresh_auth_settings()
    ray.init(address=token_head.gcs)
    yield token_head
    ray.shutdown()
    monkeypatch.undo()
    refresh_auth_settings()


def refresh_auth_settings() -> None:
    """Ray reads RAY_AUTH_MODE and the token once per process; re-read them after changing the environment (an
    earlier local cluster in this process may have cached its own token)."""
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def live_placement_groups() -> dict[str, dict]:
    return {pg_id: pg for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"}


def train_workers() -> list[psutil.Process]:
    """The Ray Train workers of this process's own cluster (its raylet is a child of this process; other clusters
    on the machine are another test's or another user's)."""
    workers = []
    for process in psutil.Process().children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(process.cmdline()):
                workers.append(process)
        except psutil.NoSuchProcess:  # ended meanwhile
            pass
    return workers


def wait_for_registered_checkpoint(run_dir: Path, global_step: int = 1, timeout: float = 400) -> None:
    """Wait until Ray has registered a checkpoint of ``global_step`` or later (its snapshot's latest): only then can
    a restart use it. The timeout is generous: a driver starting its own Ray cluster on 2 busy cores can take
    minutes."""
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    deadline = time.time() + timeout
    while not (snapshot.exists() and _latest_step(snapshot.read_text()) >= global_step):
        assert time.time() < deadline, f"no checkpoint of step {global_step} or later was registered"
        time.sleep(0.2)


def _latest_step(snapshot: str) -> int:
    try:
        latest = json.loads(snapshot)["latest_checkpoint_result"]
    except json.JSONDecodeError:  # caught while Ray rewrites it
        return 0
    return latest["metrics"]["global_step"] if latest else 0


def snapshot_now(run_dir: Path) -> dict:
    """Ray Train's checkpoint manager snapshot of the run, read again if caught while Ray rewrites it."""
    for _ in range(50):
        try:
            return json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
        except json.JSONDecodeError:
            time.sleep(0.05)
    raise AssertionError(f"no readable checkpoint manager snapshot in {run_dir}")


def complete_resume_points(run_dir: Path) -> list[int]:
    """The steps of the run's complete resume points (those whose marker is written)."""
    return sorted(int(marker.stem.removeprefix("step-")) for marker in (run_dir / RESUME_FOLDER).glob("step-*.json"))


def strike_reports_from(run_dir: Path, global_step: int) -> None:
    """Strike the checkpoints of ``global_step`` and later from Ray Train's record of a stopped run (its checkpoint
    manager snapshot), as if their reports had never reached Ray: what a worker killed between uploading the resume
    point of ``global_step`` and reporting it leaves (a later report whose resume point was still uploading at the
    kill goes too, so that the run resumes from ``global_step``'s point)."""
    path = run_dir / "checkpoint_manager_snapshot.json"
    snapshot = json.loads(path.read_text())
    pairs = zip(snapshot["checkpoint_results"], snapshot["checkpoint_report_indices"], strict=True)
    kept = [(result, index) for result, index in pairs if result["metrics"]["global_step"] < global_step]
    snapshot["checkpoint_results"] = [result for result, _ in kept]
    snapshot["checkpoint_report_indices"] = [index for _, index in kept]
    snapshot["latest_checkpoint_result"] = max(kept, key=lambda pair: pair[1])[0] if kept else None
    path.write_text(json.dumps(snapshot))
