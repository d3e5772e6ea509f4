"""``sbert-ray bench encode | train | ingest | eval``: throughput side by side with sentence-transformers (ingest: the
input pipeline beside the training step; eval: an evaluation on 1, 2, 4 ... Ray workers), as a table, JSON and an
MLflow run."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import TYPE_CHECKING

from sbert_ray.cli.arguments import (
    add_command,
    check_output,
    checked,
    choices,
    positive_int,
    positive_ints,
    sizes,
    tracking_store,
)
from sbert_ray.config import ConfigError, parse_device
from sbert_ray.files import check_folder, json_text, write_json

if TYPE_CHECKING:
    from sbert_ray.tracking.store import TrackingStore


def add_arguments(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="throughput side by side with sentence-transformers: table, JSON, MLflow"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    # Options every bench command takes (sbert-ray bench encode | train ...).
    bench_common = argparse.ArgumentParser(add_help=False)
    bench_common.add_argument("--model", required=True, help="local folder, Hub id or random:<shape>")
    bench_common.add_argument("--data-dir", help="local data folder (default: $SBERT_RAY_DATA_DIR, else the Hub)")
    bench_common.add_argument("--device", type=checked(parse_device), default="cpu", help="cpu or cuda (default: cpu)")
    bench_common.add_argument("--threads", type=positive_int, help="torch intra-op threads (default: torch's choice)")
    bench_common.add_argument("--repeats", type=positive_int, default=3, help="timed runs per variant, interleaved")
    bench_common.add_argument("--output", help="write the records as JSON here")
    bench_common.add_argument("--tracking-uri", help="MLflow (default: $MLFLOW_TRACKING_URI, else ~/sbert-ray/mlflow)")
    bench_common.add_argument("--experiment", default="sbert-ray-bench")
    bench_common.add_argument("--no-mlflow", action="store_true", help="print and write JSON only")
    _add_encode_arguments(bench_sub, bench_common)
    _add_train_arguments(bench_sub, bench_common)
    _add_ingest_arguments(bench_sub, bench_common)
    _add_eval_arguments(bench_sub, bench_common)


def _add_encode_arguments(bench_sub, bench_common: argparse.ArgumentParser) -> None:
    be = add_command(
        bench_sub,
        "encode",
        parents=[bench_common],
        help="encode speed vs sentence-transformers: fp32/bf16, smart batching",
    )
    be.add_argument("--batch-sizes", type=sizes, default=[32], help="comma-separated, e.g. 16,32,64 (default: 32)")
    be.add_argument(
        "--precisions",
        type=choices("fp32", "bf16"),
        default=["fp32", "bf16"],
        help="fp32,bf16 (bf16 is float16 on GPUs without bf16)",
    )
    be.add_argument(
        "--smart-batching",
        type=choices("on", "off"),
        default=["on", "off"],
        help="on,off: sorted by length and/or input order",
    )
    be.add_argument(
        "--limit",
        type=positive_int,
        help="first N of the 15,487 unique STSb sentences timed, and of the 1,379 test pairs scored (default: all)",
    )
    be.add_argument("--no-reference", action="store_true", help="skip sentence-transformers")
    be.set_defaults(func=run_encode)


def _add_train_arguments(bench_sub, bench_common: argparse.ArgumentParser) -> None:
    bt = add_command(
        bench_sub,
        "train",
        parents=[bench_common],
        help="training pairs/s and time to the first step: our Ray Train loop vs sentence-transformers",
    )
    bt.add_argument(
        "--workers",
        type=positive_ints,
        help="Ray Train worker counts to compare, e.g. 1,2,4 (default: 1,2; 1 with --local)",
    )
    bt.add_argument(
        "--threads-per-worker",
        type=positive_ints,
        help="torch threads (= CPUs) per worker: one number for all, or one per --workers entry, e.g. 2,1 "
        "(default: --threads, else 1)",
    )
    bt.add_argument(
        "--reference-threads",
        type=positive_int,
        help="threads of sentence-transformers' trainer in one process (default: the most CPUs a layout uses); "
        "for each worker count N > 1 it also runs N DDP processes at that layout's threads",
    )
    bt.add_argument("--batch-size", type=positive_int, default=16, help="global batch (default: 16, the quickstart's)")
    bt.add_argument("--max-seq-length", type=positive_int, default=128)
    bt.add_argument("--steps", type=positive_int, default=60, help="optimizer steps per run (default: 60)")
    bt.add_argument(
        "--objective",
        choices=("regression", "mnrl", "cached_mnrl", "reranker_bce"),
        default="regression",
        help="regression on STSb train (default); MNRL / cached MNRL on the offline NLI set's entailment pairs "
        "(ours only: --no-reference); or reranker_bce, a reranker (cross-encoder) on STSb train beside "
        "sentence-transformers' CrossEncoderTrainer",
    )
    bt.add_argument("--limit", type=positive_int, help="first N training pairs (default: all: STSb train 5,749)")
    bt.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                    help="as scaling.precision (auto: fp32 on CPU, bf16 or fp16 on GPU)")  # fmt: skip
    bt.add_argument("--eval-every", type=positive_int,
                    help="steps between report points (dev evaluation + checkpoint), e.g. 120 as the quickstart "
                    "(default: only after the last step)")  # fmt: skip
    bt.add_argument(
        "--dev-limit",
        type=positive_int,
        default=10,
        help="STSb dev pairs each report point scores (default: 10; 1500: all, as the quickstart)",
    )
    bt.add_argument(
        "--reports",
        type=choices("none", "sync", "async-upload", "async"),  # bench.train_speed.REPORT_MODES (imports torch)
        help="how our report points score and store checkpoints, one variant each, e.g. none,async: none (no report "
        "point before the last step: the baseline without evaluation), sync (dev scored on rank 0, training waits for "
        "the write and upload), async-upload (scored on rank 0, written and uploaded in the background: a run's "
        "defaults where no dev scorer fits beside the workers), async (evaluation.async_dev: scored in a Ray task on "
        "evaluation.dev_resources beside training; not with --local) (default: async-upload)",
    )
    bt.add_argument(
        "--compile", choices=["auto", "on", "off"], default="auto",
        help="scaling.compile: torch.compile the training forward; auto: on GPUs only (default: auto)",
    )  # fmt: skip
    bt.add_argument("--local", action="store_true", help="one worker in this process, without Ray (one GPU)")
    bt.add_argument("--no-reference", action="store_true", help="skip sentence-transformers' trainer")
    bt.add_argument(
        "--storage-path",
        type=checked(check_folder),
        help="checkpoint storage (default: a temporary folder on this node); on a multi-node cluster a shared one "
        "(s3://... or NFS), as checkpoint.storage_path",
    )
    bt.set_defaults(func=run_train)


def _add_ingest_arguments(bench_sub, bench_common: argparse.ArgumentParser) -> None:
    bi = add_command(
        bench_sub,
        "ingest",
        parents=[bench_common],
        help="pairs/s the input pipeline delivers per worker (read, tokenise, batch, collate) vs the training step",
    )
    bi.add_argument(
        "--dataset", default="stsb", help="registered name, or a file, folder, glob or s3:// prefix of scored pairs"
    )
    bi.add_argument(
        "--prepared", help="the same source as `sbert-ray prepare` wrote it (its folder or prefix): timed beside it"
    )
    bi.add_argument("--batch-size", type=positive_int, default=16, help="one worker's micro-batch (default: 16)")
    bi.add_argument("--max-seq-length", type=positive_int, default=128)
    bi.add_argument("--window-batches", type=positive_int, default=200, help="as stages.N.window_batches")
    bi.add_argument("--limit", type=positive_int, help="first N pairs of the dataset (default: all)")
    bi.add_argument("--batches", type=positive_int, help="micro-batches timed per run (default: one pass)")
    bi.add_argument("--local", action="store_true", help="read and tokenise in this process, without Ray")
    bi.add_argument(
        "--train-steps", type=int, default=30, help="steps of a Ray-free training run whose pairs/s go beside; 0: none"
    )
    bi.add_argument(
        "--target-pairs-per-s",
        type=float,
        default=6400.0,
        help="a worker's need, e.g. a GPU's (default: 256 pairs per 40 ms); the record says the CPUs that feed it",
    )
    bi.set_defaults(func=run_ingest)


def _add_eval_arguments(bench_sub, bench_common: argparse.ArgumentParser) -> None:
    bv = add_command(
        bench_sub,
        "eval",
        parents=[bench_common],
        help="an evaluation's time on 1, 2, 4 ... Ray workers (scaling efficiency) beside one process and "
        "sentence-transformers' evaluator",
    )
    bv.add_argument("--tasks", default="stsb", help="as sbert-ray eval --tasks (default: stsb)")
    bv.add_argument(
        "--workers", type=positive_ints, default=[1, 2], help="Ray worker counts, e.g. 1,2,4 (default: 1,2)"
    )
    bv.add_argument("--threads-per-worker", type=positive_int, default=1,
                    help="torch threads (= CPUs) of each worker, and of the one-process runs (default: 1)")  # fmt: skip
    bv.add_argument("--batch-size", type=positive_int, default=64)
    bv.add_argument("--no-reference", action="store_true", help="skip sentence-transformers' evaluator")
    bv.set_defaults(func=run_eval)


def run_encode(args: argparse.Namespace) -> int:
    from sbert_ray.bench.encode_speed import run_encode_bench
    from sbert_ray.data.readers import resolve_data_dir

    check_output(args, "--output")
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
    store = None if args.no_mlflow else tracking_store(args)
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
    from sbert_ray.bench import tables

    print(tables.format_table(records))
    if args.output:
        write_json(records, args.output)
        print(f"wrote {args.output}")
    if store is not None:
        run_id = tables.log_bench(
            records, kind, {**params, "threads": args.threads or "default"}, store.uri, args.experiment
        )
        print(f"MLflow run {run_id} at {store}")
    return 0


def run_train(args: argparse.Namespace) -> int:
    """Progress and the table go to stderr, the records as JSON to stdout (and --output): under `ray job submit`
    the job's log then ends with the JSON."""
    from sbert_ray.bench.train_speed import (
        DEFAULT_REPORTS,
        TrainBenchSettings,
        bench_config,
        check_inputs,
        run_train_bench,
        worker_layouts,
    )
    from sbert_ray.data.readers import resolve_data_dir

    check_output(args, "--output")
    workers = args.workers or ([1] if args.local else [1, 2])
    layouts = worker_layouts(workers, args.threads_per_worker or [args.threads or 1])
    data_dir = resolve_data_dir(args.data_dir)
    settings = TrainBenchSettings(
        model=args.model,
        objective=args.objective,
        data_dir=str(data_dir.resolve()) if data_dir else None,
        batch_size=args.batch_size,
        max_seq_length=args.max_seq_length,
        steps=args.steps,
        limit=args.limit,
        device=args.device,
        precision=args.precision,
        eval_every=args.eval_every or 0,
        dev_limit=args.dev_limit,
        compile={"on": True, "off": False}.get(args.compile, "auto"),
    )
    reports = args.reports or [DEFAULT_REPORTS]
    check_inputs(settings, reference=not args.no_reference)
    store = None if args.no_mlflow else tracking_store(args)
    if not args.local:
        from sbert_ray.ray_compat import connect_ray
        from sbert_ray.runs.cluster import refuse_impossible

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
        reports=reports,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    params = {**vars(settings), "layouts": layouts, "reports": reports, "repeats": args.repeats, "local": args.local}
    return _train_bench_output(args, records, params, store)


