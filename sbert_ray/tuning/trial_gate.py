"""A sweep trial's reports pass through Tune one at a time, and a trial Tune stops ends its Train run at once.

Each trial fits its own ``TorchTrainer`` (Ray Train v2): its workers run under a Train controller actor, apart from
Tune. Ray's ``TuneReportCallback`` hands the controller's reports to Tune through a queue and never waits for Tune's
answer, so a trial ASHA stops at step 4 trains on while Tune takes the report in: under load it logged dev scores
at steps 8 and 12 and trained to its end. And Tune stops a trial by stopping its actor only; the controller, its
workers and their placement group end only when that actor's process does, whenever that is.

Here rank 0 hands each report to a ``ReportGate`` actor and waits for Tune's verdict before it trains on:
``forward_reports`` (a thread of the trial) passes the report to ``tune.report``, which returns when Tune lets the
trial continue and raises ``SystemExit`` when Tune stops it. Then (or when Tune stops the trial between reports,
on the sweep's Ctrl-C) the thread aborts the trial's Train controller, as Ray Train's own Ctrl-C handler does: the
workers end and their placement group is removed, within seconds, and no later dev score is logged (off the
training ranks: none past the stopped report's own checkpoint, whose scoring may still finish).

run_trial (Tune's trial thread)        with TrialGate(): run_training(..., report_gate=gate.actor)
  forward_reports (thread)             gate.next_report -> tune.report -> gate.go_on | abort the controller
  Train controller                     ControllerToGate.after_report: gate.controller_took(itself, step)
    rank 0 (RayReporter.report)        ray.train.report(metrics); gate.ask(metrics) waits for the verdict
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import ray
from ray import tune
from ray.train import UserCallback

from sbert_ray.ray_compat import abort_train_controller, tune_stopping_trial
from sbert_ray.tuning.dev_lag import LaggedDevScores, scored_now

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the forwarding thread looks for a stop between reports
CONTROLLER_WAIT_S = 60.0  # for the controller to take the stopped report (its checkpoint's upload)


@ray.remote(num_cpus=0)
class ReportGate:
    """Rank 0's reports, one at a time, to the trial's thread, and Tune's "go on" back. With dev scores off the
    training ranks (``lagged``) each report goes with the previous one's score (``tuning.dev_lag``), which the
    scorer hands in (``dev_scored``). Owned by the trial's actor: it ends with the trial."""

    def __init__(self, lagged: bool, score_wait_s: float) -> None:
        self._lag, self._scored = LaggedDevScores() if lagged else None, asyncio.Event()
        self._score_wait_s = score_wait_s
        self._reports: asyncio.Queue = asyncio.Queue(maxsize=1)
        self._go_on = asyncio.Event()
        self._controller, self._step, self._reported = None, -1, asyncio.Event()

    async def ask(self, metrics: dict) -> None:
        """Rank 0: returns when Tune lets the trial go on after this report; never when it stopped the trial."""
        self._go_on.clear()
        await self._reports.put(metrics)
        await self._go_on.wait()

    async def next_report(self, timeout_s: float) -> dict | None:
        """The next report as Tune gets it (None: none within ``timeout_s``)."""
        try:
            metrics = await asyncio.wait_for(self._reports.get(), timeout_s)
        except TimeoutError:
            return None
        if self._lag is None:
            return scored_now(metrics)
        try:  # the previous report's score is late: wait, so the lag stays one report
            await asyncio.wait_for(self._previous_scored(), self._score_wait_s)
        except TimeoutError:  # a scorer that died says nothing: this report goes without (ASHA skips it)
            log.warning(
                "no dev score of the report before step %d within %g s", metrics["global_step"], self._score_wait_s
            )
        return self._lag.for_tune(metrics)

    async def _previous_scored(self) -> None:
        while not self._lag.ready():
            self._scored.clear()
            await self._scored.wait()

    def dev_scored(self, step: int, score: float | None) -> None:
        """The off-rank scorer: the dev score of ``step``'s checkpoint (None: its scoring failed)."""
        self._lag.scored(step, score)
        self._scored.set()

    def go_on(self) -> None:
        self._go_on.set()

    def controller_took(self, controller: Any, step: int) -> None:
        """The Train controller took rank 0's report of ``step`` (its checkpoint stored and registered)."""
        self._controller, self._step = controller, step
        self._reported.set()

    async def controller(self, step: int, timeout_s: float) -> Any:
        """The Train controller's handle once it took the report of ``step`` (within ``timeout_s``: else the handle
        as far as known, or None)."""
        try:
            await asyncio.wait_for(self._until(step), timeout_s)
        except TimeoutError:
            pass
        return self._controller

    async def _until(self, step: int) -> None:
        while self._step < step:
            self._reported.clear()
            await self._reported.wait()


class ControllerToGate(UserCallback):
    """Runs in the Train controller: tells the gate each report it took, with its own handle, so that the trial
    aborts it only once the stopped report's checkpoint is stored (an abort would end its upload)."""

    def __init__(self, gate: ray.actor.ActorHandle) -> None:
        self.gate = gate

    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        controller = ray.get_runtime_context().current_actor
        self.gate.controller_took.remote(controller, metrics[0]["global_step"])


class TrialGate:
    """In a Tune trial, around its ``run_training``: the gate rank 0 waits on (``actor``), the controller callback
    that makes the controller abortable (``callback``), and the thread that forwards reports to Tune. ``stopped``:
    Tune stopped the trial and its Train run was aborted (``run_training`` then fails: no result to report).
    ``lagged_dev``: the trial's dev scores come off the training ranks, a report late (``tuning.dev_lag``); a report
    waits up to ``score_wait_s`` for the previous one's score (the trial's ``scaling.resource_wait_s``: the scorer
    itself gives up after waiting that long for its resources), then goes without it."""

    def __init__(self, lagged_dev: bool, score_wait_s: float) -> None:
        self.actor = ReportGate.remote(lagged_dev, score_wait_s)
        self.callback = ControllerToGate(self.actor)
        self.stopped = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._forward_reports, name="trial-gate", daemon=True)

    def __enter__(self) -> TrialGate:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _forward_reports(self) -> None:
        while not self._done.is_set():
            if tune_stopping_trial():  # stopped between reports (the sweep's Ctrl-C)
                return self._abort(step=-1)
            metrics = ray.get(self.actor.next_report.remote(POLL_S))
            if metrics is None:
                continue
            try:
                tune.report(metrics)  # returns when Tune lets the trial go on
            except SystemExit:  # Tune stopped the trial at this report (ASHA, a stop criterion)
                return self._abort(metrics["global_step"])
            self.actor.go_on.remote()

    def _abort(self, step: int) -> None:
        """End the trial's Train run once the controller took the report of ``step`` (its checkpoint stored): the
        controller aborts the workers and removes their placement group."""
        self.stopped = True
        controller = ray.get(self.actor.controller.remote(step, CONTROLLER_WAIT_S))
        if controller is None:  # no report yet: the controller dies with the trial's actor
            return
        abort_train_controller(controller)
        log.info("Tune stopped this trial: its Train run was aborted")
