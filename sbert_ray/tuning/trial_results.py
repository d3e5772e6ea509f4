"""What a finished sweep leaves behind: one row per trial, the results table (CSV, markdown) and the dev plot."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray.tune import ResultGrid

from sbert_ray.config import TrainConfig
from sbert_ray.tuning.space import METRIC, SearchSpace


@dataclass
class TrialRow:
    trial_id: str
    status: str  # finished | stopped (by the scheduler) | error
    sampled: dict[str, Any]  # search key -> what Tune sampled (a label for choice / grid keys)
    config: TrainConfig
    dev_score: float | None  # the last one reported (sbert_ray.evaluation.dev_score)
    global_step: int | None
    final: dict[str, float]  # final suite: dataset -> Spearman x100 (finished trials only)
    error: str = ""
    run_id: str = ""  # the trial's MLflow run

    @property
    def objective(self) -> str:
        stage = self.config.stages[-1]
        settings = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}" for k, v in stage.loss.items())
        return f"{stage.objective}({settings})" if settings else stage.objective

    @property
    def pooling(self) -> str:
        return self.config.model.pooling or "model default"


def trial_rows(grid: ResultGrid, space: SearchSpace) -> list[TrialRow]:
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        # params.json: what Tune sampled, also for a trial that failed before its first report (then no config)
        with result.filesystem.open_input_stream(f"{result.path}/params.json") as f:  # local or object storage
            sampled = json.loads(f.read())
        status = "error" if result.error else "finished" if metrics.get("finished") else "stopped"
        dev = metrics.get(METRIC)
        rows.append(
            TrialRow(
                trial_id=result.path.rstrip("/").rsplit("/", 1)[-1],  # the sweep names trial folders by trial id
                status=status,
                sampled=sampled,
                config=space.config(sampled),
                dev_score=None if dev is None or math.isnan(dev) else float(dev),
                global_step=metrics.get("global_step"),
                final={k.removeprefix("final_"): v for k, v in metrics.items() if k.startswith("final_")},
                error=str(result.error).strip().splitlines()[-1] if result.error else "",  # the root cause
            )
        )
    return sorted(rows, key=lambda r: r.trial_id)


def best_row(rows: list[TrialRow]) -> TrialRow | None:
    """Highest dev score; a finished trial beats one the scheduler stopped, which was never fully trained."""
    scored = [r for r in rows if r.status != "error" and r.dev_score is not None]
    return max(scored, key=lambda r: (r.status == "finished", r.dev_score), default=None)


def table(rows: list[TrialRow], space: SearchSpace) -> list[dict[str, Any]]:
    finals = sorted({name for r in rows for name in r.final})
    return [
        {
            "trial": r.trial_id,
            "status": r.status,
            **{p.key: r.sampled[p.key] for p in space.params},
            METRIC: _round(r.dev_score),
            "steps": r.global_step,
            **{f"final {name}": _round(r.final.get(name)) for name in finals},
            "mlflow_run": r.run_id,
            "error": r.error,
        }
        for r in rows
    ]


def write_csv(records: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def markdown(records: list[dict[str, Any]]) -> str:
    header = list(records[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for record in records:
        cells = ("" if record[k] is None else str(record[k]).replace("|", "\\|") for k in header)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_dev_vs_learning_rate(rows: list[TrialRow], path: Path, title: str, dev_metric: str) -> None:
    """The dev score (``dev_metric``) against the (last stage's) learning rate, one colour per pooling / objective pair;
    hollow markers are trials the scheduler stopped early."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = sorted({(r.pooling, r.objective) for r in rows})
    for colour, (pooling, objective) in zip(plt.cm.tab10.colors * 10, groups, strict=False):
        for status, face in (("finished", colour), ("stopped", "none")):
            points = [
                (r.config.stages[-1].learning_rate, r.dev_score)
                for r in rows
                if (r.pooling, r.objective) == (pooling, objective) and r.status == status and r.dev_score is not None
            ]
            if points:
                label = f"{pooling} / {objective}" + (" (stopped)" if status == "stopped" else "")
                ax.scatter(*zip(*points, strict=True), facecolors=face, edgecolors=colour, label=label, s=40)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel(f"dev {dev_metric}")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
