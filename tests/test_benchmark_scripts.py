"""The encode benchmark script's dry run on CPUs, here with everything installed (the packaged model included): the
script itself (arguments, the commands and benchmark files it calls, the JSON it prints) is checked, so it does not
rot where no GPU runs it. Both scripts' dry runs where the GPU machine's packages alone are installed:
tests/test_without_ray.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def dry_run(script: str, data_dir: Path) -> list[dict]:
    """``benchmarks/<script> --dry-run DATA_DIR`` from the repository root; the JSON list it prints."""
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # this venv's tools
    done = subprocess.run(
        ["bash", f"benchmarks/{script}", "--dry-run", str(data_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_gpu_sh_dry_run_benchmarks_beside_sentence_transformers(data_dir):
    records = dry_run("gpu.sh", data_dir)
    assert {r["model"] for r in records} == {"random:tiny", "sentence-transformers/all-MiniLM-L6-v2"}
    assert {r["impl"] for r in records} == {"sbert-ray", "sentence-transformers"}
    assert all(r["sentences_per_s"] > 0 for r in records if "skipped" not in r)  # ONNX int8 needs a package
    assert {r["step"] for r in records} == {"encode-random-tiny", "encode-sentence-transformers-all-MiniLM-L6-v2"}
