#!/usr/bin/env bash
# Training benchmark on GPUs, without Ray, MLflow or datasets (run from the repository root, no install needed):
# 1. One GPU (`bench train --local`: the training core the Ray workers run, in this process): a randomly initialised
#    bert-base-shaped model (random:base) on STSb train (regression) at batch 16, 64 and 256 in auto precision (bf16
#    where the GPU has it, else fp16), beside sentence-transformers' trainer. Per run: pairs/s, MFU (model FLOPs
#    over the GPU's measured matmul peak) and the share of wall time at report points (dev scoring of all 1,500
#    STSb dev pairs and a checkpoint write, every 100 steps, as the quickstart's cadence of about 1 in 120).
# 2. Two GPUs or more: benchmarks/ddp_resume.py under torchrun on 2 GPUs (NCCL): DDP, MNRL with in-batch negatives
#    gathered across both GPUs, a checkpoint halfway and a resume from it that must retrace the uninterrupted run.
#    On one GPU this part is skipped (a record says so).
# Prints one JSON list with every record (progress and tables go to stderr). Sized to finish in about 5 minutes on
# one A100/H100-class GPU. sentence-transformers' trainer needs the datasets package: where it is missing, only our
# loop is measured.
#
# --dry-run checks the script itself on CPUs in about a minute: a tiny random BERT, a few steps at one batch size
# without the reference, and the 2-process check on gloo (tests/test_benchmark_scripts.py runs it).
#
# usage: benchmarks/gpu_train.sh [--dry-run] [DATA_DIR]     (default: $SBERT_RAY_DATA_DIR, else ../shared/data)
set -euo pipefail

dry_run=false
if [[ ${1:-} == --dry-run ]]; then dry_run=true; shift; fi
data_dir=${1:-${SBERT_RAY_DATA_DIR:-../shared/data}}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's sbert_ray, for torchrun's script too
out_dir=$(mktemp -d)
trap 'rm -rf "$out_dir"' EXIT

if $dry_run; then
  device=cpu model=random:tiny steps=6 eval_every=3 dev_limit=20 limit=(--limit 300) repeats=1 threads=1 batches=(16)
  ddp_device=cpu ddp_model=random:tiny ddp_steps=8 ddp_batch=16 gpus=2 no_reference=--no-reference
else
  python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "benchmarks/gpu_train.sh: no CUDA GPU visible to torch")'
  device=cuda model=random:base steps=300 eval_every=100 dev_limit=1500 limit=() repeats=2 threads=4 batches=(16 64 256)
  ddp_device=cuda ddp_model=random:base ddp_steps=40 ddp_batch=64
  gpus=$(python -c 'import torch; print(torch.cuda.device_count())')
  no_reference=$(python -c 'import datasets' 2>/dev/null || echo --no-reference)
fi

for batch in "${batches[@]}"; do
  python -m sbert_ray.cli bench train --local --device "$device" --model "$model" --batch-size "$batch" \
    --precision auto --steps "$steps" --eval-every "$eval_every" --dev-limit "$dev_limit" "${limit[@]}" \
    --workers 1 --threads-per-worker "$threads" --repeats "$repeats" --data-dir "$data_dir" --no-mlflow $no_reference \
    --output "$out_dir/train-$(printf %03d "$batch").json" >&2
done

if ((gpus >= 2)); then
  torchrun --standalone --nproc-per-node 2 benchmarks/ddp_resume.py --data-dir "$data_dir" --device "$ddp_device" \
    --model "$ddp_model" --steps "$ddp_steps" --batch-size "$ddp_batch" > "$out_dir/ddp-resume.json"
else
  echo "benchmarks/gpu_train.sh: $gpus GPU visible: the 2-GPU NCCL check (DDP, MNRL gather, resume) is skipped" >&2
  echo '{"check": "ddp_resume", "skipped": "needs 2 GPUs"}' > "$out_dir/ddp-resume.json"
fi

python - "$out_dir"/*.json <<'EOF'
import json, sys
records = []
for path in sys.argv[1:]:
    loaded = json.load(open(path))
    records += loaded if isinstance(loaded, list) else [loaded]
print(json.dumps(records, indent=2))
EOF
