"""One training run per name and checkpoint storage at a time: a lease, ``<storage_path>/<name>.lease``, beside the
run folder (outside it, so ``--restart`` moving the folder aside never moves the lease with it).

- a local folder (or NFS mount): an OS lock (``flock``) on the lease file, which holds who has it (host, pid, start
  time); the OS releases it when the process ends, however it ends;
- object storage (``s3://``, through pyarrow's filesystems as the run record): a lease object naming its holder
  and when it last renewed it; a daemon thread renews it every ``HEARTBEAT_S``, and a lease not renewed for
  ``EXPIRY_S`` (its process died) is taken over. Object storage has no atomic create: a taker reads the lease back
  after writing it and yields if another taker's write won.

A second run with the same name and storage is refused at once (``RunBusy``, naming the holder); the lease is
released when the run ends, by return or error.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from pyarrow import fs

from sbert_ray.config import ConfigError
from sbert_ray.training.storage import is_remote

logger = logging.getLogger(__name__)

HEARTBEAT_S = 30.0  # how often the holder of an object-storage lease renews it
EXPIRY_S = 120.0  # a lease not renewed for this long is a dead process's: taken over
SETTLE_S = 1.0  # after writing an object-storage lease, how long a taker waits before reading it back
NAMING_S = 2.0  # how long a refused process waits for a local lease's new holder to write its name into it


class RunBusy(ConfigError):
    """Another process is running the same name on the same checkpoint storage."""


@contextlib.contextmanager
def run_lease(run_dir: str) -> Iterator[None]:
    """Hold the lease of the run at ``run_dir`` (``<storage_path>/<name>``) for the block; ``RunBusy`` if another
    process holds it."""
    lease = f"{run_dir}.lease"
    with object_lease(*fs.FileSystem.from_uri(lease)) if is_remote(run_dir) else local_lease(Path(lease)):
        yield


def holder() -> dict:
    """Who takes a lease: this host and process, and since when."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "token": uuid.uuid4().hex,
    }


def busy(lease: str, held_by: dict) -> RunBusy:
    """``held_by`` {}: a lease whose holder has not (readably) written its name."""
    who = "its holder not named in it yet"
    if held_by:
        who = f"host {held_by.get('host')}, pid {held_by.get('pid')}, started {held_by.get('started')} UTC"
    return RunBusy(
        f"{lease.removesuffix('.lease')} is being trained by another process ({who}; lease {lease}): wait for it to "
        "end, or choose another name"
    )


@contextlib.contextmanager
def local_lease(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, taken without waiting. At the end the file, and the folders made for it
    while still empty, are removed: a run refused before any work leaves nothing behind."""
    try:
        made = _make_folders(path.parent)
    except OSError as err:
        raise ConfigError(f"checkpoint.storage_path: cannot write the run's lease {path}: {err}") from None
    try:
        lease = _lock(path)
        try:
            lease.truncate(0)
            lease.write(json.dumps(holder()))
            lease.flush()
            yield
        finally:
            path.unlink()  # while locked: a process that opened the file before sees it gone and opens anew
            lease.close()
    finally:
        for folder in reversed(made):
            with contextlib.suppress(OSError):  # not empty: the run wrote there
                folder.rmdir()


def _lock(path: Path) -> TextIO:
    """``path`` opened and locked; ``RunBusy`` naming the holder if another process has it locked."""
    while True:
        lease = path.open("a+")
        try:
            fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = _named_holder(lease)
            lease.close()
            raise busy(str(path), held_by) from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(lease.fileno()).st_ino:
                return lease
        lease.close()  # the previous holder removed the file between our open and our lock: lock the new one


def _named_holder(lease: TextIO, wait_s: float = NAMING_S) -> dict:
    """Who holds the locked ``lease``. The holder writes its name just after taking the lock, so a process refused
    in between finds the file empty (CI of 3de8e20: "host None, pid None"): it reads again for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        lease.seek(0)
        held_by = _parse(lease.read())
        if held_by or time.monotonic() > deadline:
            return held_by
        time.sleep(0.05)


def _make_folders(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; returns those created, outermost first."""
    missing = []
    while not folder.exists():
        missing.insert(0, folder)
        folder = folder.parent
    for made in missing:
        made.mkdir(exist_ok=True)
    return missing


@contextlib.contextmanager
def object_lease(
    filesystem: fs.FileSystem, path: str, heartbeat_s: float = HEARTBEAT_S, expiry_s: float = EXPIRY_S
) -> Iterator[None]:
    """A lease object at ``path`` renewed every ``heartbeat_s`` while the block runs; one older than ``expiry_s`` is
    taken over; deleted at the end if it is still ours."""
    current = _read(filesystem, path)
    if current is not None and time.time() - current.get("renewed", 0) < expiry_s:
        raise busy(path, current)
    if current is not None:
        logger.warning("taking over the lease %s of a run that stopped renewing it: %s", path, current)
    ours = holder()
    _write(filesystem, path, ours)
    time.sleep(SETTLE_S)  # another taker that read the same stale lease writes too: the last write wins
    current = _read(filesystem, path)
    if current is None or current["token"] != ours["token"]:
        raise busy(path, current or {})
    stop = threading.Event()
    renewing = threading.Thread(
        target=_renew, args=(filesystem, path, ours, heartbeat_s, stop), name="run-lease", daemon=True
    )
    renewing.start()
    try:
        yield
    finally:
        stop.set()
        renewing.join()
        current = _read(filesystem, path)
        if current is not None and current.get("token") == ours["token"]:
            filesystem.delete_file(path)


def _renew(filesystem: fs.FileSystem, path: str, ours: dict, heartbeat_s: float, stop: threading.Event) -> None:
    while not stop.wait(heartbeat_s):
        try:
            current = _read(filesystem, path)
            if current is not None and current.get("token") != ours["token"]:
                logger.error(
                    "the run lease %s was taken over (this process stalled past its expiry): %s", path, current
                )
                return
            _write(filesystem, path, ours)
        except OSError as err:  # the store is away for a moment: the lease lasts EXPIRY_S, try again next beat
            logger.warning("could not renew the run lease %s: %s", path, err)


def _write(filesystem: fs.FileSystem, path: str, ours: dict) -> None:
    with filesystem.open_output_stream(path) as f:
        f.write(json.dumps(ours | {"renewed": time.time()}).encode())


def _read(filesystem: fs.FileSystem, path: str, tries: int = 3) -> dict | None:
    """The lease's holder; None if there is no lease. A store that rewrites files in place (a local or HDFS path,
    unlike an object store's PUT) can show a renewal half-written: read again before calling it unreadable."""
    for _ in range(tries):
        if filesystem.get_file_info(path).type == fs.FileType.NotFound:
            return None
        with filesystem.open_input_stream(path) as f:
            if current := _parse(f.read().decode()):
                return current
        time.sleep(0.05)
    return {}


def _parse(text: str) -> dict:
    """A lease's holder; {} for an empty or half-written one (its holder still holds the OS lock)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {}
