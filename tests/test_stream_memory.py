"""Issue 19 item 6: training memory and the time to the first step do not grow with the corpus.

scripts/stream_memory.py measures it (a generated corpus on S3, trained on a Ray cluster of its own, every process
sampled): at two corpus sizes it is a benchmark, quoted with its command in docs/large-data.md. Here it runs at its
smallest size, against the session's S3 server, and what it measured must stay within the absolute bounds.
"""

from __future__ import annotations

import json

import pytest
import stream_memory

pytestmark = [pytest.mark.cluster, pytest.mark.servers, pytest.mark.slow]


def test_the_smallest_corpus_trains_within_the_memory_bounds(s3_server, data_dir, tmp_path) -> None:
    output = tmp_path / "stream-memory.json"
    argv = ["--shards", "2", "--s3-endpoint", s3_server.endpoint, "--data-dir", str(data_dir)]
    code = stream_memory.main([*argv, "--work-dir", str(tmp_path / "runs"), "--output", str(output)])
    report = json.loads(output.read_text())
    (run,) = report["runs"]
    print(f"\n{stream_memory.Measured(**run)}")
    assert code == 0 and report["broken_bounds"] == [], report
    assert run["pairs"] == 2 * stream_memory.SHARD_ROWS
    # The sampler saw what it measures: the driver, both Train workers, the cluster (all above an idle Python's RSS).
    assert run["driver_mb"] < stream_memory.DRIVER_RSS_MAX / stream_memory.MB and run["driver_mb"] > 100, run
    assert len(run["workers_mb"]) == 2 and 100 < min(run["workers_mb"]), run
    assert max(run["workers_mb"]) < stream_memory.WORKER_RSS_MAX / stream_memory.MB, run
    assert run["cluster_mb"] > sum(run["workers_mb"]) and run["first_step_s"] > 0, run