def _train_bench_output(
    args: argparse.Namespace, records: list[dict], params: dict, store: TrackingStore | None
) -> int:
    """The table on stderr, ``--output`` JSON, an MLflow run, then the records as JSON on stdout."""
    from sbert_ray.bench.train_speed import format_table, log_records

    print(format_table(records), file=sys.stderr)
    if args.output:
        write_json(records, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    if store is not None:
        run_id = log_records(records, params, store.uri, args.experiment)
        print(f"MLflow run {run_id} at {store}", file=sys.stderr)
    print(json_text(records))
    return 0


def run_ingest(args: argparse.Namespace) -> int:
    """The table on stderr, ``--output`` JSON, an MLflow run, then the record as JSON on stdout."""
    from sbert_ray.bench.ingest_speed import IngestBenchSettings, format_table, log_records, run_ingest_bench
    from sbert_ray.data.readers import resolve_data_dir
    from sbert_ray.training.sources import stage_sources

    check_output(args, "--output")
    data_dir = resolve_data_dir(args.data_dir)
    settings = IngestBenchSettings(
        model=args.model,
        data_dir=str(data_dir.resolve()) if data_dir else None,
        dataset=args.dataset,
        batch_size=args.batch_size,
        max_seq_length=args.max_seq_length,
        window_batches=args.window_batches,
        limit=args.limit,
        batches=args.batches,
    )
    store = None if args.no_mlflow else tracking_store(args)
    if not args.local:
        from sbert_ray.ray_compat import connect_ray

        connect_ray()
    _set_threads(args.threads)
    timed = [settings] + ([dataclasses.replace(settings, dataset=args.prepared)] if args.prepared else [])
    for each in timed:  # both listed (a prepared folder's manifest read) before either is timed
        stage_sources(each.config().stages[0], 0)
    records = [
        run_ingest_bench(
            each,
            repeats=args.repeats,
            local=args.local,
            train_steps=args.train_steps if each is settings else 0,  # the step's rate is the same for both
            train_threads=args.threads or 1,
            target_pairs_per_s=args.target_pairs_per_s,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
        for each in timed
    ]
    print(format_table(records), file=sys.stderr)
    if args.output:
        write_json(records, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    if store is not None:
        params = {**vars(settings), "prepared": args.prepared, "repeats": args.repeats}
        run_id = log_records(records, params, store.uri, args.experiment)
        print(f"MLflow run {run_id} at {store}", file=sys.stderr)
    print(json_text(records))
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """The table on stderr, ``--output`` JSON, an MLflow run, then the records as JSON on stdout."""
    from sbert_ray.bench import tables
    from sbert_ray.bench.eval_speed import COLUMNS, LOGGED_METRICS, EvalBench, EvalBenchSettings, record_name
    from sbert_ray.data.readers import resolve_data_dir
    from sbert_ray.evaluation.encoder_pool import replica_resources
    from sbert_ray.ray_compat import connect_ray
    from sbert_ray.runs.cluster import refuse_impossible_encoders

    check_output(args, "--output")
    if args.device != "cpu":
        raise ConfigError(f"--device {args.device}: bench eval measures CPU workers only (for now)")
    data_dir = resolve_data_dir(args.data_dir)
    settings = EvalBenchSettings(
        model=args.model,
        tasks=args.tasks,
        data_dir=str(data_dir.resolve()) if data_dir else None,
        batch_size=args.batch_size,
        threads_per_worker=args.threads_per_worker,
    )
    store = None if args.no_mlflow else tracking_store(args)
    bench = EvalBench.load(settings)  # tasks, data and model checked before Ray starts
    connect_ray()
    refuse_impossible_encoders(replica_resources(False, args.threads_per_worker), max(args.workers))
    records = bench.run(
        args.workers,
        repeats=args.repeats,
        reference=not args.no_reference,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(tables.format_table(records, COLUMNS), file=sys.stderr)
    if args.output:
        write_json(records, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    if store is not None:
        params = {**vars(settings), "workers": args.workers, "repeats": args.repeats}
        run_id = tables.log_records(records, "eval", record_name, LOGGED_METRICS, params, store.uri, args.experiment)
        print(f"MLflow run {run_id} at {store}", file=sys.stderr)
    print(json_text(records))
    return 0
