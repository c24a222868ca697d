from __future__ import annotations

import pickle
import time

import cloudpickle
import pytest

from cdcflow.errors import ChangeStreamError, StreamNotFoundError, TransientError
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    DataChangeRecord,
    HeartbeatRecord,
    record_position,
)
from cdcflow.stream import ChangeStreamQuery
from cdcflow.testing import ScriptedChangeStream

MS = 1_000_000
T0 = 1_700_000_000 * 1_000_000_000  # an arbitrary origin, in ns


def read(
    s: ScriptedChangeStream, token: str | None, start: int, end: int, hb: int = 1000
) -> list[ChangeRecord]:
    return list(s.read(ChangeStreamQuery(s.stream, token, start, end, heartbeat_millis=hb)))


def data(records: list[ChangeRecord]) -> list[DataChangeRecord]:
    return [r for r in records if isinstance(r, DataChangeRecord)]


def test_root_query_returns_partitions_alive_at_its_start() -> None:
    s = ScriptedChangeStream("S", partitions=2, origin=T0).split("p0", at=T0 + 10, into=["a", "b"])
    recs = read(s, None, T0 + 20, T0 + 100)
    assert all(isinstance(r, ChildPartitionsRecord) for r in recs)
    assert [r.partition_token for r in recs] == [INITIAL_PARTITION_TOKEN] * 3
    assert [c.token for r in recs for c in r.child_partitions] == ["a", "b", "p1"]  # type: ignore[union-attr]
    assert {record_position(r) for r in recs} == {T0 + 20}


def test_root_query_before_origin_fails_naming_the_origin() -> None:
    s = ScriptedChangeStream("S", origin=T0)
    with pytest.raises(ChangeStreamError, match="start reading at or after"):
        read(s, None, T0 - 5, T0 + 5)


def test_split_routes_keys_to_children_and_reports_them_at_the_end() -> None:
    s = ScriptedChangeStream("S", partitions=1, buckets=8, origin=T0)
    for k in range(20):
        s.write("T", k, "INSERT", {"v": k}, at=T0 + 100 + k)
    s.split("p0", at=T0 + 110, into=["a", "b"])
    before = read(s, "p0", T0, T0 + 1000)
    assert isinstance(before[-1], ChildPartitionsRecord)
    assert before[-1].start_timestamp.ns == T0 + 110
    assert before[-1].child_partitions == (
        ChildPartition("a", ("p0",)),
        ChildPartition("b", ("p0",)),
    )
    assert [m.keys["id"] for r in data(before) for m in r.mods] == list(range(10))
    after = data(read(s, "a", T0 + 110, T0 + 1000)) + data(read(s, "b", T0 + 110, T0 + 1000))
    assert sorted(m.keys["id"] for r in after for m in r.mods) == list(range(10, 20))
    for r in after:
        assert r.partition_token == s.owner(r.mods[0].keys, r.commit_timestamp.ns)


def test_merge_child_is_reported_by_every_parent_with_all_parents() -> None:
    s = ScriptedChangeStream("S", partitions=["x", "y"], origin=T0).merge(
        ["x", "y"], at=T0 + 50, into="m"
    )
    for token in ("x", "y"):
        last = read(s, token, T0, T0 + 100)[-1]
        assert isinstance(last, ChildPartitionsRecord)
        assert last.partition_token == token
        assert last.child_partitions == (ChildPartition("m", ("x", "y")),)
    assert s.partitions_at(T0 + 50) == ["m"]


def test_partition_end_at_a_slice_boundary_is_reported_by_the_next_slice() -> None:
    s = ScriptedChangeStream("S", origin=T0).split("p0", at=T0 + 50)
    assert not any(isinstance(r, ChildPartitionsRecord) for r in read(s, "p0", T0, T0 + 50))
    assert isinstance(read(s, "p0", T0 + 50, T0 + 60)[0], ChildPartitionsRecord)


def test_heartbeats_fill_idle_stretches_and_slices_neither_gap_nor_overlap() -> None:
    s = ScriptedChangeStream("S", origin=T0)
    s.write("T", 1, at=T0 + 1 * MS).write("T", 2, at=T0 + 5500 * MS).write(
        "T", 3, at=T0 + 5500 * MS
    )
    recs = read(s, "p0", T0, T0 + 8000 * MS)
    beats = [r.timestamp.ns - T0 for r in recs if isinstance(r, HeartbeatRecord)]
    assert beats == [t * MS for t in (1001, 2001, 3001, 4001, 5001, 6500, 7500)]
    positions = [record_position(r) for r in recs]
    assert positions == sorted(positions)
    whole = data(recs)
    parts = [
        data(read(s, "p0", a, b))
        for a, b in (
            (T0, T0 + 5500 * MS),
            (T0 + 5500 * MS, T0 + 5501 * MS),
            (T0 + 5501 * MS, T0 + 9000 * MS),
        )
    ]
    assert parts[0] + parts[1] + parts[2] == whole
    assert len(parts[1]) == 2  # both records share the commit timestamp at the boundary


