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
# --dry-run checks the script itself on CPUs in about a minute: a tiny random BERT in place of both models, 32
# sentences, fp32 at one batch size, one timed run (tests/test_benchmark_scripts.py runs it).
#
# usage: benchmarks/gpu.sh [--dry-run] [DATA_DIR]     (default: $SBERT_RAY_DATA_DIR, else ../shared/data)
set -euo pipefail

dry_run=false
if [[ ${1:-} == --dry-run ]]; then dry_run=true; shift; fi
data_dir=${1:-${SBERT_RAY_DATA_DIR:-../shared/data}}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's sbert_ray
out_dir=$(mktemp -d)
trap 'rm -rf "$out_dir"' EXIT

if $dry_run; then
  device=cpu models=(random:tiny)
  sizes=(--batch-sizes 16 --limit 32 --precisions fp32 --repeats 1 --threads 1)
else
  python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "benchmarks/gpu.sh: no CUDA GPU visible to torch")'
  device=cuda models=(sentence-transformers/all-MiniLM-L6-v2 random:base) sizes=(--batch-sizes 32,128 --repeats 3)
fi
for model in "${models[@]}"; do
  python -m sbert_ray.cli bench encode --model "$model" --device "$device" --data-dir "$data_dir" "${sizes[@]}" \
    --no-mlflow --output "$out_dir/${model//[:\/]/-}.json" >&2
done
python -c 'import json, sys; print(json.dumps([r for f in sys.argv[1:] for r in json.load(open(f))], indent=2))' \
  "$out_dir"/*.json
