"""``sbert-ray`` command line: eval | encode | train | tune | report | bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from sbert_ray.config import ConfigError, parse_device
from sbert_ray.data.records import DataError
from sbert_ray.files import check_file, check_folder, write_json
from sbert_ray.progress import QUIET_ENV
from sbert_ray.tracking.errors import TrackingError

if TYPE_CHECKING:
    from sbert_ray.tracking.store import TrackingStore


def _eval(args: argparse.Namespace) -> int:
    from sbert_ray.data.readers import resolve_data_dir
    from sbert_ray.evaluation.baselines import BASELINE_POOLING
    from sbert_ray.evaluation.results import format_results, nest
    from sbert_ray.evaluation.tasks import ArgsimTask, headlines, parse_tasks
    from sbert_ray.runs.argsim import finetune_config
    from sbert_ray.runs.evaluation import evaluate_model

    _refuse_protected(args, "--output")
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
        f"precision: {args.precision}   data: {data_dir or 'Hugging Face Hub'}"
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
        tracking_uri=_tracking_store(args).uri if args.mlflow else None,
        experiment=args.experiment,
        truncate_dims=args.truncate_dim or (),
        precision=args.precision,
    )
    print(format_results(results, {entry: metric for entry, (metric, _) in headlines(tasks, results).items()}))
    if args.output:
        write_json(nest(results), args.output)
        print(f"wrote {args.output}")
    return 0


def _refuse_protected(args: argparse.Namespace, option: str, kind: str = "file") -> None:
    """An output option is checked before any work: never /, HOME, the working directory or a folder above them
    (``runs.owned_paths``), and a path that can take a ``kind`` ("file" or "folder", ``files``)."""
    from sbert_ray.runs.owned_paths import refuse_protected

    value = getattr(args, option.removeprefix("--").replace("-", "_"))
    if value:
        refuse_protected(value, option)
        (check_file if kind == "file" else check_folder)(value, option)


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

    _refuse_protected(args, "--out", kind="folder")
    # Only when MLflow is used: resolving the default creates its folder.
    store = _tracking_store(args) if args.run or not args.no_mlflow else None
    tracking_uri = store and store.uri
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
        print(f"MLflow run {run_id} at {store}")
    return 0


def _tracking_store(args: argparse.Namespace) -> TrackingStore:
    """``--tracking-uri`` (else its default) checked reachable before the command's work; it prints masked."""
    from sbert_ray.tracking.mlflow_run import tracking_store

    try:
        return tracking_store(args.tracking_uri)
    except TrackingError as err:
        raise ConfigError(f"--tracking-uri: {err}") from None


def _train(args: argparse.Namespace) -> int:
    from sbert_ray.config import load_config
    from sbert_ray.evaluation.tasks import headlines, parse_tasks
    from sbert_ray.runs.training import TrainingDiverged, run_training
    from sbert_ray.tracking.store import redact_uri

    config = load_config(args.config, args.overrides)  # every config error surfaces here, before Ray starts
    try:
        result = run_training(config, restart=args.restart)
    except TrainingDiverged as err:  # a result, not a crash: one clear line, no traceback
        print(f"sbert-ray train: {err}", file=sys.stderr)
        return 1
    final = result.headlines
    if result.already_finished:
        print(f"run {config.name!r} already finished with this config: nothing to train (--restart trains it anew)")
    for entry, (metric, before) in headlines(parse_tasks(config.evaluation.before_tasks), result.before).items():
        after = _score(final[entry][1]) if entry in final else "not scored"
        print(f"{entry} test {metric}: before {_score(before)} -> after {after}")
    if final:
        print("final model: " + ", ".join(f"{entry} {_score(value)}" for entry, (_, value) in final.items()))
    print(f"model: {result.model_dir}")
    artifacts = redact_uri(result.artifact_uri)
    print(f"MLflow run {result.run_id} at {redact_uri(result.tracking_uri)} (artifacts: {artifacts})")
    return 0


def _score(value: float | None) -> str:
    """A headline score; undefined ones are NaN, or null in a finished run's record."""
    return "undefined" if value is None or value != value else f"{value:.2f}"


def _tune(args: argparse.Namespace) -> int:
    from sbert_ray.config import load_config
    from sbert_ray.runs.sweep import run_sweep
    from sbert_ray.tracking.store import redact_uri
    from sbert_ray.tuning import SweepConfig

    sweep = load_config(args.config, args.overrides, cls=SweepConfig)  # every key of the search space is checked here
    result = run_sweep(sweep, resume=args.resume)
    if result.best is not None:
        print(f"best trial {result.best.trial_id}: dev Spearman x100 {result.best.dev_spearman:.2f}")
    if result.retrained is not None:
        scores = result.retrained.headlines.items()
        print("retrained best, Spearman x100: " + ", ".join(f"{entry} {value:.2f}" for entry, (_, value) in scores))
    print(f"sweep: {result.path} (results table, plot, best config: {result.summary})")
    print(f"MLflow sweep run {result.run_id} at {redact_uri(result.tracking_uri)}")
    return 0


