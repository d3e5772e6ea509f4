"""``sbert-ray encode``: embed a corpus on a Ray cluster into parquet files of (id, text, vector)."""

from __future__ import annotations

import argparse

from sbert_ray.cli.arguments import add_command, checked, positive_int, resource_wait
from sbert_ray.config import parse_device


def add_arguments(subparsers) -> None:
    en = add_command(
        subparsers,
        "encode",
        help="embed a corpus on a Ray cluster: parquet files of (id, text, vector)",
        parents=[resource_wait()],
    )
    en.add_argument("--model", required=True, help="local folder or Hub id")
    en.add_argument(
        "--input",
        required=True,
        help="a .txt file (one sentence per line) or .csv/.tsv/.jsonl/.parquet file (see --column); a folder, glob "
        "('shards/*.jsonl') or object storage prefix (s3://bucket/corpus/) of such files, read in parallel; "
        "or a registered dataset NAME[:SPLIT] (default split: test), whose distinct sentences are embedded",
    )
    en.add_argument(
        "--output",
        required=True,
        help="folder or object storage prefix (s3://...): one KEY.parquet per input file, each appearing only once "
        "complete; a rerun skips the files already there",
    )
    en.add_argument("--column", help="the text column of a table file (default: text)")
    en.add_argument(
        "--batch-size",
        type=positive_int,
        default=32,
        help="sentences per batch at the model's max_seq_length; shorter ones fill the same token budget",
    )
    en.add_argument(
        "--workers", type=positive_int, default=1, help="encoder replicas (one GPU each with --device cuda)"
    )
    en.add_argument(
        "--device",
        type=checked(parse_device),
        help="cpu or cuda (one GPU per worker); default: cuda when the cluster has GPUs",
    )
    en.add_argument(
        "--prompt-name",
        help="one of the model's prompts (config_sentence_transformers.json), e.g. query or document, put before "
        "every text; default: the model's default prompt, if it has one",
    )
    en.add_argument(
        "--keep-columns",
        action="store_true",
        help="table files: write every column of each row beside its vector, instead of (file, id, text, vector): "
        "e.g. a teacher's vectors of --column english beside the translations a student is distilled on (objective "
        "mse)",
    )
    en.add_argument("--data-dir", help="for a registered dataset: local data folder (default: $SBERT_RAY_DATA_DIR)")
    en.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sbert_ray.runs.encode_corpus import EncodeRequest, encode_corpus

    request = EncodeRequest(
        args.model,
        args.input,
        args.output,
        column=args.column,
        batch_size=args.batch_size,
        workers=args.workers,
        device=args.device,
        data_dir=args.data_dir,
        prompt_name=args.prompt_name,
        keep_columns=args.keep_columns,
        resource_wait_s=args.resource_wait_s,
    )
    result = encode_corpus(request)
    print(
        f"wrote {result.rows} embeddings (dimension {result.dimension}) of {result.files_written} input files to "
        f"{result.output} in {result.seconds:.1f} s ({result.rows / result.seconds:.0f} rows/s); "
        f"{result.files_skipped} files were already there"
    )
    return 0
