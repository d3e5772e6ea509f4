"""``StepMeter``: how long a worker process took to start and how fast it trains, without syncing the step, and
how much of its training time report points took."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch


class StepMeter:
    """Seconds from ``started`` (the wall clock at ``fit()``; workers may run on other nodes) to this process's
    start, to its first stage's data and to the run's first optimizer step; and the steady pairs/s after this
    process's first step (start-up and first-call allocations left out), over the windows between loss reads,
    report points left out. Pairs are counted over all workers. The report points' own time (dev evaluation,
    checkpoint write and upload, and waiting there for the other ranks) is summed apart, as a share of this
    process's wall time from its first optimizer step to the end of its last report."""

    def __init__(self, started: float, device: torch.device):
        self.started, self.device = started, device
        self.time_to_worker_start = time.time() - started
        self.time_to_data: float | None = None
        self.time_to_first_step: float | None = None
        self.has_stepped = False  # whether this process has taken an optimizer step yet
        self.steady_pairs, self.steady_seconds = 0, 0.0
        self.report_seconds, self.first_step_at, self.last_report_end = 0.0, None, None  # perf_counter times
        self.last_report_s = 0.0  # how long the latest report point took
        self.restart()

    def data_ready(self) -> None:
        self.time_to_data = self.time_to_data or time.time() - self.started

    def restart(self) -> None:
        """A new window from now: training starts or resumes after something that is not training."""
        self.pairs, self.window_start = 0, time.perf_counter()

    def count(self, pairs: int) -> None:
        self.pairs += pairs

    def after_step(self, global_step: int) -> float | None:
        """Call after every optimizer step; returns the seconds to this process's first step at that step (a run
        that starts from scratch: its first step, kept as ``time_to_first_step``; a resumed one: its first step
        after the resume), None at every later step. Steady throughput counts from this process's first step on."""
        if self.has_stepped:
            return None
        self.has_stepped = True
        self.first_step_at = time.perf_counter()
        synchronize(self.device)
        seconds = time.time() - self.started
        if global_step == 1:
            self.time_to_first_step = seconds
        self.restart()
        return seconds

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Times a report point (``last_report_s``, added to the report time); training resumes in a new window
        after it."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.last_report_end = time.perf_counter()
            self.last_report_s = self.last_report_end - start
            self.report_seconds += self.last_report_s
            self.restart()

    def close_window(self) -> float:
        """Pairs/s of the window ending now (added to the steady totals); starts the next window."""
        elapsed = time.perf_counter() - self.window_start
        self.steady_pairs += self.pairs
        self.steady_seconds += elapsed
        rate = self.pairs / elapsed
        self.restart()
        return rate

    def summary(self) -> dict:
        return {
            "time_to_worker_start_s": self.time_to_worker_start,
            "time_to_data_s": self.time_to_data,
            "time_to_first_step_s": self.time_to_first_step,
            "pairs_per_s": self.steady_pairs / self.steady_seconds if self.steady_seconds else None,
            "report_s": self.report_seconds,
            "report_share": self.report_share(),
        }

    def report_share(self) -> float | None:
        """Report time over the wall time from this process's first step to its last report's end."""
        if self.first_step_at is None or self.last_report_end is None:
            return None
        return self.report_seconds / (self.last_report_end - self.first_step_at)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
