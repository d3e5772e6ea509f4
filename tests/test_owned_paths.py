"""sbert-ray never destroys what it did not create: root, HOME, the working directory and their parents are refused
as any path it writes, replaces or moves; a folder at ``output_dir`` is replaced only when it is one of our models,
a run folder moved aside by --restart only when it is one of our runs. Every refusal comes before Ray starts, and
every file that was there before is there after. (A real run replacing its own model beside another's:
test_reliability.py's rerun test.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import yaml

from sbert_ray.cli import main
from sbert_ray.config import ConfigError
from sbert_ray.runs import record
from sbert_ray.runs.owned_paths import check_model_folder, refuse_protected


def test_root_home_the_working_directory_and_their_parents_are_refused(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "home" / "work" / "project"
    work.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    for path, where in [
        ("/", "the root folder"),
        ("~", "your home folder"),
        (str(tmp_path), f"a folder above your home folder \\({home}\\)"),
        (".", "the working directory"),
        ("..", f"a folder above the working directory \\({work}\\)"),
    ]:
        with pytest.raises(ConfigError, match=f"^--output: .* is {where}; sbert-ray never writes, replaces or deletes"):
            refuse_protected(path, "--output")
    (home / "link").symlink_to(home)
    with pytest.raises(ConfigError, match="your home folder"):  # a link is followed
        check_model_folder(str(home / "link"))
    for allowed in ("~/sbert-ray/models/x", "models", "s3://bucket/runs"):
        refuse_protected(allowed, "output_dir")


def test_restart_moves_aside_only_a_run_folder(tmp_path):
    foreign, run, empty = tmp_path / "photos", tmp_path / "run", tmp_path / "empty"
    foreign.mkdir()
    (foreign / "cat.jpg").write_text("meow")
    with pytest.raises(ConfigError, match=rf"^--restart: {foreign} is not a run folder of sbert-ray"):
        record.archive(str(foreign))
    (tmp_path / "a-file").write_text("keep")
    with pytest.raises(ConfigError, match="is not a run folder"):
        record.archive(str(tmp_path / "a-file"))
    assert (foreign / "cat.jpg").read_text() == "meow" and (tmp_path / "a-file").read_text() == "keep"

    (run / "checkpoint_000001").mkdir(parents=True)  # a run of an earlier sbert-ray: checkpoints, no record
    empty.mkdir()
    kept = [Path(record.archive(str(folder))) for folder in (run, empty)]
    assert not run.exists() and not empty.exists()
    assert kept[0].name.startswith("run.replaced-") and (kept[0] / "checkpoint_000001").is_dir()
    assert kept[1].name.startswith("empty.replaced-")


# ------------------------------------------------------------------------------------ sentinels


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def sentinels(tmp_path, monkeypatch, tiny_train_config):
    """A fake HOME with keys in it, the working directory inside it, a folder of someone else's models beside where
    ours would go, notes in the checkpoint storage (a parent of every run folder), a folder there that is not a
    run, a regular file: each with a sentinel file. Returns the paths and the training config."""
    home = tmp_path / "home"
    work = home / "work"
    files = {
        home / ".ssh" / "id_ed25519": "private key",
        home / ".ray" / "auth_token": "token",
        work / "notes.txt": "work in progress",
        tmp_path / "models" / "other-model" / "config.json": "someone else's model",
        tmp_path / "runs" / "notes.txt": "about my runs",
        tmp_path / "runs" / "not-a-run" / "data.txt": "not a run",
        tmp_path / "a-file": "a file",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    config = tiny_train_config(name="mine")
    base = yaml.safe_load(config.read_text())
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "sweep", "base": base, "search_space": {}}))
    return tmp_path, home, work, config, sweep


def test_every_sentinel_survives_every_command(sentinels, data_dir, capsys):
    root, home, work, config, sweep = sentinels
    before = snapshot(root)
    models, runs = root / "models", root / "runs"
    encode = ["encode", "--model", "random:tiny", "--input", "stsb", "--data-dir", data_dir]
    cases = [  # argv -> a path the one-line error names
        (["train", config, f"output_dir={models}"], f"output_dir: {models} exists and is not a model"),
        # the run's parent: refused as a folder that holds the run's checkpoints (before it would be checked as a model)
        (["train", config, f"output_dir={runs}"], f"output_dir: {runs} is this run's folder or a folder above it"),
        (["train", config, "output_dir=~/"], f"output_dir: {home} is your home folder"),
        (["train", config, "output_dir=."], f"output_dir: {work} is the working directory"),
        (["train", config, "output_dir=/"], "output_dir: / is the root folder"),
        (["train", config, f"output_dir={root}"], f"output_dir: {root} is a folder above your home folder"),
        (["train", config, f"output_dir={root / 'a-file'}"], f"output_dir: {root / 'a-file'} is a file"),
        (["train", config, f"checkpoint.storage_path={root}", "name=home"], f"storage_path: {home} is your home"),
        (["train", config, "checkpoint.storage_path=~/", "name=work"], f"storage_path: {work} is the working dir"),
        (["train", config, "name=not-a-run", "--restart"], f"--restart: {runs / 'not-a-run'} is not a run folder"),
        (["tune", sweep, "base.output_dir=~/"], f"base.output_dir: {home} is your home folder"),
        (["tune", sweep, f"base.checkpoint.storage_path={root}", "name=home"], f"storage_path: {home} is your"),
        ([*encode, "--output", "~"], f"--output: {home} is your home folder"),
        ([*encode, "--output", models], f"--output {models} exists and is not an sbert-ray encode output"),
        (["eval", "--model", "random:tiny", "--output", "."], f"--output: {work} is the working directory"),
        (["eval", "--model", "random:tiny", "--output", "~"], f"--output: {home} is your home folder"),
        (["bench", "encode", "--model", "random:tiny", "--no-mlflow", "--output", "."], f"--output: {work} is the"),
        (["bench", "train", "--model", "random:tiny", "--no-mlflow", "--output", "~/"], f"--output: {home} is your"),
        (["report", "--no-mlflow", "--out", ".."], f"--out: {home} is your home folder"),
    ]
    connected = ray.is_initialized()  # the session's cluster, if an earlier test started it
    for argv, message in cases:
        assert main([str(arg) for arg in argv]) == 2, argv
        err = capsys.readouterr().err
        assert f"sbert-ray {argv[0]}: error: " in err and message in err and len(err.splitlines()) == 1, (argv, err)
        assert ray.is_initialized() == connected  # refused before any Ray (or MLflow) work
    assert snapshot(root) == before  # every file is still there, unchanged, and nothing was added
