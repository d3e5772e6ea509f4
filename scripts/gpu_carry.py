#!/usr/bin/env python3
"""The folder a bare GPU machine needs beside the checkout to run benchmarks/gpu.sh and gpu_train.sh: the STSb files
the benches read (``<carry>/data/stsb``, a data folder) and bert-base-uncased's vocabulary, the tokenizer of the
``random:<shape>`` models (``<carry>/tokenizer/vocab.txt``); no weights. About 1.7 MB, far under what travels with
a checkout (64 MiB): the data folder (../shared/data) and the packaged all-MiniLM-L6-v2 (88 MB, where the vocabulary
comes from) stay here.

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

from sbert_ray.data.readers import resolve_data_dir
from sbert_ray.models.random_bert import packaged_vocab

STSB_FILES = ("sts-train.csv", "sts-dev.csv", "sts-test.csv", "LICENSE.txt", "SOURCE.md")
CARRY_LIMIT = 64 << 20  # bytes: the most a device call carries beside the checkout


def prepare(data_dir: Path, out: Path) -> dict[str, int]:
    """``out`` holding the STSb files of ``data_dir`` and the packaged vocabulary; each file's size in bytes."""
    stsb = out / "data" / "stsb"
    stsb.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer").mkdir(exist_ok=True)
    copies = {stsb / name: data_dir / "stsb" / name for name in STSB_FILES}
    copies[out / "tokenizer" / "vocab.txt"] = packaged_vocab()
    for target, source in copies.items():
        shutil.copyfile(source, target)
    sizes = {str(target.relative_to(out)): target.stat().st_size for target in copies}
    if sum(sizes.values()) > CARRY_LIMIT:
        raise SystemExit(f"{out}: {sum(sizes.values())} bytes, over the {CARRY_LIMIT} a device call carries")
    return sizes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", help="the data folder holding stsb/ (default: $SBERT_RAY_DATA_DIR)")
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
