"""What sbert-ray may write, replace, move aside or delete: only what it created. Every such path goes through here.

- Never the root folder, the home folder, the working directory or a folder above one of them (``refuse_protected``):
  not as a final model, a run folder, an ``encode`` output or a results file.
- A final model folder carries ``MODEL_MARKER`` (a small JSON manifest naming the run that wrote it; the folder stays
  in sentence-transformers' layout). A folder at ``output_dir`` is replaced only when it carries the marker or is
  empty; anything else is refused before any work (``check_model_folder``).
- Our own previous model is swapped out, never deleted first (``replace_model``).
- Staging folders are made here with unique names (``staging_beside``) and only they are removed.
- An output a rerun resumes (``encode``'s, ``mine``'s) is claimed here: a new or empty folder gets a marker file
  naming the settings its contents depend on; one with the marker is resumed; anything else is refused
  (``claim_output``). Marker files, the run record among them, are written whole or not at all (``write_marker``).
- Files such an output's rerun reuses but that are not part of it (``mine``'s corpus embeddings) live in a hidden work
  area inside it, made, started afresh and removed only here (``work_area``, ``remove_work_area``).

A run folder (``--restart``) is ours when it holds a run record or Ray Train checkpoints: ``runs.record.archive``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sbert_ray.atomic_files import atomic_write
from sbert_ray.config import ConfigError
from sbert_ray.files import json_text
from sbert_ray.training.storage import is_remote

if TYPE_CHECKING:
    from pyarrow import fs

MODEL_MARKER = "sbert_ray_model.json"


def refuse_protected(path: str | os.PathLike[str], key: str) -> None:
    """Raise ``ConfigError`` naming ``key`` when the local ``path`` is /, $HOME, the working directory or one of
    their parents (symbolic links followed): a folder sbert-ray would write into, replace or delete there holds
    everything else. Object storage URIs pass."""
    if is_remote(str(path)):
        return
    resolved = Path(path).expanduser().resolve()
    places = (
        (Path(resolved.anchor), "the root folder"),
        (Path.home(), "your home folder"),
        (Path.cwd(), "the working directory"),
    )
    for place, what in places:
        place = place.resolve()
        if resolved == place or resolved in place.parents:
            where = what if resolved == place else f"a folder above {what} ({place})"
            raise ConfigError(
                f"{key}: {resolved} is {where}; sbert-ray never writes, replaces or deletes there: choose a folder "
                "of its own"
            )


def is_our_model(folder: Path) -> bool:
    return (folder / MODEL_MARKER).is_file()


def check_model_folder(output_dir: str, key: str = "output_dir", leaving: str | None = None) -> None:
    """Preflight for a final model's folder: refuse a protected path, a regular file, or an existing folder that is
    neither empty nor one of our models. ``leaving``: a run folder --restart moves aside before training (a model
    inside it goes along, whoever wrote it). First puts back the model an interrupted swap left aside."""
    refuse_protected(output_dir, key)
    path = Path(output_dir)
    restore_interrupted_swap(path)
    if path.is_file():
        raise ConfigError(f"{key}: {path} is a file, not a folder: choose a folder path for the final model")
    if not path.is_dir() or is_our_model(path) or not any(path.iterdir()):
        return
    if leaving is not None and path.is_relative_to(leaving):
        return
    raise ConfigError(
        f"{key}: {path} exists and is not a model sbert-ray wrote (no {MODEL_MARKER}); it would be replaced by "
        "the final model: choose another path, or remove the folder yourself"
    )


def refuse_model_folder_over_run(output_dir: str, run_dir: str, key: str = "output_dir") -> None:
    """Preflight: the final model's folder is not the run folder, a folder above it, or inside one of its
    checkpoints; the swap at the end would refuse it only after training (the run folder then holds checkpoints) or
    replace what the run needs to resume. A folder of its own inside the run folder (the default
    ``<run>/final-model``) is fine. A protected path (/, home, the working directory) is named as such first."""
    refuse_protected(output_dir, key)
    if is_remote(output_dir) or is_remote(run_dir):
        return
    model, run = Path(output_dir).expanduser().resolve(), Path(run_dir).expanduser().resolve()
    inside = model.relative_to(run).parts if model.is_relative_to(run) else None
    if model == run or run.is_relative_to(model) or (inside and inside[0].startswith(("checkpoint_", "."))):
        where = "this run's folder or a folder above it" if not inside else "inside one of this run's checkpoints"
        raise ConfigError(
            f"{key}: {model} is {where} ({run} holds the checkpoints the run resumes from); the final model needs a "
            f"folder of its own: leave {key} out ({run}/final-model) or choose a path outside {run}"
        )


def write_model_marker(folder: Path, **run: str) -> None:
    """Mark ``folder`` as a final model of ours, naming the run that wrote it (run name, run folder, MLflow run)."""
    manifest = {"written_by": f"sbert-ray {metadata.version('sbert-ray')}", **run, "written": _now()}
    (folder / MODEL_MARKER).write_text(json.dumps(manifest, indent=2) + "\n")


def _kept(output_dir: Path) -> Path:
    """Where the previous model waits while the new one is renamed in."""
    return output_dir.with_name(f".{output_dir.name}.previous")


def replace_model(new: Path, output_dir: Path, staging: Path) -> None:
    """Put the complete, marked model folder ``new`` at ``output_dir``. A previous model there (ours: checked
    again, hours may have passed since preflight) is renamed aside, the new one renamed in, and only then the old
    one moved into ``staging`` (removed with it).

    Two renames rather than one exchange (Linux ``renameat2(RENAME_EXCHANGE)``): that call is Linux-only and
    refused by filesystems such as NFS, where checkpoints and models often live, so a fallback would be needed
    anyway. A crash between the renames leaves the old model complete aside; ``restore_interrupted_swap`` (the
    next run's preflight, or the next swap) puts it back."""
    restore_interrupted_swap(output_dir, staging)
    check_model_folder(str(output_dir))
    kept = _kept(output_dir)
    if output_dir.exists():
        os.rename(output_dir, kept)
    os.rename(new, output_dir)
    if kept.exists():
        os.rename(kept, staging / "previous")


def restore_interrupted_swap(output_dir: Path, staging: Path | None = None) -> None:
    """A previous model left aside by a swap that did not finish: put back when ``output_dir`` is missing (the
    crash came between the renames); otherwise the swap had finished, and it goes into ``staging`` for removal."""
    kept = _kept(output_dir)
    if not is_our_model(kept):
        return
    if not output_dir.exists():
        os.rename(kept, output_dir)
    elif staging is not None:
        os.rename(kept, staging / "stale")


@contextmanager
def staging_beside(path: Path) -> Iterator[Path]:
    """A new hidden folder with a unique name beside ``path`` (same filesystem, so a rename moves its contents to
    ``path``); it and whatever is left in it are removed on exit. Nothing else is ever removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def filesystem_of(uri: str) -> tuple[fs.FileSystem, str]:
    """pyarrow's filesystem and path of a local absolute path (taken as it is, never parsed as a URI) or an object
    storage URI. pyarrow is imported here: the path checks above run where it is not installed (a GPU machine's
    benchmarks)."""
    from pyarrow import fs

    return fs.FileSystem.from_uri(uri) if is_remote(uri) else (fs.LocalFileSystem(), uri)


def read_marker(folder: str, name: str) -> Any:
    """The JSON in the file ``name`` of ``folder`` (a local folder or an object-storage prefix); None without one."""
    from pyarrow import fs

    filesystem, root = filesystem_of(folder)
    if filesystem.get_file_info(f"{root}/{name}").type == fs.FileType.NotFound:
        return None
    with filesystem.open_input_stream(f"{root}/{name}") as stream:
        return json.loads(stream.read())


def write_marker(folder: str, name: str, data: Any) -> None:
    """``data`` as JSON into the file ``name`` of ``folder``, whole or not at all (a crash leaves the old one)."""
    from pyarrow import fs

    filesystem, root = filesystem_of(folder)
    if isinstance(filesystem, fs.LocalFileSystem):  # object storage needs none (pyarrow would add an empty object)
        filesystem.create_dir(root, recursive=True)
    with atomic_write(f"{root}/{name}", filesystem) as partial, filesystem.open_output_stream(partial) as stream:
        stream.write((json_text(data, default=str) + "\n").encode())


def recorded_settings(folder: str, marker: str, not_ours: str) -> Any:
    """The settings in ``folder``'s ``marker`` when it is an output of ours; None when it is new or empty;
    ``ConfigError(not_ours)`` when it holds anything else (it is not ours to write into)."""
    from pyarrow import fs

    recorded = read_marker(folder, marker)
    filesystem, root = filesystem_of(folder)
    if recorded is None and filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True)):
        raise ConfigError(not_ours)
    return recorded


def claim_output(folder: str, marker: str, settings: dict[str, Any], not_ours: str) -> Any:
    """Claim ``folder`` for output a rerun resumes: a new or empty one is marked ours, ``marker`` holding
    ``settings`` (what its contents depend on). Returns the settings it was claimed with, this run's or an earlier
    run's, which the caller compares: outputs made with other settings would mix. Anything else is refused
    (``recorded_settings``)."""
    recorded = recorded_settings(folder, marker, not_ours)
    if recorded is None:
        write_marker(folder, marker, settings)
        return settings
    return recorded


def work_area(output: Path, name: str, marker: str, settings: dict[str, Any]) -> Path:
    """The hidden folder ``name`` inside ``output`` (a local output claimed already: ``claim_output``), marked with
    ``settings`` (what its files depend on beyond the output's own marker), for files a rerun reuses. One marked
    with other settings (or unmarked: a run stopped while making it) is removed and made afresh: its files would not
    be this run's."""
    folder = _work_area(output, name)
    if read_marker(str(folder), marker) != settings:
        shutil.rmtree(folder, ignore_errors=True)
        write_marker(str(folder), marker, settings)
    return folder


def remove_work_area(output: Path, name: str) -> None:
    """Remove ``output``'s work area ``name`` (``work_area``), if there: the output is complete without it."""
    shutil.rmtree(_work_area(output, name), ignore_errors=True)


def _work_area(output: Path, name: str) -> Path:
    if not name.startswith(".") or "/" in name:
        raise ValueError(f"a work area is a hidden folder directly inside the output, not {name!r}")
    return output / name


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
