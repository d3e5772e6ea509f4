#!/usr/bin/env python
"""CPU seconds per kind of process of tiny 2-worker fits on a fresh local 2-CPU cluster: where a fit's CPU goes
(Train workers, Ray Data and evaluation tasks, Ray's helper actors), to size the suite's cluster phase.

    python scripts/fit_cpu.py [--fits 3] [--workers 2] [--data-dir ../shared/data] [--warm]

Every process under this one is sampled every 0.2 s; the table counts the fits after the first (the first also
starts the cluster's own actors). ``--warm`` starts the cluster with ``local_cluster.MANY_SHORT_FITS``, as
the suite's clusters are.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray
from local_cluster import MANY_SHORT_FITS, NO_STATE_API, tiny_training_yaml

from sbert_ray.config import load_config
from sbert_ray.runs.train_run import run_training


class CpuSampler:
    """The CPU seconds of every process under this one, by kind (its command's first word: ``ray::RayTrainWorker``)."""

    def __init__(self) -> None:
        self.seconds: dict[int, tuple[str, float]] = {}

    def sample(self) -> None:
        for process in psutil.Process().children(recursive=True):
            try:
                times = process.cpu_times()
                kind = (" ".join(process.cmdline()).split() or ["(exited)"])[0]
                self.seconds[process.pid] = (kind, times.user + times.system)
            except psutil.Error:  # ended meanwhile
                pass

    def sample_until(self, done: threading.Event) -> None:
        while not done.wait(0.2):
            self.sample()

    def by_kind(self, since: dict[int, tuple[str, float]]) -> collections.Counter:
        kinds = collections.Counter()
        for pid, (kind, seconds) in self.seconds.items():
            kinds[kind] += seconds - since.get(pid, (kind, 0.0))[1]
        return kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fits", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    parser.add_argument("--warm", action="store_true", help="tuned as the suite's clusters")
    parser.add_argument("--workers", type=int, default=2, help="Train workers per fit")
    args = parser.parse_args()
    os.environ.update({**NO_STATE_API, **(MANY_SHORT_FITS if args.warm else {})})
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    root = Path(tempfile.mkdtemp(prefix="fit-cpu-"))
    stage = {"dataset": "stsb", "split": "train", "limit": 96, "batch_size": 8}
    evaluation = {"dev_limit": 100, "eval_every": 4, "final_tasks": ["stsb"]}
    sampler, since = CpuSampler(), {}
    for fit in range(args.fits):
        path = root / f"fit{fit}.yaml"
        tracking = f"sqlite:///{root / 'mlflow.db'}"
        text = tiny_training_yaml(f"fit{fit}", args.data_dir.resolve(), stage, evaluation, root, tracking, args.workers)
        path.write_text(text)
        done = threading.Event()
        sampling = threading.Thread(target=sampler.sample_until, args=(done,))
        sampling.start()
        started = time.time()
        run_training(load_config(path))
        done.set()
        sampling.join()
        sampler.sample()
        print(f"fit {fit}: {time.time() - started:.1f} s", flush=True)
        if fit == 0:
            since = dict(sampler.seconds)
            driver_since = sum(psutil.Process().cpu_times()[:2])
    kinds = sampler.by_kind(since)
    kinds["(this driver)"] = sum(psutil.Process().cpu_times()[:2]) - driver_since
    print(f"CPU seconds of fits 2-{args.fits} by process kind ({sum(kinds.values()):.1f} in all):")
    for kind, seconds in kinds.most_common():
        print(f"{seconds:8.1f}  {kind}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
