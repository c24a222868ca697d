from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcflow.keyrange import (
    MAX_BOUND_CHARS,
    KeyRange,
    range_token,
    split_ranges,
    token_range,
)
from cdcflow.model import is_snapshot_token, snapshot_table, snapshot_token

wire_values = st.one_of(
    st.none(), st.booleans(), st.text(), st.integers(-(2**63), 2**63 - 1).map(str),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["NaN", "Infinity", "-Infinity"]),
)
keys = st.lists(wire_values, min_size=1, max_size=4).map(tuple)


@given(st.integers(0, 99_999), st.one_of(st.none(), keys), st.one_of(st.none(), keys))
def test_a_range_token_names_its_table_and_gives_its_range_back(
    index: int, lo: tuple[object, ...] | None, hi: tuple[object, ...] | None
) -> None:
    r = KeyRange(index, lo, hi)  # type: ignore[arg-type]
    token = range_token("Orders", r)
    assert token.startswith(f"snapshot/Orders/{index:05d}/")
    assert is_snapshot_token(token) and snapshot_table(token) == "Orders"
    back = token_range(token)
    assert back == r
    assert back is not None and range_token("Orders", back) == token  # canonical text


def test_a_range_token_is_readable_and_a_table_token_has_no_range() -> None:
    token = range_token("public.Orders", KeyRange(2, ("1000", None), ("2000", "a/b")))
    assert token == 'snapshot/public.Orders/00002/[["1000",null],["2000","a/b"]]'
    assert snapshot_table(token) == "public.Orders"
    assert token_range(snapshot_token("Orders")) is None
    assert KeyRange(0).bounds_text() == "[null,null]"


@pytest.mark.parametrize("token", [
    "snapshot/T/x/[null,null]", "snapshot/T/00001", "snapshot/T/00001/[1]",
    "snapshot/T/00001/not json", 'snapshot/T/00001/[{"a":1},null]', "Parent0",
])
def test_malformed_range_tokens_are_refused(token: str) -> None:
    with pytest.raises(ValueError, match="snapshot token"):
        token_range(token)


@given(st.lists(st.integers(0, 10**6), unique=True, max_size=300), st.integers(1, 40))
def test_a_split_covers_every_key_once_in_ranges_of_about_rows_per_task(
    values: list[int], rows_per_task: int
) -> None:
    sorted_keys = [(str(v).zfill(7),) for v in sorted(values)]  # text sorts like the ints
    ranges = split_ranges(iter(sorted_keys), rows_per_task)
    if len(sorted_keys) <= rows_per_task:
        assert ranges == []
        return
    assert [r.index for r in ranges] == list(range(len(ranges)))
    assert ranges[0].lo is None and ranges[-1].hi is None
    assert all(a.hi == b.lo for a, b in itertools.pairwise(ranges))
    sizes = [
        sum(1 for k in sorted_keys if (r.lo is None or k >= r.lo) and (r.hi is None or k < r.hi))
        for r in ranges
    ]
    assert sum(sizes) == len(sorted_keys)  # contiguous, half-open: each key in one range
    assert all(n == rows_per_task for n in sizes[:-1]) and 1 <= sizes[-1] <= rows_per_task


def test_keys_too_long_for_a_token_are_not_made_bounds() -> None:
    long = "x" * MAX_BOUND_CHARS
    sorted_keys = [("a",), ("b",), (long + "1",), (long + "2",), ("y",), ("z",)]
    ranges = split_ranges(sorted_keys, 2)
    assert [r.lo for r in ranges] == [None, ("y",)]  # the long keys joined the first range
    assert all(len(range_token("T", r)) < 2 * MAX_BOUND_CHARS + 50 for r in ranges)
    with pytest.raises(ValueError, match="rows_per_task"):
        split_ranges([], 0)
