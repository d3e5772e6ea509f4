"""Every private or version-sensitive Ray API sbert-ray uses, in one place (written against Ray 2.60).

Each function says why the public API does not do, and ``tests/test_ray_compat.py`` exercises each on a real
cluster, so a Ray upgrade that moves or changes one fails there, naming it, instead of somewhere deep in a run.
``tests/test_architecture.py`` keeps every other module off ``ray._private``, ``ray.core.generated``,
``ray.train.v2`` and private keyword arguments. Connecting to Ray lives here too: every driver and worker pool
joins a cluster through ``connect_ray``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow.fs
import ray
import ray.data
from ray.util.placement_group import PlacementGroup

NODE_IP_ENV = "SBERT_RAY_NODE_IP"  # the address a local cluster we start listens on (default: loopback only)
LOOPBACK = "127.0.0.1"
# The node label of a node that runs none of our work: cluster.yaml and k8s/raycluster.yaml put it on the head (GCS,
# MLflow, the drivers). The head offers no CPU, but Ray places a zero-CPU task (our data reads and tokenisation)
# on any node; a "!" label selector keeps such tasks off it. A node without the label (every node of a local
# cluster) matches the selector, so elsewhere nothing changes. Label selectors with "!" are Ray 2.49+ API.
CONTROL_LABEL = {"sbert-ray/role": "control"}
OFF_CONTROL_NODES = {key: f"!{value}" for key, value in CONTROL_LABEL.items()}


class TaskPoolFollowingCluster(ray.data.TaskPoolStrategy):
    """A Ray Data task pool of at most ``most`` tasks and at most one per CPU the cluster has when a pass starts. A
    ``TaskPoolStrategy(size=n)`` holds the n it was given when the dataset was made: on an autoscaling cluster, the
    CPUs it had at the start. Ray Data reads ``size`` when it plans an execution (``MapOperator.create``), and plans
    every pass anew (a streaming split's coordinator makes an executor per epoch), so here the nodes that joined
    since count from the next pass on. Equal caps compare equal, so a read and a map stage of one still fuse."""

    def __init__(self, most: int):  # no super().__init__: it would assign ``size``
        self.most = most

    @property
    def size(self) -> int:
        return min(self.most, max(1, int(ray.cluster_resources().get("CPU", 1))))


def connect_ray() -> None:
    """Join the cluster in RAY_ADDRESS (set under `ray job submit`), else start a fresh local one on the loopback
    interface: never whatever cluster happens to be recorded in /tmp/ray, which may be stale."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return
    node_ip = os.environ.get(NODE_IP_ENV)
    with contextlib.nullcontext() if node_ip else _loopback_node():
        # ``_node_ip_address``: ray.init has no public way to choose the address of the node it starts.
        ray.init(address="local", _node_ip_address=node_ip or LOOPBACK, dashboard_host=node_ip or LOOPBACK)


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """A local cluster on 127.0.0.1: its node address, hence every server of its processes (GCS, raylet, object
    manager, workers, agents, metrics export), on the loopback interface only. ray.init swaps a loopback
    ``_node_ip_address`` for the machine's outward address, so other nodes could join, unless Ray clusters are
    switched off for this process (``ray_constants.ENABLE_RAY_CLUSTER``, what Ray does on macOS and Windows); our
    local cluster has no other nodes."""
    from ray._private import ray_constants

    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


def run_storage(context) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem and folder of the Ray Train run a worker's ``context`` (``ray.train.get_context()``) belongs to:
    where Ray Train keeps its checkpoints, so that what we store beside them (``training.resume_points``) lives on
    the same storage, reached the same way. ``get_storage`` is a DeveloperAPI (its ``StorageContext`` may change
    between minor versions); the public API names no run folder."""
    storage = context.get_storage()
    return storage.storage_filesystem, storage.experiment_fs_path


def checkpoint_persister(context) -> Callable[[ray.train.Checkpoint, str], ray.train.Checkpoint]:
    """What Ray Train does with a reported checkpoint's folder when ``ray.train.report`` is given no
    ``checkpoint_upload_fn``: copy it to ``name`` in the run folder of the worker's ``context`` and return the
    stored checkpoint. Our upload function first waits for the folder's background write
    (``training.checkpoint_writes``), then must store it itself, and the public API names no run folder:
    ``StorageContext.persist_current_checkpoint`` (behind the DeveloperAPI ``get_storage``) does it as Ray would."""
    return context.get_storage().persist_current_checkpoint


def started_the_cluster() -> bool:
    """Whether this process started the cluster it is connected to (its head node runs inside this process's
    session): then the live nodes are all the cluster will ever have. No public API tells a started cluster from a
    joined one."""
    node = ray._private.worker._global_node
    return node is not None and node.is_head()


@dataclass(frozen=True)
class NodeGroup:
    """A node group the cluster's autoscaler publishes: each node's resources, and at most how many (-1: any)."""

    resources: dict[str, float]
    max_count: int


def autoscaler_node_groups() -> list[NodeGroup] | None:
    """The node groups the cluster's autoscaler (v2, KubeRay) publishes in the GCS; None where none are published
    (Ray's v1 autoscaler under `ray up`, or no autoscaler). Ray has no public API for the cluster's configured
    maximum, only for what it has now."""
    from ray._private.state import state

    config = state.get_cluster_config()
    if config is None or not config.node_group_configs:
        return None
    return [NodeGroup(dict(group.resources), group.max_count) for group in config.node_group_configs]


@dataclass(frozen=True)
class ActorPlacementGroup:
    """A live placement group of this job that an actor (not the driver) created."""

    group: PlacementGroup
    creator_dead: bool


def actor_created_placement_groups() -> list[ActorPlacementGroup]:
    """This job's live, non-detached placement groups that an actor created (a Train controller's, under a sweep
    trial). ``ray.util.placement_group_table()`` leaves out who created a group, so this reads the GCS records."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    job_id = ray.get_runtime_context().get_job_id()
    records = (
        gcs_pb2.PlacementGroupTableData.FromString(raw)
        for raw in state._connect_and_get_accessor().get_placement_group_table()
    )
    return [
        ActorPlacementGroup(
            PlacementGroup(ray.PlacementGroupID(record.placement_group_id)),
            record.creator_actor_dead,
        )
        for record in records
        if record.state != gcs_pb2.PlacementGroupTableData.REMOVED
        and not record.is_detached
        and record.creator_job_id.hex() == job_id
        and record.creator_actor_id
        and not ray.ActorID(record.creator_actor_id).is_nil()
    ]


def run_on_train_worker_main_thread(function: Callable[[], None]) -> None:
    """Run ``function`` on the main thread of the Ray Train worker actor this code trains in (where Python lets a
    signal handler be installed; training runs on another thread). Train v2's worker actor has an ``execute``
    method for its controller; no public API runs code on that thread. Raises AttributeError or a RayError where
    this is no Train v2 worker."""
    ray.get(ray.get_runtime_context().current_actor.execute.remote(function))


def tune_stopping_trial() -> bool:
    """Whether Tune asked the trial this code runs in to stop (``Trainable.stop`` sets the function session's stop
    event, which only ``tune.report`` looks at, at the next report). Ray's private session API: nothing public
    tells a trial between its reports."""
    from ray.train._internal.session import get_session

    session = get_session()
    return session is not None and session.stop_event.is_set()


def abort_train_controller(controller: ray.actor.ActorHandle) -> None:
    """End a Train v2 run from outside it: its controller actor's ``abort`` (what Ray Train's own Ctrl-C handler
    calls) stops the workers and removes their placement group. The controller's process ends with it, so the call
    itself fails as it goes."""
    try:
        ray.get(controller.abort.remote())
    except ray.exceptions.RayActorError:
        pass
