#!/usr/bin/env python
"""What reading a prepared source's next window ahead saves: one worker's micro-batches of a pass over a prepared
source on object storage (the moto S3 server of scripts/local_cluster.py), consumed as a GPU step consumes them
(this thread waits ``--step-ms`` per micro-batch, as it waits on the device), with the read-ahead
(``training.stream._read_ahead``) and with each window read in line, interleaved.

    python scripts/read_ahead.py [--step-ms 10] [--repeats 3] [--data-dir ../shared/data]

Prints each run's wall time and the medians as JSON; the time beyond ``micro-batches x step`` is what the data
path costs the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import local_cluster
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sbert_ray.config import EvalConfig, ModelConfig, StageConfig, TrainConfig
from sbert_ray.data.readers import load_records
from sbert_ray.models import build_random_bert, load_encoder
from sbert_ray.runs.prepare_source import PrepareRequest, prepare_source
from sbert_ray.training import stream


def in_line(prepared, groups, windows):
    return (stream._read(prepared, groups, window) for window in windows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("../shared/data"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="read-ahead-"))
    s3 = local_cluster.start_s3(root)
    os.environ.update(s3.env)
    try:
        model = root / "tiny"
        build_random_bert(model)
        pairs = load_records("stsb", "train", args.data_dir)
        (root / "raw").mkdir()
        columns = {name: [getattr(p, name) for p in pairs] * 4 for name in ("sentence1", "sentence2", "score")}
        pq.write_table(pa.table(columns), root / "raw" / "pairs.parquet")  # 4 x STSb train: 23k pairs
        folder = f"s3://{local_cluster.BUCKET}/prepared"
        prepare_source(PrepareRequest(str(root / "raw"), str(model), 128, folder))
        stage = StageConfig(dataset=folder, batch_size=32, window_batches=50)
        config = TrainConfig(name="read-ahead", model=ModelConfig(name=str(model)), stages=[stage],
                             evaluation=EvalConfig(final_tasks=[]))  # fmt: skip
        encoder = load_encoder(str(model), max_seq_length=128)
        cpu = torch.device("cpu")
        seconds: dict[str, list[float]] = {"in line": [], "read-ahead": []}
        read_ahead = stream._read_ahead
        for _ in range(args.repeats):
            for name, reader in (("in line", in_line), ("read-ahead", read_ahead)):
                stream._read_ahead = reader
                sources = stream.local_sources(config, 0, encoder)
                plan = stream.batch_plan(stage, 0, seed=config.seed, world_size=1, rank=0)
                steps, _ = stream.stage_steps([s.rows for s in sources], [s.weight for s in sources], stage, plan)
                batches = stream.StageBatches(sources, plan, steps, 0, 0,
                                              lambda b: b[0].collate(b[1], 0, False, cpu))  # fmt: skip
                started = time.perf_counter()
                for _ in zip(range(steps), batches, strict=False):
                    time.sleep(args.step_ms / 1000)
                seconds[name].append(time.perf_counter() - started)
                print(f"{name}: {steps} micro-batches in {seconds[name][-1]:.2f} s", flush=True)
        stream._read_ahead = read_ahead
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        print(json.dumps({"micro_batches": steps, "step_ms": args.step_ms, "median_s": medians}))
    finally:
        local_cluster.stop(s3.process)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
