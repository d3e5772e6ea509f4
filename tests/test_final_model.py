"""The final model is copied out of the last checkpoint through a temporary folder and a rename."""

from pathlib import Path

import pytest
import ray.train

from sbert_ray.runs.training import save_final_model
from sbert_ray.training.state import MODEL_DIR


def checkpoint_with_model(root: Path, files: dict[str, str]) -> ray.train.Checkpoint:
    model = root / MODEL_DIR
    model.mkdir(parents=True)
    for name, text in files.items():
        (model / name).write_text(text)
    return ray.train.Checkpoint.from_directory(root)


def test_final_model_replaces_the_previous_one(tmp_path):
    output = tmp_path / "final-model"
    save_final_model(checkpoint_with_model(tmp_path / "a", {"config.json": "first", "old.txt": "x"}), output)
    save_final_model(checkpoint_with_model(tmp_path / "b", {"config.json": "second"}), output)
    assert sorted(p.name for p in output.iterdir()) == ["config.json"]
    assert (output / "config.json").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "final-model"]  # no staging folder left


def test_a_failed_copy_leaves_the_previous_model_and_no_partial_folder(tmp_path):
    output = tmp_path / "final-model"
    save_final_model(checkpoint_with_model(tmp_path / "a", {"config.json": "first"}), output)
    broken = checkpoint_with_model(tmp_path / "b", {"config.json": "second"})
    # A weights file that cannot be read: copytree copies the rest, then raises.
    (tmp_path / "b" / MODEL_DIR / "model.safetensors").symlink_to(tmp_path / "missing")
    with pytest.raises(OSError):
        save_final_model(broken, output)
    assert (output / "config.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "final-model"]
