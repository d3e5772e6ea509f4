#!/usr/bin/env bash
# Encode benchmark on one GPU, without Ray, MLflow, datasets or pyarrow (run from the repository root, no install
# needed; python3 with torch, transformers and sentence-transformers): a randomly initialised bert-base-shaped model
# (random:base) and the packaged all-MiniLM-L6-v2, each as this project's encode in fp32 / bf16 (autocast and bf16
# weights; float16 on GPUs without bf16) with smart batching on and off, beside sentence-transformers in fp32 and
# bf16, at batch 32 and 128 on the 15,487 unique STSb sentences. A model that cannot be loaded (all-MiniLM-L6-v2 on a
# machine without its package or the Hub) leaves a record saying why and the other still runs; each model's records
# are written as it finishes (benchmarks/steps.sh). Sized to finish in under 5 minutes on one A100/H100-class GPU.
# gpu_train.sh runs one encode run beside the training benchmark.
#
# On a bare GPU machine: `python3 scripts/gpu_carry.py` here, carry the folder `carry`, and run
# `benchmarks/gpu.sh --carry carry` there (docs/testing.md).
#
# --dry-run checks the script itself on CPUs in seconds: a tiny random BERT and all-MiniLM-L6-v2, 32
# sentences, fp32 at one batch size, one timed run (tests/test_benchmark_scripts.py runs it).
#
# usage: benchmarks/gpu.sh [--dry-run] [--carry DIR | DATA_DIR]     (default: $SBERT_RAY_DATA_DIR, else
#        ../shared/data); with $OUT set, the records are kept in $OUT/gpu.json as the models finish
set -uo pipefail  # no -e: a model that fails is recorded and the next one runs
source "$(dirname "$0")/steps.sh"

if $dry_run; then
  device=cpu models=(random:tiny sentence-transformers/all-MiniLM-L6-v2)
  sizes=(--batch-sizes 16 --limit 32 --precisions fp32 --repeats 1 --threads 1)
else
  python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "benchmarks/gpu.sh: no CUDA GPU visible to torch")' || exit 1
  device=cuda models=(random:base sentence-transformers/all-MiniLM-L6-v2) sizes=(--batch-sizes 32,128 --repeats 3)
fi
for model in "${models[@]}"; do
  step "encode-${model//[:\/]/-}" python3 -m sbert_ray.cli bench encode --model "$model" --device "$device" \
    --data-dir "$data_dir" "${sizes[@]}" --no-mlflow
done

finish
