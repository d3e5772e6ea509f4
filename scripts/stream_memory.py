#!/usr/bin/env python
"""Training memory and the time to the first step against the corpus size (issue 19 item 6), as a benchmark.

    python scripts/stream_memory.py --data-dir ../shared/data --shards 2 16 --output results/stream-memory.json

A generated corpus of scored pairs (short random sentences, parquet shards of equal size on an S3 server: moto,
started here unless ``--s3-endpoint`` names one) is trained for a few dozen steps on 2 workers of a Ray cluster of
its own with a small object store, once per ``--shards`` size. The driver (the ``sbert-ray train`` process) and
every process of the cluster are sampled with psutil while the run goes. What the run holds is the shard being
read, the blocks in the object store (bounded by its size and Ray Data's backpressure) and each worker's window,
none of which depends on how many shards there are; the run counts the corpus from parquet footers, so nothing
before the first step reads it either.

It writes what it measured and the bounds it broke as JSON and exits 1 when it broke any: each size against the
absolute bounds, and the largest size against the smallest one for growth. CI runs the smallest size only
(tests/test_stream_memory.py); docs/large-data.md quotes both sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import local_cluster
import mlflow
import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

SHARD_ROWS = 125_000  # every shard the same size: a read task holds one shard's row group, whatever the corpus
ROW_GROUP_ROWS = 8192
OBJECT_STORE_BYTES = 300 * 1024**2
STEPS = 30
MB = 1024**2

# The bounds. Measured here (2 cores, 2026-12-01, load ~40 from other jobs): driver 770 MB and workers 665-735 MB
# at both sizes. A process of this project (torch, transformers, Ray, a tiny model) starts near 400-600 MB; what
# the corpus could add is the slope the issue measured on the old path, ~500 MB per million pairs in the driver and
# in each worker (~900 MB between 0.25 M and 2 M pairs).
DRIVER_RSS_MAX = 1200 * MB  # the `sbert-ray train` process: config, file list, Ray driver, MLflow; no records
WORKER_RSS_MAX = 1200 * MB  # a Train worker: model, optimizer, its window, Ray Data's prefetched blocks
# 8x the pairs may add allocator noise, not data: a tenth of what the old path's slope would add.
GROWTH_MAX = 150 * MB
# The cluster's processes summed (~6.5 GB here: ~27 Ray processes). The sum counts object-store pages once per
# process that maps them (up to the 300 MB store each) and Ray's pool of idle workers varies by a process or two
# (~450 MB each). One read process per shard at once (the bug this benchmark found: 16 shards, ~14 more processes
# of ~400 MB) would add ~5 GB.
CLUSTER_GROWTH_MAX = 1024 * MB


def corpus_shard(rows: int, seed: int) -> pa.Table:
    """``rows`` scored pairs of 4-10 random words from a 5,000-word vocabulary (vectorised: no Python per row)."""
    rng = np.random.default_rng(seed)
    vocab = pa.array([f"w{i}" for i in range(5000)])

    def sentences() -> pa.Array:
        lengths = rng.integers(4, 11, rows)
        words = [pc.take(vocab, rng.integers(0, len(vocab), rows)) for _ in range(10)]
        # a word past the sentence's length is null, and binary_join_element_wise skips nulls
        words = [pc.if_else(pa.array(lengths > k), w, pa.nulls(rows, pa.string())) for k, w in enumerate(words)]
        return pc.binary_join_element_wise(*words, " ", null_handling="skip")

    return pa.table({"sentence1": sentences(), "sentence2": sentences(), "score": rng.uniform(0, 5, rows)})


def write_corpus(prefix: str, shards: int, env: dict[str, str]) -> None:
    s3 = pafs.S3FileSystem(
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_override=env["AWS_ENDPOINT_URL"],
        region=env["AWS_DEFAULT_REGION"],
    )
    for i in range(shards):
        pq.write_table(corpus_shard(SHARD_ROWS, seed=i), f"{prefix}/part-{i:04d}.parquet",
                       filesystem=s3, row_group_size=ROW_GROUP_ROWS)  # fmt: skip


class Peaks:
    """Peak RSS of every process under ``roots`` (and of their sum per root), sampled every ``interval_s`` while a
    run goes; ``train_workers`` are those that were ever a Ray Train worker."""

    def __init__(self, roots: list[int], interval_s: float = 0.2):
        self.roots, self.interval_s = roots, interval_s
        self.rss: dict[int, int] = {}
        self.total: dict[int, int] = {}
        self.train_workers: set[int] = set()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample_until_done, daemon=True)
        self.thread.start()

    def _sample_until_done(self) -> None:
        while not self.done.wait(self.interval_s):
            for root in list(self.roots):
                self.total[root] = max(self._sample(root), self.total.get(root, 0))

    def _sample(self, root: int) -> int:
        try:
            processes = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        summed = 0
        for process in processes:
            try:
                rss, title = process.memory_info().rss, " ".join(process.cmdline())
            except psutil.Error:
                continue
            self.rss[process.pid] = max(rss, self.rss.get(process.pid, 0))
            summed += rss
            if "RayTrainWorker" in title:
                self.train_workers.add(process.pid)
        return summed

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


@dataclass(frozen=True)
class Measured:
    pairs: int
    driver_mb: float  # peak RSS of the `sbert-ray train` process
    workers_mb: list[float]  # peak RSS of each Ray Train worker
    cluster_mb: float  # peak of the summed RSS of all the cluster's processes
    first_step_s: float  # MLflow's train/time_to_first_step_s: from fit() to the end of the first step
    wall_s: float  # the whole `sbert-ray train` command

    def __str__(self) -> str:
        workers = "/".join(f"{w:.0f}" for w in self.workers_mb)
        return (
            f"{self.pairs:,} pairs: driver {self.driver_mb:.0f} MB, workers {workers} MB, cluster "
            f"{self.cluster_mb:.0f} MB, first step {self.first_step_s:.0f} s, wall {self.wall_s:.0f} s"
        )


def train_on_corpus(shards: int, s3_env: dict[str, str], data_dir: Path, root: Path) -> Measured:
    """Write ``shards`` shards to S3 and train on them on a cluster of our own, sampling memory as it goes."""
    prefix, root = f"corpus-{shards}", root / f"corpus-{shards}"
    root.mkdir(parents=True)
    write_corpus(f"{local_cluster.BUCKET}/{prefix}", shards, s3_env)
    config = root / "config.yaml"
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    stage = {"dataset": f"s3://{local_cluster.BUCKET}/{prefix}/", "batch_size": 32, "max_steps": STEPS}
    evaluation = {"dev_limit": 50, "final_tasks": []}
    config.write_text(
        local_cluster.tiny_training_yaml(f"memory-{shards}", data_dir, stage, evaluation, root / "runs", tracking_uri)
    )
    ray_tmp = tempfile.mkdtemp(prefix="sr-", dir="/tmp")  # short: Ray's socket paths live under it
    # No token (a ~/.ray/auth_token of this machine would switch it on), S3 reachable from every process.
    env = {**s3_env, **local_cluster.NO_STATE_API, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled"}
    port = local_cluster.free_port()
    head = local_cluster.start(
        [str(local_cluster.BIN / "ray"), "start", "--head", "--block", "--port", str(port),
         "--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--object-store-memory", str(OBJECT_STORE_BYTES),
         "--include-dashboard", "false", "--dashboard-agent-listen-port", str(local_cluster.free_port()),
         "--ray-client-server-port", str(local_cluster.free_port()), "--disable-usage-stats", "--temp-dir", ray_tmp],
        root / "head.log", env,
    )  # fmt: skip
    try:
        peaks = Peaks([head.pid])
        started = time.time()
        driver = subprocess.Popen(
            [str(local_cluster.BIN / "sbert-ray"), "train", str(config)],
            env={**os.environ, **env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
            stdout=(root / "train.log").open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        peaks.roots.append(driver.pid)
        code = driver.wait(timeout=900)
        wall = time.time() - started
        peaks.stop()
        if code != 0:
            raise RuntimeError(f"sbert-ray train exited with {code}:\n{(root / 'train.log').read_text()[-3000:]}")
    finally:
        local_cluster.stop(head)  # its process group: this cluster's processes, and nothing else
        shutil.rmtree(ray_tmp, ignore_errors=True)
    client = mlflow.MlflowClient(tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("sbert-ray").experiment_id])
    return Measured(
        pairs=shards * SHARD_ROWS,
        driver_mb=peaks.rss[driver.pid] / MB,
        workers_mb=[peaks.rss[pid] / MB for pid in sorted(peaks.train_workers)],
        cluster_mb=peaks.total[head.pid] / MB,
        first_step_s=run.data.metrics["train/time_to_first_step_s"],
        wall_s=wall,
    )


def broken_bounds(runs: list[Measured]) -> list[str]:
    """The bounds ``runs`` (smallest corpus first) break: each run's own, then the largest against the smallest."""
    broken = [f"{run.pairs:,} pairs: the driver holds {run.driver_mb:.0f} MB" for run in runs
              if run.driver_mb >= DRIVER_RSS_MAX / MB]  # fmt: skip
    broken += [f"{run.pairs:,} pairs: a Train worker holds {max(run.workers_mb):.0f} MB" for run in runs
               if max(run.workers_mb) >= WORKER_RSS_MAX / MB]  # fmt: skip
    if len(runs) < 2:
        return broken
    small, large = runs[0], runs[-1]
    if large.driver_mb > small.driver_mb + GROWTH_MAX / MB:
        broken.append(f"the driver grew {large.driver_mb - small.driver_mb:.0f} MB with the corpus")
    if max(large.workers_mb) > max(small.workers_mb) + GROWTH_MAX / MB:
        broken.append(f"a Train worker grew {max(large.workers_mb) - max(small.workers_mb):.0f} MB with the corpus")
    if large.cluster_mb > small.cluster_mb + CLUSTER_GROWTH_MAX / MB:
        broken.append(f"the cluster grew {large.cluster_mb - small.cluster_mb:.0f} MB with the corpus")
    # Start-up: listing and counting more footers, nothing that reads the pairs.
    if large.first_step_s > small.first_step_s * 1.5 + 10:
        broken.append(f"the first step took {large.first_step_s:.0f} s vs {small.first_step_s:.0f} s")
    return broken


