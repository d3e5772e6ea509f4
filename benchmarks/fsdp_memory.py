"""Memory per worker under DDP and under FSDP (``scaling.strategy``), two gloo workers on CPU, on a random
Qwen3-shaped decoder of about 100 M parameters (``models.random_decoder.tiny_config`` widened).

    python benchmarks/fsdp_memory.py --steps 2 > benchmarks/results/fsdp_memory_<date>.json

Each strategy runs in two fresh processes (``torch.multiprocessing.spawn``): the model built from one seed on every
rank, DDP-wrapped or sharded (``training.sharding.shard_encoder``, as the training worker does), AdamW as training
builds it (``training.optimization``), then ``--steps`` MNRL steps on 8 short pairs per worker. Per rank it prints
``state_mib``: the bytes of this rank's parameters, gradients and AdamW state counted from the tensors (their local
shards under FSDP; machine-independent), and the process's resident memory: before the model (``base_rss_mib``),
after the steps (``rss_mib``) and its peak (``peak_rss_mib``, which under FSDP includes the whole model as every rank
builds it before sharding). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from sbert_ray.config import StageConfig
from sbert_ray.losses import MultipleNegativesRankingLoss
from sbert_ray.models import SentenceEncoder
from sbert_ray.models.random_decoder import decoder_tokenizer, tiny_config
from sbert_ray.training.optimization import prepare_optimization
from sbert_ray.training.sharding import shard_encoder

# Qwen3-shaped, 11 layers of hidden 768 (12 heads of 64, no grouping) and feed-forward 3072: ~104 M parameters.
SHAPE = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 11,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
}
CPU = torch.device("cpu")


def decoder(seed: int) -> SentenceEncoder:
    from transformers import AutoModel

    tokenizer = decoder_tokenizer("left")
    config = tiny_config("qwen3", tokenizer, **SHAPE)
    torch.manual_seed(seed)
    return SentenceEncoder(AutoModel.from_config(config), tokenizer, "lasttoken", 64).train()


def _mib(tensors) -> float:
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local) / 2**20


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def worker(rank: int, strategy: str, steps: int, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    base = _rss_mib()
    encoder = decoder(seed=0)
    parameters = sum(p.numel() for p in encoder.parameters())
    objective = MultipleNegativesRankingLoss(encoder)
    if strategy == "fsdp":
        shard_encoder(encoder, keep_meta_copy=False)
        model = objective
    else:
        model = DistributedDataParallel(objective)
    optimizer = prepare_optimization(objective, StageConfig(), steps, CPU, "fp32", None).optimizer
    pairs = [(f"A sentence about topic {rank}-{i}.", f"Another sentence on topic {rank}-{i}.") for i in range(8)]
    features = [encoder.tokenize([pair[column] for pair in pairs]) for column in (0, 1)]
    for _ in range(steps):
        model(features).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the gradients stay allocated, as between DDP's steps
    trainable = [p for p in objective.parameters() if p.requires_grad]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    record = {
        "strategy": strategy,
        "rank": rank,
        "parameters": parameters,
        "parameters_mib": round(_mib(trainable), 1),
        "gradients_mib": round(_mib(p.grad for p in trainable), 1),
        "adamw_state_mib": round(_mib(state), 1),
        "base_rss_mib": round(base, 1),
        "rss_mib": round(_rss_mib(), 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10, 1),  # KiB on Linux
    }
    record["state_mib"] = round(record["parameters_mib"] + record["gradients_mib"] + record["adamw_state_mib"], 1)
    with open(f"{out}.{rank}", "w") as file:
        json.dump(record, file)
    dist.destroy_process_group()


def measure(strategy: str, steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="sbert-ray-fsdp-memory-") as folder:
        rendezvous, out = os.path.join(folder, "rendezvous"), os.path.join(folder, "record")
        mp.spawn(worker, args=(strategy, steps, rendezvous, out), nprocs=2, join=True)
        records = []
        for rank in range(2):
            with open(f"{out}.{rank}") as file:
                records.append(json.load(file))
        return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps([record for strategy in ("ddp", "fsdp") for record in measure(strategy, args.steps)], indent=1))


if __name__ == "__main__":
    main()
