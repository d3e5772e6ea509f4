"""Which files under a listed folder, prefix or glob are data: the one rule for training sources and corpora."""

from __future__ import annotations

import posixpath


def is_hidden(path: str, base: str) -> bool:
    """Whether ``path``, listed under the folder ``base``, is no data: a part of its path below ``base`` (its name,
    or a folder on the way) starts with ``.`` or ``_``. Spark, Hive and Ray Data keep their bookkeeping there
    (``_SUCCESS``, ``.crc`` files, ``_temporary/`` task attempts, ``.staging/``): partial or duplicate rows."""
    return any(part.startswith((".", "_")) for part in posixpath.relpath(path, base).split("/"))
