#!/usr/bin/env python
"""Training memory and the time to the first step against the corpus size (issue 19 item 6), and with
``--prepared`` the same for a prepared source plus a resume late in the pass (issue 27 item 6), as a benchmark.

    python scripts/stream_memory.py --data-dir ../shared/data --shards 2 16 --output results/stream-memory.json
    python scripts/stream_memory.py --data-dir ../shared/data --shards 4 32 --prepared --output prepared.json

A generated corpus of scored pairs (short random sentences, parquet shards of equal size on an S3 server: moto,
started here unless ``--s3-endpoint`` names one) is trained for a few dozen steps on 2 workers of a Ray cluster of
its own with a small object store, once per ``--shards`` size. The driver (the ``sbert-ray train`` process) and
every process of the cluster are sampled with psutil while the run goes. What the run holds is the shard being
read, the blocks in the object store (bounded by its size and Ray Data's backpressure) and each worker's window,
none of which depends on how many shards there are; the run counts the corpus from parquet footers, so nothing
before the first step reads it either.

With ``--prepared`` the corpus is first tokenised by ``sbert-ray prepare`` on the same cluster (into S3 too), and
the run trains on the prepared prefix: each worker reads its own share of the shards (no Ray Data). That run is
killed (SIGKILL to the driver) once its first resume point is complete; the point's stream position is then moved
to ``--at`` of the first pass (the position is all a resume reads from: the weights and optimizer do not change
what is read), and the same command is submitted again, as after a lost driver. It resumes there, and is killed
once it has logged its first report: its time to the first step (``train/time_to_resumed_step_s``, from its
``fit()``; and from its launch), the rows rank 0 read (``data/<source>/read``) and both processes' peaks.

It writes what it measured and the bounds it broke as JSON and exits 1 when it broke any: each size against the
absolute bounds, and the largest size against the smallest one for growth. CI runs the smallest size only
(tests/test_stream_memory.py; a tiny prepared corpus too); docs/large-data.md quotes both sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
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
ROW_GROUP_ROWS = 8192  # the raw shards' and (prepare's default) the prepared shards'
OBJECT_STORE_BYTES = 300 * 1024**2
STEPS = 30
BATCH, WORKERS, WINDOW_BATCHES = 32, 2, 200  # the stage's global batch, tiny_training_yaml's workers, the default
MAX_SEQ_LENGTH = 128  # random:tiny's default, which prepare is given as the run's
REPORT_EVERY = 5  # with --prepared: steps between report points (each one a resume point)
RUN_TIMEOUT_S = 1800
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
# A resume from a prepared source reads the window its position lies in: rank 0's part of it and the row groups
# that part starts and ends in (docs/large-data.md, Resume), whatever the corpus.
RESUME_READ_MAX = WINDOW_BATCHES * BATCH // WORKERS + 2 * ROW_GROUP_ROWS


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


def write_corpus(prefix: str, shards: int, shard_rows: int, env: dict[str, str]) -> None:
    s3 = pafs.S3FileSystem(
        access_key=env["AWS_ACCESS_KEY_ID"],
        secret_key=env["AWS_SECRET_ACCESS_KEY"],
        endpoint_override=env["AWS_ENDPOINT_URL"],
        region=env["AWS_DEFAULT_REGION"],
    )
    for i in range(shards):
        pq.write_table(corpus_shard(shard_rows, seed=i), f"{prefix}/part-{i:04d}.parquet",
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
class Resumed:
    """The run submitted again after its driver was killed, its resume point moved to ``position`` of ``of``."""

    position: int  # global micro-batches of the first pass before the resume point, as moved there
    of: int  # global micro-batches per pass
    epoch: float  # train/epoch the resumed run logged at its first report (position / of, and its steps since)
    driver_mb: float
    workers_mb: list[float]
    first_step_s: float  # train/time_to_resumed_step_s: from its fit() to its first step
    first_step_wall_s: float  # from launching the command again to that step
    rows_read: int  # rank 0's data/<source>/read at its first report: what the resume read, and its steps since


@dataclass(frozen=True)
class Measured:
    pairs: int
    driver_mb: float  # peak RSS of the `sbert-ray train` process
    workers_mb: list[float]  # peak RSS of each Ray Train worker
    cluster_mb: float  # peak of the summed RSS of all the cluster's processes
    first_step_s: float  # MLflow's train/time_to_first_step_s: from fit() to the end of the first step
    wall_s: float  # the whole `sbert-ray train` command (--prepared: until it was killed)
    first_step_wall_s: float | None = None  # from launching `sbert-ray train` to its first step
    prepare_s: float | None = None  # --prepared: the whole `sbert-ray prepare` command
    rows_read: int | None = None  # --prepared: rank 0's data/<source>/read at the first report
    resumed: Resumed | None = None  # --prepared: the same run resumed late in its first pass

    def __str__(self) -> str:
        workers = "/".join(f"{w:.0f}" for w in self.workers_mb)
        line = (
            f"{self.pairs:,} pairs: driver {self.driver_mb:.0f} MB, workers {workers} MB, cluster "
            f"{self.cluster_mb:.0f} MB, first step {self.first_step_s:.0f} s, wall {self.wall_s:.0f} s"
        )
        if self.resumed is None:
            return line
        again = self.resumed
        return (
            f"{line}; prepare {self.prepare_s:.0f} s; resumed at {again.position:,}/{again.of:,}: driver "
            f"{again.driver_mb:.0f} MB, workers {'/'.join(f'{w:.0f}' for w in again.workers_mb)} MB, first step "
            f"{again.first_step_s:.1f} s ({again.first_step_wall_s:.0f} s from launch), {again.rows_read:,} rows read"
        )


@dataclass(frozen=True)
class Driven:
    """One `sbert-ray train` command: when it was launched, how long it ran and its processes' peaks."""

    launched: float
    wall_s: float
    driver_mb: float
    workers_mb: list[float]
    worker_pids: list[int]
    cluster_mb: float


