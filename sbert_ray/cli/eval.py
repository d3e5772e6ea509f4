"""``sbert-ray eval``: score a sentence encoder (or one of the paper's baselines) on evaluation tasks."""

from __future__ import annotations

import argparse
from pathlib import Path

from sbert_ray.cli.arguments import (
    add_command,
    check_output,
    checked,
    positive_int,
    resource_wait,
    sizes,
    tracking_store,
)
from sbert_ray.config import parse_device


def add_arguments(subparsers) -> None:
    ev = add_command(subparsers, "eval", help="evaluate a sentence encoder", parents=[resource_wait()])
    ev.add_argument("--model", required=True, help="local folder or Hub id")
    ev.add_argument("--tasks", default="sts", help="comma-separated tasks (default: sts)")
    ev.add_argument("--data-dir", help="local data folder (default: $SBERT_RAY_DATA_DIR, else the Hub)")
    ev.add_argument("--output", help="write results as JSON here (mteb: tasks: their result files in mteb/ beside it)")
    ev.add_argument("--batch-size", type=positive_int, default=64)
    ev.add_argument("--similarities", default="cosine", help="cosine,manhattan,euclidean,dot")
    ev.add_argument("--device", type=checked(parse_device), help="cpu, cuda, cuda:N or mps")
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
        type=positive_int,
        default=1,
        help="encode on this many Ray workers (one GPU each with --device cuda); same numbers as one process",
    )
    ev.add_argument(
        "--truncate-dim",
        type=sizes,
        metavar="K[,K...]",
        help="score the first K embedding values (Matryoshka), e.g. 384,128,64: entries like stsb@128",
    )
    ev.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="encode with fp32 or bf16 weights (float16 on GPUs without bf16); default fp32",
    )
    ev.add_argument(
        "--reranker",
        help="rerank: tasks: a cross-encoder folder or Hub id (or a bi-encoder, by cosine) that reorders the top k",
    )
    ev.add_argument(
        "--top-k",
        type=positive_int,
        help="rerank: tasks: first-stage candidates per query that --reranker reorders (default 100)",
    )
    ev.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sbert_ray.data.readers import resolve_data_dir
    from sbert_ray.evaluation.baselines import BASELINE_POOLING
    from sbert_ray.evaluation.mteb_tasks import DEFAULT_MTEB_DIR, MtebTask
    from sbert_ray.evaluation.results import format_results, nest
    from sbert_ray.evaluation.tasks import RERANK_TOP_K, parse_tasks
    from sbert_ray.files import write_json
    from sbert_ray.runs.argsim_folds import finetune_config
    from sbert_ray.runs.eval_run import EvalRequest, evaluate_model

    check_output(args, "--output")
    tasks = parse_tasks(args.tasks, args.similarities.split(","), reranks=True)  # a typo fails before any loading
    data_dir = resolve_data_dir(args.data_dir)
    finetune = None
    if args.mode == "finetune":  # checked here, before any encoding or Ray work
        pooling = BASELINE_POOLING.get(args.baseline)
        overrides = args.train_set + ["model.allow_unsafe_weights=true"] * args.allow_unsafe_weights
        finetune = finetune_config(args.model, data_dir, pooling, overrides)
    request = EvalRequest(
        args.model,
        tasks,
        data_dir,
        args.batch_size,
        baseline=args.baseline,
        finetune=finetune,
        workers=args.workers,
        device=args.device,
        allow_unsafe_weights=args.allow_unsafe_weights,
        store=tracking_store(args) if args.mlflow else None,
        experiment=args.experiment,
        truncate_dims=args.truncate_dim or (),
        precision=args.precision,
        resource_wait_s=args.resource_wait_s,
        mteb_dir=Path(args.output).parent / "mteb" if args.output else DEFAULT_MTEB_DIR,
        reranker=args.reranker,
        top_k=args.top_k or RERANK_TOP_K,
    )
    print(
        f"model: {args.model}{f' ({args.baseline} baseline)' if args.baseline else ''}   mode: {args.mode}   "
        f"precision: {args.precision}   data: {data_dir or 'Hugging Face Hub'}"
    )
    results = evaluate_model(request, progress=lambda task, seconds: print(f"{task.spec}: {seconds:.1f} s", flush=True))
    print(format_results(results, {entry: metric for entry, (metric, _) in tasks.primary_scores(results).items()}))
    if args.output:
        write_json(nest(results), args.output)
        print(f"wrote {args.output}")
    if any(isinstance(task, MtebTask) for task in tasks):
        print(f"mteb result files: {request.mteb_dir.expanduser() / 'results'}")
    return 0
