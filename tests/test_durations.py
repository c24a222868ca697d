"""Sizes as WriteTables takes them: "64MiB", "500KB", bytes; a bad one names the fix."""

from __future__ import annotations

import pytest

from cdcflow.durations import parse_size
from cdcflow.errors import PipelineDefinitionError


def test_sizes_in_binary_and_decimal_units() -> None:
    assert parse_size("64MiB") == 64 * 2**20
    assert parse_size(" 1.5 KB ") == 1500
    assert parse_size("2gib") == 2 * 2**30
    assert parse_size("100") == parse_size("100B") == parse_size(100) == 100


def test_a_bad_size_says_how_to_write_one() -> None:
    with pytest.raises(PipelineDefinitionError, match=r"write e\.g\. 64MiB"):
        parse_size("64 megs")
