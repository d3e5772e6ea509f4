"""What every command's parser shares: argparse types for numbers and lists, and the --quiet option."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from sbert_ray.config import ConfigError
from sbert_ray.files import check_file, check_folder
from sbert_ray.tracking.errors import TrackingError

if TYPE_CHECKING:
    from sbert_ray.tracking.store import TrackingStore


def add_command(
    subparsers, name: str, help: str, parents: list[argparse.ArgumentParser] = ()
) -> argparse.ArgumentParser:
    """A subcommand's parser, with the options every command takes (--quiet) after ``parents``' own."""
    return subparsers.add_parser(name, parents=[*parents, _common_options()], help=help)


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", help="no progress bars or training progress lines")
    return common


def resource_wait() -> argparse.ArgumentParser:
    """--resource-wait-s of the commands whose --workers encoder replicas wait for the cluster's CPUs/GPUs."""
    from sbert_ray.config import RESOURCE_WAIT_S

    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--resource-wait-s",
        type=non_negative_float,
        default=RESOURCE_WAIT_S,
        help="how long the encoder replicas wait for CPUs/GPUs other work holds before the command stops, naming "
        f"what is missing (default: {RESOURCE_WAIT_S:g}, as a training config's scaling.resource_wait_s)",
    )
    return parent


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def sizes(text: str) -> list[int]:
    try:
        values = positive_ints(text)
    except argparse.ArgumentTypeError:
        values = []
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct positive sizes like 384,128,64, got {text!r}")
    return values


def choices(*allowed: str):
    """An argparse type for a comma-separated subset of ``allowed``, e.g. fp32,bf16."""

    def parse(text: str) -> list[str]:
        values = text.split(",")
        unknown = [value for value in values if value not in allowed]
        if unknown or len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"expected distinct values from {','.join(allowed)}, got {text!r}")
        return values

    return parse


def checked(parse):
    """An argparse type from one of our parsers: its ConfigError becomes argparse's "argument --flag: ..." line."""

    def convert(text: str):
        try:
            return parse(text)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def check_output(args: argparse.Namespace, option: str, kind: str = "file") -> None:
    """An output option checked before any work: never /, HOME, the working directory or a folder above them
    (``runs.owned_paths``), and a path that can take a ``kind`` ("file" or "folder", ``files``)."""
    from sbert_ray.runs.owned_paths import refuse_protected

    value = getattr(args, option.removeprefix("--").replace("-", "_"))
    if value:
        refuse_protected(value, option)
        (check_file if kind == "file" else check_folder)(value, option)


def tracking_store(args: argparse.Namespace) -> TrackingStore:
    """``--tracking-uri`` (else its default) checked reachable before the command's work; it prints masked."""
    from sbert_ray.tracking.mlflow_run import tracking_store

    try:
        return tracking_store(args.tracking_uri)
    except TrackingError as err:
        raise ConfigError(f"--tracking-uri: {err}") from None
