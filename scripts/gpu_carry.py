#!/usr/bin/env python3
"""The folder a bare GPU machine needs beside the checkout to run benchmarks/gpu.sh and gpu_train.sh: the data files
the benches read (``<carry>/data``, a data folder: STSb, and the offline NLI set MNRL trains on) and
bert-base-uncased's vocabulary, the tokenizer of the ``random:<shape>`` models (``<carry>/tokenizer/vocab.txt``); no
weights. About 4 MB, far under what travels with a checkout (64 MiB): the data folder (../shared/data) and the
packaged all-MiniLM-L6-v2 (88 MB, where the vocabulary comes from) stay here.

    python3 scripts/gpu_carry.py [--data-dir DIR] [--out carry]

The folder is ignored by git (.gitignore); name it in the device call's ``carry`` and pass it to the scripts
(``benchmarks/gpu.sh --carry carry``), which read the data from it and set ``$SBERT_RAY_BERT_VOCAB`` to its
vocabulary. Prints what it wrote as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from sbert_ray.bench.train_speed import DATASETS
from sbert_ray.data.readers import local_files, resolve_data_dir
from sbert_ray.models.random_bert import packaged_vocab

# (dataset, split) the benches read: training sets, STSb dev (report points) and all of STSb (bench encode).
BENCH_DATA = sorted({*((name, "train") for name in DATASETS.values()), ("stsb", "dev"), ("stsb", "test")})
CARRY_LIMIT = 64 << 20  # bytes: the most a device call carries beside the checkout


def prepare(data_dir: Path, out: Path) -> dict[str, int]:
    """``out`` holding ``BENCH_DATA``'s files of ``data_dir`` (with each dataset folder's SOURCE.md, where the files
    and their licence come from) and the packaged vocabulary; each file's size in bytes."""
    files = {file for name, split in BENCH_DATA for file in local_files(name, split)}
    files |= {f"{Path(file).parts[0]}/SOURCE.md" for file in files}
    copies = {out / "data" / file: data_dir / file for file in sorted(files)}
    copies[out / "tokenizer" / "vocab.txt"] = packaged_vocab()
    for target, source in copies.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    sizes = {str(target.relative_to(out)): target.stat().st_size for target in copies}
    if sum(sizes.values()) > CARRY_LIMIT:
        raise SystemExit(f"{out}: {sum(sizes.values())} bytes, over the {CARRY_LIMIT} a device call carries")
    return sizes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="the data folder to copy from (default: $SBERT_RAY_DATA_DIR)")
    parser.add_argument("--out", default="carry", help="the carry folder to write (default: carry)")
    args = parser.parse_args(argv)
    data_dir = resolve_data_dir(args.data_dir)
    if data_dir is None:
        parser.error("no data folder: pass --data-dir or set SBERT_RAY_DATA_DIR")
    sizes = prepare(data_dir, Path(args.out))
    print(json.dumps({"carry": args.out, "bytes": sum(sizes.values()), "files": sizes}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
