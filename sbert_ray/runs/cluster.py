"""Joining the Ray cluster, how many runs it holds at once, and our errors raised inside it."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from sbert_ray.config import ConfigError, ScalingConfig, TrainConfig
from sbert_ray.data.records import DataError

logger = logging.getLogger(__name__)
INPUT_ERRORS = (ConfigError, DataError)  # bad input: the CLI prints these as one line
NODE_IP_ENV = "SBERT_RAY_NODE_IP"  # the address a local cluster we start listens on (default: loopback only)
LOOPBACK = "127.0.0.1"


def connect_ray() -> None:
    """Join the cluster in RAY_ADDRESS (set under `ray job submit`), else start a fresh local one: never whatever
    cluster happens to be recorded in /tmp/ray, which may be stale."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
        return
    node_ip = os.environ.get(NODE_IP_ENV)
    with contextlib.nullcontext() if node_ip else _loopback_node():
        ray.init(address="local", _node_ip_address=node_ip or LOOPBACK, dashboard_host=node_ip or LOOPBACK)


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """A local cluster on 127.0.0.1: its node address, hence every server of its processes (GCS, raylet, object
    manager, workers, agents, metrics export), on the loopback interface only. ray.init swaps a loopback
    ``_node_ip_address`` for the machine's outward address, so other nodes could join, unless Ray clusters are
    switched off for this process (what it does on macOS and Windows); our local cluster has no other nodes."""
    from ray._private import ray_constants

    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


class ResourcesBusy(ConfigError):
    """The cluster could hold the workers, but other work held their resources for longer than
    ``scaling.resource_wait_s``."""


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
    may start (its autoscaler's maximum) cannot hold ``num_workers`` of them as placed. A cluster we joined that
    publishes no maximum (Ray's v1 autoscaler, `ray up`) may grow: there only ``wait_for_workers`` applies."""
    kinds = [kind for kind in node_kinds() or [] if kind.count]
    if not kinds:
        return
    bundle, n, strategy = scaling.resources_per_worker(), scaling.num_workers, scaling.placement_strategy
    nodes = _nodes_text(kinds)
    if not any(kind.holds(bundle) for kind in kinds):
        raise ConfigError(f"scaling: one worker needs {_text(bundle)}, more than any node of this cluster ({nodes})")
    if strategy == "STRICT_PACK":  # every worker on one node
        most = max(kind.holds(bundle) for kind in kinds)
    elif strategy == "STRICT_SPREAD":  # every worker on a node of its own
        most = sum(kind.count for kind in kinds if kind.holds(bundle))
    else:
        most = sum(kind.holds(bundle) * kind.count for kind in kinds)
    if n > most:
        raise ConfigError(
            f"scaling.num_workers={n} workers of {_text(bundle)} ({strategy}): this cluster can hold at most "
            f"{int(most)} (its nodes: {nodes})"
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
        f"{what}: {count} of {_text(bundle)} each, but this cluster can hold at most {int(most)} "
        f"(its nodes: {_nodes_text(kinds)})"
    )


def _nodes_text(kinds: list[NodeKind]) -> str:
    return ", ".join(f"{'any number' if math.isinf(k.count) else int(k.count)} x {_text(k.resources)}" for k in kinds)


def node_kinds() -> list[NodeKind] | None:
    """What the connected cluster can ever have: its autoscaler's node groups at their maximum count, where it
    publishes them; the nodes themselves when this process started the cluster (a fixed local one); else None."""
    from ray._private.state import state

    config = state.get_cluster_config()
    if config is not None and config.node_group_configs:
        return [
            NodeKind(dict(group.resources), math.inf if group.max_count == -1 else group.max_count)
            for group in config.node_group_configs
        ]
    this_node = ray._private.worker._global_node
    if this_node is not None and this_node.is_head():
        return [NodeKind(node["Resources"], 1) for node in ray.nodes() if node["Alive"]]
    return None


def wait_for_workers(scaling: ScalingConfig) -> None:
    """Wait up to ``scaling.resource_wait_s`` until the workers' resources are free at once (a placement group of
    them, as Ray Train asks for, reserved and released), else ``ResourcesBusy`` naming what is missing."""
    bundle, n = scaling.resources_per_worker(), scaling.num_workers
    group = placement_group([bundle] * n, strategy=scaling.placement_strategy)
    try:
        # A free cluster still takes a moment to place the group: at least a second, even with a wait of 0.
        if group.wait(timeout_seconds=max(scaling.resource_wait_s, 1.0)):
            return
    finally:
        remove_placement_group(group)
    needed = {key: value * n for key, value in bundle.items()}
    free, total = ray.available_resources(), ray.cluster_resources()
    missing = {key: value - free.get(key, 0) for key, value in needed.items() if value > free.get(key, 0)}
    raise ResourcesBusy(
        f"scaling: {n} workers of {_text(bundle)} ({scaling.placement_strategy}) were not free within "
        f"scaling.resource_wait_s={scaling.resource_wait_s:g} s: they need {_text(needed)}, "
        f"{_text({key: free.get(key, 0) for key in needed})} of {_text({key: total.get(key, 0) for key in needed})} "
        f"are free now (missing {_text(missing) if missing else 'a node to place them together'}); other work holds "
        "the rest"
    )


def _text(resources: dict[str, float]) -> str:
    """``{'CPU': 2.0, 'GPU': 1.0, 'memory': ...}`` as ``2 CPU, 1 GPU`` (the resources runs ask for)."""
    return ", ".join(f"{resources.get(key, 0):g} {key}" for key in ("CPU", "GPU") if key in resources) or "nothing"


def runs_that_fit(configs: list[TrainConfig], driver_cpus: float = 0.0) -> int:
    """How many of these training runs the connected Ray cluster can hold at once, sized by the largest; each
    run's own driver takes ``driver_cpus``. Bounds sweep trials and argument-similarity folds."""
    available = ray.cluster_resources()
    cpus = max(c.scaling.num_workers * c.scaling.cpus_per_worker for c in configs) + driver_cpus
    fits = [available.get("CPU", 0) // cpus]
    gpus = max((c.scaling.num_workers * c.scaling.gpus_per_worker for c in configs if c.scaling.use_gpu), default=0)
    if gpus:
        fits.append(available.get("GPU", 0) // gpus)
    return max(1, int(min(fits)))


def input_error(error: BaseException) -> ConfigError | DataError | None:
    """Our bad-input error inside ``error``, else None. A Ray task's error holds the remote one in ``cause`` (and
    is an instance of its class too, with Ray's traceback as its message)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, INPUT_ERRORS) and not isinstance(seen, ray.exceptions.RayError):
            return seen
        seen = getattr(seen, "cause", None) or seen.__cause__
    return None


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
