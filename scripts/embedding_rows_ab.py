#!/usr/bin/env python
"""The cost of a 2-worker CPU step by how the word-embedding gradient crosses: interleaved, in two gloo processes
of one thread each, all-MiniLM-L6-v2 and 16 pairs per rank, ms per step of forward, backward, all-reduces,
densifying and AdamW (median over the steps after two warm-up steps of each round).

    python scripts/embedding_rows_ab.py [--rounds 4] [--steps 15]

Ways: ``rows`` (training/sparse_embeddings.py: the rows on their own gloo group after backward), ``ddp_rows``
(the rows all-reduced by DDP, as before 2026-12-07: it races in torch 2.13's gloo, see docs/testing.md) and
``dense`` (the whole vocabulary's gradient in DDP's buckets).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from sbert_ray.losses import CosineSimilarityLoss
from sbert_ray.models import load_encoder
from sbert_ray.training.sparse_embeddings import densify, sparse_embedding_gradients

WAYS = ("rows", "ddp_rows", "dense")
WORDS = "a man is playing guitar while the woman sings in a small park near the river at night".split()


def one_way(way: str, steps: int, pairs: list[list[str]]) -> list[float]:
    torch.manual_seed(0)
    encoder = load_encoder("sentence-transformers/all-MiniLM-L6-v2")
    objective = CosineSimilarityLoss(encoder)
    weight = encoder.transformer.get_input_embeddings().weight
    if way == "rows":
        sparse_embedding_gradients(objective, torch.device("cpu"), dist.get_world_size())
    elif way == "ddp_rows":
        encoder.transformer.get_input_embeddings().sparse = True
    model = DistributedDataParallel(objective)
    optimizer = torch.optim.AdamW(objective.parameters(), lr=2e-5)
    features, labels = [encoder.tokenize(column) for column in pairs], torch.rand(len(pairs[0]))
    seconds = []
    for step in range(steps + 2):
        dist.barrier()
        start = time.perf_counter()
        model(features, labels).backward()
        if way == "rows":
            densify(weight)
        elif way == "ddp_rows":
            weight.grad = weight.grad.to_dense()
        optimizer.step()
        if way != "dense":
            weight.grad = None
        optimizer.zero_grad(set_to_none=False)
        if step >= 2:
            seconds.append(time.perf_counter() - start)
    return seconds


def worker(rank: int, port: int, rounds: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    draw = random.Random(rank)
    pairs = [[" ".join(draw.choices(WORDS, k=draw.randint(6, 20))) for _ in range(16)] for _ in range(2)]
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(rounds):
        for way in WAYS if round_ % 2 == 0 else reversed(WAYS):
            seconds[way] += one_way(way, steps, pairs)
    if rank == 0:
        for way, values in seconds.items():
            print(f"{way}: median {1000 * statistics.median(values):.0f} ms per step over {len(values)} steps")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    mp.spawn(worker, args=(20000 + random.randrange(5000), args.rounds, args.steps), nprocs=2)


if __name__ == "__main__":
    main()