def _bench_encode(args: argparse.Namespace) -> int:
    from sbert_ray.bench.encode import run_encode_bench
    from sbert_ray.data.readers import resolve_data_dir

    _refuse_protected(args, "--output")
    _set_threads(args.threads)
    options = {
        "model": args.model,
        "batch_sizes": args.batch_sizes,
        "precisions": args.precisions,
        "smart_batching": [choice == "on" for choice in args.smart_batching],
        "repeats": args.repeats,
        "device": args.device,
        "limit": args.limit,
        "reference": not args.no_reference,
    }
    data_dir = resolve_data_dir(args.data_dir)
    store = None if args.no_mlflow else _tracking_store(args)
    records = run_encode_bench(data_dir=data_dir, progress=lambda line: print(line, flush=True), **options)
    return _bench_output(args, "encode", records, {**options, "data_dir": data_dir}, store)


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _bench_output(
    args: argparse.Namespace, kind: str, records: list[dict], params: dict, store: TrackingStore | None
) -> int:
    """What ``sbert-ray bench encode`` ends with: the table, ``--output`` JSON, an MLflow run (unless ``store`` is
    None)."""
    from sbert_ray.bench import report

    print(report.format_table(records))
    if args.output:
        write_json(records, args.output)
        print(f"wrote {args.output}")
    if store is not None:
        run_id = report.log_bench(
            records, kind, {**params, "threads": args.threads or "default"}, store.uri, args.experiment
        )
        print(f"MLflow run {run_id} at {store}")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _bench_train(args: argparse.Namespace) -> int:
    """Progress and the table go to stderr, the records as JSON to stdout (and --output): under `ray job submit`
    the job's log then ends with the JSON."""
    from sbert_ray.bench.train import (
        TrainBenchSettings,
        bench_config,
        check_inputs,
        format_table,
        log_records,
        run_train_bench,
    )
    from sbert_ray.data.readers import resolve_data_dir
    from sbert_ray.files import json_text

    _refuse_protected(args, "--output")
    workers = args.workers or ([1] if args.local else [1, 2])
    threads = args.threads_per_worker or [args.threads or 1]
    if len(threads) not in (1, len(workers)):
        raise ConfigError("--threads-per-worker takes one number, or one per --workers entry")
    layouts = list(zip(workers, threads * len(workers) if len(threads) == 1 else threads, strict=True))
    if args.steps < 2:
        raise ConfigError("--steps must be >= 2: the first step is timed apart from the rest")
    data_dir = resolve_data_dir(args.data_dir)
    settings = TrainBenchSettings(
        model=args.model,
        data_dir=str(data_dir.resolve()) if data_dir else None,
        batch_size=args.batch_size,
        max_seq_length=args.max_seq_length,
        steps=args.steps,
        limit=args.limit,
        device=args.device,
        precision=args.precision,
    )
    check_inputs(settings, reference=not args.no_reference)
    store = None if args.no_mlflow else _tracking_store(args)
    if not args.local:
        from sbert_ray.runs.cluster import connect_ray, refuse_impossible

        connect_ray()
        for workers, threads in layouts:  # a layout the cluster can never hold would wait for ever
            refuse_impossible(bench_config(settings, workers, threads, storage="").scaling)
    records = run_train_bench(
        settings,
        layouts,
        repeats=args.repeats,
        reference_threads=args.reference_threads,
        reference=not args.no_reference,
        local=args.local,
        storage_path=args.storage_path,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(format_table(records), file=sys.stderr)
    if args.output:
        write_json(records, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    if store is not None:
        params = {**vars(settings), "layouts": layouts, "repeats": args.repeats, "local": args.local}
        run_id = log_records(records, params, store.uri, args.experiment)
        print(f"MLflow run {run_id} at {store}", file=sys.stderr)
    print(json_text(records))
    return 0


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _sizes(text: str) -> list[int]:
    try:
        sizes = _positive_ints(text)
    except argparse.ArgumentTypeError:
        sizes = []
    if not sizes or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"expected distinct positive sizes like 384,128,64, got {text!r}")
    return sizes


def _checked(parse):
    """An argparse type from one of our parsers: its ConfigError becomes argparse's "argument --flag: ..." line."""

    def convert(text: str):
        try:
            return parse(text)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def _choices(*allowed: str):
    """An argparse type for a comma-separated subset of ``allowed``, e.g. fp32,bf16."""

    def parse(text: str) -> list[str]:
        values = text.split(",")
        unknown = [value for value in values if value not in allowed]
        if unknown or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"expected distinct values from {','.join(allowed)}, got {text!r}")
        return values

    return parse


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
    ev.add_argument("--device", type=_checked(parse_device), help="cpu, cuda, cuda:N or mps")
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
    ev.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="encode with fp32 or bf16 weights (float16 on GPUs without bf16); default fp32",
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
    en.add_argument(
        "--device",
        type=_checked(parse_device),
        help="cpu or cuda (one GPU per worker); default: cuda when the cluster has GPUs",
    )
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
    tr.add_argument(
        "--restart",
        action="store_true",
        help="train anew although a run of this name exists (finished, or with another config); its folder is kept "
        "as <name>.replaced-<time>",
    )
    tr.set_defaults(func=_train)

    tu = sub.add_parser(
        "tune", parents=[common], help="hyperparameter sweep: Tune trials of Ray Train runs, tracked in MLflow"
    )
    tu.add_argument("config", help="sweep YAML, e.g. jobs/configs/sweep-offline.yaml")
    tu.add_argument("overrides", nargs="*", help="key=value overrides, e.g. num_samples=4 base.stages.0.limit=500")
    tu.add_argument("--resume", action="store_true", help="continue an interrupted sweep; finished trials stay")
    tu.set_defaults(func=_tune)

    bench = sub.add_parser("bench", help="throughput side by side with sentence-transformers: table, JSON, MLflow")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    # Options every bench command takes (sbert-ray bench encode | train ...).
    bench_common = argparse.ArgumentParser(add_help=False)
    bench_common.add_argument("--model", required=True, help="local folder, Hub id or random:<shape>")
    bench_common.add_argument("--data-dir", help="local data folder (default: $SBERT_RAY_DATA_DIR, else the Hub)")
    bench_common.add_argument("--device", type=_checked(parse_device), default="cpu", help="cpu or cuda (default: cpu)")
    bench_common.add_argument("--threads", type=_positive_int, help="torch intra-op threads (default: torch's choice)")
    bench_common.add_argument("--repeats", type=_positive_int, default=3, help="timed runs per variant, interleaved")
    bench_common.add_argument("--output", help="write the records as JSON here")
    bench_common.add_argument("--tracking-uri", help="MLflow (default: $MLFLOW_TRACKING_URI, else ~/sbert-ray/mlflow)")
    bench_common.add_argument("--experiment", default="sbert-ray-bench")
    bench_common.add_argument("--no-mlflow", action="store_true", help="print and write JSON only")

    be = bench_sub.add_parser(
        "encode",
        parents=[bench_common, common],
        help="encode speed vs sentence-transformers: fp32/bf16, smart batching",
    )
    be.add_argument("--batch-sizes", type=_sizes, default=[32], help="comma-separated, e.g. 16,32,64 (default: 32)")
    be.add_argument(
        "--precisions",
        type=_choices("fp32", "bf16"),
        default=["fp32", "bf16"],
        help="fp32,bf16 (bf16 is float16 on GPUs without bf16)",
    )
    be.add_argument(
        "--smart-batching",
        type=_choices("on", "off"),
        default=["on", "off"],
        help="on,off: sorted by length and/or input order",
    )
    be.add_argument("--limit", type=_positive_int, help="first N of the 15,487 unique STSb sentences (default: all)")
    be.add_argument("--no-reference", action="store_true", help="skip sentence-transformers")
    be.set_defaults(func=_bench_encode)

    bt = bench_sub.add_parser(
        "train",
        parents=[bench_common, common],
        help="training pairs/s and time to the first step: our Ray Train loop vs sentence-transformers",
    )
    bt.add_argument(
        "--workers",
        type=_positive_ints,
        help="Ray Train worker counts to compare, e.g. 1,2,4 (default: 1,2; 1 with --local)",
    )
    bt.add_argument(
        "--threads-per-worker",
        type=_positive_ints,
        help="torch threads (= CPUs) per worker: one number for all, or one per --workers entry, e.g. 2,1 "
        "(default: --threads, else 1)",
    )
    bt.add_argument(
        "--reference-threads",
        type=_positive_int,
        help="threads of sentence-transformers' trainer (default: the most CPUs a layout uses)",
    )
    bt.add_argument("--batch-size", type=_positive_int, default=16, help="global batch (default: 16, the quickstart's)")
    bt.add_argument("--max-seq-length", type=_positive_int, default=128)
    bt.add_argument("--steps", type=_positive_int, default=60, help="optimizer steps per run (default: 60)")
    bt.add_argument("--limit", type=_positive_int, help="first N STSb train pairs (default: all 5,749)")
    bt.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                    help="as scaling.precision (auto: fp32 on CPU, bf16 or fp16 on GPU)")  # fmt: skip
    bt.add_argument("--local", action="store_true", help="one worker in this process, without Ray (one GPU)")
    bt.add_argument("--no-reference", action="store_true", help="skip sentence-transformers' trainer")
    bt.add_argument(
        "--storage-path",
        type=_checked(check_folder),
        help="checkpoint storage (default: a temporary folder on this node); on a multi-node cluster a shared one "
        "(s3://... or NFS), as checkpoint.storage_path",
    )
    bt.set_defaults(func=_bench_train)
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
    except TrackingError as err:  # the tracking store failed or went away (credentials masked)
        print(f"sbert-ray {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
