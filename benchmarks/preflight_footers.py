"""How long a run's preflight takes to count a source of many parquet shards on object storage: every shard's footer
read and checked (``training.sources.known_rows``) as before (one at a time, a pyarrow filesystem built for each),
then ``FOOTER_READERS`` at a time, then also one filesystem per folder (now), interleaved, on a local S3-compatible
server (moto, as the tests start it).

    python benchmarks/preflight_footers.py --shards 2000 --repeats 2 --output footers.json

Each shard holds ``--rows`` (anchor, positive, negative) rows in one row group with statistics. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import local_cluster
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from sbert_ray.config import StageConfig
from sbert_ray.training import sources


def write_shards(filesystem: pafs.FileSystem, prefix: str, shards: int, rows: int) -> None:
    def write(shard: int) -> None:
        texts = [f"shard {shard} sentence {i}" for i in range(rows)]
        table = pa.table({"anchor": texts, "positive": [t + "." for t in texts], "negative": texts[::-1]})
        pq.write_table(table, f"{prefix}/part-{shard:05d}.parquet", filesystem=filesystem)

    with ThreadPoolExecutor(16) as writers:
        list(writers.map(write, range(shards)))


FOLDER_FILESYSTEMS = sources._FolderFilesystems.__call__
VARIANTS = {  # name: (footers read at once, one filesystem per folder)
    "one at a time, a filesystem per file (before)": (1, False),
    f"{sources.FOOTER_READERS} at once, a filesystem per file": (sources.FOOTER_READERS, False),
    f"{sources.FOOTER_READERS} at once, a filesystem per folder (now)": (sources.FOOTER_READERS, True),
}


def time_preflight(spec: str, readers: int, per_folder: bool) -> tuple[float, int]:
    sources.FOOTER_READERS = readers
    sources._FolderFilesystems.__call__ = (
        FOLDER_FILESYSTEMS if per_folder else lambda folders, file: sources._filesystem(file, folders.key)
    )
    stage = StageConfig(dataset=spec, objective="triplet")  # keeps every row: the footers count it
    start = time.perf_counter()
    (source,) = sources.stage_sources(stage, 0)
    rows = sources.known_rows(source, stage, None)
    return time.perf_counter() - start, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as root:
        server = local_cluster.start_s3(Path(root))
        try:
            os.environ.update(server.env)  # pyarrow's S3 client reads the endpoint and credentials from it
            spec = f"s3://{local_cluster.BUCKET}/footers"
            filesystem, prefix = pafs.FileSystem.from_uri(spec)
            written = time.perf_counter()
            write_shards(filesystem, prefix, args.shards, args.rows)
            written = time.perf_counter() - written
            seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for _ in range(args.repeats):  # interleaved: the VM's speed drifts within minutes
                for name, variant in VARIANTS.items():
                    elapsed, rows = time_preflight(spec, *variant)
                    assert rows == args.shards * args.rows, rows
                    seconds[name].append(elapsed)
        finally:
            local_cluster.stop(server.process)

    result = {
        "shards": args.shards,
        "rows_per_shard": args.rows,
        "write_s": round(written, 1),
        "preflight_s": {name: [round(s, 1) for s in runs] for name, runs in seconds.items()},
        "speedup_vs_before": {
            name: round(statistics.median(next(iter(seconds.values()))) / statistics.median(runs), 2)
            for name, runs in seconds.items()
        },
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(json.dumps(result, indent=2))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
