"""Throughput benchmarks beside sentence-transformers: ``sbert-ray bench encode`` (``encode_speed``) and ``bench
train`` (``train_speed``; on a Ray cluster through ``train_speed_on_ray``, or ``--local`` in one process).

Measurements only (no Ray for single-process runs); results are plain records that ``bench.tables`` prints,
charts and logs to MLflow.
"""
