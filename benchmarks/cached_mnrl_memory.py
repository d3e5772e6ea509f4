"""Peak memory of one training step, cached_mnrl against plain mnrl, side by side at the same global batch.

    python benchmarks/cached_mnrl_memory.py --data-dir ../shared/data --batch-size 512 --output results/cached.json

Each measurement runs in a fresh process: the model is loaded and the batch (NLI triplets: anchor, positive, hard
negative) tokenised, then the kernel's resident-set high-water mark is reset (/proc/self/clear_refs) and one
forward + backward runs in train mode. Peak = VmHWM after the step minus VmRSS before it, i.e. the activations,
gradients and temporaries of the step (torch's CPU allocator returns freed blocks to malloc, so the resident set
follows what is allocated). A last process compares the two losses' gradients with dropout off. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from sbert_ray.data import load_records
from sbert_ray.losses import CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss
from sbert_ray.models.encoder import SentenceEncoder


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split(f"{field}:")[1].split()[0])


def _batch(args: argparse.Namespace, encoder: SentenceEncoder) -> list[dict]:
    triplets = load_records("nli-triplets", "dev", args.data_dir)[: args.batch_size]
    if len(triplets) < args.batch_size:
        raise SystemExit(f"only {len(triplets)} triplets for a batch of {args.batch_size}")
    columns = [[t.anchor for t in triplets], [t.positive for t in triplets], [t.negative for t in triplets]]
    return [encoder.tokenize(column) for column in columns]


def _objective(name: str, encoder: SentenceEncoder, mini_batch_size: int):
    if name == "mnrl":
        return MultipleNegativesRankingLoss(encoder)
    return CachedMultipleNegativesRankingLoss(encoder, mini_batch_size=mini_batch_size)


def measure(args: argparse.Namespace) -> dict:
    """One step of `args.objective` in this process (a child of `main`)."""
    torch.manual_seed(0)
    encoder = SentenceEncoder.load(args.model).train()
    features = _batch(args, encoder)
    objective = _objective(args.objective, encoder, args.mini_batch_size)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status_kib("VmRSS")
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = objective(features)
    loss.backward()
    return {
        "peak_step_mib": (_status_kib("VmHWM") - before) / 1024,
        "resident_before_step_mib": before / 1024,
        "step_seconds": time.perf_counter() - start,
        "step_cpu_seconds": time.process_time() - start_cpu,  # the work done, less sensitive to a shared machine
        "loss": loss.item(),
    }


def compare_gradients(args: argparse.Namespace) -> dict:
    """Both losses on the same batch with dropout off: the largest gradient difference."""
    encoder = SentenceEncoder.load(args.model)  # eval mode
    features = _batch(args, encoder)
    grads = []
    for name in ("mnrl", "cached_mnrl"):
        encoder.zero_grad()
        _objective(name, encoder, args.mini_batch_size)(features).backward()
        grads.append({k: p.grad.clone() for k, p in encoder.named_parameters() if p.requires_grad})
    plain, cached = grads
    return {
        "max_abs_gradient_difference": max((plain[k] - cached[k]).abs().max().item() for k in plain),
        "max_abs_gradient": max(g.abs().max().item() for g in plain.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--mini-batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", help="also write the JSON here")
    parser.add_argument("--objective", help=argparse.SUPPRESS)  # set for the child processes
    parser.add_argument("--compare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.objective or args.compare:
        print(json.dumps(compare_gradients(args) if args.compare else measure(args)))
        return

    def child(*extra: str) -> dict:
        command = [sys.executable, __file__, *sys.argv[1:], *extra]
        return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)

    report = {
        "model": args.model,
        "batch_size": args.batch_size,
        "mini_batch_size": args.mini_batch_size,
        "mnrl": child("--objective", "mnrl"),
        "cached_mnrl": child("--objective", "cached_mnrl"),
    }
    for key in ("peak_step_mib", "step_cpu_seconds"):
        report[f"{key}_ratio_cached_to_plain"] = report["cached_mnrl"][key] / report["mnrl"][key]
    report["gradients"] = child("--compare")
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
