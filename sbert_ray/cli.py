"""``sbert-ray`` command line: eval | train | tune | report."""

from __future__ import annotations

import argparse
import logging
import sys

from sbert_ray.config import ConfigError
from sbert_ray.data.records import DataError


def _eval(args: argparse.Namespace) -> int:
    from sbert_ray.data.readers import resolve_data_dir
    from sbert_ray.evaluation import suite
    from sbert_ray.evaluation.sts import format_table
    from sbert_ray.models.encoder import SentenceEncoder

    tasks = suite.parse_tasks(args.tasks)  # fail on a typo before loading anything
    data_dir = resolve_data_dir(args.data_dir)
    encoder = SentenceEncoder.load(args.model)
    if args.device:
        encoder.to(args.device)
    results = suite.run_tasks(
        encoder, tasks, data_dir, batch_size=args.batch_size, similarities=args.similarities.split(",")
    )
    print(f"model: {args.model}   data: {data_dir or 'Hugging Face Hub'}")
    sts_results = {k: v for k, v in results.items() if "spearman_cosine" in v}
    if sts_results:
        print(format_table(sts_results))
    if args.output:
        suite.write_json(results, args.output)
        print(f"wrote {args.output}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from sbert_ray.config import load_config
    from sbert_ray.training.driver import train

    config = load_config(args.config, args.overrides)  # every config error surfaces here, before Ray starts
    result = train(config)
    for name, before in result.before.items():
        after = result.metrics.get(f"final_{name}")
        after_text = f"{after:.2f}" if after is not None else "n/a"
        print(f"{name} test Spearman x100: before {before['spearman_cosine']:.2f} -> after {after_text}")
    finals = {k.removeprefix("final_"): v for k, v in result.metrics.items() if k.startswith("final_")}
    if finals:
        print("final model: " + ", ".join(f"{k} {v:.2f}" for k, v in finals.items()))
    print(f"model: {result.model_dir}")
    print(f"MLflow run {result.run_id} at {result.tracking_uri} (artifacts: {result.artifact_uri})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sbert-ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    ev = sub.add_parser("eval", help="evaluate a sentence encoder")
    ev.add_argument("--model", required=True, help="local folder or Hub id")
    ev.add_argument("--tasks", default="sts", help="comma-separated tasks (default: sts)")
    ev.add_argument("--data-dir", help="local data folder (default: $SBERT_RAY_DATA_DIR, else the Hub)")
    ev.add_argument("--output", help="write results as JSON here")
    ev.add_argument("--batch-size", type=int, default=64)
    ev.add_argument("--similarities", default="cosine", help="cosine,manhattan,euclidean,dot")
    ev.add_argument("--device", help="e.g. cuda")
    ev.set_defaults(func=_eval)

    tr = sub.add_parser("train", help="train on a Ray cluster (RAY_ADDRESS, else a local one)")
    tr.add_argument("config", help="YAML config, e.g. jobs/configs/quickstart.yaml")
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. stages.0.learning_rate=3e-5")
    tr.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError, FileNotFoundError) as err:  # bad input: one clear line, no traceback
        print(f"sbert-ray {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
