"""``sbert-ray prepare``: tokenise a training source once, into shards training reads without tokenising."""

from __future__ import annotations

import argparse

from sbert_ray.cli.arguments import add_command, positive_int, resource_wait


def add_arguments(subparsers) -> None:
    pr = add_command(
        subparsers,
        "prepare",
        help="tokenise a training source once on a Ray cluster: parquet shards of token ids plus manifest.json, which "
        "a stage's dataset names instead of the raw source",
        parents=[resource_wait()],
    )
    pr.add_argument(
        "source",
        help="the training source: a .csv/.tsv/.jsonl/.parquet file, a folder or glob of such shards, an object "
        "storage prefix (s3://bucket/shards/) or a Hub dataset's files (hf://datasets/<owner>/<name>/<glob>)",
    )
    pr.add_argument("--model", required=True, help="the model trained on it (local folder or Hub id): its tokenizer")
    pr.add_argument("--max-seq-length", type=positive_int, required=True, help="as the run's model.max_seq_length")
    pr.add_argument(
        "--prompt",
        action="append",
        metavar="NAME=TEXT",
        help="a prompt, as the run's model.prompts (repeat for each; e.g. --prompt 'query=query: '); default: the "
        "model's own prompts",
    )
    pr.add_argument(
        "--output",
        required=True,
        help="folder or object storage prefix: one KEY.parquet shard per input file, each appearing only once "
        "complete, and manifest.json once all are; a rerun writes only the shards not there",
    )
    pr.add_argument("--objective", default="regression", help="as the stage's objective: which rows and columns")
    pr.add_argument(
        "--column",
        action="append",
        metavar="FIELD=COLUMN",
        help="as the stage's columns: the input's column for a field (repeat for each), e.g. --column anchor=question",
    )
    pr.add_argument("--score-max", type=float, default=5.0, help="as the stage's score_max (default: 5)")
    pr.add_argument("--errors", choices=("raise", "skip"), default="raise", help="as the stage's errors")
    pr.add_argument(
        "--rows-per-group",
        type=positive_int,
        default=8192,
        help="rows per parquet row group of each shard (default: 8192, the rows of a table the stream reads)",
    )
    pr.add_argument("--workers", type=positive_int, default=1, help="tokenizer actors, one CPU each")
    pr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sbert_ray.runs.prepare_source import PrepareRequest, prepare_source

    request = PrepareRequest(
        args.source,
        args.model,
        args.max_seq_length,
        args.output,
        prompts=_pairs(args.prompt, "--prompt"),
        objective=args.objective,
        columns=_pairs(args.column, "--column"),
        score_max=args.score_max,
        errors=args.errors,
        rows_per_group=args.rows_per_group,
        workers=args.workers,
        resource_wait_s=args.resource_wait_s,
    )
    result = prepare_source(request)
    print(
        f"wrote {result.rows} tokenised examples of {result.files_written} input files to {result.output} in "
        f"{result.seconds:.1f} s; {result.files_skipped} shards were already there"
    )
    return 0


def _pairs(given: list[str] | None, option: str) -> dict[str, str] | None:
    from sbert_ray.config import ConfigError

    if given is None:
        return None
    bad = next((pair for pair in given if "=" not in pair), None)
    if bad is not None:
        raise ConfigError(f"{option} {bad!r}: give NAME=VALUE")
    return dict(pair.split("=", 1) for pair in given)
