"""MLflow: where runs go, the run lifecycle on the driver, and rank-0 logging from inside Train workers.

Only this package imports MLflow. The driver owns the run (create or resume, params, tags, final status);
rank 0 of the training workers logs metrics and artifacts to that run by id through an ``MlflowClient``.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from sbert_ray.atomic_files import atomic_write
from sbert_ray.tracking.errors import TrackingError
from sbert_ray.tracking.store import TrackingStore, mlflow_call, open_store

logger = logging.getLogger(__name__)

DEFAULT_HOME = Path("~/sbert-ray/mlflow").expanduser()
NAME_TAG = "sbert_ray.name"
MAX_PARAM_LENGTH = 6000  # MLflow rejects longer param values
MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch
METRICS_TIMEOUT_S = 5.0  # one metrics request of a training worker: short enough never to stall training
CALL_TIMEOUT_S = 60.0  # one request of the driver's (artifact uploads included)
RETRY_AFTER_S = 10.0  # a worker that found the store away keeps its metrics in the spool this long, then tries again
# A worker's metrics requests at most this often: a basic-auth server hashes the password on every request (werkzeug's
# scrypt, 0.33 CPU-s a request on the 2-core VM, 2026-12-06), and a fast run reads its loss several times a second.
SEND_EVERY_S = 1.0
# How long a report point or the end of training waits for the metrics thread to hand on what it was given: a few
# requests of METRICS_TIMEOUT_S (the thread sends everything queued in one go).
DRAIN_TIMEOUT_S = 6 * METRICS_TIMEOUT_S

T = TypeVar("T")


def resolve_tracking_uri(configured: str | None) -> str:
    """The config's URI, else $MLFLOW_TRACKING_URI, else a sqlite database at a stable path in the home folder
    (never inside a Ray job's temporary working directory, which is deleted after the job)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_HOME / 'mlflow.db'}"
    if uri.startswith("sqlite:///"):
        # Absolute: Ray Train workers and Tune trials run in other working directories.
        database = Path(uri.removeprefix("sqlite:///")).expanduser().resolve()
        database.parent.mkdir(parents=True, exist_ok=True)  # sqlite creates the database file, not its folder
        uri = f"sqlite:///{database}"
    return uri


def create_sqlite_store(uri: str) -> None:
    """For a sqlite store: create its tables once, one process at a time (two processes creating a fresh store at
    once, two runs on a new machine, crash in MLflow's migrations). A file beside the database says it is created."""
    if not uri.startswith("sqlite:///"):
        return
    database = Path(uri.removeprefix("sqlite:///"))
    created = database.with_name(database.name + ".created")
    if created.exists():
        return
    with database.with_name(database.name + ".lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while another process creates it; released when the file closes
        if not created.exists():
            mlflow_call(uri, lambda: MlflowClient(uri).search_experiments(max_results=1), timeout_s=CALL_TIMEOUT_S)
            created.touch()


def tracking_store(configured: str | None) -> TrackingStore:
    """The store a command logs to (``resolve_tracking_uri``), checked reachable before the command's work, and
    printed masked."""
    return open_store(resolve_tracking_uri(configured))


def ensure_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    """Experiment id for ``name``; a new experiment on a sqlite store keeps its artifacts beside the database."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    artifact_location = None
    if tracking_uri.startswith("sqlite:///"):
        db_path = Path(tracking_uri.removeprefix("sqlite:///"))
        artifact_location = (db_path.parent / "artifacts").resolve().as_uri()
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id  # another process created it a moment ago


def environment_tags() -> dict[str, str]:
    tags = {f"{package}_version": version(package) for package in ("ray", "torch", "transformers")}
    tags["git_commit"] = git_commit()
    job_id = ray_job_submission_id()
    if job_id:
        tags["ray_job_id"] = job_id
    return tags


def ray_job_submission_id() -> str | None:
    """The id `ray job submit` gave this job: Ray's job supervisor passes it to the entrypoint in the job
    config's metadata (RAY_JOB_CONFIG_JSON_ENV_VAR)."""
    job_config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
    return job_config.get("metadata", {}).get("job_submission_id")


def git_commit() -> str:
    """$SBERT_RAY_GIT_COMMIT, else the commit of the working directory or of the installed package's checkout."""
    if os.environ.get("SBERT_RAY_GIT_COMMIT"):
        return os.environ["SBERT_RAY_GIT_COMMIT"]
    for where in (Path.cwd(), Path(__file__).resolve().parent):
        out = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.strip()
    return "unknown"


class RunLogger:
    """Logs to one existing run by id; what rank 0 of the Train workers uses.

    With a ``spool`` file, metrics go through it, off the caller's thread: ``log_metrics`` only queues them for a
    daemon thread, which appends them to the file and sends what waits there. A batch the store does not take
    (down, slow, refusing) stays in the file, and ``RETRY_AFTER_S`` later the thread sends everything waiting there,
    in order, with the original timestamps. Tracking never fails training. ``drain`` waits (bounded) until the
    thread has handled everything queued (report points, the end of training: then the metrics are in the store
    or the file); ``flush`` with a ``wait_s`` (the driver, after training) is where a store that stays away is
    reported. Every other call waits out an outage for up to ``wait_s`` and raises ``TrackingError`` after that."""

    def __init__(self, tracking_uri: str, run_id: str, spool: str | Path | None = None, wait_s: float = 0.0):
        self.tracking_uri = tracking_uri
        self.store = TrackingStore(tracking_uri)  # how log lines show it: masked
        self.run_id = run_id
        self.spool = Path(spool).expanduser() if spool else None
        self.wait_s = wait_s
        self._retry_at = 0.0  # while the store is away: when to try it again
        self._queued: queue.SimpleQueue | None = None  # metric batches (and drain markers) for the thread
        self._spool_lock = threading.Lock()  # the spool file and _retry_at: the thread's, or a caller's flush

    @functools.cached_property
    def client(self) -> MlflowClient:
        """Made on first use: opening a sqlite store takes ~0.6 s, which a training worker spends after its first
        optimizer step, when it has something to log, rather than before."""
        create_sqlite_store(self.tracking_uri)
        return MlflowClient(self.tracking_uri)

    def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``function(*args, **kwargs)``, an MLflow call, waiting out an outage for up to ``wait_s``."""
        return mlflow_call(self.tracking_uri, function, *args, timeout_s=CALL_TIMEOUT_S, wait_s=self.wait_s, **kwargs)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if self.spool is None:
            self.call(self.client.log_batch, self.run_id, metrics=batch)
            return
        if self._queued is None:
            self._queued = queue.SimpleQueue()
            threading.Thread(target=self._send_queued, name="mlflow-metrics", daemon=True).start()
        self._queued.put(batch)

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Wait up to ``timeout_s`` until the metrics thread has spooled (and tried to send) every batch queued
        before this call; warns when it has not."""
        if self._queued is None:
            return
        handled = threading.Event()
        self._queued.put(handled)  # the thread sets it after every batch queued before it
        if not handled.wait(timeout_s):
            logger.warning(
                "MLflow at %s: metrics still queued after %.0f s; they are sent in the background and are lost if "
                "this process ends first",
                self.store,
                timeout_s,
            )

    def _send_queued(self) -> None:
        """The metrics thread: each batch appended to the spool file as it comes; what waits there sent at most every
        ``SEND_EVERY_S`` (and ``RETRY_AFTER_S`` after the store was found away), or at once for a drain marker,
        which is set once the batches before it are handled."""
        next_send = 0.0  # time.monotonic() from which what waits in the spool may be sent
        while True:
            # Wait for metrics or a marker; while some wait in the spool, only until they may be sent.
            due = max(next_send, self._retry_at) - time.monotonic() if self.spool.exists() else None
            try:
                items = [self._queued.get(timeout=None if due is None else max(due, 0.0))]
            except queue.Empty:
                items = []
            while not self._queued.empty():
                items.append(self._queued.get())
            batches = [item for item in items if not isinstance(item, threading.Event)]
            markers = [item for item in items if isinstance(item, threading.Event)]
            try:
                with self._spool_lock:
                    if batches:
                        self.spool.parent.mkdir(parents=True, exist_ok=True)
                        with self.spool.open("a") as f:
                            f.write("".join(_spool_lines(batch) for batch in batches))
                    now = time.monotonic()
                    if now >= self._retry_at and (markers or now >= next_send):
                        self._send_spool(wait_s=0.0)
                        next_send = now + SEND_EVERY_S
            except Exception:  # tracking never fails training; the spool file keeps what reached it
                logger.exception("logging metrics to MLflow at %s failed", self.store)
            for marker in markers:
                marker.set()

    def flush(self, wait_s: float = 0.0) -> None:
        """Send the metrics waiting in the spool file (after the queued ones are in it). With ``wait_s``, wait that
        long for a store that does not answer and raise ``TrackingError`` if it never takes them; without, keep
        them for a later call."""
        self.drain()
        with self._spool_lock:
            self._send_spool(wait_s)

    def _send_spool(self, wait_s: float) -> None:
        pending = _read_spool(self.spool) if self.spool else []
        while pending:
            try:
                mlflow_call(
                    self.tracking_uri,
                    self.client.log_batch,
                    self.run_id,
                    metrics=pending[:MAX_METRICS_PER_BATCH],
                    timeout_s=METRICS_TIMEOUT_S,
                    wait_s=wait_s,
                )
            except TrackingError as err:
                if wait_s:
                    raise TrackingError(f"{err} ({len(pending)} metrics wait in {self.spool})") from None
                if not self._retry_at:
                    logger.warning("%s; metrics wait in %s until it answers again", err, self.spool)
                self._retry_at = time.monotonic() + RETRY_AFTER_S
                return
            pending = pending[MAX_METRICS_PER_BATCH:]
            _write_spool(self.spool, pending)
        if self._retry_at:
            logger.warning("MLflow at %s answers again; the waiting metrics are logged", self.store)
            self._retry_at = 0.0

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self.call(self.client.log_artifacts, self.run_id, str(local_dir), artifact_path)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self.call(self.client.log_dict, self.run_id, data, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.call(self.client.log_text, self.run_id, text, artifact_file)

    def log_figure(self, figure, artifact_file: str) -> None:
        self.call(self.client.log_figure, self.run_id, figure, artifact_file)

    def close_if_running(self, status: str) -> None:
        """End the run with ``status`` if it is still RUNNING (a crashed run that is being replaced)."""
        if self.call(self.client.get_run, self.run_id).info.status == "RUNNING":
            self.call(self.client.set_terminated, self.run_id, status=status)


def _read_spool(path: Path) -> list[Metric]:
    if not path.exists():
        return []
    metrics = []
    for line in path.read_text().splitlines():
        try:
            metrics.append(Metric(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):  # the last line of a worker killed while writing it
            logger.warning("skipping a partly written line of %s: %r", path, line)
    return metrics


def _write_spool(path: Path, metrics: list[Metric]) -> None:
    """What is still to be sent, written to a temporary file and renamed (a crash leaves the old or the new list)."""
    if not metrics:
        path.unlink(missing_ok=True)
        return
    with atomic_write(path) as partial:
        Path(partial).write_text(_spool_lines(metrics))


def _spool_lines(metrics: list[Metric]) -> str:
    return "".join(
        json.dumps({"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}) + "\n" for m in metrics
    )


class RunTracker(RunLogger):
    """The driver's run: created, or with ``run_id`` (a resumed training run) or ``resume_key`` (an unfinished run
    tagged with that key, a resumed sweep) continued; as a context manager it ends the run FINISHED, FAILED or
    KILLED by how the block ends."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        resume_key: str | None = None,
        parent_run_id: str | None = None,
        run_id: str | None = None,
        wait_s: float = 0.0,
    ):
        super().__init__(tracking_uri, run_id or "", wait_s=wait_s)
        experiment_id = self.call(ensure_experiment, self.client, experiment, tracking_uri)
        if run_id is None and resume_key:
            run_id = self.call(_unfinished_run, self.client, experiment_id, resume_key)
        self.resumed = run_id is not None
        if run_id is None:
            tags = {"mlflow.runName": run_name}
            if resume_key:
                tags[NAME_TAG] = resume_key
            if parent_run_id:
                tags["mlflow.parentRunId"] = parent_run_id  # shows the run nested under its parent
            run_id = self.call(self.client.create_run, experiment_id, tags=tags, run_name=run_name).info.run_id
        else:
            self.call(self.client.update_run, run_id, status="RUNNING")
        self.run_id = run_id

    @property
    def artifact_uri(self) -> str:
        return self.call(self.client.get_run, self.run_id).info.artifact_uri

    @property
    def artifact_store(self) -> TrackingStore:
        """Where the run's artifacts go, masked when shown (an artifact URI may carry credentials too)."""
        return TrackingStore(self.artifact_uri)

    def log_params(self, params: dict[str, Any]) -> None:
        existing = self.call(self.client.get_run, self.run_id).data.params  # a resumed run keeps its params
        items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in params.items() if k not in existing]
        for start in range(0, len(items), 100):  # MLflow's batch limit for params
            self.call(self.client.log_batch, self.run_id, params=items[start : start + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.call(self.client.log_batch, self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def metric_history(self, key: str) -> list[Metric]:
        return self.call(self.client.get_metric_history, self.run_id, key)

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        """FINISHED when the block completes (after every waiting metric is logged), FAILED on an error, KILLED
        when interrupted (Ctrl-C, a stopped trial). After an error, a store that does not answer leaves the run
        as it is (a resumed training run is closed when it ends), rather than hiding the error."""
        if exc_type is None:
            self.flush(wait_s=self.wait_s)
            self.call(self.client.set_terminated, self.run_id, status=RunStatus.to_string(RunStatus.FINISHED))
            return
        status = RunStatus.FAILED if issubclass(exc_type, Exception) else RunStatus.KILLED
        try:
            self.flush()
            mlflow_call(
                self.tracking_uri,
                self.client.set_terminated,
                self.run_id,
                status=RunStatus.to_string(status),
                timeout_s=METRICS_TIMEOUT_S,
            )
        except TrackingError as err:
            logger.warning("MLflow run %s could not be marked %s: %s", self.run_id, RunStatus.to_string(status), err)


def _unfinished_run(client: MlflowClient, experiment_id: str, resume_key: str) -> str | None:
    """An unfinished run with the same key (a sweep's, by its folder) is continued, not duplicated."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{NAME_TAG}` = '{resume_key}' and attributes.status != 'FINISHED'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def plot_curves(tracker: RunTracker, keys: dict[str, str]) -> None:
    """One PNG per metric (e.g. training loss, dev Spearman) from the run's logged history."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for key, artifact_file in keys.items():
        history = sorted(tracker.metric_history(key), key=lambda m: (m.step, m.timestamp))
        if not history:
            continue
        by_step = {m.step: m.value for m in history}  # a resumed run re-logs some steps; keep the last value
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(list(by_step), list(by_step.values()), marker="." if len(by_step) < 50 else None)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        tracker.log_figure(fig, artifact_file)
        plt.close(fig)
