"""Resume points: a run's full-state checkpoints, kept apart from the models Ray Train keeps by dev score.

Ray Train's checkpoint manager keeps the ``checkpoint.keep_best`` best checkpoints by dev score plus the latest and
deletes the rest, whatever they hold; with ``checkpoint.full_every > 1`` it would delete the last full-state one
whenever that is not among the best and the latest holds weights only, and a failure after that would restart the
run from step 0. So every checkpoint reported to Ray holds the model only (keep_best ranks models), and rank 0
uploads each full-state checkpoint here (from its checkpoint-writing thread: ``training.checkpoint_writes``),
beside Ray's, under ``<run folder>/resume_points/``:

    step-000000060/        the full state (model, optimizer, scheduler, scaler, position, every rank's generators)
    step-000000060.json    written once every file of the folder is uploaded: the point is complete

A point without its marker (an upload cut short by a kill) is never chosen; after each new complete one, the two
newest complete points stay and everything older goes (marker first, so a cut deletion leaves no marked half).
Local folders and object storage alike (pyarrow's filesystems, as Ray Train reaches them).

A restarted or resized worker group reads the newest complete point once per node (``fetch_once_per_node``): the
first rank there downloads it into a node-local folder while the others wait on a file lock, then all load it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

RESUME_FOLDER = "resume_points"  # in the run folder, beside Ray Train's checkpoint_* folders
KEEP = 2  # complete points kept: the newest, and the one before in case the newest cannot be read
POINT_NAME = re.compile(r"step-(\d+)$")
NODE_CACHE = Path(tempfile.gettempdir()) / "sbert-ray-resume"  # one download per node, shared by its ranks


@dataclass(frozen=True)
class ResumePoint:
    """A complete resume point: its folder on the run's filesystem, its step, and the id of its upload (a point
    retrained after a resume is uploaded again under the same name, as another upload)."""

    path: str
    global_step: int
    upload: str


class ResumePoints:
    """The resume points of one run: ``folder`` on ``filesystem`` (Ray Train's storage filesystem)."""

    def __init__(self, filesystem: pafs.FileSystem, folder: str):
        self.filesystem, self.folder = filesystem, folder.rstrip("/")

    def save(self, local: Path, global_step: int) -> None:
        """Upload the full-state checkpoint folder ``local`` as the point of ``global_step``, mark it complete,
        drop the points it replaces, and delete ``local``."""
        path = self._path(global_step)
        if self.filesystem.get_file_info(path).type != pafs.FileType.NotFound:
            self.filesystem.delete_dir(path)  # what a kill left of an earlier upload of this step
        self.filesystem.create_dir(path)
        pafs.copy_files(
            str(local), path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=self.filesystem
        )
        marker = {"global_step": global_step, "upload": uuid.uuid4().hex}
        with self.filesystem.open_output_stream(f"{path}.json") as stream:
            stream.write(json.dumps(marker).encode())
        self._prune(global_step)
        shutil.rmtree(local)

    def latest(self) -> ResumePoint | None:
        """The newest complete point, or None."""
        complete = self._complete()
        if not complete:
            return None
        step = complete[-1]
        with self.filesystem.open_input_stream(f"{self._path(step)}.json") as stream:
            marker = json.loads(stream.read())
        return ResumePoint(self._path(step), step, marker["upload"])

    def _path(self, global_step: int) -> str:
        return f"{self.folder}/step-{global_step:09d}"

    def _folders(self) -> dict[int, pafs.FileInfo]:
        """{step: its folder's info} of every point, complete or not."""
        listing = self.filesystem.get_file_info(pafs.FileSelector(self.folder, allow_not_found=True))
        return {
            int(match.group(1)): info
            for info in listing
            if info.type == pafs.FileType.Directory and (match := POINT_NAME.match(info.base_name))
        }

    def _complete(self) -> list[int]:
        """The steps of the complete points, oldest first."""
        steps = sorted(self._folders())
        markers = self.filesystem.get_file_info([f"{self._path(step)}.json" for step in steps])
        return [step for step, marker in zip(steps, markers, strict=True) if marker.type == pafs.FileType.File]

    def _prune(self, newest: int) -> None:
        """Delete the complete points older than the KEEP newest, and what killed uploads left before ``newest``."""
        complete = self._complete()
        kept = set(complete[-KEEP:])
        for step in sorted(self._folders()):
            if step in kept or step >= newest:
                continue
            if step in complete:
                self.filesystem.delete_file(f"{self._path(step)}.json")
            self.filesystem.delete_dir(self._path(step))


def fetch_once_per_node(filesystem: pafs.FileSystem, point: ResumePoint, cache: Path = NODE_CACHE) -> tuple[Path, bool]:
    """The local folder of ``point`` on this node, and whether this call downloaded it. The ranks of one node share
    one download: the first to take the lock downloads, the others find it there; folders of older points of the
    same run (a restart's earlier downloads) go."""
    run_cache = _run_cache(point, cache)
    target, done = run_cache / point.upload, run_cache / f"{point.upload}.done"
    run_cache.mkdir(parents=True, exist_ok=True)
    with _locked(run_cache / ".lock"):
        if done.exists():
            return target, False
        for stale in run_cache.iterdir():
            if stale.is_dir():
                shutil.rmtree(stale)
            elif stale.name != ".lock":
                stale.unlink()
        pafs.copy_files(
            point.path, str(target), source_filesystem=filesystem, destination_filesystem=pafs.LocalFileSystem()
        )
        done.touch()
    return target, True


def drop_node_copy(point: ResumePoint, cache: Path = NODE_CACHE) -> None:
    """Remove this node's copy of ``point`` (once every rank of the node has loaded it)."""
    shutil.rmtree(_run_cache(point, cache), ignore_errors=True)


def _run_cache(point: ResumePoint, cache: Path) -> Path:
    """This node's folder for the points of ``point``'s run."""
    return cache / hashlib.sha256(point.path.rsplit("/", 1)[0].encode()).hexdigest()[:16]


@contextmanager
def _locked(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        yield
