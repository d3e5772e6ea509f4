"""Progress of long runs as they happen: a line per training report point (printed by Ray Train's controller,
whose output Ray forwards to the driver's terminal and to the job log), and a bar of a sweep's trials."""

from __future__ import annotations

import time
from typing import Any

import ray.train
from ray.tune import Callback

from sbert_ray.progress import progress_bar


def duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


class TrainingProgress(ray.train.UserCallback):
    """``stage 1/1  step 120/360  loss 0.0213  dev 84.91  31.2 pairs/s  elapsed 1m05s  ETA 2m10s`` at every report
    (each dev evaluation and the end of each stage). ``stage_steps``: the optimizer steps of each stage."""

    def __init__(self, stage_steps: list[int]) -> None:
        self.stage_steps = stage_steps
        self.first: tuple[float, int] | None = None  # (time, global step) of the first report seen

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        print(self.line(metrics[0], time.time()), flush=True)

    def line(self, report: dict[str, Any], now: float) -> str:
        stage, step, done = report["stage"], report["step"], report["global_step"]
        total = sum(self.stage_steps)
        parts = [f"stage {stage + 1}/{len(self.stage_steps)}", f"step {step}/{self.stage_steps[stage]}"]
        if "train_loss" in report:
            parts.append(f"loss {report['train_loss']:.4f}")
        if "dev_score" in report:
            parts.append(f"dev {report['dev_score']:.4g}")
        if "pairs_per_s" in report:
            parts.append(f"{report['pairs_per_s']:.1f} pairs/s")
        if self.first is None:  # the rate needs two reports: a resumed run starts counting where it resumed
            self.first = (now, done)
        else:
            elapsed, steps = now - self.first[0], done - self.first[1]
            parts.append(f"elapsed {duration(elapsed)}")
            if steps > 0:
                parts.append(f"ETA {duration(elapsed / steps * (total - done))}")
        return "  ".join(parts)


class SweepProgress(Callback):
    """A bar of finished trials, with how many run and wait: ``trials 3/8 [running 2, pending 3]``."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.bar = None

    def on_step_begin(self, iteration: int, trials: list, **info) -> None:
        if self.bar is None:
            self.bar = progress_bar(total=self.total, desc="trials", unit="trial")
        status = [trial.status for trial in trials]
        ended = sum(s in ("TERMINATED", "ERROR") for s in status)
        self.bar.update(ended - self.bar.n)
        self.bar.set_postfix(running=status.count("RUNNING"), pending=status.count("PENDING"), refresh=False)

    def on_experiment_end(self, trials: list, **info) -> None:
        if self.bar is not None:
            self.bar.close()
