"""Files sbert-ray writes: whether a path can take them (checked before any work), and JSON that stays JSON.

Every folder or file a command will write goes through ``check_folder`` or ``check_file`` first, so a path that
is a file where a folder is needed (or the other way round), lies under a regular file, or sits in a folder this
process cannot write is one line naming the key or flag, not a traceback after the work. Whether sbert-ray may
replace what is there is another question (ownership), answered elsewhere.

JSON has no NaN or infinity (Python's ``json`` writes them, and other readers refuse the file): ``json_text``
writes them as null.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from sbert_ray.atomic_files import atomic_write
from sbert_ray.config import ConfigError


def check_folder(path: str, key: str | None = None) -> str:
    """A folder to create or write into (checkpoint storage, an output folder): a local path or file:// URI, or
    object storage (s3://, gs://, ...) whose bucket must exist and answer. Returns ``path``; a ConfigError names
    ``key`` (argparse adds the flag itself)."""
    _raise(key, _remote_problem(path) if "://" in path else _local_problem(Path(path), folder=True))
    return path


def check_file(path: str, key: str | None = None) -> str:
    """A local file to create or replace (``--output`` JSON). Returns ``path``; a ConfigError names ``key``."""
    _raise(key, _local_problem(Path(path), folder=False))
    return path


def _raise(key: str | None, problem: str | None) -> None:
    if problem:
        raise ConfigError(f"{key}: {problem}" if key else problem)


def _local_problem(path: Path, folder: bool) -> str | None:
    """Why ``path`` cannot be written as a folder (or a file), or None. Writability is tried, not inferred from
    permission bits (root passes every os.access check, a read-only mount fails writes whatever the bits say)."""
    path = path.expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if _exists(p))
    if existing != path and not existing.is_dir():
        return f"{path} lies under {existing}, which is a file"
    if existing == path and folder and not path.is_dir():
        return f"{path} is a file, not a folder"
    if existing == path and not folder and path.is_dir():
        return f"{path} is a folder; name a file"
    parent = existing if existing != path or folder else path.parent
    try:
        with tempfile.TemporaryFile(dir=parent):  # unnamed where the OS allows, else removed at once
            pass
    except OSError as err:
        return f"cannot write in {parent} ({err.strerror or err})"
    return None


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # not even visible to this process (a folder above it cannot be searched)
        return False


def _remote_problem(uri: str) -> str | None:
    """Object storage as Ray Train reaches it (pyarrow's filesystems): the bucket exists and answers."""
    from pyarrow import fs

    from sbert_ray.tracking.store import redact_uri  # here: it loads MLflow, which most commands never need

    shown = redact_uri(uri)
    try:
        filesystem, path = fs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as err:
        return f"{shown}: pyarrow cannot open it ({_first_line(err)})"
    if isinstance(filesystem, fs.LocalFileSystem):
        return _local_problem(Path(path), folder=True)
    bucket = path.split("/")[0]
    try:
        info = filesystem.get_file_info(bucket)
    except (OSError, ValueError) as err:
        return f"{shown}: cannot reach bucket {bucket!r} ({_first_line(err)})"
    if info.type == fs.FileType.NotFound:
        return f"{shown}: bucket {bucket!r} does not exist"
    return None


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


# ------------------------------------------------------------------------------------------------ JSON


def json_text(data: Any, default: Any = None) -> str:
    """``data`` as indented JSON, a NaN or infinity as null (JSON has neither); ``default`` as ``json.dumps``."""
    return json.dumps(_finite(data), indent=2, allow_nan=False, default=default)


def _finite(data: Any) -> Any:
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(value) for value in data]
    return data


def write_json(data: Any, path: str | Path) -> None:
    """``json_text(data)`` written via a temporary file and a rename: a crash never leaves a truncated file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as partial:
        Path(partial).write_text(json_text(data) + "\n")
