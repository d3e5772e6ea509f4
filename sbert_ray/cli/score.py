"""``sbert-ray score``: a teacher's scores of (query, passage) pairs or mined n-tuples on a Ray cluster."""

from __future__ import annotations

import argparse

from sbert_ray.cli.arguments import add_command, checked, positive_int, resource_wait
from sbert_ray.config import parse_device


def add_arguments(subparsers) -> None:
    sc = add_command(
        subparsers,
        "score",
        help="score (query, passage) pairs or mined n-tuples with a cross-encoder or a bi-encoder on a Ray cluster: "
        "the rows plus score (or score_positive, score_negative_1..n) columns",
        parents=[resource_wait()],
    )
    sc.add_argument(
        "--model",
        required=True,
        help="the teacher: a cross-encoder / reranker (sentence-transformers' CrossEncoder layout, or a Hugging Face "
        "...ForSequenceClassification model with one label), scoring as CrossEncoder.predict does; or a bi-encoder, "
        "scoring by the cosine of the embeddings",
    )
    sc.add_argument(
        "--input",
        required=True,
        help="a .csv/.tsv/.jsonl/.parquet file; a folder, glob or object storage prefix (s3://...) of such files, "
        "read in parallel (e.g. the output of `sbert-ray mine`)",
    )
    sc.add_argument(
        "--output",
        required=True,
        help="folder or object storage prefix (s3://...): one KEY.parquet per input file (its rows and their scores), "
        "each appearing only once complete; a rerun skips the files already there",
    )
    sc.add_argument("--query-column", help="default: query, else anchor")
    sc.add_argument(
        "--passage-column",
        help="score (query, this column) pairs into `score`; default: negative_1..n beside positive make n-tuples "
        "(scores in score_positive, score_negative_1..n; `negative` for mined triplets), else passage or positive",
    )
    sc.add_argument("--batch-size", type=positive_int, default=32, help="pairs per forward pass")
    sc.add_argument("--workers", type=positive_int, default=1, help="teacher replicas (one GPU each with cuda)")
    sc.add_argument(
        "--device",
        type=checked(parse_device),
        help="cpu or cuda (one GPU per worker); default: cuda when the cluster has GPUs",
    )
    sc.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sbert_ray.runs.score_rows import ScoreRequest, score_rows

    request = ScoreRequest(
        args.model,
        args.input,
        args.output,
        query_column=args.query_column,
        passage_column=args.passage_column,
        batch_size=args.batch_size,
        workers=args.workers,
        device=args.device,
        resource_wait_s=args.resource_wait_s,
    )
    result = score_rows(request)
    print(
        f"wrote {result.rows} rows with {', '.join(result.score_columns)} ({result.teacher}) of "
        f"{result.files_written} input files to {result.output} in {result.seconds:.1f} s "
        f"({result.rows / result.seconds:.0f} rows/s); {result.files_skipped} files were already there"
    )
    return 0
