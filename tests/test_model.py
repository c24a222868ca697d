"""Timestamp as a datetime that keeps nanoseconds, and records built from wire-like values.

The Timestamp properties run over mixes of Timestamps (in several zones) and plain
datetimes drawn from a few neighbouring instants, so equal values, values one nanosecond
apart and values of the same microsecond all occur often.
"""

from __future__ import annotations

import copy
import operator
import pickle
import re
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta, timezone
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcflow.model import (
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    MoveInEvent,
    PartitionEndRecord,
    PartitionEventRecord,
    PartitionMetadata,
    PartitionStartRecord,
    PartitionState,
    Timestamp,
    record_position,
)

_MIN_NS = Timestamp(1, 1, 1).ns
_MAX_NS = Timestamp(9999, 12, 31, 23, 59, 59, 999_999, nanosecond=999).ns
_BASE_NS = 1_714_564_800_000_000_000  # 2024-05-01T12:00:00Z
_ZONES = [UTC, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-8))]
_OPS: list[Callable[[Any, Any], Any]] = [
    operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
]

Value = Timestamp | datetime


def _timestamp_in(ns: int, tz: timezone) -> Timestamp:
    """The Timestamp of ``ns`` whose fields are local to ``tz``."""
    local = datetime.astimezone(_plain(ns, UTC), tz)
    return Timestamp(
        local.year, local.month, local.day, local.hour, local.minute, local.second,
        local.microsecond, tzinfo=tz, nanosecond=ns % 1000,
    )


def _plain(ns: int, tz: timezone) -> datetime:
    """The plain datetime of ``ns`` truncated to its microsecond, in ``tz``."""
    utc = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000)
    return utc.astimezone(tz)


def _key(value: Value) -> int:
    """The instant in nanoseconds: a plain datetime is its microsecond's first nanosecond."""
    if isinstance(value, Timestamp):
        return value.ns
    return Timestamp.from_datetime(value).ns


# A handful of instants around one microsecond boundary: equal, 1 ns apart, same microsecond.
_near_ns = st.builds(
    lambda micro, nano: _BASE_NS + micro * 1000 + nano,
    st.integers(0, 1),
    st.sampled_from([0, 0, 1, 2, 999]),
)
_zone = st.sampled_from(_ZONES)
_timestamps = st.builds(_timestamp_in, _near_ns, _zone)
_datetimes = st.builds(_plain, _near_ns, _zone)
_values: st.SearchStrategy[Value] = st.one_of(_timestamps, _datetimes)
_any_ns = st.integers(_MIN_NS, _MAX_NS)


# -- Timestamp: equality, hashing, order --------------------------------------------------


@given(_values, _values)
def test_equal_values_hash_equal_and_equality_is_symmetric(a: Value, b: Value) -> None:
    assert (a == b) == (b == a)
    assert (a != b) == (not operator.eq(a, b)) == (b != a)  # __ne__ agrees with __eq__
    if a == b:
        assert hash(a) == hash(b)
        assert len({a, b}) == 1


@settings(max_examples=500)
@given(_values, _values, _values)
def test_equality_is_transitive(a: Value, b: Value, c: Value) -> None:
    if a == b and b == c:
        assert a == c
    if a == b:
        assert (a == c) == (b == c)  # equal values are interchangeable


@given(_values, _values)
def test_order_is_total_and_follows_nanoseconds(a: Value, b: Value) -> None:
    for op in _OPS:
        assert op(a, b) == op(_key(a), _key(b)), (op.__name__, a, b)


@given(st.lists(_values, min_size=2, max_size=8))
def test_sorting_a_mix_orders_by_instant(values: list[Value]) -> None:
    keys = [_key(v) for v in sorted(values)]
    assert keys == sorted(keys)


@given(st.integers(1, 999), _zone)
def test_nanoseconds_past_a_microsecond_equal_no_datetime(nano: int, tz: timezone) -> None:
    ts = _timestamp_in(_BASE_NS + nano, tz)
    at = _plain(_BASE_NS, tz)  # the same microsecond
    after = _plain(_BASE_NS + 1000, tz)
    assert ts != at and at != ts and not operator.eq(ts, at)
    assert at < ts and ts > at and ts >= at and at <= ts
    assert not ts <= at and not at >= ts
    assert ts < after and after > ts


@given(_any_ns)
def test_zero_nanoseconds_is_the_datetime(ns: int) -> None:
    ts = Timestamp.from_ns(ns - ns % 1000)
    plain = datetime(ts.year, ts.month, ts.day, ts.hour, ts.minute, ts.second,
                     ts.microsecond, tzinfo=UTC)
    assert ts == plain and plain == ts
    assert hash(ts) == hash(plain)
    assert {plain: "row"}[ts] == "row"
    assert ts <= plain and ts >= plain and not ts < plain and not ts > plain


