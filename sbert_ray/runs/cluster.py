"""Joining the Ray cluster, and how many runs it holds at once."""

from __future__ import annotations

import os

import ray

from sbert_ray.config import TrainConfig


def connect_ray() -> None:
    """Join the cluster in RAY_ADDRESS (set under `ray job submit`), else start a fresh local one: never whatever
    cluster happens to be recorded in /tmp/ray, which may be stale."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local")


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
