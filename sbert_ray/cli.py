"""``sbert-ray`` command line: eval | encode | train | tune | report."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from sbert_ray.config import ConfigError
from sbert_ray.data.records import DataError
from sbert_ray.progress import QUIET_ENV


def _eval(args: argparse.Namespace) -> int:
    from sbert_ray.data.readers import resolve_data_dir
    from sbert_ray.evaluation.baselines import BASELINE_POOLING
    from sbert_ray.evaluation.results import format_results, write_json
    from sbert_ray.evaluation.tasks import ArgsimTask, headlines, parse_tasks
    from sbert_ray.runs.argsim import finetune_config
    from sbert_ray.runs.evaluation import evaluate_model
    from sbert_ray.tracking.mlflow_run import resolve_tracking_uri

    tasks = parse_tasks(args.tasks, args.similarities.split(","))  # fail on a typo before loading anything
    if args.baseline == "tfidf" and (args.mode == "finetune" or not all(isinstance(t, ArgsimTask) for t in tasks)):
        raise ConfigError("--baseline tfidf scores argument-similarity tasks (afs, ukp-aspect, bws) unsupervised only")
    if args.truncate_dim and (args.mode == "finetune" or args.baseline == "tfidf"):
        raise ConfigError("--truncate-dim scores the model's own embeddings: not with --mode finetune or tfidf")
    data_dir = resolve_data_dir(args.data_dir)
    finetune = None
    if args.mode == "finetune":  # checked here, before any encoding or Ray work
        pooling = BASELINE_POOLING.get(args.baseline)
        overrides = args.train_set + ["model.allow_unsafe_weights=true"] * args.allow_unsafe_weights
        finetune = finetune_config(args.model, data_dir, pooling, overrides)
    print(
        f"model: {args.model}{f' ({args.baseline} baseline)' if args.baseline else ''}   mode: {args.mode}   "
        f"data: {data_dir or 'Hugging Face Hub'}"
    )
    results = evaluate_model(
        args.model,
        tasks,
        data_dir,
        args.batch_size,
        baseline=args.baseline,
        finetune=finetune,
        workers=args.workers,
        device=args.device,
        allow_unsafe_weights=args.allow_unsafe_weights,
        progress=lambda task, seconds: print(f"{task.spec}: {seconds:.1f} s", flush=True),
        tracking_uri=resolve_tracking_uri(args.tracking_uri) if args.mlflow else None,
        experiment=args.experiment,
        truncate_dims=args.truncate_dim or (),
    )
    print(format_results(results, {entry: metric for entry, (metric, _) in headlines(tasks, results).items()}))
    if args.output:
        write_json(results, args.output)
        print(f"wrote {args.output}")
    return 0


def _encode(args: argparse.Namespace) -> int:
    from sbert_ray.runs.encode import encode_corpus

    result = encode_corpus(
        args.model,
        args.input,
        args.output,
        column=args.column,
        batch_size=args.batch_size,
        workers=args.workers,
        device=args.device,
        data_dir=args.data_dir,
    )
    print(
        f"wrote {result.rows} embeddings (dimension {result.dimension}) to {result.output} in {result.seconds:.1f} s "
        f"({result.rows / result.seconds:.0f} rows/s)"
    )
    return 0


def _report(args: argparse.Namespace) -> int:
    from sbert_ray.evaluation import report
    from sbert_ray.tracking.mlflow_run import resolve_tracking_uri

    # Only when MLflow is used: resolving the default creates its folder.
    tracking_uri = resolve_tracking_uri(args.tracking_uri) if args.run or not args.no_mlflow else None
    result_sets = [report.read_results_file(spec) for spec in args.results]
    result_sets += [report.read_mlflow_run(run_id, tracking_uri) for run_id in args.run]
    if not result_sets:
        raise ConfigError("give at least one results file or --run")
    for note in args.note:
        label, _, text = note.partition("=")
        matching = [rs for rs in result_sets if rs.label == label]
        if not matching:
            raise ConfigError(f"--note {note!r}: no results labelled {label!r}")
        matching[0].notes.append(text)
    path = report.build_report(result_sets, args.out)
    print(f"wrote {path}")
    if not args.no_mlflow:
        run_id = report.log_report(path, result_sets, tracking_uri, args.experiment)
        print(f"MLflow run {run_id} at {tracking_uri}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from sbert_ray.config import load_config
    from sbert_ray.evaluation.tasks import headlines, parse_tasks
    from sbert_ray.runs.training import run_training

    config = load_config(args.config, args.overrides)  # every config error surfaces here, before Ray starts
    result = run_training(config)
    final = result.headlines
    for entry, (metric, before) in headlines(parse_tasks(config.evaluation.before_tasks), result.before).items():
        after = f"{final[entry][1]:.2f}" if entry in final else "not scored"
        print(f"{entry} test {metric}: before {before:.2f} -> after {after}")
    if final:
        print("final model: " + ", ".join(f"{entry} {value:.2f}" for entry, (_, value) in final.items()))
    print(f"model: {result.model_dir}")
    print(f"MLflow run {result.run_id} at {result.tracking_uri} (artifacts: {result.artifact_uri})")
    return 0


def _tune(args: argparse.Namespace) -> int:
    from sbert_ray.config import load_config
    from sbert_ray.runs.sweep import run_sweep
    from sbert_ray.tuning import SweepConfig

    sweep = load_config(args.config, args.overrides, cls=SweepConfig)  # every key of the search space is checked here
    result = run_sweep(sweep, resume=args.resume)
    if result.best is not None:
        print(f"best trial {result.best.trial_id}: dev Spearman x100 {result.best.dev_spearman:.2f}")
    if result.retrained is not None:
        scores = result.retrained.headlines.items()
        print("retrained best, Spearman x100: " + ", ".join(f"{entry} {value:.2f}" for entry, (_, value) in scores))
    print(f"sweep: {result.path} (results table, plot, best config: {result.summary})")
    print(f"MLflow sweep run {result.run_id} at {result.tracking_uri}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"expected distinct positive sizes like 384,128,64, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sbert-ray", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", help="no progress bars or training progress lines")

    ev = sub.add_parser("eval", parents=[common], help="evaluate a sentence encoder")
    ev.add_argument("--model", required=True, help="local folder or Hub id")
    ev.add_argument("--tasks", default="sts", help="comma-separated tasks (default: sts)")
    ev.add_argument("--data-dir", help="local data folder (default: $SBERT_RAY_DATA_DIR, else the Hub)")
    ev.add_argument("--output", help="write results as JSON here")
    ev.add_argument("--batch-size", type=_positive_int, default=64)
    ev.add_argument("--similarities", default="cosine", help="cosine,manhattan,euclidean,dot")
    ev.add_argument("--device", help="e.g. cuda")
    ev.add_argument("--mlflow", action="store_true", help="log the evaluation as an MLflow run (params, metrics, JSON)")
    ev.add_argument("--tracking-uri", help="with --mlflow (default: $MLFLOW_TRACKING_URI, else ~/sbert-ray/mlflow)")
    ev.add_argument("--experiment", default="sbert-ray-eval", help="with --mlflow: the MLflow experiment")
    ev.add_argument(
        "--mode",
        choices=("unsupervised", "finetune"),
        default="unsupervised",
        help="argument similarity: score as is, or fine-tune a fresh copy per cross-topic fold first",
    )
    ev.add_argument(
        "--train-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="finetune mode: training config override, e.g. stages.0.max_steps=20 (repeatable)",
    )
    ev.add_argument(
        "--baseline",
        choices=("avg", "cls", "tfidf"),
        help="the paper's baselines from --model's backbone: token average, CLS vector, or tf-idf",
    )
    ev.add_argument(
        "--allow-unsafe-weights",
        action="store_true",
        help="also load pickled PyTorch weights (pytorch_model.bin), which can run code: trusted models only",
    )
    ev.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="encode on this many Ray workers (one GPU each with --device cuda); same numbers as one process",
    )
    ev.add_argument(
        "--truncate-dim",
        type=_sizes,
        metavar="K[,K...]",
        help="score the first K embedding values (Matryoshka), e.g. 384,128,64: entries like stsb@128",
    )
    ev.set_defaults(func=_eval)

    en = sub.add_parser(
        "encode", parents=[common], help="embed a corpus on a Ray cluster: parquet files of (id, text, vector)"
    )
    en.add_argument("--model", required=True, help="local folder or Hub id")
    en.add_argument(
        "--input",
        required=True,
        help="a .txt file (one sentence per line), a .csv/.tsv/.jsonl/.parquet file (see --column), "
        "or a registered dataset NAME[:SPLIT] (default split: test), whose distinct sentences are embedded",
    )
    en.add_argument("--output", required=True, help="folder to create; it appears only once complete")
    en.add_argument("--column", help="the text column of a table file (default: text)")
    en.add_argument("--batch-size", type=_positive_int, default=32)
    en.add_argument(
        "--workers", type=_positive_int, default=1, help="encoder replicas (one GPU each with --device cuda)"
    )
    en.add_argument("--device", help="cpu or cuda (one GPU per worker); default: cuda when the cluster has GPUs")
    en.add_argument("--data-dir", help="for a registered dataset: local data folder (default: $SBERT_RAY_DATA_DIR)")
    en.set_defaults(func=_encode)

    rp = sub.add_parser(
        "report", parents=[common], help="our results beside the paper's Tables 1-7: markdown + PNG plots, MLflow"
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
    rp.set_defaults(func=_report)

    tr = sub.add_parser("train", parents=[common], help="train on a Ray cluster (RAY_ADDRESS, else a local one)")
    tr.add_argument("config", help="YAML config, e.g. jobs/configs/quickstart.yaml")
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. stages.0.learning_rate=3e-5")
    tr.set_defaults(func=_train)

    tu = sub.add_parser(
        "tune", parents=[common], help="hyperparameter sweep: Tune trials of Ray Train runs, tracked in MLflow"
    )
    tu.add_argument("config", help="sweep YAML, e.g. jobs/configs/sweep-offline.yaml")
    tu.add_argument("overrides", nargs="*", help="key=value overrides, e.g. num_samples=4 base.stages.0.limit=500")
    tu.add_argument("--resume", action="store_true", help="continue an interrupted sweep; finished trials stay")
    tu.set_defaults(func=_tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.quiet:  # read by this process and every Ray process it starts
        os.environ[QUIET_ENV] = "1"
    try:
        return args.func(args)
    except (ConfigError, DataError) as err:  # bad input: one clear line, no traceback
        print(f"sbert-ray {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
