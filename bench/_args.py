"""argparse ``type=`` helpers shared by the benchmarks' command lines.

A value a benchmark cannot run with (``abc``, ``0`` records, ``-3`` seconds, ``nan``, a
list with an empty item) is refused while the command line is read: argparse prints the
usage and one line naming the option and what to give, and exits with status 2, instead
of a traceback from deep in the run (or a run of nothing).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "from_env", "int_list", "non_negative_float", "non_negative_int", "positive_float",
    "positive_int",
]

_T = TypeVar("_T")


def _int(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        msg = f"{text!r}: give a whole number of at least {least}"
        raise argparse.ArgumentTypeError(msg)
    return value


def positive_int(text: str) -> int:
    """A whole number of at least 1 (records, rounds, partitions, ...)."""
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number of at least 0 (where 0 means something: see the option's help)."""
    return _int(text, 0)


def _float(text: str, *, zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        what = "0 or more" if zero else "above 0"
        msg = f"{text!r}: give a number {what}"
        raise argparse.ArgumentTypeError(msg)
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (seconds to run, a rate)."""
    return _float(text, zero=False)


def non_negative_float(text: str) -> float:
    """A finite number of 0 or more (a delay, where 0 means none)."""
    return _float(text, zero=True)


def int_list(text: str) -> list[int]:
    """Whole numbers of at least 1 separated by commas: ``10,1000,10000``."""
    items = text.split(",")
    try:
        return [positive_int(item) for item in items]
    except argparse.ArgumentTypeError:
        msg = f"{text!r}: give whole numbers of at least 1 separated by commas, such as 10,100"
        raise argparse.ArgumentTypeError(msg) from None


def from_env(parser: argparse.ArgumentParser, name: str, default: str,
             convert: Callable[[str], _T]) -> _T:
    """The environment variable ``name`` (else ``default``) read by ``convert`` (one of the
    helpers above); a value it refuses ends the command as a bad option does, naming the
    variable."""
    text = os.environ.get(name, default)
    try:
        return convert(text)
    except argparse.ArgumentTypeError as e:
        parser.error(f"{name}: {e}")