def test_two_timestamps_a_nanosecond_apart_are_not_both_the_datetime() -> None:
    plain = datetime(2024, 5, 1, 12, 0, 0, 123_456, tzinfo=UTC)
    first = Timestamp.parse("2024-05-01T12:00:00.123456000Z")
    second = Timestamp.parse("2024-05-01T12:00:00.123456001Z")
    assert first == plain and first != second
    assert second != plain and plain < second


def test_naive_datetimes_and_other_types_behave_as_with_datetime() -> None:
    ts = Timestamp.parse("2024-05-01T12:00:00.000000001Z")
    naive = datetime(2024, 5, 1, 12)
    assert ts != naive and not operator.eq(ts, naive)
    with pytest.raises(TypeError):
        _ = ts < naive
    with pytest.raises(TypeError):
        _ = naive <= ts
    assert ts != "2024-05-01T12:00:00.000000001Z"
    assert ts != date(2024, 5, 1)
    with pytest.raises(TypeError):
        _ = ts > 5  # type: ignore[operator]


# -- Timestamp: representations ------------------------------------------------------------


@given(_any_ns)
def test_ns_and_from_ns_round_trip(ns: int) -> None:
    ts = Timestamp.from_ns(ns)
    assert ts.ns == ns
    assert ts.nanosecond == ns % 1000
    assert ts.tzinfo is UTC


@given(st.one_of(st.builds(Timestamp.from_ns, _any_ns), _timestamps))
def test_pickle_and_copy_keep_the_nanoseconds(ts: Timestamp) -> None:
    copies = [pickle.loads(pickle.dumps(ts, protocol))
              for protocol in range(pickle.HIGHEST_PROTOCOL + 1)]
    copies += [copy.copy(ts), copy.deepcopy(ts), copy.deepcopy({"at": [ts]})["at"][0]]
    for other in copies:
        assert type(other) is Timestamp
        assert other == ts and other.ns == ts.ns and hash(other) == hash(ts)


_deltas = st.timedeltas(min_value=timedelta(days=-3650), max_value=timedelta(days=3650))


