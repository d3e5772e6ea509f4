"""What a restart inside a pass over a prepared source costs before its first micro-batch: the rows read and the
seconds, in one worker's stream (``training.stream.StageBatches``, as a Train worker takes it), for a restart at
``--at`` of the first pass and for a fresh start.

    python benchmarks/prepared_resume.py --rows 200000 --output resume.json
    PYTHONPATH=/path/to/older/checkout python benchmarks/prepared_resume.py ...   # the same, with older code

The source is written here: ``--rows`` synthetic tokenised pairs (8 to 40 token ids each) in 8 shards of row groups
of 8,192 rows, with a manifest of the tiny random model's settings. Rows read are counted at the reader: the
stream's own ``read`` count where it keeps one (a prepared source read by row group), else every table
``training.sources.read_tables`` gives (code that streamed a pass from its start). Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sbert_ray.config import EvalConfig, ModelConfig, StageConfig, TrainConfig
from sbert_ray.data.prepared import MANIFEST, Manifest, Shard, prepared_settings
from sbert_ray.models import load_encoder
from sbert_ray.training import stream as stream_module
from sbert_ray.training.sources import column_roles, reading

SHARDS, ROWS_PER_GROUP, MODEL, MAX_SEQ_LENGTH = 8, 8192, "random:tiny", 64


def write_source(folder: Path, rows: int, stage: StageConfig, encoder) -> None:
    """``rows`` tokenised pairs with scores in SHARDS shards, and their manifest."""
    rng = np.random.default_rng(0)
    shards = []
    for index, count in enumerate(np.diff(np.linspace(0, rows, SHARDS + 1).astype(int)).tolist()):
        columns = {}
        lengths = []
        for k in (0, 1):
            sizes = rng.integers(8, 41, count)
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
            ids = rng.integers(1000, 30000, int(offsets[-1])).astype(np.int32)
            columns[f"ids_{k}"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids))
            columns[f"hash_{k}"] = pa.array(rng.integers(-(2**63), 2**63 - 1, count, dtype=np.int64))
            lengths.append(sizes)
        columns["length"] = pa.array(np.maximum(*lengths).astype(np.int32))
        columns["truncated"] = pa.array(np.zeros(count, dtype=np.int8))
        columns["label"] = pa.array(rng.random(count).astype(np.float32))
        name = f"part-{index}.parquet"
        pq.write_table(pa.table(columns), folder / name, row_group_size=ROWS_PER_GROUP)
        groups = [min(ROWS_PER_GROUP, count - start) for start in range(0, count, ROWS_PER_GROUP)]
        shards.append(Shard(name, count, tuple(groups)))
    settings = prepared_settings(encoder.tokenizer, encoder.max_seq_length, encoder.prompts, reading(stage))
    manifest = Manifest(str(folder), settings, "synthetic", MODEL, {}, column_roles(stage, 2), ROWS_PER_GROUP,
                        tuple(shards))  # fmt: skip
    (folder / MANIFEST).write_text(json.dumps(manifest.to_json()))


def first_batch(config: TrainConfig, encoder, position: int) -> dict:
    """Seconds and rows read until the first micro-batch of a stream started at ``position`` of epoch 0."""
    read = [0]
    counts_reads = "read" in {field.name for field in dataclasses.fields(stream_module.SourceCounts)}
    if not counts_reads:  # older code: every table it read of the shards, counted as it comes
        original = stream_module.read_tables

        def counted(*args, **kwargs):
            for table in original(*args, **kwargs):
                read[0] += table.num_rows
                yield table

        stream_module.read_tables = counted
    stage = config.stages[0]
    started = time.perf_counter()
    sources = stream_module.local_sources(config, 0, encoder)
    plan = stream_module.batch_plan(stage, 0, seed=config.seed, world_size=1, rank=0)
    per_epoch, _ = stream_module.stage_steps([s.rows for s in sources], [s.weight for s in sources], stage, plan)
    counted_from = time.perf_counter()  # (older code read the whole pass once here, to count it)
    read[0] = 0
    batches = stream_module.StageBatches(
        sources, plan, per_epoch, 0, position,
        collate=lambda batch: batch[0].collate(batch[1], 0, False, torch.device("cpu")),
    )  # fmt: skip
    next(iter(batches))
    seconds = time.perf_counter() - counted_from
    if counts_reads:
        read[0] = int(batches.metrics()[f"data/{sources[0].name}/read"])
    else:
        stream_module.read_tables = original
    return {"position": position, "of": per_epoch, "rows_read": read[0], "seconds": round(seconds, 3),
            "sources_opened_s": round(counted_from - started, 3)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--window-batches", type=int, default=200)
    parser.add_argument("--at", type=float, default=0.9, help="where in the first pass the restart is")
    parser.add_argument("--label", default="now")
    parser.add_argument("--output")
    args = parser.parse_args()
    torch.set_num_threads(1)
    encoder = load_encoder(MODEL, max_seq_length=MAX_SEQ_LENGTH)
    with tempfile.TemporaryDirectory() as folder:
        stage = StageConfig(dataset=folder, batch_size=args.batch_size, window_batches=args.window_batches)
        write_source(Path(folder), args.rows, stage, encoder)
        config = TrainConfig(
            name="prepared-resume", model=ModelConfig(name=MODEL, max_seq_length=MAX_SEQ_LENGTH), stages=[stage],
            evaluation=EvalConfig(final_tasks=[]),
        )  # fmt: skip
        per_pass = -(-args.rows // args.batch_size)
        fresh = first_batch(config, encoder, 0)
        restart = first_batch(config, encoder, int(args.at * per_pass))
    result = {
        "label": args.label,
        "rows": args.rows,
        "batch_size": args.batch_size,
        "window_batches": args.window_batches,
        "rows_per_group": ROWS_PER_GROUP,
        "window_rows": args.window_batches * args.batch_size,
        "fresh_start": fresh,
        "restart": restart,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")


if __name__ == "__main__":
    main()
