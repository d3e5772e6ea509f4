"""Where a run's checkpoints live: a local folder (or NFS mount), or object storage (s3://, gs://, ...) that Ray
Train reaches through pyarrow's filesystems (an S3-compatible endpoint comes from AWS_ENDPOINT_URL)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.fs
import ray.train

from sbert_ray.training.state import MODEL_DIR


def is_remote(storage_path: str) -> bool:
    return "://" in storage_path


def resolve_storage(storage_path: str) -> str:
    """A URI as it is; a local path made absolute (trials and jobs run in other working directories)."""
    return storage_path if is_remote(storage_path) else str(Path(storage_path).expanduser().resolve())


def download_final_model(checkpoint: ray.train.Checkpoint, destination: str) -> str:
    """The final model of a run on remote storage is its latest checkpoint's model (saved at the last step of the
    last stage): copy that folder, without the optimizer state beside it, to ``destination``."""
    local = Path(destination).expanduser().resolve()
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    pyarrow.fs.copy_files(f"{checkpoint.path}/{MODEL_DIR}", str(local), source_filesystem=checkpoint.filesystem)
    return str(local)
