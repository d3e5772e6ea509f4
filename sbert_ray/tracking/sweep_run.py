"""MLflow for a sweep: the parent run, under which each trial's training run nests."""

from __future__ import annotations

from mlflow.entities import RunStatus

from sbert_ray.tracking.mlflow_run import NAME_TAG, RunTracker


class SweepTracker(RunTracker):
    """The sweep's run. Trials create their own runs (``train(parent_run_id=...)``); this one finds them again."""

    def child_runs(self) -> dict[str, tuple[str, str]]:
        """{training run key (<storage>/<name>): (run id, status)} of every run nested under this one."""
        experiment_id = self.call(self.client.get_run, self.run_id).info.experiment_id
        runs = self.call(
            self.client.search_runs,
            [experiment_id],
            filter_string=f"tags.`mlflow.parentRunId` = '{self.run_id}'",
            max_results=10_000,
        )
        return {run.data.tags.get(NAME_TAG, run.info.run_id): (run.info.run_id, run.info.status) for run in runs}

    def close_child(self, run_id: str, stopped: bool) -> None:
        """End a trial's run that its trial could not end: KILLED when the scheduler stopped it, else FAILED."""
        status = RunStatus.KILLED if stopped else RunStatus.FAILED
        self.call(self.client.set_terminated, run_id, status=RunStatus.to_string(status))
