"""The documentation: the site builds without warnings, the configuration reference documents every key of the config
dataclasses (it is generated from their comments), and every file README links to exists."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing
from pathlib import Path

import config_reference

from sbert_ray.config import TrainConfig
from sbert_ray.tuning import SweepConfig

REPO = Path(__file__).resolve().parents[1]


def dataclass_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass, as the reference names them (`stages.N.` for list items)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f.name
        keys.append(f"{prefix}{name}")
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if typing.get_origin(hints[name]) is list and dataclasses.is_dataclass(item := typing.get_args(hints[name])[0]):
            keys += dataclass_keys(item, f"{prefix}{name}.N.")  # stages, evaluation.dev_tasks (empty by default)
        elif dataclasses.is_dataclass(value) and not isinstance(value, TrainConfig):
            keys += dataclass_keys(type(value), f"{prefix}{name}.")
        elif value is None and (optional := _optional_dataclass(typing.get_type_hints(cls)[name])):
            keys += dataclass_keys(optional, f"{prefix}{name}.")
    return keys


def _optional_dataclass(hint) -> type | None:
    """X for a field typed ``X | None`` with X a dataclass (``model.lora``: None by default, its keys documented)."""
    inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return inner[0] if len(inner) == 1 and dataclasses.is_dataclass(inner[0]) else None


def test_every_config_key_is_documented():
    documented = {root: [key for key, _ in config_reference.keys(root)] for _, root in config_reference.DOCUMENTS}
    assert documented["TrainConfig"] == dataclass_keys(TrainConfig)
    assert documented["SweepConfig"] == dataclass_keys(SweepConfig)
    assert config_reference.undocumented() == []


def test_a_key_without_a_comment_is_named(tmp_path, monkeypatch):
    source = (REPO / "sbert_ray" / "config" / "schema.py").read_text()
    line = next(line for line in source.splitlines() if line.strip().startswith("keep_best:"))
    (tmp_path / "schema.py").write_text(source.replace(line, line.split("#")[0].rstrip()))
    monkeypatch.setattr(config_reference, "SOURCES", [tmp_path / "schema.py", config_reference.SOURCES[1]])
    assert config_reference.undocumented() == ["checkpoint.keep_best"]


def test_the_site_builds_strictly_with_the_reference(tmp_path):
    site = tmp_path / "site"
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    built = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    reference = (site / "configuration" / "index.html").read_text()
    assert config_reference.MARKER not in reference
    assert all(f"<code>{key}</code>" in reference for key in dataclass_keys(TrainConfig))


def test_readme_links_point_to_files_that_exist():
    readme = (REPO / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if not t.startswith(("http", "#"))]
    assert targets and [t for t in targets if not (REPO / t).exists()] == []


GROUPED = """
import os, pathlib, pytest

@pytest.mark.xdist_group("shared runs")
@pytest.mark.parametrize("n", range(4))
def test_grouped(n):
    pathlib.Path(__file__).with_name(f"{n}.process").write_text(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.parametrize("n", range(4))
def test_alone(n):
    pass
"""


def test_the_first_phase_keeps_an_xdist_group_in_one_process(tmp_path):
    """README's first phase (`-n 2 --dist loadgroup`) runs the tests of one ``xdist_group`` (the FSDP runs: a module
    fixture of ~30 CPU-s) in one process. pytest 9.2 with pytest-xdist 3.8 silently split them (pyproject's pin)."""
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup"]
    done = subprocess.run([*command, "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "8 passed" in done.stdout, done.stdout[-2000:]
    processes = {path.name: path.read_text() for path in tmp_path.glob("*.process")}
    assert len(processes) == 4 and len(set(processes.values())) == 1, processes
