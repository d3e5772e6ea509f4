"""One run per name and storage at a time (``runs.run_lease``): a local OS lock that a second holder cannot take
and a dead process gives back; an object-storage lease that is renewed, refused while fresh, taken over when
stale, and deleted at the end. The object-storage logic runs here on a local pyarrow filesystem, and once on the
real S3-compatible server."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import local_cluster
import pytest
from mlflow.tracking import MlflowClient
from pyarrow import fs

from sbert_ray.runs import run_lease
from sbert_ray.runs.run_lease import RunBusy, object_lease

HOLD = """
import sys, time
from sbert_ray.runs.run_lease import run_lease
with run_lease(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_local_lease_refuses_a_second_holder_names_it_and_is_given_back(tmp_path):
    run_dir = str(tmp_path / "runs" / "tiny")
    with run_lease.run_lease(run_dir):
        holder = json.loads((tmp_path / "runs" / "tiny.lease").read_text())
        assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
        with pytest.raises(RunBusy) as refused:  # a second open of the file: its own lock, refused at once
            with run_lease.run_lease(run_dir):
                pass
        assert str(refused.value) == (
            f"{run_dir} is being trained by another process (host {socket.gethostname()}, pid {os.getpid()}, "
            f"started {holder['started']} UTC; lease {run_dir}.lease): wait for it to end, or choose another name"
        )
    assert not (tmp_path / "runs").exists()  # released on exit: the lease and the folder made for it are gone
    with run_lease.run_lease(run_dir):
        pass
    with pytest.raises(ValueError), run_lease.run_lease(run_dir):
        raise ValueError("the run failed")
    with run_lease.run_lease(run_dir):  # ... and on error
        pass


def test_a_process_refused_before_the_holder_wrote_its_name_waits_for_the_name(tmp_path):
    """The holder writes its name just after it takes the lock: a second process refused in between reads the name
    once it is there (CI of 3de8e20 printed "host None, pid None"), or says it is not there yet."""
    path = tmp_path / "tiny.lease"
    with path.open("a+") as taken:
        fcntl.flock(taken, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, not yet named: the window

        def name_it() -> None:
            taken.write(json.dumps({"host": "node-7", "pid": 4242, "started": "2026-12-07T11:42:17Z"}))
            taken.flush()

        naming = threading.Timer(0.3, name_it)
        naming.start()
        with pytest.raises(RunBusy, match=r"\(host node-7, pid 4242, started 2026-12-07T11:42:17Z UTC; lease "):
            with run_lease.local_lease(path):
                pass
        naming.join()
        taken.truncate(0)
        taken.flush()
        with pytest.raises(RunBusy, match=r"\(its holder not named in it yet; lease "):
            with run_lease.local_lease(path):
                pass


def test_a_local_lease_of_a_killed_process_is_free_again(tmp_path):
    run_dir = str(tmp_path / "killed")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, run_dir], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunBusy, match=f"pid {holder.pid},"):
            with run_lease.run_lease(run_dir):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean-up of its own: the OS drops the lock
        holder.wait()
    with run_lease.run_lease(run_dir):
        pass


def test_an_object_lease_is_renewed_refused_while_fresh_and_taken_over_when_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lease, "SETTLE_S", 0.05)
    local, path = fs.LocalFileSystem(), str(tmp_path / "tiny.lease")
    stale = {"host": "gone", "pid": 1, "started": "2026-01-01T00:00:00Z", "token": "t", "renewed": time.time() - 60}
    (tmp_path / "tiny.lease").write_text(json.dumps(stale))
    with object_lease(local, path, heartbeat_s=0.1, expiry_s=30):  # 60 s since renewed: taken over
        first = run_lease._read(local, path)  # as a second holder reads it (a renewal can be caught mid-write)
        assert first["pid"] == os.getpid() and first["token"] != "t"
        time.sleep(0.5)
        renewed = run_lease._read(local, path)
        assert renewed["token"] == first["token"] and renewed["renewed"] > first["renewed"]
        with pytest.raises(RunBusy, match=f"pid {os.getpid()},"), object_lease(local, path, expiry_s=30):
            pass
    assert not (tmp_path / "tiny.lease").exists()  # deleted at the end


@pytest.mark.servers
def test_an_object_lease_on_s3(s3_server, monkeypatch):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    run_dir = f"s3://{local_cluster.BUCKET}/leases/tiny"
    with run_lease.run_lease(run_dir):
        with pytest.raises(RunBusy, match=f"host {socket.gethostname()}, pid {os.getpid()},"):
            with run_lease.run_lease(run_dir):
                pass
    objects = s3_server.client().list_objects_v2(Bucket=local_cluster.BUCKET, Prefix="leases/").get("Contents", [])
    assert [o["Key"] for o in objects if not o["Key"].endswith("/")] == []  # released: deleted


OPEN_RUN = """
import sys
from sbert_ray.tracking.mlflow_run import RunTracker
with RunTracker(sys.argv[1], sys.argv[2], run_name=sys.argv[2]):
    pass
"""


def test_runs_opened_at_once_on_a_fresh_sqlite_store_all_succeed(tmp_path):
    """Two processes (runs of other names on a new machine) create the same sqlite store and experiment at once:
    MLflow's migrations run once, under the store's file lock, and both runs are created (without the lock, one
    crashes in an alembic migration)."""
    uri = f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    (tmp_path / "mlflow").mkdir()
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    opening = [subprocess.Popen([sys.executable, "-c", OPEN_RUN, uri, "shared"], stderr=subprocess.PIPE, text=True,
                                env=env) for _ in range(2)]  # fmt: skip
    errors = [process.communicate(timeout=300)[1] for process in opening]
    assert [process.returncode for process in opening] == [0, 0], [error[-2000:] for error in errors]
    client = MlflowClient(uri)
    assert len(client.search_runs([client.get_experiment_by_name("shared").experiment_id])) == 2