@given(_near_ns, _zone, _deltas)
def test_datetime_methods_keep_the_nanoseconds(ns: int, tz: timezone, delta: timedelta) -> None:
    ts = _timestamp_in(ns, tz)
    step = ((delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds) * 1000
    for moved in (ts + delta, delta + ts):
        assert type(moved) is Timestamp and moved.ns == ns + step
    later = ts - delta
    assert type(later) is Timestamp and later.ns == ns - step
    assert ts - _plain(ns - ns % 1000, UTC) == timedelta(0)  # datetime - datetime: µs
    for zone in (UTC, *_ZONES):
        there = ts.astimezone(zone)
        assert type(there) is Timestamp and there.ns == ns and there.utcoffset() == \
            zone.utcoffset(None)
    year = ts.replace(year=2020)
    assert type(year) is Timestamp and year.nanosecond == ts.nanosecond and year.year == 2020
    assert ts.replace(nanosecond=7).ns == ns - ns % 1000 + 7
    naive = ts.replace(tzinfo=None)
    assert type(naive) is datetime and naive.tzinfo is None


def test_an_instance_made_without_new_reads_as_no_nanoseconds() -> None:
    """datetime's C constructors can make a Timestamp without __new__ (slots unset)."""
    bare = datetime.__new__(Timestamp, 2024, 5, 1, 12, 0, 0, 5, UTC)
    assert bare.nanosecond == 0 and bare.ns == _BASE_NS + 5000
    assert bare.rfc3339() == "2024-05-01T12:00:00.000005000Z"
    with pytest.raises(AttributeError, match="no attribute 'other'"):
        _ = bare.other  # type: ignore[attr-defined]


@given(st.one_of(st.builds(Timestamp.from_ns, _any_ns), _timestamps))
def test_parse_reads_back_rfc3339(ts: Timestamp) -> None:
    text = ts.rfc3339()
    assert text.endswith("Z") and len(text.split(".")[1]) == len("123456789Z")
    parsed = Timestamp.parse(text)
    assert parsed == ts and parsed.ns == ts.ns
    assert str(ts) == text
    assert eval(repr(ts), {"Timestamp": Timestamp}) == ts


@given(_near_ns, _zone)
def test_parse_honours_offsets(ns: int, tz: timezone) -> None:
    local = _timestamp_in(ns, tz)
    offset = local.utcoffset()
    assert offset is not None
    minutes = int(offset.total_seconds()) // 60
    sign = "+" if minutes >= 0 else "-"
    text = (
        f"{local:%Y-%m-%dT%H:%M:%S}.{local.microsecond:06d}{local.nanosecond:03d}"
        f"{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"
    )
    assert Timestamp.parse(text).ns == ns


def test_invalid_timestamps_name_the_fix() -> None:
    with pytest.raises(ValueError, match=re.escape("2024-05-01T12:00:00.123456789Z")):
        Timestamp.parse("May 1st")
    with pytest.raises(ValueError, match=re.escape("tzinfo=datetime.UTC")):
        Timestamp(2024, 5, 1, tzinfo=None)
    with pytest.raises(ValueError, match=r"0\.\.999"):
        Timestamp(2024, 5, 1, nanosecond=1000)


# -- records from wire-like values -----------------------------------------------------------

_WHEN = "2024-05-01T12:00:00.123456789Z"


def _data_record(**changes: object) -> DataChangeRecord:
    fields: dict[str, object] = {
        "partition_token": "tok",
        "commit_timestamp": _WHEN,
        "record_sequence": "00000001",
        "server_transaction_id": "tx",
        "is_last_record_in_transaction_in_partition": True,
        "table_name": "Orders",
        "column_types": [
            ColumnType("id", {"code": "INT64"}, True, 1),
            ColumnType("total", {"code": "NUMERIC"}, False, 2),
        ],
        "mods": [Mod({"id": "1"}, {"total": "9.50"}, {})],
        "mod_type": "INSERT",
        "value_capture_type": "OLD_AND_NEW_VALUES",
        "number_of_records_in_transaction": 1,
        "number_of_partitions_in_transaction": 1,
    }
    fields.update(changes)
    return DataChangeRecord(**fields)  # type: ignore[arg-type]


def test_data_change_record_from_wire_values() -> None:
    record = _data_record()
    assert type(record.commit_timestamp) is Timestamp
    assert record.commit_timestamp.ns == Timestamp.parse(_WHEN).ns
    assert record.commit_timestamp.nanosecond == 789
    assert isinstance(record.column_types, tuple) and isinstance(record.mods, tuple)
    assert record.column_types[0].type == {"code": "INT64"}
    assert record.mods[0].new_values == {"total": "9.50"}
    assert record.transaction_tag == "" and record.is_system_transaction is False
    assert record_position(record) == Timestamp.parse(_WHEN).ns
    # the same instant given as ns, as a Timestamp or as a datetime in another zone
    ns = Timestamp.parse(_WHEN).ns
    assert _data_record(commit_timestamp=ns) == record
    assert _data_record(commit_timestamp=Timestamp.parse(_WHEN)) == record
    whole = datetime(2024, 5, 1, 14, 0, 0, 123_456, tzinfo=timezone(timedelta(hours=2)))
    assert _data_record(commit_timestamp=whole).commit_timestamp.ns == ns - 789
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        record.table_name = "Other"  # type: ignore[misc]
    again = pickle.loads(pickle.dumps(record))
    assert again == record and again.commit_timestamp.nanosecond == 789


def test_timestamps_convert_from_text_ns_and_datetimes() -> None:
    naive = HeartbeatRecord("tok", datetime(2024, 5, 1, 12))
    assert naive.timestamp == Timestamp.parse("2024-05-01T12:00:00Z")  # naive is UTC
    assert HeartbeatRecord("tok", 1).timestamp.rfc3339() == "1970-01-01T00:00:00.000000001Z"
    offset = HeartbeatRecord("tok", "2024-05-01T14:00:00.000000005+02:00")
    assert offset.timestamp.ns == Timestamp.parse("2024-05-01T12:00:00.000000005Z").ns
    assert offset.timestamp.tzinfo is UTC
    with pytest.raises(TypeError, match="RFC 3339 text or integer ns"):
        HeartbeatRecord("tok", 1.5)
    with pytest.raises(ValueError, match="RFC 3339"):
        HeartbeatRecord("tok", "noon")


def test_partition_records_from_wire_values() -> None:
    children = ChildPartitionsRecord(
        "parent", _WHEN, "00000002",
        [ChildPartition("c1", ["parent"]), ChildPartition("c2", ["parent", "other"])],
    )
    assert children.child_partitions[1].parent_partition_tokens == ("parent", "other")
    assert isinstance(children.child_partitions, tuple)
    start = PartitionStartRecord("tok", _WHEN, "1", ["a", "b"])
    assert start.partition_tokens == ("a", "b")
    end = PartitionEndRecord("tok", Timestamp.parse(_WHEN).ns, "2")
    event = PartitionEventRecord("tok", _WHEN, "3", [MoveInEvent("src")])
    assert event.move_in_events == (MoveInEvent("src"),) and event.move_out_events == ()
    positions = {record_position(r) for r in (children, start, end, event)}
    assert positions == {Timestamp.parse(_WHEN).ns}


def test_partition_metadata_takes_state_text() -> None:
    meta = PartitionMetadata("tok", ["p"], 0, 10, 0, "RUNNING")
    assert meta.state is PartitionState.RUNNING and meta.parent_tokens == ("p",)
    with pytest.raises(ValueError, match="SLEEPING"):
        PartitionMetadata("tok", [], 0, 10, 0, "SLEEPING")
