"""``sbert-ray mine``: hard negatives for (anchor, positive) pairs on a Ray cluster, as parquet n-tuples or triplets."""

from __future__ import annotations

import argparse

from sbert_ray.cli.arguments import add_command, check_output, checked, positive_int, resource_wait
from sbert_ray.config import parse_device


def add_arguments(subparsers) -> None:
    mi = add_command(
        subparsers,
        "mine",
        help="mine hard negatives on a Ray cluster: parquet (anchor, positive, negative_1..n) a stage trains on",
        parents=[resource_wait()],
    )
    mi.add_argument("--model", required=True, help="local folder or Hub id that encodes anchors and corpus")
    mi.add_argument(
        "--pairs",
        required=True,
        help="a .csv/.tsv/.jsonl/.parquet file with anchor and positive columns, or a registered dataset "
        "NAME[:SPLIT] (default split: train) whose records' first two texts are anchor and positive",
    )
    mi.add_argument("--output", required=True, help="folder of part-NNNNN.parquet shards; a rerun resumes it")
    mi.add_argument("--anchor-column", help="the pairs file's anchor column (default: anchor)")
    mi.add_argument("--positive-column", help="the pairs file's positive column (default: positive)")
    mi.add_argument(
        "--corpus",
        help="negatives also come from this corpus (a .txt/.csv/.tsv/.jsonl/.parquet file, a dataset NAME[:SPLIT], "
        "or an s3:// prefix of such files); the positives are always candidates",
    )
    mi.add_argument("--corpus-column", help="the corpus tables' text column (default: text)")
    mi.add_argument("--num-negatives", type=positive_int, default=3)
    mi.add_argument("--range-min", type=int, default=0, help="skip this many best candidates left after filtering")
    mi.add_argument(
        "--range-max",
        type=positive_int,
        help="consider candidates up to this rank (default: range_min + num_negatives + the most positives of an "
        "anchor, 10 x num_negatives with a margin or --max-score)",
    )
    mi.add_argument(
        "--max-score", type=float, help="drop candidates scoring above this (cosine, or the --rescore-with teacher's)"
    )
    mi.add_argument(
        "--min-score", type=float, help="drop candidates scoring below this (cosine, or the --rescore-with teacher's)"
    )
    mi.add_argument(
        "--rescore-with",
        metavar="MODEL",
        help="a cross-encoder / reranker folder whose scores of the candidates and positives rank them and the "
        "filters (--max-score, --min-score, --margin, --relative-margin) use, as sentence-transformers' "
        "cross_encoder=; e.g. --max-score 0.9 drops negatives the reranker finds relevant",
    )
    mi.add_argument(
        "--output-scores",
        action="store_true",
        help="add score_positive and score_negative_1..n (score_negative for triplets): the scores the negatives "
        "were chosen by, as margin_mse and distill_kl read them",
    )
    mi.add_argument("--margin", type=float, help="drop candidates with score + margin above the positive's score")
    mi.add_argument(
        "--relative-margin",
        type=float,
        help="drop candidates above positive - |positive| x this (0.05: at least 5%% below the positive)",
    )
    mi.add_argument("--sampling", choices=("top", "random"), default="top", help="the best candidates, or random ones")
    mi.add_argument("--seed", type=int, default=0, help="for --sampling random")
    mi.add_argument(
        "--triplets",
        action="store_true",
        help="write (anchor, positive, negative) rows, one per negative, instead of n-tuples",
    )
    mi.add_argument(
        "--approximate",
        action="store_true",
        help="search each corpus chunk with a faiss HNSW graph instead of exactly (needs sbert-ray[faiss])",
    )
    mi.add_argument("--batch-size", type=positive_int, default=32)
    mi.add_argument("--workers", type=positive_int, default=1, help="encoder actors (one GPU each with cuda)")
    mi.add_argument(
        "--device",
        type=checked(parse_device),
        help="cpu or cuda (one GPU per worker); default: cuda when the cluster has GPUs",
    )
    mi.add_argument("--shard-size", type=positive_int, default=65536, help="anchors per output file")
    mi.add_argument("--data-dir", help="for registered datasets: local data folder (default: $SBERT_RAY_DATA_DIR)")
    mi.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sbert_ray.evaluation.hard_negatives import MiningSettings
    from sbert_ray.runs.mine_negatives import MineRequest, ShardDone, mine_negatives

    check_output(args, "--output", kind="folder")
    settings = MiningSettings(
        num_negatives=args.num_negatives,
        range_min=args.range_min,
        range_max=args.range_max,
        max_score=args.max_score,
        min_score=args.min_score,
        margin=args.margin,
        relative_margin=args.relative_margin,
        sampling=args.sampling,
        seed=args.seed,
        output_format="triplet" if args.triplets else "n-tuple",
        rescored=args.rescore_with is not None,
        output_scores=args.output_scores,
    )
    request = MineRequest(
        args.model,
        args.pairs,
        args.output,
        settings,
        anchor_column=args.anchor_column,
        positive_column=args.positive_column,
        corpus=args.corpus,
        corpus_column=args.corpus_column,
        batch_size=args.batch_size,
        workers=args.workers,
        device=args.device,
        data_dir=args.data_dir,
        shard_size=args.shard_size,
        approximate=args.approximate,
        rescore_with=args.rescore_with,
        resource_wait_s=args.resource_wait_s,
    )

    def shard_done(done: ShardDone) -> None:
        what = "complete from an earlier run" if done.skipped else f"mined in {done.seconds:.1f} s"
        print(f"shard {done.index + 1}/{done.shards}: {done.rows} rows, {what}", flush=True)

    result = mine_negatives(request, progress=shard_done)
    dropped = ", ".join(f"{name} {count}" for name, count in result.dropped.items() if count) or "none"
    print(
        f"wrote {result.rows} rows in {result.shards_written} shards to {result.output} in {result.seconds:.1f} s "
        f"({result.shards_skipped} shards kept from an earlier run); {result.anchors} anchors, corpus of "
        f"{result.corpus} (embedded once, in {result.corpus_chunks_embedded} chunks); candidates dropped: {dropped}; "
        f"anchors with fewer than {settings.num_negatives} "
        f"negatives: {result.short_anchors}"
    )
    return 0
