"""The GPU machine this project can borrow has torch, transformers and sentence-transformers but no Ray, MLflow or
datasets: ``sbert-ray bench encode`` and ``bench train --local`` (the training core in one process) run there. Here
both run in a subprocess whose imports of those three packages fail, as they would where they are not installed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# Runs the CLI with ray, mlflow and datasets unimportable: a finder placed first claims them and fails their
# loading, so `import ray` raises ModuleNotFoundError wherever it happens (at module level or inside a function).
BLOCKED_CLI = """
import importlib.abc, importlib.util, sys

class Blocked(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in ("ray", "mlflow", "datasets"):
            return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        raise ModuleNotFoundError(f"{spec.name} is not installed here", name=spec.name)

    def exec_module(self, module):
        pass

sys.meta_path.insert(0, Blocked())
from sbert_ray.cli import main
sys.exit(main(sys.argv[1:]))
"""
COMMON = ["--model", "random:tiny", "--repeats", "1", "--no-mlflow", "--no-reference"]


def run_blocked(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED_CLI, *argv], capture_output=True, text=True, timeout=300)


def test_the_blocker_blocks():
    blocked = subprocess.run(
        [sys.executable, "-c", BLOCKED_CLI.replace("from sbert_ray.cli import main", "import ray")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert blocked.returncode != 0 and "ModuleNotFoundError: ray is not installed here" in blocked.stderr


@pytest.mark.slow  # a whole benchmark in a fresh interpreter
@pytest.mark.parametrize(
    "bench, options",
    [
        ("train", ["--local", "--steps", "3", "--limit", "64"]),
        ("encode", ["--limit", "64", "--precisions", "fp32", "--smart-batching", "on"]),
    ],
)
def test_benches_run_without_ray_mlflow_or_datasets(bench, options, data_dir: Path, tmp_path: Path):
    output = tmp_path / f"{bench}.json"
    done = run_blocked("bench", bench, *COMMON, *options, "--data-dir", str(data_dir), "--output", str(output))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (record,) = json.loads(output.read_text())
    assert record["impl"] == "sbert-ray"
    assert (record["pairs_per_s"] if bench == "train" else record["sentences_per_s"]) > 0
