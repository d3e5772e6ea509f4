#!/usr/bin/env bash
# Training benchmark on one GPU, without Ray, MLflow or datasets (`bench train --local`: the training core the Ray
# workers run, in this process; run from the repository root, no install needed): the packaged all-MiniLM-L6-v2
# and a randomly initialised bert-base-shaped model (random:base), this project's loop beside
# sentence-transformers' trainer on STSb train (regression), at the paper's batch of 16 and at 64 (a batch that
# keeps a large GPU busier), in auto precision (bf16 where the GPU has it, else fp16) and, for bert-base at batch
# 64, fp32 as well. Sized to finish in under 5 minutes on one A10G/A100-class GPU; prints one JSON list with every
# record (progress and tables go to stderr). sentence-transformers' trainer needs the datasets package: where it
# is missing, only our loop is measured.
#
# Not measured yet: no GPU was available where this was written, so the GPU path was checked by reading only and
# README quotes no GPU training figures.
#
# usage: benchmarks/gpu_train.sh [DATA_DIR]     (default: $SBERT_RAY_DATA_DIR, else ../shared/data)
set -euo pipefail

data_dir=${1:-${SBERT_RAY_DATA_DIR:-../shared/data}}
out_dir=$(mktemp -d)
trap 'rm -rf "$out_dir"' EXIT

python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "benchmarks/gpu_train.sh: no CUDA GPU visible to torch")'
no_reference=$(python -c 'import datasets' 2>/dev/null || echo --no-reference)
run() {  # MODEL BATCH PRECISION STEPS
  python -m sbert_ray.cli bench train --local --device cuda --model "$1" --batch-size "$2" --precision "$3" \
    --steps "$4" --workers 1 --threads-per-worker 4 --repeats 2 --data-dir "$data_dir" --no-mlflow $no_reference \
    --output "$out_dir/${1//[:\/]/-}-$2-$3.json" >&2
}
run sentence-transformers/all-MiniLM-L6-v2 16 auto 150
run sentence-transformers/all-MiniLM-L6-v2 64 auto 100
run random:base 16 auto 100
run random:base 64 auto 60
run random:base 64 fp32 60
python -c 'import json, sys; print(json.dumps([r for f in sys.argv[1:] for r in json.load(open(f))], indent=2))' \
  "$out_dir"/*.json
