"""Reserving Ray resources with a bounded wait. Ray itself waits for ever for an actor or task the cluster cannot
place now (CPUs, GPUs or memory held by other work); a placement group of what they need, waited for up to a
bound, either holds their resources (they then start in it at once) or ends with ``ResourcesBusy`` naming what is
missing. Training runs, encoder pools (encode, eval, mine, retrieval) and async dev scoring all reserve this way."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from sbert_ray.config import ConfigError

RESOURCE_KEYS = ("CPU", "GPU", "memory")
GIB = 2**30
T = TypeVar("T")


class ResourcesBusy(ConfigError):
    """The cluster could hold what was asked for, but other work held it for longer than the wait allowed."""


def resources_text(resources: dict[str, float]) -> str:
    """``{'CPU': 2.0, 'GPU': 1.0, 'memory': 2**31}`` as ``2 CPU, 1 GPU, 2 GiB memory`` (what runs ask for)."""
    parts = [
        f"{resources[key] / GIB:g} GiB memory" if key == "memory" else f"{resources[key]:g} {key}"
        for key in RESOURCE_KEYS
        if key in resources
    ]
    return ", ".join(parts) or "nothing"


def reserve(bundles: list[dict[str, float]], strategy: str, wait_s: float, what: str, bound: str) -> PlacementGroup:
    """A placement group of ``bundles`` once the cluster holds them all at once, within ``wait_s`` seconds (at
    least one: a free cluster still takes a moment to place a group), else ``ResourcesBusy`` naming ``what`` waited
    and the option that bounds the wait (``bound``). The caller removes the group when done."""
    bundles = [{key: need for key, need in bundle.items() if need > 0} for bundle in bundles]  # Ray refuses 0s
    group = placement_group(bundles, strategy=strategy)
    if group.wait(timeout_seconds=max(wait_s, 1.0)):
        return group
    remove_placement_group(group)
    raise ResourcesBusy(busy_message(bundles, what, wait_s, bound))


def wait_until_free(bundles: list[dict[str, float]], strategy: str, wait_s: float, what: str, bound: str) -> None:
    """``reserve`` and release: for work that Ray places itself (a Ray Train worker group, a Ray Data actor pool),
    which would otherwise wait for ever when the resources never come free."""
    remove_placement_group(reserve(bundles, strategy, wait_s, what, bound))


def busy_message(bundles: list[dict[str, float]], what: str, wait_s: float, bound: str) -> str:
    """What ``bundles`` need in all, what of it the cluster has free now and of what total, and what is missing."""
    needed = {key: sum(bundle.get(key, 0) for bundle in bundles) for key in RESOURCE_KEYS}
    needed = {key: value for key, value in needed.items() if value > 0}
    free, total = ray.available_resources(), ray.cluster_resources()
    missing = {key: value - free.get(key, 0) for key, value in needed.items() if value > free.get(key, 0)}
    return (
        f"{what} were not free within {bound}={wait_s:g} s: they need {resources_text(needed)}, "
        f"{resources_text({key: free.get(key, 0) for key in needed})} of "
        f"{resources_text({key: total.get(key, 0) for key in needed})} are free now (missing "
        f"{resources_text(missing) if missing else 'a node to place them together'}); other work holds the rest"
    )


def call_reserved(function: Callable[..., T], args: tuple, bundle: dict[str, float], wait_s: float, what: str) -> T:
    """``function(*args)`` in a Ray task on ``bundle``'s resources, reserved first (``reserve``, bounded by
    ``scaling.resource_wait_s``: ``wait_s``), and released when it returns. Outside any placement group of the
    caller (a Tune trial's holds only its token CPU)."""
    group = reserve([bundle], "PACK", wait_s, what, "scaling.resource_wait_s")
    try:
        options = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0), **in_bundle(group, 0)}
        return ray.get(ray.remote(function).options(**options).remote(*args))
    finally:
        remove_placement_group(group)


def in_bundle(group: PlacementGroup, index: int) -> dict:
    """Options that start an actor or task in bundle ``index`` of ``group`` (the resources reserved for it)."""
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)}
