"""Arrow columns of WriteTables' files: timestamps from any mix of the values a row holds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from cdcflow.model import Timestamp
from cdcflow.transforms._tablebuild import timestamps

NS = 1_704_067_200_123_456_789
PLUS_TWO = timezone(timedelta(hours=2))


@pytest.mark.parametrize("values", [
    [Timestamp.from_ns(NS), None, Timestamp.from_ns(NS + 1)],  # the decoder's: fast path
    [Timestamp.from_ns(NS).astimezone(PLUS_TWO), None],  # another zone, same instant
    [Timestamp.from_ns(NS), datetime(2024, 1, 1, tzinfo=UTC)],  # a plain datetime among them
    [Timestamp.from_ns(NS), "2024-01-01T00:00:00.123456789Z"],  # text among them
    [datetime.__new__(Timestamp, 2024, 1, 1, 0, 0, 0, 123456, UTC)],  # made without __new__
])
def test_timestamps_keep_every_nanosecond(values: list[Any]) -> None:
    got = timestamps(values).cast("int64").to_pylist()
    expected = [None if v is None else Timestamp.parse(v).ns if isinstance(v, str)
                else Timestamp.from_datetime(v).ns for v in values]
    assert got == expected
    assert str(timestamps(values).type) == "timestamp[ns, tz=UTC]"


@pytest.mark.parametrize(
    "first", [-(2**63) + 1, -9_223_372_036_000_000_001, -9_223_372_036_000_000_000])
def test_rfc3339_text_at_the_start_of_what_nanoseconds_hold(first: int) -> None:
    """A timestamp in the first second of 64-bit nanoseconds (1677-09-21T00:12:43.1..Z):
    its second's start is outside that range, and Arrow's floor wrapped around (a CSV
    WriteTables of it raised ArrowInvalid). Every value's text is Timestamp's own."""
    import pyarrow as pa

    from cdcflow.transforms._tablebuild import rfc3339

    values = [first, None, 0, 2**63 - 1, -1]
    text = rfc3339(pa.array(values, pa.int64()).cast(pa.timestamp("ns", tz="UTC")))
    assert text.to_pylist() == [None if v is None else Timestamp.from_ns(v).rfc3339()
                                for v in values]
