"""Hyperparameter sweeps: search spaces over training configs and the results table of a finished sweep. The sweep
itself (Ray Tune trials of training runs) is orchestration: ``sbert_ray.runs.sweep``."""

from sbert_ray.tuning.space import AshaConfig, SearchSpace, SweepConfig

__all__ = ["AshaConfig", "SearchSpace", "SweepConfig"]
