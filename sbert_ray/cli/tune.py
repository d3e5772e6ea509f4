"""``sbert-ray tune``: a hyperparameter sweep, Tune trials of Ray Train runs tracked in MLflow."""

from __future__ import annotations

import argparse
import sys

from sbert_ray.cli.arguments import add_command


def add_arguments(subparsers) -> None:
    tu = add_command(subparsers, "tune", help="hyperparameter sweep: Tune trials of Ray Train runs, tracked in MLflow")
    tu.add_argument("config", help="sweep YAML, e.g. jobs/configs/sweep-offline.yaml")
    tu.add_argument("overrides", nargs="*", help="key=value overrides, e.g. num_samples=4 base.stages.0.limit=500")
    tu.add_argument("--resume", action="store_true", help="continue an interrupted sweep; finished trials stay")
    tu.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sbert_ray.config import load_config
    from sbert_ray.runs.sweep import SweepInterrupted, run_sweep
    from sbert_ray.tuning import SweepConfig

    sweep = load_config(args.config, args.overrides, cls=SweepConfig)  # every key of the search space is checked here
    try:
        result = run_sweep(sweep, resume=args.resume)
    except SweepInterrupted as interrupted:  # the sweep's MLflow run ended KILLED; nothing looks complete
        print(f"sbert-ray tune: {interrupted}", file=sys.stderr)
        return 130  # a shell's code for Ctrl-C
    if result.best is not None:
        print(f"best trial {result.best.trial_id}: dev {result.dev_metric} {result.best.dev_score:.4g}")
    if result.retrained is not None:
        scores = result.retrained.headlines.items()
        print("retrained best, Spearman x100: " + ", ".join(f"{entry} {value:.2f}" for entry, (_, value) in scores))
    print(f"sweep: {result.path} (results table, plot, best config: {result.summary})")
    print(f"MLflow sweep run {result.run_id} at {result.tracking_uri}")  # masked
    return 0
