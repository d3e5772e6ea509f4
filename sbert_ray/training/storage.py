"""Where a run's checkpoints live: a local folder (or NFS mount), or object storage (s3://, gs://, ...) that Ray
Train reaches through pyarrow's filesystems (an S3-compatible endpoint comes from AWS_ENDPOINT_URL)."""

from __future__ import annotations

from pathlib import Path


def is_remote(storage_path: str) -> bool:
    return "://" in storage_path


def resolve_storage(storage_path: str) -> str:
    """A URI as it is; a local path made absolute (trials and jobs run in other working directories)."""
    return storage_path if is_remote(storage_path) else str(Path(storage_path).expanduser().resolve())
