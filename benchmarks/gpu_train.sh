#!/usr/bin/env bash
# Training benchmark on one GPU machine, without Ray, MLflow, datasets or pyarrow (run from the repository root, no
# install needed; python3 with torch, transformers and sentence-transformers):
# 1. One GPU (`bench train --local`: the training core the Ray workers run, in this process): a randomly initialised
#    bert-base-shaped model (random:base) in bf16 (fp16 on GPUs without it), MNRL at batch 256, 64 and 16 and cached
#    MNRL at 256 (on the offline NLI set's 5,270 entailment pairs), each eager and with torch.compile. Per run:
#    pairs/s, MFU against the measured matmul peak and the datasheet's (H100/H200, A100, L4, L40S), peak GPU memory
#    and the share of wall time at report points (dev scoring of all 1,500 STSb dev pairs and a checkpoint write,
#    every 100 of the 200 steps).
# 2. One encode run (`bench encode`): random:base in bf16 at batch 128, ours beside sentence-transformers.
# 3. Two GPUs or more: benchmarks/ddp_resume.py under torchrun on 2 GPUs (NCCL): DDP, MNRL with in-batch negatives
#    gathered across both GPUs, a checkpoint halfway and a resume from it that must retrace the uninterrupted run.
#    On one GPU a record says it is skipped.
# Steps run in that order (the headline batch 256 first); each step's records are written as it finishes and a step
# that fails leaves a record saying why (benchmarks/steps.sh). Sized for about 8 minutes on one H100/H200.
#
# On a bare GPU machine: `python3 scripts/gpu_carry.py` here, carry the folder `carry`, and run
# `benchmarks/gpu_train.sh --carry carry` there (docs/testing.md).
#
# --dry-run checks the script itself on CPUs in about a minute: a tiny random BERT, a few steps of MNRL and cached
# MNRL at batch 16, eager only, one encode run and the 2-process check on gloo (tests/test_without_ray.py runs it,
# with everything the GPU machine lacks blocked).
#
# usage: benchmarks/gpu_train.sh [--dry-run] [--carry DIR | DATA_DIR]     (default: $SBERT_RAY_DATA_DIR, else
#        ../shared/data); with $OUT set, the records are kept in $OUT/gpu_train.json as the steps finish
set -uo pipefail  # no -e: a failed step is recorded and the next one runs
source "$(dirname "$0")/steps.sh"

if $dry_run; then
  device=cpu model=random:tiny steps=4 eval_every=2 dev_limit=20 limit=(--limit 64) threads=1 compiles=(eager)
  runs=(mnrl:16 cached_mnrl:16) encode=(--batch-sizes 16 --limit 32 --precisions fp32 --threads 1)
  ddp_device=cpu ddp_model=random:tiny ddp_steps=8 ddp_batch=16 gpus=2
else
  python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "benchmarks/gpu_train.sh: no CUDA GPU visible to torch")' || exit 1
  device=cuda model=random:base steps=200 eval_every=100 dev_limit=1500 limit=() threads=4 compiles=(eager compile)
  runs=(mnrl:256 cached_mnrl:256 mnrl:64 mnrl:16) encode=(--batch-sizes 128 --precisions bf16)
  ddp_device=cuda ddp_model=random:base ddp_steps=40 ddp_batch=64
  gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
fi

for run in "${runs[@]}"; do
  objective=${run%:*} batch=${run#*:}
  for compile in "${compiles[@]}"; do
    step "train-$objective-$batch-$compile" python3 -m sbert_ray.cli bench train --local --device "$device" \
      --model "$model" --objective "$objective" --batch-size "$batch" --precision auto --steps "$steps" \
      --eval-every "$eval_every" --dev-limit "$dev_limit" "${limit[@]}" --workers 1 --threads-per-worker "$threads" \
      --repeats 1 --data-dir "$data_dir" --no-mlflow --no-reference --compile "$([[ $compile == compile ]] && echo on || echo off)"
  done
done

step "encode" python3 -m sbert_ray.cli bench encode --model "$model" --device "$device" --data-dir "$data_dir" \
  --smart-batching on --repeats 2 --no-mlflow "${encode[@]}"

if ((gpus >= 2)); then
  step "ddp-resume" python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/ddp_resume.py --data-dir "$data_dir" \
    --device "$ddp_device" --model "$ddp_model" --steps "$ddp_steps" --batch-size "$ddp_batch"
else
  step "ddp-resume" python3 -c 'import sys; sys.exit("the 2-GPU NCCL check (DDP, MNRL gather, resume) needs 2 GPUs")'
fi

finish
