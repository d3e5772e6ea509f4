"""``sbert-ray report``: results beside the paper's Tables 1-7, as markdown and PNG plots, logged to MLflow."""

from __future__ import annotations

import argparse

from sbert_ray.cli.arguments import add_command, check_output, tracking_store


def add_arguments(subparsers) -> None:
    rp = add_command(
        subparsers, "report", help="our results beside the paper's Tables 1-7: markdown + PNG plots, MLflow"
    )
    rp.add_argument("results", nargs="*", help="results JSON of `sbert-ray eval --output`, as [LABEL=]PATH")
    rp.add_argument("--run", action="append", default=[], help="an MLflow run id with evaluation.json (repeatable)")
    rp.add_argument(
        "--note",
        action="append",
        default=[],
        metavar="LABEL=TEXT",
        help="a model difference to state for LABEL, e.g. 'minilm=all-MiniLM-L6-v2, 6 layers, 22M'",
    )
    rp.add_argument("--out", default="reports/reproduction", help="folder for report.md and the plots")
    rp.add_argument("--tracking-uri", help="MLflow (default: $MLFLOW_TRACKING_URI, else ~/sbert-ray/mlflow)")
    rp.add_argument("--experiment", default="sbert-ray-reports")
    rp.add_argument("--no-mlflow", action="store_true", help="write the files only")
    rp.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sbert_ray.evaluation import reproduction_report

    check_output(args, "--out", kind="folder")
    # Only when MLflow is used: resolving the default creates its folder.
    store = tracking_store(args) if args.run or not args.no_mlflow else None
    tracking_uri = store and store.uri
    result_sets = reproduction_report.gather_result_sets(args.results, args.run, tracking_uri, args.note)
    path = reproduction_report.build_report(result_sets, args.out)
    print(f"wrote {path}")
    if not args.no_mlflow:
        run_id = reproduction_report.log_report(path, result_sets, tracking_uri, args.experiment)
        print(f"MLflow run {run_id} at {store}")
    return 0
