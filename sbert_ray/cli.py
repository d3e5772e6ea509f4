"""``sbert-ray`` command line: eval | train | tune | report."""

from __future__ import annotations

import argparse
import logging
import sys

from sbert_ray.config import ConfigError
from sbert_ray.data.records import DataError


def _eval(args: argparse.Namespace) -> int:
    import time

    from sbert_ray.data.readers import resolve_data_dir
    from sbert_ray.evaluation import argsim, suite
    from sbert_ray.evaluation.baselines import BASELINE_POOLING, load_model

    tasks = suite.parse_tasks(args.tasks)  # fail on a typo before loading anything
    if args.baseline == "tfidf" and (
        args.mode == "finetune" or any(t.partition(":")[0] not in argsim.ARGSIM_DATASETS for t in tasks)
    ):
        raise ConfigError("--baseline tfidf scores argument-similarity tasks (afs, ukp-aspect, bws) unsupervised only")
    if args.precision == "bf16" and args.baseline == "tfidf":
        raise ConfigError("--precision bf16 applies to transformer encoders, not the tf-idf baseline")
    data_dir = resolve_data_dir(args.data_dir)
    options = {"mode": args.mode}
    if args.mode == "finetune":  # checked here, before any encoding or Ray work
        pooling = BASELINE_POOLING.get(args.baseline)
        options["train_config"] = argsim.finetune_config(args.model, data_dir, pooling, args.train_set)
    model = load_model(args.model, args.baseline)
    if args.precision == "bf16":  # cast on the device it runs on; Ray workers re-cast on theirs
        model.to(args.device if args.device and args.workers == 1 else "cpu").to_precision("bf16")
    if args.workers > 1:
        from sbert_ray.evaluation.distributed import RayEncoder

        model = RayEncoder(model, args.workers, use_gpu=(args.device or "").startswith("cuda"))
    elif args.device:
        model.to(args.device)
    print(
        f"model: {args.model}{f' ({args.baseline} baseline)' if args.baseline else ''}   mode: {args.mode}   "
        f"precision: {args.precision}   data: {data_dir or 'Hugging Face Hub'}"
    )
    results: dict[str, dict] = {}
    try:
        for task in tasks:
            start = time.perf_counter()
            results |= suite.run_tasks(
                model, [task], data_dir, args.batch_size, args.similarities.split(","), **options
            )
            print(f"{task}: {time.perf_counter() - start:.1f} s", flush=True)
    finally:
        if args.workers > 1:
            model.close()
    print(suite.format_results(results))
    if args.output:
        suite.write_json(results, args.output)
        print(f"wrote {args.output}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from sbert_ray.evaluation import report
    from sbert_ray.tracking.mlflow_run import resolve_tracking_uri

    tracking_uri = resolve_tracking_uri(args.tracking_uri)
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
    from sbert_ray.evaluation.suite import primary_metric
    from sbert_ray.training.driver import train

    config = load_config(args.config, args.overrides)  # every config error surfaces here, before Ray starts
    result = train(config)
    for name, before in result.before.items():
        metric = primary_metric(before)
        after = result.final.get(name)
        after_text = f"{after:.2f}" if after is not None else "not scored"
        print(f"{name} test {metric}: before {before[metric]:.2f} -> after {after_text}")
    if result.final:
        print("final model: " + ", ".join(f"{k} {v:.2f}" for k, v in result.final.items()))
    print(f"model: {result.model_dir}")
    print(f"MLflow run {result.run_id} at {result.tracking_uri} (artifacts: {result.artifact_uri})")
    return 0


def _tune(args: argparse.Namespace) -> int:
    from sbert_ray.config import load_config
    from sbert_ray.tuning import SweepConfig, run_sweep

    sweep = load_config(args.config, args.overrides, cls=SweepConfig)  # every key of the search space is checked here
    result = run_sweep(sweep, resume=args.resume)
    if result.best is not None:
        print(f"best trial {result.best.trial_id}: dev Spearman x100 {result.best.dev_spearman:.2f}")
    if result.retrained is not None:
        print("retrained best, Spearman x100: " + ", ".join(f"{k} {v:.2f}" for k, v in result.retrained.final.items()))
    print(f"sweep: {result.path} (summary/: results table, plot, best config)")
    print(f"MLflow sweep run {result.run_id} at {result.tracking_uri}")
    return 0


def _bench_encode(args: argparse.Namespace) -> int:
    from sbert_ray.bench import report
    from sbert_ray.bench.encode import run_encode_bench
    from sbert_ray.data.readers import resolve_data_dir
    from sbert_ray.tracking.mlflow_run import resolve_tracking_uri

    options = {  # every option is checked before a model is loaded
        "model": args.model,
        "batch_sizes": _int_list("--batch-sizes", args.batch_sizes),
        "precisions": _choices("--precisions", args.precisions, ("fp32", "bf16")),
        "smart_batching": [s == "on" for s in _choices("--smart-batching", args.smart_batching, ("on", "off"))],
        "repeats": args.repeats,
        "device": args.device,
        "limit": args.limit,
        "reference": not args.no_reference,
    }
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    data_dir = resolve_data_dir(args.data_dir)
    records = run_encode_bench(data_dir=data_dir, progress=lambda line: print(line, flush=True), **options)
    print(report.format_table(records))
    if args.output:
        report.write_json(records, args.output)
        print(f"wrote {args.output}")
    if not args.no_mlflow:
        tracking_uri = resolve_tracking_uri(args.tracking_uri)
        params = {**options, "data_dir": data_dir, "threads": records[0]["threads_per_worker"]}
        run_id = report.log_bench(records, "encode", params, tracking_uri, args.experiment)
        print(f"MLflow run {run_id} at {tracking_uri}")
    return 0


def _int_list(option: str, text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        raise ConfigError(f"{option} takes comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise ConfigError(f"{option} must be positive, got {text!r}")
    return values


def _choices(option: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    values = text.split(",")
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise ConfigError(f"{option}: unknown {unknown}; choose from {', '.join(allowed)}")
    return values


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
    ev.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="encode with fp32 or bf16 weights (float16 on GPUs without bf16); default fp32",
    )
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
        "--workers",
        type=int,
        default=1,
        help="encode on this many Ray workers (one GPU each with --device cuda); same numbers as one process",
    )
    ev.set_defaults(func=_eval)

    rp = sub.add_parser("report", help="our results beside the paper's Tables 1-7: markdown + PNG plots, MLflow")
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

    tr = sub.add_parser("train", help="train on a Ray cluster (RAY_ADDRESS, else a local one)")
    tr.add_argument("config", help="YAML config, e.g. jobs/configs/quickstart.yaml")
    tr.add_argument("overrides", nargs="*", help="key=value overrides, e.g. stages.0.learning_rate=3e-5")
    tr.set_defaults(func=_train)

    tu = sub.add_parser("tune", help="hyperparameter sweep: Tune trials of Ray Train runs, tracked in MLflow")
    tu.add_argument("config", help="sweep YAML, e.g. jobs/configs/sweep-offline.yaml")
    tu.add_argument("overrides", nargs="*", help="key=value overrides, e.g. num_samples=4 base.stages.0.limit=500")
    tu.add_argument("--resume", action="store_true", help="continue an interrupted sweep; finished trials stay")
    tu.set_defaults(func=_tune)

    bench = sub.add_parser("bench", help="throughput benchmarks side by side in one process: table, JSON, MLflow")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    be = bench_sub.add_parser("encode", help="encode speed vs sentence-transformers, fp32/bf16, smart batching")
    be.add_argument("--model", required=True, help="local folder, Hub id or random:<shape>")
    be.add_argument("--data-dir", help="local data folder (default: $SBERT_RAY_DATA_DIR, else the Hub)")
    be.add_argument("--batch-sizes", default="32", help="comma-separated, e.g. 16,32,64 (default: 32)")
    be.add_argument("--precisions", default="fp32,bf16", help="fp32,bf16 (bf16 is float16 on GPUs without bf16)")
    be.add_argument("--smart-batching", default="on,off", help="on,off: sorted by length and/or input order")
    be.add_argument("--repeats", type=int, default=3, help="timed runs per variant, interleaved (default: 3)")
    be.add_argument("--limit", type=int, help="first N of the 15,487 unique STSb sentences (default: all)")
    be.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    be.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    be.add_argument("--no-reference", action="store_true", help="skip sentence-transformers")
    be.add_argument("--output", help="write the records as JSON here")
    be.add_argument("--tracking-uri", help="MLflow (default: $MLFLOW_TRACKING_URI, else ~/sbert-ray/mlflow)")
    be.add_argument("--experiment", default="sbert-ray-bench")
    be.add_argument("--no-mlflow", action="store_true", help="print and write JSON only")
    be.set_defaults(func=_bench_encode)
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
