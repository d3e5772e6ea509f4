"""Issue 19 item 6: training memory and the time to the first step do not grow with the corpus.

scripts/stream_memory.py measures it (a generated corpus on S3, trained on a Ray cluster of its own, every process
sampled): at two corpus sizes it is a benchmark, quoted with its command in docs/large-data.md. Here it runs at its
smallest size, against the session's S3 server, and what it measured must stay within the absolute bounds; its
prepared mode (issue 27 item 6: prepare, train, kill, resume late in the pass) at a tiny size, for what it reports.
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


def test_a_tiny_prepared_corpus_is_prepared_trained_killed_and_resumed_late_in_its_pass(
    s3_server, data_dir, tmp_path
) -> None:
    """Issue 27 item 6 at CI size (2 shards of 3,000 pairs): the benchmark's prepared mode runs end to end (prepare
    on the cluster, train, kill the driver at the first resume point, resume at 90 % of the pass) and what it
    reports is what happened: the resumed run logged its epoch past the moved position, read no more than its
    share's window, and both runs' processes were sampled."""
    output = tmp_path / "prepared.json"
    argv = ["--shards", "2", "--shard-rows", "3000", "--prepared", "--s3-endpoint", s3_server.endpoint]
    code = stream_memory.main([*argv, "--data-dir", str(data_dir), "--work-dir", str(tmp_path / "runs"),
                               "--output", str(output)])  # fmt: skip
    report = json.loads(output.read_text())
    (run,) = report["runs"]
    again = run["resumed"]
    print(f"\n{stream_memory.Measured(**run | {'resumed': stream_memory.Resumed(**again)})}")
    assert code == 0 and report["broken_bounds"] == [] and report["source"] == "prepared", report
    # 6,000 pairs, 2 workers of 16 a micro-batch: 188 global micro-batches a pass, moved to 169 (90 %)
    assert (run["pairs"], again["of"], again["position"]) == (6000, 188, 169), again
    # its first report is REPORT_EVERY steps on: the epoch logged there counts from the moved position
    assert again["epoch"] == pytest.approx((169 + stream_memory.REPORT_EVERY) / 188), again
    # rank 0 read the row groups its share of the window lies in (the window holds the whole of so short a pass:
    # its 3,000 rows, in row groups of a whole shard each), so the pass at most, and something
    assert 0 < again["rows_read"] <= 6000 and 0 < run["rows_read"] <= 6000, run
    for driver, workers in ((run["driver_mb"], run["workers_mb"]), (again["driver_mb"], again["workers_mb"])):
        assert driver > 100 and len(workers) == 2 and min(workers) > 100, run
    assert 0 < run["first_step_s"] <= run["first_step_wall_s"] and run["prepare_s"] > 0, run
    assert 0 < again["first_step_s"] <= again["first_step_wall_s"], again
