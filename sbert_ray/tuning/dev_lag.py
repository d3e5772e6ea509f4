"""What a sweep trial's reports tell Tune about the dev score, and when (Ray-free: the trial's gate runs it).

Inline (``evaluation.async_dev`` false) each report carries its own checkpoint's dev score. Off the training ranks
(true) that score arrives while the trial trains on, so each report carries the score of the trial's previous
report instead: a lag of one report, the same every run (the gate waits for that score if it is late, which a
scorer as fast as one report interval never makes it do; one that never comes is given up after the trial's
``scaling.resource_wait_s``, and that report goes without). The first report has none yet (NaN: Tune wants the
metric in every result). ``DEV_STEP`` names the step of the checkpoint a score belongs to and is ASHA's time: a
rung then compares trials on their scores at the same steps as inline, and stops the same trials, one report later.
"""

from __future__ import annotations

import math

from sbert_ray.evaluation.dev_score import DEV_SCORE

DEV_STEP = "dev_step"  # the global step of the checkpoint whose dev score a report to Tune carries


def scored_now(metrics: dict) -> dict:
    """An inline report to Tune: its dev score is its own step's."""
    return {**metrics, DEV_STEP: metrics["global_step"]}


class LaggedDevScores:
    """Off-rank dev scores as they arrive (``scored``), each handed to Tune with the report after its own."""

    def __init__(self) -> None:
        self._scores: dict[int, float | None] = {}  # step -> score; None: its scoring failed
        self._previous: int | None = None  # the step of the last report handed to Tune

    def scored(self, step: int, score: float | None) -> None:
        self._scores[step] = score

    def ready(self) -> bool:
        """Whether the next report can go to Tune: the previous report's score (or its failure) has arrived."""
        return self._previous is None or self._previous in self._scores

    def for_tune(self, metrics: dict) -> dict:
        """Rank 0's report (no dev score of its own) with the previous report's score and step."""
        previous, self._previous = self._previous, metrics["global_step"]
        score = self._scores.pop(previous, None)
        if score is None:  # the first report, or a score that failed: ASHA skips a result without its time
            return {**metrics, DEV_SCORE: math.nan}
        return {**metrics, DEV_SCORE: score, DEV_STEP: previous}
