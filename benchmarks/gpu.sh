#!/usr/bin/env bash
# Encode benchmark on one GPU, without Ray, MLflow or datasets (run from the repository root, no install needed):
# the packaged all-MiniLM-L6-v2 and a randomly initialised bert-base-shaped model (random:base), each as this
# project's encode in fp32 / bf16 (autocast and bf16 weights; float16 on GPUs without bf16) with smart batching on
# and off, beside sentence-transformers in fp32 and bf16, at batch 32 and 128 on the 15,487 unique STSb sentences.
# Sized to finish in under 5 minutes on one A100/H100-class GPU; prints one JSON list with the records of both
# models (progress and tables go to stderr).
#
# Not measured yet: no GPU was available where this was written, so the GPU path was checked by reading only
# and README quotes no GPU figures.
#
# usage: benchmarks/gpu.sh [DATA_DIR]     (default: $SBERT_RAY_DATA_DIR, else ../shared/data)
set -euo pipefail

data_dir=${1:-${SBERT_RAY_DATA_DIR:-../shared/data}}
out_dir=$(mktemp -d)
trap 'rm -rf "$out_dir"' EXIT

python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "benchmarks/gpu.sh: no CUDA GPU visible to torch")'
for model in sentence-transformers/all-MiniLM-L6-v2 random:base; do
  python -m sbert_ray.cli bench encode --model "$model" --device cuda --data-dir "$data_dir" --batch-sizes 32,128 \
    --repeats 3 --no-mlflow --output "$out_dir/${model//[:\/]/-}.json" >&2
done
python -c 'import json, sys; print(json.dumps([r for f in sys.argv[1:] for r in json.load(open(f))], indent=2))' \
  "$out_dir"/*.json
