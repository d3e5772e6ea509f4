"""Joining the Ray cluster, how many runs it holds at once, and our errors raised inside it."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

import ray

from sbert_ray.config import ConfigError, TrainConfig
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