def test_transaction_groups_mods_per_partition_table_and_mod_type() -> None:
    s = ScriptedChangeStream("S", partitions=2, buckets=2, origin=T0)
    keys = {s.owner(k, T0 + 1): k for k in range(10)}  # one key in each partition
    k0, k1 = keys["p0"], keys["p1"]
    with s.transaction(at=T0 + 1, tag="t1") as tx:
        tx.write("A", k0, "INSERT", {"v": 1})
        tx.write("A", k0, "UPDATE", {"v": 2}, {"v": 1})
        tx.write("B", k0, "INSERT", {"w": "x"})
        tx.write("A", k1, "DELETE", old_values={"v": 0})
    recs = s.expected_records()
    assert [(r.partition_token, r.table_name, r.mod_type, r.record_sequence) for r in recs] == [
        ("p0", "A", "INSERT", "00000000"),
        ("p0", "A", "UPDATE", "00000001"),
        ("p0", "B", "INSERT", "00000002"),
        ("p1", "A", "DELETE", "00000000"),
    ]
    assert {r.server_transaction_id for r in recs} == {"txn-00000000"}
    assert all(r.number_of_records_in_transaction == 4 for r in recs)
    assert all(r.number_of_partitions_in_transaction == 2 for r in recs)
    assert [r.is_last_record_in_transaction_in_partition for r in recs] == [
        False,
        False,
        True,
        True,
    ]
    assert recs[1].mods[0].old_values == {"v": 1} and recs[0].transaction_tag == "t1"
    assert [c.name for c in recs[0].column_types] == ["id", "v"]
    assert recs[0].column_types[0].is_primary_key and recs[0].column_types[0].type == {
        "code": "INT64"
    }
    changes = s.expected_changes()
    assert [(c.table, c.mod_type) for c in changes] == [
        ("A", "INSERT"),
        ("A", "UPDATE"),
        ("B", "INSERT"),
        ("A", "DELETE"),
    ]


def test_expected_records_is_what_reading_every_partition_gives() -> None:
    s = ScriptedChangeStream("S", partitions=2, buckets=16, origin=T0)
    for i in range(60):
        s.write("T", i % 7, "UPDATE", {"v": i}, at=T0 + i * 10)
    s.split("p0", at=T0 + 155).merge(["p0.1", "p1"], at=T0 + 333, into="m").split("m", at=T0 + 400)
    got = []
    for token in ("p0", "p1", "p0.0", "p0.1", "m", "m.0", "m.1"):
        start = min(p.start for t, p in s._parts.items() if t == token)
        got += data(read(s, token, start, T0 + 10_000))
    order = s.expected_records()
    assert len(got) == len(order) == 60
    assert sorted(got, key=order.index) == order
    assert len(s.expected_records(T0 + 100, T0 + 200)) == 10


def test_pickled_copy_reads_the_same_records_with_nanoseconds() -> None:
    s = ScriptedChangeStream("S", origin=T0)
    s.write("T", 1, at=T0 + 123_456_789)
    s.expected_records()  # fill the compiled cache before pickling
    copy = pickle.loads(cloudpickle.dumps(s))
    assert read(copy, "p0", T0, T0 + 10**9) == read(s, "p0", T0, T0 + 10**9)
    assert data(read(copy, "p0", T0, T0 + 10**9))[0].commit_timestamp.ns == T0 + 123_456_789


def test_fail_reads_raises_transient_errors_then_recovers() -> None:
    s = ScriptedChangeStream("S", origin=T0)
    for i in range(5):
        s.write("T", i, at=T0 + i)
    s.fail_reads(2, after_records=3, token="p0")
    for _ in range(2):
        got: list[ChangeRecord] = []
        with pytest.raises(TransientError, match="UNAVAILABLE"):
            for r in s.read(ChangeStreamQuery("S", "p0", T0, T0 + 100)):
                got.append(r)
        assert len(got) == 3
    assert len(data(read(s, "p0", T0, T0 + 100))) == 5
    assert s.reads == 3


def test_a_stalled_partition_answers_once_its_time_has_passed_in_every_copy() -> None:
    s = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(4):
        s.write("T", i, at=T0 + 10 + i)
    began = time.monotonic()  # before the stall's deadline is set: it counts from there
    s.stall("p0", 0.4, after=T0 + 5)
    copy = pickle.loads(cloudpickle.dumps(s))  # a task's copy stalls until the same moment
    assert read(copy, "p0", T0, T0 + 5) == read(s, "p0", T0, T0 + 5)  # before `after`: at once
    other = data(read(s, "p1", T0 + 5, T0 + 100))  # another partition: at once
    assert time.monotonic() - began < 0.3
    stalled = data(read(copy, "p0", T0 + 5, T0 + 100))
    assert time.monotonic() - began >= 0.4
    assert len(stalled) + len(other) == 4 and stalled and other
    with pytest.raises(ValueError, match="unknown partition 'p9'"):
        s.stall("p9", 1)
    with pytest.raises(ValueError, match="seconds >= 0"):
        s.stall("p0", -1)


def test_unknown_stream_and_bad_scripts_are_refused() -> None:
    s = ScriptedChangeStream("Orders", origin=T0)
    with pytest.raises(StreamNotFoundError, match="stream='Orders'"):
        s.describe_stream("Other")
    assert s.describe_stream("Orders").partition_mode == "IMMUTABLE_KEY_RANGE"
    s.split("p0", at=T0 + 10)
    with pytest.raises(ValueError, match="already ended"):
        s.split("p0", at=T0 + 20)
    with pytest.raises(ValueError, match="starts at"):
        s.split("p0.0", at=T0 + 5)
    with pytest.raises(ValueError, match="taken"):
        s.split("p0.0", at=T0 + 20, into=["p0.1", "z"])
    with pytest.raises(ChangeStreamError, match="outside"):
        read(s, "p0.0", T0, T0 + 100)
