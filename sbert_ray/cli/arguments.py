"""What every command's parser shares: argparse types for numbers and lists, and the --quiet option."""

from __future__ import annotations

import argparse


def add_command(
    subparsers, name: str, help: str, parents: list[argparse.ArgumentParser] = ()
) -> argparse.ArgumentParser:
    """A subcommand's parser, with the options every command takes (--quiet) after ``parents``' own."""
    return subparsers.add_parser(name, parents=[*parents, _common_options()], help=help)


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", help="no progress bars or training progress lines")
    return common


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