def measure(shards: list[int], s3_env: dict[str, str], data_dir: Path, work_dir: Path) -> dict:
    """Every size in turn (smallest first), what the machine was doing meanwhile, and the bounds broken."""
    started, load_before = datetime.now(UTC), os.getloadavg()
    runs = [train_on_corpus(n, s3_env, data_dir, work_dir) for n in sorted(shards)]
    return {
        "started_utc": started.isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1024**3, 1),
        "load_average_before": load_before,  # the machine may be shared: its load stretches every time
        "load_average_after": os.getloadavg(),
        "runs": [asdict(run) for run in runs],
        "broken_bounds": broken_bounds(runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=local_cluster.REPO.parent / "shared" / "data")
    parser.add_argument("--shards", type=int, nargs="+", default=[2, 16], help=f"corpus sizes ({SHARD_ROWS:,} each)")
    parser.add_argument("--s3-endpoint", help="an S3 server holding the bucket 'sbert-ray' (default: start moto)")
    parser.add_argument("--work-dir", type=Path, help="where the runs go (default: a temporary folder, removed)")
    parser.add_argument("--output", type=Path, help="the JSON (default: printed only)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stream-memory-") as scratch:
        work_dir = args.work_dir or Path(scratch)
        s3 = None if args.s3_endpoint else local_cluster.start_s3(Path(scratch))
        endpoint = args.s3_endpoint or s3.endpoint
        try:
            report = measure(args.shards, {"AWS_ENDPOINT_URL": endpoint, **local_cluster.S3_CREDENTIALS},
                             args.data_dir, work_dir)  # fmt: skip
        finally:
            if s3 is not None:
                local_cluster.stop(s3.process)
    for run in report["runs"]:
        print(Measured(**run))
    print("\n".join(f"bound broken: {b}" for b in report["broken_bounds"]) or "within every bound")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["broken_bounds"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
