"""Progress people can watch: tqdm bars in the process the user runs (off when its output is not a terminal, or
with ``--quiet``, which sets SBERT_RAY_QUIET for this process and everything it starts)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from tqdm.auto import tqdm

QUIET_ENV = "SBERT_RAY_QUIET"


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "") not in ("", "0")


def progress_bar(iterable: Iterable | None = None, total: int | None = None, desc: str | None = None, **kwargs) -> tqdm:
    """A tqdm bar, disabled under --quiet and when stderr is not a terminal (logs, Ray workers, CI)."""
    return tqdm(iterable, total=total, desc=desc, disable=True if quiet() else None, leave=False, **kwargs)
