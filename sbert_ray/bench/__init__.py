"""Throughput benchmarks, side by side in one process: ``sbert-ray bench encode``.

Measurements only (no Ray for single-process runs); results are plain records that ``bench.tables`` prints,
charts and logs to MLflow.
"""
