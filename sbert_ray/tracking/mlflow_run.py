"""MLflow: where runs go, the run lifecycle on the driver, and rank-0 logging from inside Train workers.

Only this package imports MLflow. The driver owns the run (create or resume, params, tags, final status);
rank 0 of the training workers logs metrics and artifacts to that run by id through an ``MlflowClient``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient

DEFAULT_HOME = Path("~/sbert-ray/mlflow").expanduser()
NAME_TAG = "sbert_ray.name"
MAX_PARAM_LENGTH = 6000  # MLflow rejects longer param values


def resolve_tracking_uri(configured: str | None) -> str:
    """The config's URI, else $MLFLOW_TRACKING_URI, else a sqlite database at a stable path in the home folder
    (never inside a Ray job's temporary working directory, which is deleted after the job)."""
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{DEFAULT_HOME / 'mlflow.db'}"
    if uri.startswith("sqlite:///"):  # sqlite creates the database file, not its folder
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return uri


def ensure_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    """Experiment id for ``name``; a new experiment on a sqlite store keeps its artifacts beside the database."""
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    artifact_location = None
    if tracking_uri.startswith("sqlite:///"):
        db_path = Path(tracking_uri.removeprefix("sqlite:///"))
        artifact_location = (db_path.parent / "artifacts").resolve().as_uri()
    return client.create_experiment(name, artifact_location=artifact_location)


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
    """Logs to one existing run by id; what rank 0 of the Train workers uses."""

    def __init__(self, tracking_uri: str, run_id: str):
        self.tracking_uri = tracking_uri
        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_figure(self, figure, artifact_file: str) -> None:
        self.client.log_figure(self.run_id, figure, artifact_file)


class RunTracker(RunLogger):
    """The driver's run: created (or an unfinished one with the same key resumed); as a context manager it ends
    the run FINISHED, FAILED or KILLED by how the block ends."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        resume_key: str | None = None,
        parent_run_id: str | None = None,
    ):
        client = MlflowClient(tracking_uri)
        experiment_id = ensure_experiment(client, experiment, tracking_uri)
        run_id = _unfinished_run(client, experiment_id, resume_key) if resume_key else None
        self.resumed = run_id is not None
        if run_id is None:
            tags = {"mlflow.runName": run_name}
            if resume_key:
                tags[NAME_TAG] = resume_key
            if parent_run_id:
                tags["mlflow.parentRunId"] = parent_run_id  # shows the run nested under its parent
            run_id = client.create_run(experiment_id, tags=tags, run_name=run_name).info.run_id
        else:
            client.update_run(run_id, status="RUNNING")
        super().__init__(tracking_uri, run_id)

    @property
    def artifact_uri(self) -> str:
        return self.client.get_run(self.run_id).info.artifact_uri

    def log_params(self, params: dict[str, Any]) -> None:
        existing = self.client.get_run(self.run_id).data.params  # a resumed run keeps its params
        items = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in params.items() if k not in existing]
        for start in range(0, len(items), 100):  # MLflow's batch limit for params
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def metric_history(self, key: str) -> list[Metric]:
        return self.client.get_metric_history(self.run_id, key)

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        """FINISHED when the block completes, FAILED on an error, KILLED when interrupted (Ctrl-C, a stopped trial)."""
        if exc_type is None:
            status = RunStatus.FINISHED
        else:
            status = RunStatus.FAILED if issubclass(exc_type, Exception) else RunStatus.KILLED
        self.client.set_terminated(self.run_id, status=RunStatus.to_string(status))


def _unfinished_run(client: MlflowClient, experiment_id: str, resume_key: str) -> str | None:
    """An unfinished run with the same key (same training run name and storage) is continued, not duplicated."""
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
