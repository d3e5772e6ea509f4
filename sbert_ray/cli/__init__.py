"""``sbert-ray`` command line: eval | encode | mine | score | prepare | train | tune | report | bench."""

from __future__ import annotations

import argparse
import atexit
import gc
import logging
import os
import sys

from sbert_ray.cli import bench, encode, mine, prepare, report, score, train, tune
from sbert_ray.cli import eval as evaluate
from sbert_ray.config import ConfigError
from sbert_ray.data.records import DataError
from sbert_ray.progress import QUIET_ENV
from sbert_ray.tracking.errors import TrackingError

# At exit the interpreter's last garbage collections walk every object torch, transformers, Ray and MLflow made
# (3-6 s of a command on a 2-core machine); the process is ending, so they are frozen out of those walks. Registered
# before any of them is imported, this runs after their own exit handlers (Ray's shutdown, MLflow's flushes).
atexit.register(gc.freeze)

# In the order `sbert-ray --help` lists them.
COMMANDS = (evaluate, encode, mine, score, prepare, report, train, tune, bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sbert-ray", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_arguments(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.quiet:  # read by this process and every Ray process it starts
        os.environ[QUIET_ENV] = "1"
    try:
        return args.func(args)
    except (ConfigError, DataError) as err:  # bad input: one clear line, no traceback
        print(f"sbert-ray {args.command}: error: {err}", file=sys.stderr)
        return 2
    except TrackingError as err:  # the tracking store failed or went away (credentials masked)
        print(f"sbert-ray {args.command}: error: {err}", file=sys.stderr)
        return 1
