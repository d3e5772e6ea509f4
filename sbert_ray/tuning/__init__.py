"""Hyperparameter sweeps: search spaces over training configs, run as Ray Tune trials of Ray Train runs."""

from sbert_ray.tuning.space import AshaConfig, SearchSpace, SweepConfig
from sbert_ray.tuning.sweep import SweepResult, run_sweep

__all__ = ["AshaConfig", "SearchSpace", "SweepConfig", "SweepResult", "run_sweep"]
