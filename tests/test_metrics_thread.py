"""Rank 0's metrics leave the training step through a thread: ``RunLogger.log_metrics`` only queues them.

Against a real sqlite MLflow store in a temporary folder (no server, no Ray), made slow by holding its
``log_batch`` calls until the test lets them through.
"""

from __future__ import annotations

import itertools
import threading
import time

from sbert_ray.tracking.mlflow_run import SEND_EVERY_S, RunLogger, RunTracker, resolve_tracking_uri

STEPS = 30


def test_log_metrics_returns_while_the_store_is_held_and_every_metric_arrives_once_in_order(tmp_path):
    uri = resolve_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with RunTracker(uri, "metrics-thread", "run") as tracker:
        run_id = tracker.run_id
    logger = RunLogger(uri, run_id, spool=tmp_path / "spool.jsonl")
    store_open = threading.Event()
    store_calls = []
    log_batch = logger.client.log_batch

    def held_log_batch(*args, **kwargs):
        store_calls.append(threading.current_thread().name)
        store_open.wait(timeout=5)  # a synchronous logger stalls the caller here, 5 s a call
        return log_batch(*args, **kwargs)

    logger.client.log_batch = held_log_batch
    started = time.monotonic()
    for step in range(1, STEPS + 1):
        logger.log_metrics({"train/loss": 1.0 / step, "train/step_again": float(step)}, step=step)
    logging_s = time.monotonic() - started

    assert not store_open.is_set()
    assert logging_s < 5, f"log_metrics waited on the store: {logging_s:.1f} s for {STEPS} calls"
    store_open.set()
    logger.drain()
    logger.flush(wait_s=10)  # what the driver does after training: nothing is left in the spool

    assert store_calls and "mlflow-metrics" in store_calls  # the store was called from the metrics thread
    assert not (tmp_path / "spool.jsonl").exists()
    history = logger.client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, STEPS + 1))  # each step once
    assert [m.value for m in history] == [1.0 / step for step in range(1, STEPS + 1)]
    timestamps = [m.timestamp for m in history]
    assert timestamps == sorted(timestamps)  # taken when logged, kept in order through the queue
    again = logger.client.get_metric_history(run_id, "train/step_again")
    assert [(m.step, m.value) for m in again] == [(step, float(step)) for step in range(1, STEPS + 1)]


def test_metrics_go_out_at_most_every_send_interval_and_at_once_when_drained(tmp_path):
    """A fast run reads its loss several times a second; each request costs a basic-auth server a password hash, so
    the thread sends what waits at most every ``SEND_EVERY_S``, and at once when a report point drains it."""
    uri = resolve_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with RunTracker(uri, "send-interval", "run") as tracker:
        run_id = tracker.run_id
    logger = RunLogger(uri, run_id, spool=tmp_path / "spool.jsonl")
    sent_at = []
    log_batch = logger.client.log_batch

    def timed_log_batch(*args, **kwargs):
        sent_at.append(time.monotonic())
        return log_batch(*args, **kwargs)

    logger.client.log_batch = timed_log_batch
    started = time.monotonic()
    for step in range(1, STEPS + 1):  # 30 loss reads in ~1.5 s
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
        time.sleep(0.05)
    logger.drain()

    history = logger.client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, STEPS + 1))  # the drain sent the rest without waiting
    assert not (tmp_path / "spool.jsonl").exists()
    elapsed = time.monotonic() - started
    assert len(sent_at) <= elapsed / SEND_EVERY_S + 2, sent_at  # on time, plus the drain's
    gaps = [later - earlier for earlier, later in itertools.pairwise(sent_at[:-1])]  # the last: the drain's
    assert all(gap >= 0.9 * SEND_EVERY_S for gap in gaps), gaps
