"""Two-process DDP check of the training core without Ray, for a machine with two GPUs (NCCL) or, with --device cpu,
two CPU processes (gloo): MNRL (on the bench's data: the offline NLI set's entailment pairs) with its in-batch
negatives gathered across both ranks trains ``--steps`` steps with a checkpoint halfway, then a second pass resumes
from that checkpoint and trains to the end. Rank 0 writes one JSON record (to ``--output``, else stdout): both passes'
logged losses after the checkpoint, the largest difference between the two final models' weights, and pairs/s.

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_resume.py --data-dir ../shared/data [--device cpu]

The resumed pass restores weights, AdamW state, the schedule, the data position and every rank's random state, so
it retraces the uninterrupted one: on a GPU up to the non-deterministic order of reductions in some kernels (a
relative difference of about 1e-6 per step that grows with the steps), on CPUs exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from sbert_ray.bench.train_speed import TrainBenchSettings, bench_config
from sbert_ray.training.loop import LocalReporter
from sbert_ray.training.meter import StepMeter
from sbert_ray.training.precision import resolve_precision
from sbert_ray.training.stage_plan import stage_plans
from sbert_ray.training.stages import Worker, start_worker, train_stages
from sbert_ray.training.stream import SourceStream, local_sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batch-size", type=int, default=64, help="global: 32 per rank, 64 in-batch negatives")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output", help="write the record here (default: stdout)")
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    settings = TrainBenchSettings(
        model=args.model, objective="mnrl", data_dir=args.data_dir, batch_size=args.batch_size, steps=args.steps,
        device=args.device, precision="auto", eval_every=args.steps // 2,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="sbert-ray-ddp-resume-") as own:
        shared = [own]
        dist.broadcast_object_list(shared)  # rank 0's folder: every rank resumes from the checkpoint rank 0 wrote
        tmp = shared[0]
        config = bench_config(settings, world_size, 1, storage=tmp)
        checkpoints = Path(tmp) / "checkpoints"
        uninterrupted, first = train(config, device, rank, world_size, checkpoints, restored=None)
        halfway = checkpoints / f"step-{args.steps // 2}"
        dist.barrier()  # rank 0 has written the halfway checkpoint
        resumed, second = train(config, device, rank, world_size, None, restored=halfway)
        difference = max(
            (a - b).abs().max().item()
            for a, b in zip(uninterrupted.state_dict().values(), resumed.state_dict().values(), strict=True)
        )
        dist.barrier()  # rank 0's folder stays until every rank has read its checkpoint
    if rank == 0:
        record = {
            "check": "ddp_resume", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "backend": dist.get_backend(), "workers": world_size, "objective": "mnrl (gathered across workers)",
            "steps": args.steps, "batch_size": args.batch_size, "precision": resolve_precision("auto", device),
            "losses_uninterrupted": losses_after(first, args.steps // 2),
            "losses_resumed": losses_after(second, args.steps // 2),
            "max_weight_difference": difference,
            "pairs_per_s": first["pairs_per_s"],
        }  # fmt: skip
        text = json.dumps(record, indent=2)
        if args.output:
            Path(args.output).write_text(text)
        else:
            print(text)
    dist.destroy_process_group()


def rank_share(config, encoder, rank: int, world_size: int, index: int) -> list[SourceStream]:
    """Stage ``index``'s sources read and tokenised in this process, each pass every ``world_size``-th row from the
    ``rank``-th: a share of its own for each rank, as Ray Data's split gives each worker."""

    def share(source: SourceStream, key: tuple[int, int, int]):
        return (table.take(np.arange(rank, table.num_rows, world_size)) for table in source.open_pass(key))

    return [
        dataclasses.replace(source, open_pass=functools.partial(share, source))
        for source in local_sources(config, index, encoder)
    ]


def train(config, device, rank, world_size, checkpoints, restored):
    """One pass of the training core as DDP rank ``rank``; returns the encoder and the reporter's log and rate."""

    def ddp(objective):
        return DistributedDataParallel(
            objective, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
        )

    worker = Worker(device, resolve_precision("auto", device), rank, world_size, distribute=ddp)
    meter = StepMeter(time.time(), device)
    started = start_worker(config, worker, restored)
    reporter = LocalReporter(checkpoints if rank == 0 else None)
    stage_data = functools.partial(rank_share, config, started.encoder, rank, world_size)
    train_stages(stage_plans(config), started, stage_data, worker, reporter, meter)
    return started.encoder, {"logged": reporter.logged, "pairs_per_s": meter.summary()["pairs_per_s"]}


def losses_after(run: dict, step: int) -> dict[int, float]:
    return {at: metrics["train/loss"] for at, metrics in run["logged"] if "train/loss" in metrics and at > step}


if __name__ == "__main__":
    main()