@dataclass(frozen=True)
class Cluster:
    head: subprocess.Popen
    env: dict[str, str]  # S3, and RAY_ADDRESS naming this cluster


@contextlib.contextmanager
def cluster_of_our_own(root: Path, s3_env: dict[str, str]) -> Iterator[Cluster]:
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
        yield Cluster(head, {**os.environ, **env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    finally:
        local_cluster.stop(head)  # its process group: this cluster's processes, and nothing else
        shutil.rmtree(ray_tmp, ignore_errors=True)


def drive(cluster: Cluster, config: Path, log: Path, until: Callable[[], bool] | None = None) -> Driven:
    """`sbert-ray train config` on ``cluster``, sampled: to its end (an error unless it succeeds), or until
    ``until()`` holds, when its driver is killed as a lost driver dies (SIGKILL)."""
    peaks = Peaks([cluster.head.pid])
    launched = time.time()
    driver = subprocess.Popen([str(local_cluster.BIN / "sbert-ray"), "train", str(config)], env=cluster.env,
                              stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip
    peaks.roots.append(driver.pid)
    try:
        while until is not None and driver.poll() is None and not until():
            if time.time() > launched + RUN_TIMEOUT_S:
                raise TimeoutError(f"sbert-ray train ran {RUN_TIMEOUT_S} s without getting there; see {log}")
            time.sleep(0.5)
        if until is not None and driver.poll() is None:
            driver.kill()
        code = driver.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if driver.poll() is None:  # stopped early (an error, Ctrl-C): no driver outlives the cluster it runs on
            driver.kill()
        peaks.stop()
    if code != 0 and (until is None or code != -9):
        raise RuntimeError(f"sbert-ray train exited with {code}:\n{log.read_text()[-3000:]}")
    workers = sorted(peaks.train_workers)
    return Driven(launched, time.time() - launched, peaks.rss[driver.pid] / MB,
                  [peaks.rss[pid] / MB for pid in workers], workers, peaks.total[cluster.head.pid] / MB)  # fmt: skip


def training_config(
    root: Path, name: str, dataset: str, data_dir: Path, stage: dict, evaluation: dict | None = None
) -> tuple[Path, str]:
    """The run's config file and MLflow tracking URI (SQLite, in ``root``)."""
    config, tracking_uri = root / "config.yaml", f"sqlite:///{root / 'mlflow.db'}"
    evaluation = {"dev_limit": 50, "final_tasks": [], **(evaluation or {})}
    stage = {"dataset": dataset, "batch_size": BATCH, **stage}
    yaml = local_cluster.tiny_training_yaml(name, data_dir, stage, evaluation, root / "runs", tracking_uri)
    config.write_text(yaml)
    return config, tracking_uri


def train_on_corpus(shards: int, shard_rows: int, s3_env: dict[str, str], data_dir: Path, root: Path) -> Measured:
    """Write ``shards`` shards to S3 and train on them on a cluster of our own, sampling memory as it goes."""
    prefix, root = f"corpus-{shards}x{shard_rows}", root / f"corpus-{shards}"
    root.mkdir(parents=True)
    write_corpus(f"{local_cluster.BUCKET}/{prefix}", shards, shard_rows, s3_env)
    dataset = f"s3://{local_cluster.BUCKET}/{prefix}/"
    config, tracking_uri = training_config(root, f"memory-{shards}", dataset, data_dir, {"max_steps": STEPS})
    with cluster_of_our_own(root, s3_env) as cluster:
        run = drive(cluster, config, root / "train.log")
    metrics = Metrics(tracking_uri)
    return Measured(
        pairs=shards * shard_rows,
        driver_mb=run.driver_mb,
        workers_mb=run.workers_mb,
        cluster_mb=run.cluster_mb,
        first_step_s=metrics.last("train/time_to_first_step_s"),
        wall_s=run.wall_s,
        first_step_wall_s=metrics.logged_at("train/time_to_first_step_s") - run.launched,
    )


class Metrics:
    """The metrics of the one MLflow run of a benchmark's tracking URI, as logged so far."""

    def __init__(self, tracking_uri: str):
        self.client = mlflow.MlflowClient(tracking_uri)

    def history(self, suffix: str) -> list:
        """Every point logged of the metric whose name ends with ``suffix`` (none yet: empty)."""
        experiment = self.client.get_experiment_by_name("sbert-ray")
        runs = self.client.search_runs([experiment.experiment_id]) if experiment else []
        if not runs:
            return []
        (run,) = runs
        keys = [key for key in run.data.metrics if key.endswith(suffix)]
        return sorted(self.client.get_metric_history(run.info.run_id, keys[0]), key=lambda m: m.step) if keys else []

    def last(self, suffix: str) -> float:
        return self.history(suffix)[-1].value

    def logged_at(self, suffix: str) -> float:
        return self.history(suffix)[-1].timestamp / 1000

    def at_step(self, suffix: str, step: int) -> float:
        """The value logged last at ``step``: a killed run may have logged steps past its resume point, which the
        resumed run logs again."""
        return max((m for m in self.history(suffix) if m.step == step), key=lambda m: m.timestamp).value


def resume_points(storage: Path) -> list[Path]:
    """The run's complete resume points (``training.resume_points``: a marker beside each), oldest first."""
    return sorted(marker.with_suffix("") for marker in storage.glob("*/resume_points/step-*.json"))


def train_prepared(
    shards: int, shard_rows: int, at: float, s3_env: dict[str, str], data_dir: Path, root: Path
) -> Measured:
    """Write ``shards`` shards to S3, prepare them, train on the prepared prefix on a cluster of our own until its
    first resume point, move that point to ``at`` of the pass and resume there, sampling memory as it goes."""
    prefix, root = f"corpus-{shards}x{shard_rows}", root / f"prepared-{shards}"
    root.mkdir(parents=True)
    write_corpus(f"{local_cluster.BUCKET}/{prefix}", shards, shard_rows, s3_env)
    prepared = f"s3://{local_cluster.BUCKET}/prepared-{uuid.uuid4().hex[:8]}/"  # a rerun would find it written
    # A whole pass is far more steps than we train: the run is killed at its first resume point, and again after.
    stage = {"max_steps": 1_000_000 // BATCH, "window_batches": WINDOW_BATCHES}
    config, tracking_uri = training_config(root, f"prepared-{shards}", prepared, data_dir, stage,
                                           {"eval_every": REPORT_EVERY})  # fmt: skip
    metrics, storage = Metrics(tracking_uri), root / "runs"
    with cluster_of_our_own(root, s3_env) as cluster:
        started = time.time()
        subprocess.run(
            [str(local_cluster.BIN / "sbert-ray"), "prepare", f"s3://{local_cluster.BUCKET}/{prefix}/",
             "--model", "random:tiny", "--max-seq-length", str(MAX_SEQ_LENGTH), "--objective", "regression",
             "--output", prepared, "--workers", "2"],
            env=cluster.env, stdout=(root / "prepare.log").open("w"), stderr=subprocess.STDOUT, check=True,
        )  # fmt: skip
        prepare_s = time.time() - started
        first = drive(cluster, config, root / "train.log", until=lambda: bool(resume_points(storage)))
        # Its workers gone (they may finish uploading a newer point first), their CPUs and memory free again.
        await_exit(first.worker_pids)
        point = resume_points(storage)[-1]
        state = json.loads((point / "train_state.json").read_text())
        per_pass = math.ceil(shards * shard_rows // WORKERS / (BATCH // WORKERS))
        position = int(at * per_pass)
        (point / "train_state.json").write_text(json.dumps({**state, "batch": position}))
        relaunched = time.time()

        def resumed_reads() -> list:
            # Only the resumed run's: the killed run may have logged reads past its last complete resume point.
            return [
                m
                for m in metrics.history("/read")
                if m.step > state["global_step"] and m.timestamp / 1000 >= relaunched
            ]

        again = drive(cluster, config, root / "resumed.log", until=lambda: bool(resumed_reads()))
    report = min(m.step for m in resumed_reads())
    return Measured(
        pairs=shards * shard_rows,
        driver_mb=first.driver_mb,
        workers_mb=first.workers_mb,
        cluster_mb=max(first.cluster_mb, again.cluster_mb),
        first_step_s=metrics.at_step("train/time_to_first_step_s", 1),
        wall_s=first.wall_s,
        first_step_wall_s=metrics.history("train/time_to_first_step_s")[0].timestamp / 1000 - first.launched,
        prepare_s=prepare_s,
        rows_read=int(metrics.history("/read")[0].value),
        resumed=Resumed(
            position=position,
            of=per_pass,
            epoch=metrics.at_step("train/epoch", report),
            driver_mb=again.driver_mb,
            workers_mb=again.workers_mb,
            first_step_s=metrics.last("train/time_to_resumed_step_s"),
            first_step_wall_s=metrics.logged_at("train/time_to_resumed_step_s") - again.launched,
            rows_read=int(metrics.at_step("/read", report)),
        ),
    )


def await_exit(pids: list[int], timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while any(psutil.pid_exists(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.5)


def broken_bounds(runs: list[Measured]) -> list[str]:
    """The bounds ``runs`` (smallest corpus first) break: each run's own, then the largest against the smallest."""
    broken = [f"{run.pairs:,} pairs: the driver holds {run.driver_mb:.0f} MB" for run in runs
              if run.driver_mb >= DRIVER_RSS_MAX / MB]  # fmt: skip
    broken += [f"{run.pairs:,} pairs: a Train worker holds {max(run.workers_mb):.0f} MB" for run in runs
               if max(run.workers_mb) >= WORKER_RSS_MAX / MB]  # fmt: skip
    broken += [f"{run.pairs:,} pairs: the resume read {run.resumed.rows_read:,} rows" for run in runs
               if run.resumed and run.resumed.rows_read > RESUME_READ_MAX]  # fmt: skip
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
    if small.resumed and large.resumed and large.resumed.first_step_s > small.resumed.first_step_s * 1.5 + 10:
        broken.append(f"the resumed step took {large.resumed.first_step_s:.0f} s vs {small.resumed.first_step_s:.0f} s")
    return broken


def ratios(runs: list[Measured]) -> dict[str, float]:
    """The largest corpus's measures over the smallest's: 1 where they do not grow with the corpus."""

    def measures(run: Measured) -> dict[str, float]:
        own = {"pairs": run.pairs, "driver_mb": run.driver_mb, "worker_mb": max(run.workers_mb),
               "first_step_s": run.first_step_s, "first_step_wall_s": run.first_step_wall_s}  # fmt: skip
        if again := run.resumed:
            own |= {"resumed_driver_mb": again.driver_mb, "resumed_worker_mb": max(again.workers_mb),
                    "resumed_first_step_s": again.first_step_s, "resumed_first_step_wall_s": again.first_step_wall_s,
                    "resumed_rows_read": again.rows_read}  # fmt: skip
        return own

    small, large = measures(runs[0]), measures(runs[-1])
    return {name: round(large[name] / small[name], 3) for name in small}


def measure(
    shards: list[int], shard_rows: int, s3_env: dict[str, str], data_dir: Path, work_dir: Path, at: float | None
) -> dict:
    """Every size in turn (smallest first), what the machine was doing meanwhile, and the bounds broken; ``at``:
    prepared, resumed at that fraction of the pass (None: the raw corpus, trained to its end)."""
    started, load_before = datetime.now(UTC), os.getloadavg()
    runs = [
        train_prepared(n, shard_rows, at, s3_env, data_dir, work_dir) if at is not None
        else train_on_corpus(n, shard_rows, s3_env, data_dir, work_dir)
        for n in sorted(shards)
    ]  # fmt: skip
    return {
        "started_utc": started.isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1024**3, 1),
        "load_average_before": load_before,  # the machine may be shared: its load stretches every time
        "load_average_after": os.getloadavg(),
        "source": "raw" if at is None else "prepared",
        "runs": [asdict(run) for run in runs],
        "ratios": ratios(runs) if len(runs) > 1 else {},
        "broken_bounds": broken_bounds(runs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, default=local_cluster.REPO.parent / "shared" / "data")
    parser.add_argument("--shards", type=int, nargs="+", default=[2, 16], help="corpus sizes, in shards")
    parser.add_argument("--shard-rows", type=int, default=SHARD_ROWS, help="pairs per shard (default: %(default)s)")
    parser.add_argument("--prepared", action="store_true", help="prepare the corpus, train on it and resume late")
    parser.add_argument("--at", type=float, default=0.9, help="--prepared: where in the first pass it resumes")
    parser.add_argument("--s3-endpoint", help="an S3 server holding the bucket 'sbert-ray' (default: start moto)")
    parser.add_argument("--work-dir", type=Path, help="where the runs go (default: a temporary folder, removed)")
    parser.add_argument("--output", type=Path, help="the JSON (default: printed only)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stream-memory-") as scratch:
        work_dir = args.work_dir or Path(scratch)
        s3 = None if args.s3_endpoint else local_cluster.start_s3(Path(scratch))
        endpoint = args.s3_endpoint or s3.endpoint
        try:
            s3_env = {"AWS_ENDPOINT_URL": endpoint, **local_cluster.S3_CREDENTIALS}
            at = args.at if args.prepared else None
            report = measure(args.shards, args.shard_rows, s3_env, args.data_dir, work_dir, at)
        finally:
            if s3 is not None:
                local_cluster.stop(s3.process)
    for run in report["runs"]:
        print(Measured(**run | {"resumed": run["resumed"] and Resumed(**run["resumed"])}))
    print(f"largest / smallest: {report['ratios']}")
    print("\n".join(f"bound broken: {b}" for b in report["broken_bounds"]) or "within every bound")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["broken_bounds"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
