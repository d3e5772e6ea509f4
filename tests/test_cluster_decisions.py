"""What the run layer decides from a cluster's shape, without a cluster: whether workers may run on another machine,
which local paths they could not read there, how many sweep trials a cluster holds at its largest, and whether dev
scores go off the training ranks (evaluation.async_dev: auto)."""

from __future__ import annotations

import dataclasses
import math

from sbert_ray.config import EvalConfig, ScalingConfig, TrainConfig
from sbert_ray.runs.cluster import (
    NodeKind,
    leaves_machine,
    most_resources,
    resolve_async_dev,
    runs_fitting,
    unshared_paths,
    with_async_dev,
)

WORKER = {"CPU": 4.0, "GPU": 1.0}
GPU_NODES = [NodeKind({"CPU": 0.0}, 1), NodeKind({"CPU": 96.0, "GPU": 8.0}, 4)]  # a CPU-less head, 4 GPU nodes


def test_workers_leave_the_machine_when_another_may_hold_them():
    here, other = "10.0.0.1", "10.0.0.2"
    assert leaves_machine(GPU_NODES, [(here, {"CPU": 0.0})], here, WORKER)  # the autoscaler starts GPU nodes
    assert leaves_machine(None, [(here, {"CPU": 0.0})], here, WORKER)  # `ray up`: a head that holds no worker
    assert leaves_machine(None, [(here, {"CPU": 8.0, "GPU": 1.0}), (other, WORKER)], here, WORKER)
    # One machine: a head that holds the worker, or a local cluster of several nodes on one address.
    assert not leaves_machine(None, [(here, {"CPU": 8.0, "GPU": 1.0})], here, WORKER)
    assert not leaves_machine(None, [(here, {"CPU": 0.0}), (here, WORKER)], here, WORKER)
    assert not leaves_machine([NodeKind(WORKER, 1)], [(here, WORKER)], here, WORKER)


def test_only_paths_on_a_shared_filesystem_reach_other_machines():
    mounts = [("/", "ext4"), ("/home", "xfs"), ("/mnt/efs", "nfs4"), ("/fsx", "lustre"), ("/mnt/s3", "fuse.s3fs")]
    paths = {
        "model.name": "/home/me/models/mine",
        "data_dir": "/mnt/efs/data",
        "checkpoint.storage_path": "/mnt/efsx/runs",  # a sibling of the mount point, not inside it
        "a": "/fsx/runs",
        "b": "/mnt/s3/runs",
        "c": "/mnt/efs",
    }
    assert unshared_paths(paths, mounts) == {
        "model.name": "/home/me/models/mine", "checkpoint.storage_path": "/mnt/efsx/runs",
    }  # fmt: skip
    assert unshared_paths({"data_dir": "/data"}, []) == {"data_dir": "/data"}  # no mount table: not known shared


def gpu_trial(num_workers: int = 1) -> TrainConfig:
    return TrainConfig(scaling=ScalingConfig(num_workers=num_workers, use_gpu=True, cpus_per_worker=4))


def test_sweep_concurrency_counts_the_nodes_an_autoscaler_may_start():
    """A cluster that scales GPU nodes from zero: at the sweep's start it has no GPU (1 trial at a time, before),
    at its largest 32 (4 nodes of 8): 32 one-GPU trials, or 16 of two workers; a trial's driver takes a CPU."""
    capacity = most_resources(GPU_NODES)
    assert capacity == {"CPU": 384.0, "GPU": 32.0}
    assert runs_fitting(capacity, [gpu_trial()], driver_cpus=0.01) == 32
    assert runs_fitting(capacity, [gpu_trial(), gpu_trial(2)], driver_cpus=0.01) == 16
    assert runs_fitting({"CPU": 0.0}, [gpu_trial()]) == 1  # the head alone, as at the start
    assert most_resources([NodeKind(WORKER, math.inf)]) is None  # no maximum: what the cluster has now decides
    assert most_resources(None) is None


def cpu_run(num_workers: int, cpus: float, async_dev="auto", dev_resources=None) -> TrainConfig:
    evaluation = EvalConfig(async_dev=async_dev, dev_resources=dev_resources or {"CPU": 1.0})
    return TrainConfig(evaluation=evaluation, scaling=ScalingConfig(num_workers=num_workers, cpus_per_worker=cpus))


def test_dev_scores_go_off_the_training_ranks_where_the_cluster_holds_a_scorer_beside_the_workers():
    """auto: decided from the cluster's size before the fit; said in one line. The test cluster's 2 CPUs hold a
    scorer of one CPU beside 2 workers of half a CPU, not beside 2 of one CPU; 8 one-GPU workers leave no quarter
    GPU on an 8-GPU node, a ninth GPU does; true and false are kept."""
    assert resolve_async_dev([cpu_run(2, 0.5)], {"CPU": 2.0}, runs=1) == (
        True,
        "evaluation.async_dev=auto: dev scores off the training ranks, on 1 CPU beside the training workers "
        "(the cluster's 2 CPU)",
    )
    assert resolve_async_dev([cpu_run(2, 1.0)], {"CPU": 2.0}, runs=1) == (
        False,
        "evaluation.async_dev=auto: dev scores inline on rank 0: the cluster's 2 CPU cannot hold 1 CPU beside the "
        "training workers",
    )
    quarter = {"CPU": 1.0, "GPU": 0.25}
    eight = TrainConfig(
        evaluation=EvalConfig(dev_resources=quarter),
        scaling=ScalingConfig(num_workers=8, use_gpu=True, cpus_per_worker=4),
    )
    assert not resolve_async_dev([eight], {"CPU": 96.0, "GPU": 8.0}, runs=1)[0]
    assert resolve_async_dev([eight], {"CPU": 96.0, "GPU": 9.0}, runs=1)[0]
    # evaluation.dev_workers: that many scorers of dev_resources each, beside the workers
    two_scorers = dataclasses.replace(cpu_run(2, 0.5), evaluation=EvalConfig(dev_workers=2))
    assert resolve_async_dev([two_scorers], {"CPU": 3.0}, runs=1)[1].endswith(
        "on 2 CPU beside the training workers (the cluster's 3 CPU)"
    )
    assert not resolve_async_dev([two_scorers], {"CPU": 2.0}, runs=1)[0]
    assert resolve_async_dev([cpu_run(2, 1.0, async_dev=True)], {"CPU": 2.0}, runs=1)[0] is True
    assert resolve_async_dev([cpu_run(2, 0.5, async_dev=False)], {"CPU": 2.0}, runs=1)[0] is False


def test_a_sweep_places_dev_scorers_only_where_they_cost_no_concurrent_trial():
    """2 CPUs hold 3 trials of half a CPU (+ the trial's token 0.01) but only 1 with a scorer: auto keeps the 3
    trials inline; capped at one trial, the scorer fits beside it. Scorers off the ranks count in concurrency."""
    trial = cpu_run(1, 0.5)
    assert not resolve_async_dev([trial], {"CPU": 2.0}, runs=None, driver_cpus=0.01)[0]
    async_dev, why = resolve_async_dev([trial], {"CPU": 2.0}, runs=1, driver_cpus=0.01)
    assert async_dev and "beside the training workers" in why
    assert runs_fitting({"CPU": 2.0}, [trial], driver_cpus=0.01) == 3
    assert runs_fitting({"CPU": 2.0}, [with_async_dev(trial, True)], driver_cpus=0.01) == 1
    assert not resolve_async_dev([cpu_run(1, 0.5)], {"CPU": 6.0}, runs=None, driver_cpus=0.01)[
        0
    ]  # 11 alone, 3 with scorers
