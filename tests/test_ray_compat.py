"""Each private or version-sensitive Ray API of ``sbert_ray.ray_compat`` against the installed Ray: a Ray upgrade
that moves or changes one fails here, naming it. ``connect_ray`` on a fresh local cluster is
``test_run_cluster.py::test_the_local_cluster_we_start_listens_on_loopback_only``."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from sbert_ray import ray_compat


def test_the_switch_that_keeps_a_local_cluster_on_loopback_is_still_there():
    from ray._private import ray_constants

    assert isinstance(ray_constants.ENABLE_RAY_CLUSTER, bool)
    assert "_node_ip_address" in inspect.getsource(ray._private.worker.init)  # taken through ray.init's **kwargs


def test_a_train_worker_actor_runs_code_on_its_main_thread():
    """``run_on_train_worker_main_thread`` calls the worker actor's ``execute`` (what Train v2's controller uses):
    it must still exist and take a function. Its effect on a real worker is tests/test_faults.py's SIGTERM test."""
    from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker

    assert list(inspect.signature(RayTrainWorker.execute).parameters)[:2] == ["self", "fn"]


@ray.remote(num_cpus=0)
class GroupMaker:
    """An actor that reserves a placement group, as a sweep trial's Train controller does."""

    def make(self) -> ray.PlacementGroupID:
        group = placement_group([{"CPU": 0.01}])
        ray.get(group.ready())
        return group.id


def test_what_the_cluster_and_its_placement_groups_say(local_ray):
    """This process started the session's local cluster, which has no autoscaler; a group an actor created is
    listed with its creator alive, then dead once the actor is killed, and gone once removed."""
    assert ray_compat.started_the_cluster()
    assert ray_compat.autoscaler_node_groups() is None
    driver_group = placement_group([{"CPU": 0.01}])  # the driver's own: never listed
    maker = GroupMaker.remote()
    group_id = ray.get(maker.make.remote())
    try:
        listed = {held.group.id: held.creator_dead for held in ray_compat.actor_created_placement_groups()}
        assert listed == {group_id: False}
        ray.kill(maker)
        deadline = time.monotonic() + 30
        while not all(held.creator_dead for held in ray_compat.actor_created_placement_groups()):
            assert time.monotonic() < deadline, "the creator's death never reached the placement group's record"
            time.sleep(0.2)
    finally:
        for held in ray_compat.actor_created_placement_groups():
            remove_placement_group(held.group)
        remove_placement_group(driver_group)
    assert ray_compat.actor_created_placement_groups() == []


def test_a_train_runs_storage_context_still_names_its_filesystem_and_folder(tmp_path):
    """``run_storage`` reads these two off the context's ``get_storage()`` inside a worker (there on a cluster:
    ``test_training.py::test_a_killed_run_resumes_on_the_curve_of_an_uninterrupted_one``)."""
    import pyarrow.fs
    from ray.train.v2._internal.execution.context import TrainContext
    from ray.train.v2._internal.execution.storage import StorageContext

    class Context:
        def get_storage(self):
            return StorageContext(storage_path=str(tmp_path), experiment_dir_name="run")

    assert callable(TrainContext.get_storage)
    filesystem, folder = ray_compat.run_storage(Context())
    assert isinstance(filesystem, pyarrow.fs.LocalFileSystem) and folder == f"{tmp_path}/run"


def test_a_train_runs_storage_context_still_stores_a_checkpoint_folder_as_ray_would(tmp_path):
    """``checkpoint_persister`` stores the folder our upload function hands on under its name in the run folder and
    returns the stored checkpoint (inside a worker on a cluster: every cluster training test)."""
    import pyarrow.fs
    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.storage import StorageContext

    class Context:
        def get_storage(self):
            return StorageContext(storage_path=str(tmp_path / "storage"), experiment_dir_name="run")

    local = tmp_path / "local"
    (local / "model").mkdir(parents=True)
    (local / "model" / "weights").write_bytes(b"w")
    stored = ray_compat.checkpoint_persister(Context())(Checkpoint.from_directory(local), "checkpoint_0")
    assert isinstance(stored, Checkpoint) and isinstance(stored.filesystem, pyarrow.fs.LocalFileSystem)
    assert stored.path == f"{tmp_path}/storage/run/checkpoint_0"
    assert (Path(stored.path) / "model" / "weights").read_bytes() == b"w"


def test_a_trial_can_still_be_asked_whether_tune_stopped_it_and_its_train_run_aborted():
    """``tune_stopping_trial`` reads the function session's stop event; ``abort_train_controller`` calls the Train
    controller's ``abort``. Their effect in a sweep is tests/test_cluster_sweep.py's ASHA test."""
    import ray.train._internal.session as session
    from ray.train.v2._internal.execution.controller.controller import TrainController

    assert ray_compat.tune_stopping_trial() is False  # no trial here
    assert "stop_event" in inspect.getsource(session)
    assert callable(TrainController.abort)


# A cluster whose one node is labelled as cluster.yaml's head: a zero-CPU task that avoids it waits for another.
LABELLED_HEAD = """
import ray
from sbert_ray.ray_compat import CONTROL_LABEL, OFF_CONTROL_NODES
ray.init(address="local", num_cpus=1, labels=CONTROL_LABEL, include_dashboard=False)
# A task without the selector runs first: the node has a worker process idle, so a task it could run would start
# within milliseconds, and seconds of waiting show that this one never will.
assert ray.get(ray.remote(num_cpus=0)(lambda: 1).remote(), timeout=60) == 1
task = ray.remote(num_cpus=0, label_selector=OFF_CONTROL_NODES)(lambda: 0).remote()
ready, _ = ray.wait([task], timeout=5)
print("ran" if ready else "waits")
"""


@pytest.mark.cluster
@pytest.mark.slow
def test_zero_cpu_tasks_keep_off_a_node_labelled_control_and_run_on_any_other(local_ray):
    """``OFF_CONTROL_NODES`` (a "!" label selector): on the session's cluster, whose node has no label, a zero-CPU
    task runs; on a cluster whose only node carries ``CONTROL_LABEL`` it never starts."""
    task = ray.remote(num_cpus=0, label_selector=ray_compat.OFF_CONTROL_NODES)(lambda: 1)
    assert ray.get(task.remote(), timeout=60) == 1
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # a cluster of its own
    done = subprocess.run([sys.executable, "-c", LABELLED_HEAD], env=env, capture_output=True, text=True, timeout=180)
    assert done.stdout.split()[-1:] == ["waits"], done.stderr[-2000:]
