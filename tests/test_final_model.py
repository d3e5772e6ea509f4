"""The final model: copied out of the last checkpoint into a staging folder, marked as ours, swapped in. Only a folder
sbert-ray wrote (or an empty one) is ever replaced, and a crash at any step leaves one complete model."""

import json
import os
import shutil
from pathlib import Path

import pytest
import ray.train
from sentence_transformers import SentenceTransformer

from sbert_ray.config import ConfigError
from sbert_ray.runs.final_model import save_final_model
from sbert_ray.runs.owned_paths import MODEL_MARKER, check_model_folder
from sbert_ray.training.state import MODEL_DIR

RUN = {"run": "tiny", "run_dir": "/runs/tiny", "mlflow_run_id": "abc123"}


def checkpoint_with_model(root: Path, files: dict[str, str]) -> ray.train.Checkpoint:
    model = root / MODEL_DIR
    model.mkdir(parents=True)
    for name, text in files.items():
        (model / name).write_text(text)
    return ray.train.Checkpoint.from_directory(root)


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_our_previous_model_is_replaced_and_the_folder_still_loads(tmp_path, tiny_model_dir):
    output = tmp_path / "final-model"
    save_final_model(checkpoint_with_model(tmp_path / "a", {"config.json": "first", "old.txt": "x"}), output, **RUN)
    marker = json.loads((output / MODEL_MARKER).read_text())
    assert {key: marker[key] for key in RUN} == RUN and marker["written_by"].startswith("sbert-ray ")

    shutil.copytree(tiny_model_dir, tmp_path / "b" / MODEL_DIR)
    save_final_model(ray.train.Checkpoint.from_directory(tmp_path / "b"), output, **RUN | {"mlflow_run_id": "def456"})
    assert names(output) == sorted([*(p.name for p in tiny_model_dir.iterdir()), MODEL_MARKER])  # nothing old left
    assert json.loads((output / MODEL_MARKER).read_text())["mlflow_run_id"] == "def456"
    assert SentenceTransformer(str(output), device="cpu").encode(["a marked folder loads"]).shape == (1, 32)
    assert names(tmp_path) == ["a", "b", "final-model"]  # no staging folder, no previous model left


def test_a_folder_we_did_not_write_is_refused_and_kept(tmp_path):
    foreign = tmp_path / "models"
    (foreign / "other-model").mkdir(parents=True)
    (foreign / "other-model" / "config.json").write_text("theirs")
    with pytest.raises(ConfigError, match=rf"output_dir: {foreign} exists and is not a model sbert-ray wrote .*"
                       r"choose another path, or remove the folder yourself"):  # fmt: skip
        check_model_folder(str(foreign))
    # Checked again at the swap (hours after preflight): still refused, nothing touched.
    with pytest.raises(ConfigError, match="is not a model sbert-ray wrote"):
        save_final_model(checkpoint_with_model(tmp_path / "a", {"config.json": "new"}), foreign, **RUN)
    assert names(foreign) == ["other-model"] and (foreign / "other-model" / "config.json").read_text() == "theirs"
    assert names(tmp_path) == ["a", "models"]

    (tmp_path / "a-file").write_text("keep")
    with pytest.raises(ConfigError, match=rf"output_dir: {tmp_path / 'a-file'} is a file, not a folder"):
        check_model_folder(str(tmp_path / "a-file"))
    (tmp_path / "empty").mkdir()
    check_model_folder(str(tmp_path / "empty"))  # an empty folder holds nothing to lose
    # A model inside the run folder --restart moves aside goes along with it, whoever wrote it.
    check_model_folder(str(foreign / "other-model"), leaving=str(foreign))


def test_a_failed_copy_leaves_the_previous_model_and_no_partial_folder(tmp_path):
    output = tmp_path / "final-model"
    save_final_model(checkpoint_with_model(tmp_path / "a", {"config.json": "first"}), output, **RUN)
    broken = checkpoint_with_model(tmp_path / "b", {"config.json": "second"})
    # A weights file that cannot be read: copytree copies the rest, then raises.
    (tmp_path / "b" / MODEL_DIR / "model.safetensors").symlink_to(tmp_path / "missing")
    with pytest.raises(OSError):
        save_final_model(broken, output, **RUN)
    assert (output / "config.json").read_text() == "first"
    assert names(tmp_path) == ["a", "b", "final-model"]


class Crash(BaseException):
    """The process dying between two steps of the swap (no exception handler runs for a real one)."""


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_a_crash_at_any_step_of_the_swap_leaves_one_complete_model(tmp_path, monkeypatch, crash_at):
    """The swap is three renames: previous model aside, new one in, previous one into the staging folder. Dying
    before any of them leaves a complete model at the path, or (between the first two) the previous one aside,
    which the next run's preflight puts back; the next swap then finishes cleanly."""
    output = tmp_path / "final-model"
    save_final_model(checkpoint_with_model(tmp_path / "a", {"config.json": "first"}), output, **RUN)
    renames, rename = [], os.rename

    def crashing_rename(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        if len(renames) == crash_at:
            raise Crash
        rename(src, dst)

    monkeypatch.setattr(os, "rename", crashing_rename)
    with pytest.raises(Crash):
        save_final_model(checkpoint_with_model(tmp_path / "b", {"config.json": "second"}), output, **RUN)
    monkeypatch.setattr(os, "rename", rename)
    assert renames[-1] == [("final-model", ".final-model.previous"), (MODEL_DIR, "final-model"),
                           (".final-model.previous", "previous")][crash_at - 1]  # fmt: skip

    if crash_at == 2:  # between the renames: no model at the path, the previous one complete beside it
        assert not output.exists() and (tmp_path / ".final-model.previous" / "config.json").read_text() == "first"
    check_model_folder(str(output))  # the next run's preflight
    expected = "second" if crash_at == 3 else "first"
    assert (output / "config.json").read_text() == expected and (output / MODEL_MARKER).is_file()
    save_final_model(checkpoint_with_model(tmp_path / "c", {"config.json": "third"}), output, **RUN)
    assert (output / "config.json").read_text() == "third"
    assert names(tmp_path) == ["a", "b", "c", "final-model"]  # the stale previous model is gone too
