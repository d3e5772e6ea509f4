"""Files that are whole or absent: written under a temporary name beside their own, then moved over it.

A rename within one folder is atomic on a local filesystem, so a crash leaves the old file or the new one, never
part of either; on object storage a move is one copy, so the object appears whole. Readers then never need to
recognise a half-written file (a shard, a marker, a record, a results file, the metrics spool)."""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def atomic_write(path: str | os.PathLike[str], filesystem: Any = None) -> Iterator[str]:
    """The temporary name (``.<name>.partial`` beside ``path``) to write the file under; when the block ends without
    an error, the file is moved to ``path``, replacing what was there; after an error it is removed.
    ``filesystem``: the pyarrow filesystem that ``path`` is on; a local path when None."""
    folder, name = posixpath.split(os.fspath(path))
    partial = posixpath.join(folder, f".{name}.partial")
    try:
        yield partial
    except BaseException:  # nothing half-written stays behind; what was at ``path`` is untouched
        with contextlib.suppress(OSError):  # not written yet, or gone: nothing to remove
            if filesystem is None:
                os.remove(partial)
            else:
                filesystem.delete_file(partial)
        raise
    if filesystem is None:
        os.replace(partial, path)
    else:
        filesystem.move(partial, os.fspath(path))
