"""Sizes as WriteTables takes them ("64MiB", "500KB", bytes) and durations ("250ms",
"1h30m", seconds); a bad one names the fix."""

from __future__ import annotations

import pytest

from cdcflow.durations import parse_duration, parse_size
from cdcflow.errors import PipelineDefinitionError


def test_sizes_in_binary_and_decimal_units() -> None:
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size(" 1.5 KB ") == 1500
    assert parse_size("2gib") == 2 * 2**30
    assert parse_size("100") == parse_size("100B") == parse_size(100) == 100


def test_a_bad_size_says_how_to_write_one() -> None:
    with pytest.raises(PipelineDefinitionError, match=r"write e\.g\. 64MiB"):
        parse_size("64 megs")
    for fraction in ("1.5", "1.5B"):  # a fraction of a byte: refused, not rounded down
        with pytest.raises(PipelineDefinitionError, match="a number of bytes is whole"):
            parse_size(fraction)


def test_durations_and_what_is_not_one() -> None:
    assert parse_duration("1h30m") == 5400.0
    assert parse_duration(" 250MS ") == 0.25 and parse_duration("2") == parse_duration(2) == 2.0
    for bad in ("nan", "NaN", "inf", "-inf", "1e400", float("nan"), float("inf"), "5 parsecs"):
        with pytest.raises(ValueError, match=r"not a duration: .*write e\.g\. 250ms"):
            parse_duration(bad)


def test_a_negative_duration_is_named_as_such() -> None:
    with pytest.raises(ValueError, match=r"'-1s' is negative; write a time of 0 or more"):
        parse_duration("-1s")
