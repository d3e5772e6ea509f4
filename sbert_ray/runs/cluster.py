"""How many runs the Ray cluster holds at once, whether they fit now, and our errors raised inside it (joining it:
``sbert_ray.ray_compat.connect_ray``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray

from sbert_ray.config import ConfigError, EvalConfig, ScalingConfig, TrainConfig
from sbert_ray.data.records import DataError
from sbert_ray.ray_compat import autoscaler_node_groups, started_the_cluster
from sbert_ray.reservations import resources_text, wait_until_free
from sbert_ray.training.faults import causes

logger = logging.getLogger(__name__)
INPUT_ERRORS = (ConfigError, DataError)  # bad input: the CLI prints these as one line


@dataclass(frozen=True)
class NodeKind:
    """Nodes of one shape the cluster has, or may start: their resources and how many (inf: no limit)."""

    resources: dict[str, float]
    count: float

    def holds(self, bundle: dict[str, float]) -> int:
        """How many workers of ``bundle`` one such node holds."""
        return min(math.floor(self.resources.get(key, 0) / need + 1e-9) for key, need in bundle.items())


def check_resources(scaling: ScalingConfig) -> None:
    """Before a run's ``fit()``: refuse workers the cluster can never hold, then wait up to
    ``scaling.resource_wait_s`` for them to be free (Ray Train itself would wait, and retry, for ever)."""
    refuse_impossible(scaling)
    wait_for_workers(scaling)


def refuse_impossible(scaling: ScalingConfig) -> None:
    """A ``ConfigError`` naming the numbers when no node can hold one worker, or all the nodes the cluster has or
    may start (its autoscaler's maximum) cannot hold ``num_workers`` (elastic: its minimum) of them as placed. A
    cluster we joined that publishes no maximum (Ray's v1 autoscaler, `ray up`) may grow: there only
    ``wait_for_workers`` applies."""
    kinds = [kind for kind in node_kinds() or [] if kind.count]
    if not kinds:
        return
    bundle, n, strategy = scaling.resources_per_worker(), scaling.min_workers, scaling.placement_strategy
    nodes = _nodes_text(kinds)
    if not any(kind.holds(bundle) for kind in kinds):
        raise ConfigError(
            f"scaling: one worker needs {resources_text(bundle)}, more than any node of this cluster ({nodes})"
        )
    if strategy == "STRICT_PACK":  # every worker on one node
        most = max(kind.holds(bundle) for kind in kinds)
    elif strategy == "STRICT_SPREAD":  # every worker on a node of its own
        most = sum(kind.count for kind in kinds if kind.holds(bundle))
    else:
        most = sum(kind.holds(bundle) * kind.count for kind in kinds)
    if n > most:
        raise ConfigError(
            f"scaling.num_workers={n if not scaling.elastic else f'{scaling.num_workers}: at least {n}'} workers "
            f"of {resources_text(bundle)} ({strategy}): this cluster can hold at most {int(most)} (its nodes: {nodes})"
        )


def refuse_impossible_actors(bundle: dict[str, float], count: int, what: str) -> None:
    """A ``ConfigError`` naming the numbers when the connected cluster (as ``node_kinds`` knows it) can never hold
    ``count`` actors of ``bundle`` placed anywhere: Ray would wait for them for ever."""
    problem = actors_problem([kind for kind in node_kinds() or [] if kind.count], bundle, count, what)
    if problem:
        raise ConfigError(problem)


def actors_problem(kinds: list[NodeKind], bundle: dict[str, float], count: int, what: str) -> str | None:
    """Why ``count`` actors of ``bundle`` (``what`` names them) never fit on nodes of ``kinds``, or None (also when
    the kinds are unknown: a cluster that may grow)."""
    bundle = {key: need for key, need in bundle.items() if need > 0}
    most = sum(kind.holds(bundle) * kind.count for kind in kinds)
    if not kinds or count <= most:
        return None
    return (
        f"{what}: {count} of {resources_text(bundle)} each, but this cluster can hold at most {int(most)} "
        f"(its nodes: {_nodes_text(kinds)})"
    )


def _nodes_text(kinds: list[NodeKind]) -> str:
    """Each kind's count and its CPUs and GPUs (what workers ask for; every node has memory)."""
    return ", ".join(f"{_count(kind)} x {resources_text(_processors(kind.resources))}" for kind in kinds)


def _count(kind: NodeKind) -> str:
    return "any number" if math.isinf(kind.count) else str(int(kind.count))


def _processors(resources: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in resources.items() if key in ("CPU", "GPU")}


def node_kinds() -> list[NodeKind] | None:
    """What the connected cluster can ever have: its autoscaler's node groups at their maximum count, where it
    publishes them; the nodes themselves when this process started the cluster (a fixed local one); else None."""
    autoscaled = autoscaler_node_kinds()
    if autoscaled:
        return autoscaled
    if started_the_cluster():
        return [NodeKind(node["Resources"], 1) for node in ray.nodes() if node["Alive"]]
    return None


def autoscaler_node_kinds() -> list[NodeKind] | None:
    """The node groups the cluster's autoscaler publishes, each at its maximum count; None where it publishes none
    (Ray's v1 autoscaler under `ray up`, or no autoscaler)."""
    groups = autoscaler_node_groups()
    if groups is None:
        return None
    return [NodeKind(group.resources, math.inf if group.max_count == -1 else group.max_count) for group in groups]


def wait_for_workers(scaling: ScalingConfig) -> None:
    """Wait up to ``scaling.resource_wait_s`` until the workers' resources are free at once (a placement group of
    them, as Ray Train asks for, reserved and released; elastic: of the fewest it trains on), else ``ResourcesBusy``
    naming what is missing."""
    bundle, n = scaling.resources_per_worker(), scaling.min_workers
    what = f"scaling: {n} workers of {resources_text(bundle)} ({scaling.placement_strategy})"
    wait_until_free([bundle] * n, scaling.placement_strategy, scaling.resource_wait_s, what, "scaling.resource_wait_s")


def refuse_impossible_encoders(replica: dict[str, float], workers: int) -> None:
    """encode, eval and mine: a ``ConfigError`` when the cluster can never hold ``--workers`` encoder replicas of
    ``replica`` (more than its CPUs, or cuda without a GPU); Ray would wait for them for ever."""
    refuse_impossible_actors(replica, workers, f"--workers {workers} encoder replicas")


def runs_that_fit(configs: list[TrainConfig], driver_cpus: float = 0.0) -> int:
    """How many of these training runs the connected Ray cluster can hold at once (``runs_fitting`` its
    ``cluster_capacity``). Bounds sweep trials and argument-similarity folds."""
    return runs_fitting(cluster_capacity(), configs, driver_cpus)


def cluster_capacity() -> dict[str, float]:
    """The resources the cluster can have at once: the maximum its autoscaler publishes (nodes it has not started
    yet count: a cluster that scales GPU nodes from zero has no GPU at a sweep's start), else what it has now (no
    autoscaler, one that publishes nothing, or a node group without a maximum)."""
    return most_resources(autoscaler_node_kinds()) or ray.cluster_resources()


def most_resources(kinds: list[NodeKind] | None) -> dict[str, float] | None:
    """CPUs and GPUs of these node groups at their maximum counts; None without groups or with one unbounded."""
    if not kinds or any(math.isinf(kind.count) for kind in kinds):
        return None
    return {key: sum(kind.resources.get(key, 0) * kind.count for kind in kinds) for key in ("CPU", "GPU")}


def runs_fitting(capacity: dict[str, float], configs: list[TrainConfig], driver_cpus: float = 0.0) -> int:
    """How many of these runs ``capacity`` (resource -> amount) holds at once, sized by the largest; each run's
    own driver takes ``driver_cpus``, and its dev scorer ``evaluation.dev_resources`` when ``async_dev`` is true.
    At least 1."""
    return max(1, _fitting(capacity, configs, driver_cpus))


def _fitting(capacity: dict[str, float], configs: list[TrainConfig], driver_cpus: float) -> int:
    needs = [run_needs(config, driver_cpus) for config in configs]
    return int(min(capacity.get(key, 0) // most for key in ("CPU", "GPU") if (most := max(n[key] for n in needs)) > 0))


def run_needs(config: TrainConfig, driver_cpus: float = 0.0) -> dict[str, float]:
    """CPUs and GPUs one training run holds: its workers, its driver, its dev scorer when ``async_dev`` is true."""
    scaling, scorer = config.scaling, dev_scorers(config.evaluation) if config.evaluation.async_dev is True else {}
    gpus = scaling.max_workers * scaling.gpus_per_worker if scaling.use_gpu else 0.0
    return {
        "CPU": scaling.max_workers * scaling.cpus_per_worker + driver_cpus + scorer.get("CPU", 0.0),
        "GPU": gpus + scorer.get("GPU", 0.0),
    }


def dev_scorers(evaluation: EvalConfig) -> dict[str, float]:
    """What the off-rank dev scorers of one run hold in all: ``dev_workers`` times ``dev_resources``."""
    return {key: need * evaluation.dev_workers for key, need in evaluation.dev_resources.items()}


def resolve_async_dev(
    configs: list[TrainConfig], capacity: dict[str, float], runs: int | None, driver_cpus: float = 0.0
) -> tuple[bool, str]:
    """``evaluation.async_dev`` of these runs (a run, or a sweep's trials, which share it) and the log line that
    says why. ``auto``: off the training ranks when ``capacity`` holds a dev scorer (``evaluation.dev_resources``)
    beside each of ``runs`` of them at once (1: a training run; None: as many as it holds without scorers), so
    scoring never takes a run's place; else inline. Decided from the cluster's size, not what is free now: the same
    on every try. Sums over the cluster: a scorer split over two nodes' leftovers counts as placed."""
    evaluation = configs[0].evaluation
    scorer = resources_text(dev_scorers(evaluation))
    if evaluation.async_dev != "auto":
        where = f"off the training ranks on {scorer}" if evaluation.async_dev else "inline on rank 0"
        return evaluation.async_dev, f"evaluation.async_dev={str(evaluation.async_dev).lower()}: dev scores {where}"
    runs = runs or runs_fitting(capacity, [with_async_dev(c, False) for c in configs], driver_cpus)
    beside = _fitting(capacity, [with_async_dev(c, True) for c in configs], driver_cpus) >= runs
    held = f"the cluster's {resources_text(_processors(capacity))}"
    what = "the training workers" if runs == 1 else f"each of {runs} concurrent trials"
    if beside:
        return True, f"evaluation.async_dev=auto: dev scores off the training ranks, on {scorer} beside {what} ({held})"
    return False, f"evaluation.async_dev=auto: dev scores inline on rank 0: {held} cannot hold {scorer} beside {what}"


def with_async_dev(config: TrainConfig, async_dev: bool) -> TrainConfig:
    return dataclasses.replace(config, evaluation=dataclasses.replace(config.evaluation, async_dev=async_dev))


# Filesystem types (/proc/mounts) every node can mount: NFS (EFS), SMB, parallel filesystems, FUSE object stores.
SHARED_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "glusterfs", "ceph", "beegfs", "fuse.")


def workers_may_leave_this_machine(scaling: ScalingConfig) -> bool:
    """Whether a worker of ``scaling`` may run on another machine than this process's (``leaves_machine``)."""
    this_node = ray.get_runtime_context().get_node_id()
    alive = [node for node in ray.nodes() if node["Alive"]]
    here = next(node["NodeManagerAddress"] for node in alive if node["NodeID"] == this_node)
    machines = [(node["NodeManagerAddress"], node["Resources"]) for node in alive]
    return leaves_machine(autoscaler_node_kinds(), machines, here, scaling.resources_per_worker())


def leaves_machine(
    autoscaled: list[NodeKind] | None,
    alive: list[tuple[str, dict[str, float]]],
    here: str,
    bundle: dict[str, float],
) -> bool:
    """Whether a worker of ``bundle`` may run on another machine than the one at address ``here``: the
    autoscaler (``autoscaled``: its node groups, where it publishes them) may start more than one node; a live
    node (``alive``: address, resources) is at another address; or no live node can hold a worker, so an
    autoscaler must start one elsewhere (a `ray up` head has no CPUs for work). Nodes at one address share its
    disks (a local multi-node cluster)."""
    if autoscaled and sum(kind.count for kind in autoscaled) > 1:
        return True
    if any(address != here for address, _ in alive):
        return True
    return not any(NodeKind(resources, 1).holds(bundle) for _, resources in alive)


def unshared_paths(paths: dict[str, str], mounts: list[tuple[str, str]]) -> dict[str, str]:
    """Of ``paths`` (key -> absolute local path), those not on a filesystem other nodes can mount: the
    filesystem type of the deepest mount point (``mounts``: (mount point, type) as /proc/mounts lists them)
    holding each path is not one of SHARED_FILESYSTEMS."""

    def filesystem(path: str) -> str:
        holding = [(point, kind) for point, kind in mounts if path == point or path.startswith(point.rstrip("/") + "/")]
        return max(holding, key=lambda mount: len(mount[0]), default=("", ""))[1]

    return {key: path for key, path in paths.items() if not filesystem(path).startswith(SHARED_FILESYSTEMS)}


def local_mounts() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of this machine (Linux /proc/mounts; none elsewhere)."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return []
    return [(fields[1].replace("\\040", " "), fields[2]) for fields in map(str.split, lines) if len(fields) > 2]


def refuse_unshared_paths(paths: dict[str, str], scaling: ScalingConfig) -> None:
    """A ``ConfigError`` naming the keys whose local path (on this node's own disk) workers on other nodes could
    not read, when workers may run there (``workers_may_leave_this_machine``)."""
    unshared = unshared_paths(paths, local_mounts())
    if unshared and workers_may_leave_this_machine(scaling):
        named = ", ".join(f"{key}={path}" for key, path in unshared.items())
        raise ConfigError(
            f"{named}: on this machine's own disk, which workers on the cluster's other machines cannot read; use a "
            "Hub id for model.name, no data_dir (the Hub's datasets), s3://... for checkpoint.storage_path, or a "
            "shared filesystem (NFS, EFS, Lustre) mounted at the same path on every node"
        )


def input_error(error: BaseException) -> ConfigError | DataError | None:
    """Our bad-input error inside ``error`` (``faults.causes``: a Ray task's error is an instance of its cause's
    class too, with Ray's traceback as its message), else None."""
    inside = (c for c in causes(error) if isinstance(c, INPUT_ERRORS) and not isinstance(c, ray.exceptions.RayError))
    return next(inside, None)


class _HideInputErrors(logging.Filter):
    """Keeps Ray Data's console from printing what it says about our bad-input error: the task's traceback, and
    "Exception occurred in Ray Data or Ray Core internal code" (logged while handling it). Its log file, ray-data.log
    in the session's logs, still has them."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        return error is None or input_error(error) is None


@contextlib.contextmanager
def input_errors_unwrapped() -> Iterator[None]:
    """Bad input found inside a Ray task (a file's bad row read by a Ray Data task) comes out as our own one-line
    ``ConfigError`` / ``DataError``, not as Ray's ``RayTaskError`` whose message is the remote traceback; that
    traceback is logged at debug level and stays in Ray's logs."""
    console = [handler for handler in logging.getLogger("ray.data").handlers if handler.get_name() == "console"]
    hide = _HideInputErrors()
    for handler in console:
        handler.addFilter(hide)
    try:
        yield
    except ray.exceptions.RayError as err:
        cause = input_error(err)
        if cause is None:
            raise
        logger.debug("bad input found inside a Ray task", exc_info=err)
        # Ray Data appends its retry advice to the message as further lines; ours is the first.
        raise type(cause)(str(cause).partition("\n")[0]) from None
    finally:
        for handler in console:
            handler.removeFilter(hide)
