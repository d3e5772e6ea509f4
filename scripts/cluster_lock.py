#!/usr/bin/env python
"""requirements/cluster.lock: the exact versions the cluster image (docker/Dockerfile) installs, and the image tag
that names them.

The roots are what a cluster node runs: sbert-ray's dependencies with its ``models`` extra, boto3 (checkpoints on
S3) and psycopg2-binary (the MLflow server's PostgreSQL store). The lock pins them and everything they pull in, at
the versions installed in the environment this runs in: run it in the environment the tests passed in (with boto3
and psycopg2-binary installed), so the image holds what was tested.

    python scripts/cluster_lock.py            # write the lock; print the image tag
    python scripts/cluster_lock.py --check    # exit 1 when this environment differs from the lock
    python scripts/cluster_lock.py --tag      # print the image tag of the lock as written

Local version labels are dropped (torch 2.13.0+cpu is pinned as torch==2.13.0, which on Linux is the CUDA build);
torch's CUDA libraries (nvidia-*, triton) are left to torch, whose own metadata pins them exactly. The tag is the
lock's content hash, so cluster.yaml and k8s/ naming it name exactly these versions.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements" / "cluster.lock"
PROJECT, EXTRA = "sbert-ray", "models"
EXTRA_ROOTS = ("boto3", "psycopg2-binary")
HEADER = """\
# The cluster image's exact packages (docker/Dockerfile installs them): sbert-ray's dependencies with its `models`
# extra, boto3 and psycopg2-binary, and everything they pull in, as installed where the tests passed.
# Written by scripts/cluster_lock.py; do not edit. torch's CUDA libraries are pinned by torch itself.
# python: {python}
"""


def project_roots() -> list[Requirement]:
    """sbert-ray's requirements that apply with its ``models`` extra, as its installed metadata states them (the
    pyproject.toml it was installed from)."""
    requirements = [Requirement(text) for text in metadata.requires(PROJECT) or []]
    return [req for req in requirements if applies(req, {EXTRA})]


def roots() -> list[Requirement]:
    return project_roots() + [Requirement(name) for name in EXTRA_ROOTS]


def applies(req: Requirement, extras: set[str]) -> bool:
    """Whether ``req`` is needed here (Linux, this Python) with ``extras`` of the package that states it."""
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**default_environment(), "extra": extra}) for extra in extras or {""})


def closure(requirements: list[Requirement]) -> dict[str, str]:
    """{canonical name: installed version} of ``requirements`` and everything they need, recursively. A package
    that is not installed is an error naming it: the lock would otherwise miss it silently."""
    pins: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    pending = [(req, set(req.extras)) for req in requirements]
    while pending:
        req, extras = pending.pop()
        name = canonicalize_name(req.name)
        if name == PROJECT or (name, frozenset(extras)) in seen:
            continue
        seen.add((name, frozenset(extras)))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"cluster_lock: {req.name} (needed for the image) is not installed here; pip install it first")
        pins[name] = Version(dist.version).public
        for text in dist.requires or []:
            sub = Requirement(text)
            if applies(sub, extras):
                pending.append((sub, set(sub.extras)))
    return pins


def lock_text(pins: dict[str, str]) -> str:
    """The lock: the header (with the Python it was written on, which the image's base must match) and the pins."""
    python = "{}.{}".format(*sys.version_info[:2])
    return HEADER.format(python=python) + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))


def image_tag(text: str) -> str:
    """The image tag of a lock: its content hash, so a changed lock cannot keep an old image's name."""
    return "lock-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="exit 1 when this environment differs from the lock")
    action.add_argument("--tag", action="store_true", help="print the image tag of the lock as written")
    args = parser.parse_args(argv)
    if args.tag:
        print(image_tag(LOCK.read_text()))
        return 0
    text = lock_text(closure(roots()))
    if args.check:
        if text == LOCK.read_text():
            return 0
        print(f"{LOCK.relative_to(REPO)} differs from this environment: run scripts/cluster_lock.py", file=sys.stderr)
        return 1
    LOCK.parent.mkdir(exist_ok=True)
    LOCK.write_text(text)
    print(image_tag(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
