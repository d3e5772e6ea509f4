"""Checkpoint writes off the training thread. At a report point the training thread only copies the checkpoint to
host memory (``state.Snapshot``); serialising it (safetensors, ``torch.save``) and writing it happen in one
background thread, one report point at a time in report order, while training goes on. A full-state checkpoint is
written to a folder of its own that becomes a resume point (``training.resume_points``: uploaded from the same
thread, after the write), its model and position hard-linked into the report's folder: what Ray Train uploads and
keeps by dev score. The report's folder is complete when the future ``save`` returns is done; Ray Train's upload
waits for it (``training.worker``), so the checkpoint Ray registers is always whole.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from sbert_ray.training.state import MODEL_DIR, STATE_FILE, Snapshot


class PointStore(Protocol):
    """Where full-state checkpoints become resume points (``training.resume_points.ResumePoints``)."""

    def save(self, local: Path, global_step: int) -> None:
        """Upload the folder ``local`` as the point of ``global_step``, then delete ``local``."""


class CheckpointWrites:
    """Rank 0's checkpoint writes and resume-point uploads, in one background thread (``background``; else each
    in the call: ``checkpoint.upload: sync``). ``points``: where full-state checkpoints go (None: they stay in the
    report's folder). An error of a write or upload is raised at the next ``save``, ``wait`` or ``close``."""

    def __init__(self, points: PointStore | None = None, background: bool = True):
        self.points = points
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-write") if background else None
        self.pending: Future | None = None  # the previous report point's last job: its write, or its upload

    def save(self, snapshot: Callable[[], Snapshot], folder: Path, global_step: int) -> Future:
        """Write the checkpoint ``snapshot()`` takes into the existing, empty ``folder``; returns a future done when
        ``folder`` is complete (its error raised there). The previous report point's write and upload finish first,
        so one snapshot at a time is held in host memory (at one report per hundreds of steps it is long done)."""
        self.wait()
        taken = snapshot()
        written = self._run(self._write, taken, folder)
        self.pending = written
        if taken.full_state and self.points is not None:
            self.pending = self._run(self._upload, written, global_step)
        return written

    def wait(self) -> None:
        """Until the last report point's checkpoint is written and uploaded (its error raised here)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        if self.executor is not None:
            self.executor.shutdown()

    def _run(self, job: Callable, *args) -> Future:
        if self.executor is not None:
            return self.executor.submit(job, *args)
        done = Future()
        done.set_result(job(*args))
        return done

    def _write(self, snapshot: Snapshot, folder: Path) -> Path | None:
        """Write ``snapshot`` into ``folder``; a full state that becomes a resume point into a folder of its own
        first, returned, with its model and position linked into ``folder``."""
        if not (snapshot.full_state and self.points is not None):
            snapshot.write(folder)
            return None
        full = Path(tempfile.mkdtemp(prefix="sbert-ray-full-"))
        try:
            snapshot.write(full)
            link_weights(full, folder)
        except BaseException:
            shutil.rmtree(full)  # never uploaded: its upload job sees this error
            raise
        return full

    def _upload(self, written: Future, global_step: int) -> None:
        self.points.save(written.result(), global_step)  # a failed write uploads nothing


def link_weights(full: Path, folder: Path) -> None:
    """The model and position of the full-state checkpoint folder ``full`` in ``folder``, as hard links (no copy):
    what Ray Train is given to keep by dev score, while ``full`` becomes a resume point."""
    shutil.copytree(full / MODEL_DIR, folder / MODEL_DIR, copy_function=os.link)
    os.link(full / STATE_FILE, folder / STATE_FILE)
