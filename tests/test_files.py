"""Paths a command will write are checked before any work (right kind, writable; local and object storage), and
JSON files never hold NaN. The unwritable place is /proc, which refuses new files to root as well (permission bits
would not: these tests may run as root)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import local_cluster
import pytest

from sbert_ray.atomic_files import atomic_write
from sbert_ray.cli import main
from sbert_ray.config import ConfigError, load_config
from sbert_ray.files import check_file, check_folder, json_text, write_json
from sbert_ray.runs.train_run import run_training

UNWRITABLE = "/proc/sbert-ray-test"


@pytest.fixture
def regular_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a folder\n")
    return path


def test_usable_paths_pass_and_nothing_is_created(tmp_path: Path) -> None:
    assert check_folder(str(tmp_path / "new" / "runs"), "checkpoint.storage_path") == str(tmp_path / "new" / "runs")
    check_folder(str(tmp_path))
    check_folder(f"file://{tmp_path}/runs")
    check_file(str(tmp_path / "out" / "results.json"))
    (tmp_path / "old.json").write_text("{}")
    check_file(str(tmp_path / "old.json"))  # replaced by the writer: fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # the write probe leaves nothing behind


@pytest.mark.parametrize(
    "check, where, problem",
    [
        (check_folder, "{file}", "{file} is a file, not a folder"),
        (check_folder, "{file}/runs", "{file}/runs lies under {file}, which is a file"),
        (check_folder, UNWRITABLE + "/runs", "cannot write in /proc ("),
        (check_file, "{tmp}", "{tmp} is a folder; name a file"),
        (check_file, "{file}/results.json", "{file}/results.json lies under {file}, which is a file"),
        (check_file, UNWRITABLE + ".json", "cannot write in /proc ("),
    ],
)
def test_unusable_paths_name_the_key(tmp_path: Path, regular_file: Path, check, where: str, problem: str) -> None:
    path = where.format(file=regular_file, tmp=tmp_path)
    with pytest.raises(ConfigError, match="^some.key: " + re.escape(problem.format(file=regular_file, tmp=tmp_path))):
        check(path, "some.key")


def test_a_uri_pyarrow_cannot_open_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint.storage_path: nosuch://bucket/runs: pyarrow cannot open it"):
        check_folder("nosuch://bucket/runs", "checkpoint.storage_path")


@pytest.mark.servers
def test_object_storage_needs_an_existing_bucket(s3_server, monkeypatch) -> None:
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    check_folder(f"s3://{local_cluster.BUCKET}/runs", "checkpoint.storage_path")
    with pytest.raises(ConfigError) as err:
        check_folder("s3://no-such-bucket/runs", "checkpoint.storage_path")
    assert str(err.value) == "checkpoint.storage_path: s3://no-such-bucket/runs: bucket 'no-such-bucket' does not exist"


# --- train, eval and bench check their paths before any work -------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("checkpoint.storage_path={file}", "checkpoint.storage_path: {file} is a file, not a folder"),
        ("checkpoint.storage_path=" + UNWRITABLE, "checkpoint.storage_path: cannot write in /proc"),
        ("output_dir={file}", "output_dir: {file} is a file, not a folder"),
        ("output_dir={file}/model", "output_dir: {file}/model lies under {file}, which is a file"),
    ],
)
def test_train_refuses_unusable_paths_before_mlflow(
    tiny_train_config, tmp_path: Path, regular_file: Path, override: str, message: str
) -> None:
    """These were found after the MLflow run opened (storage: a traceback) or after the whole training (output)."""
    config = load_config(tiny_train_config(), [override.format(file=regular_file)])
    with pytest.raises(ConfigError, match="^" + re.escape(message.format(file=regular_file))):
        run_training(config)
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--model", "random:tiny", "--tasks", "stsb"],
        ["bench", "encode", "--model", "random:tiny"],
        ["bench", "train", "--model", "random:tiny", "--local"],
    ],
)
@pytest.mark.parametrize(
    "output, message",
    [
        ("{tmp}", "{tmp} is a folder; name a file"),
        ("{file}/r.json", "{file}/r.json lies under {file}, which is a file"),
    ],
)
def test_output_files_are_checked_before_any_work(
    tmp_path: Path, regular_file: Path, capsys, command: list[str], output: str, message: str
) -> None:
    """eval --output used to fail after the whole evaluation."""
    assert main([*command, "--output", output.format(tmp=tmp_path, file=regular_file)]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert error.endswith(f"error: --output: {message.format(tmp=tmp_path, file=regular_file)}")


def test_bench_train_checks_its_storage_path(regular_file: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "train", "--model", "random:tiny", "--storage-path", str(regular_file)])
    assert exit_info.value.code == 2
    assert f"argument --storage-path: {regular_file} is a file, not a folder" in capsys.readouterr().err


# --- JSON ------------------------------------------------------------------------------------------------------


def test_json_never_holds_nan_or_infinity(tmp_path: Path) -> None:
    data = {"a": math.nan, "b": [1.5, math.inf, -math.inf], "c": {"d": (math.nan, "x")}, "e": 2}
    assert json.loads(json_text(data)) == {"a": None, "b": [1.5, None, None], "c": {"d": [None, "x"]}, "e": 2}
    write_json(data, tmp_path / "out" / "data.json")
    strict = json.loads((tmp_path / "out" / "data.json").read_text(), parse_constant=pytest.fail)
    assert strict["a"] is None and [p.name for p in (tmp_path / "out").iterdir()] == ["data.json"]


def test_an_atomic_write_interrupted_by_an_error_leaves_the_old_file_and_no_partial(tmp_path):
    target = tmp_path / "record.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_write(target) as partial:
        Path(partial).write_text("half")
        raise RuntimeError("killed mid-write")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
    with atomic_write(target) as partial:
        Path(partial).write_text("new")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]
