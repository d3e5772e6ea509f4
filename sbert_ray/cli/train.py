"""``sbert-ray train``: train on a Ray cluster from a YAML config and key=value overrides."""

from __future__ import annotations

import argparse
import sys

from sbert_ray.cli.arguments import add_command
from sbert_ray.config import load_config


def add_arguments(subparsers) -> None:
    tr = add_command(subparsers, "train", help="train on a Ray cluster (RAY_ADDRESS, else a local one)")
    tr.add_argument("config", help="YAML config, e.g. jobs/configs/quickstart.yaml")
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. stages.0.learning_rate=3e-5")
    tr.add_argument(
        "--restart",
        action="store_true",
        help="train anew although a run of this name exists (finished, or with another config); its folder is kept "
        "as <name>.replaced-<time>",
    )
    tr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)  # every config error surfaces here, before Ray starts
    # The run layer (torch, transformers, Ray, MLflow: seconds to import) only for a valid config.
    from sbert_ray.runs.train_run import run_training
    from sbert_ray.training.faults import DeterministicError
    from sbert_ray.training.trainer import TrainingDiverged

    try:
        result = run_training(config, restart=args.restart)
    except TrainingDiverged as err:  # a result, not a crash: one clear line, no traceback
        print(f"sbert-ray train: {err}", file=sys.stderr)
        return 1
    except DeterministicError as err:  # found on a worker; bad input exits as bad input found before training does
        print(f"sbert-ray train: error: {err}", file=sys.stderr)
        return 2 if err.bad_input else 1
    final = result.headlines
    if result.already_finished:
        print(f"run {config.name!r} already finished with this config: nothing to train (--restart trains it anew)")
    for entry, (metric, before) in result.before_headlines.items():
        after = _score(final[entry][1]) if entry in final else "not scored"
        print(f"{entry} test {metric}: before {_score(before)} -> after {after}")
    if final:
        print("final model: " + ", ".join(f"{entry} {_score(value)}" for entry, (_, value) in final.items()))
    print(f"model: {result.model_dir}")
    print(f"MLflow run {result.run_id} at {result.tracking_uri} (artifacts: {result.artifact_uri})")  # both masked
    return 0


def _score(value: float | None) -> str:
    """A headline score; undefined ones are NaN, or null in a finished run's record."""
    return "undefined" if value is None or value != value else f"{value:.2f}"
