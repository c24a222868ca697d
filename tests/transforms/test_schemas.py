"""SchemaChanges' fold on its own, and in a run on every runner."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import MemoryStore
from cdcflow.model import ColumnType, DataChangeRecord, Mod, Timestamp
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import ReadChangeStream, SchemaChange, SchemaChanges

T0 = 1_700_000_000 * 10**9
INT = {"code": "INT64"}
TEXT = {"code": "STRING"}


def rec(at: int, columns: dict[str, Any], *, op: str = "INSERT", txn: str = "t",
        seq: str = "0", table: str = "T") -> DataChangeRecord:
    types = tuple(ColumnType(name, type_, name == "id", i + 1)
                  for i, (name, type_) in enumerate({"id": INT, **columns}.items()))
    return DataChangeRecord(
        partition_token="p", commit_timestamp=Timestamp.from_ns(at), record_sequence=seq,
        server_transaction_id=f"{txn}{at}", is_last_record_in_transaction_in_partition=True,
        table_name=table, column_types=types, mods=(Mod({"id": 1}, {}, {}),), mod_type=op,  # type: ignore[arg-type]
        value_capture_type="NEW_VALUES", number_of_records_in_transaction=1,
        number_of_partitions_in_transaction=1, transaction_tag="",
    )


def names(event: SchemaChange) -> list[str]:
    return [c.name for c in event.columns]


def test_events_precede_the_first_record_of_each_shape_in_commit_order() -> None:
    step = SchemaChanges()
    v1 = rec(T0 + 1, {"a": INT, "b": TEXT})
    update = rec(T0 + 2, {"b": TEXT}, op="UPDATE")  # fewer columns: still version 1
    added = rec(T0 + 4, {"a": INT, "b": TEXT, "c": INT})
    late = rec(T0 + 3, {"a": INT, "b": TEXT})  # a lagging partition's older record
    state, out = step.process_batch(step.initial_state(), [v1, added], Timestamp.from_ns(T0 + 2))
    got = list(out)
    assert [type(e).__name__ for e in got] == ["SchemaChange", "DataChangeRecord"]
    assert got[0].version == 1 and names(got[0]) == ["id", "a", "b"]  # type: ignore[union-attr]
    assert state.held == (added,)  # the watermark has not passed it
    kept = state
    state, out = step.process_batch(state, [late, update], Timestamp.from_ns(T0 + 10))
    assert state is not kept and kept.held == (added,)  # the given state is unchanged
    got = list(out)
    assert got[:2] == [update, late]
    event = got[2]
    assert isinstance(event, SchemaChange) and got[3] == added
    assert (event.table, event.version, event.commit_timestamp.ns) == ("T", 2, T0 + 4)
    assert event.added == ("c",) and event.dropped == () and event.retyped == ()
    assert state.held == ()


def test_drop_shows_in_a_full_row_and_retype_in_any_row() -> None:
    step = SchemaChanges()
    rows = [rec(T0 + 1, {"a": INT, "b": TEXT}),
            rec(T0 + 2, {"b": TEXT}, op="UPDATE"),  # lacks a, but lists only what it wrote
            rec(T0 + 3, {"b": TEXT}),  # an INSERT without a: a was dropped
            rec(T0 + 4, {"b": INT}, op="UPDATE")]  # b's type changed
    state, out = step.process_batch(step.initial_state(), rows, Timestamp.from_ns(T0 + 9))
    events = [e for e in out if isinstance(e, SchemaChange)]
    assert [(e.version, e.dropped, e.added, e.retyped) for e in events] == [
        (1, (), ("id", "a", "b"), ()), (2, ("a",), (), ()), (3, (), (), ("b",))]
    assert names(events[-1]) == ["id", "b"] and events[-1].columns[1].type == INT
    # a replay from the same state gives the same output
    again = SchemaChanges().process_batch(step.initial_state(), rows, Timestamp.from_ns(T0 + 9))
    assert list(again[1]) == list(step.process_batch(
        step.initial_state(), rows, Timestamp.from_ns(T0 + 9))[1])
    assert state.schemas["T"].version == 3


def test_elements_that_are_not_records_are_refused() -> None:
    with pytest.raises(TypeError, match="apply it to ReadPartition's output"):
        SchemaChanges().process_batch(SchemaChanges().initial_state(), ["x"],  # type: ignore[list-item]
                                      Timestamp.from_ns(T0))


def test_through_the_test_harness_on_every_runner(runner: Any) -> None:
    stream = ScriptedChangeStream("S", partitions=3, buckets=12, origin=T0)
    ms = 1_000_000
    for key in range(6):
        stream.write("Orders", key, "INSERT", {"total": key, "note": "x"}, at=T0 + key * ms)
    stream.write("Orders", 2, "UPDATE", {"total": 20}, at=T0 + 7 * ms)
    for key in range(6, 10):  # ADD COLUMN discount
        stream.write("Orders", key, "INSERT", {"total": key, "note": "y", "discount": 0.5},
                     at=T0 + 10 * ms + key * ms)
    for key in range(10, 14):  # DROP COLUMN note
        stream.write("Orders", key, "INSERT", {"total": key, "discount": 0.1},
                     at=T0 + 30 * ms + key * ms)
    stream.write("Items", 1, "INSERT", {"sku": "s"}, at=T0 + 50 * ms)
    out = cf.Collect()
    p = cf.Pipeline("schemas")
    (p | ReadChangeStream(stream="S", start_at=T0, end_at=T0 + 60 * ms, client=stream)
     | SchemaChanges() | out)
    summary = Engine(p, MemoryStore(), runner,
                     RunOptions(batch_interval=0, max_batch_span=0.005)).run()
    assert summary.reason == "end reached"
    items = out.items
    events = [e for e in items if isinstance(e, SchemaChange)]
    assert [(e.table, e.version, e.added, e.dropped) for e in events] == [
        ("Orders", 1, ("id", "total", "note"), ()),
        ("Orders", 2, ("discount",), ()),
        ("Orders", 3, (), ("note",)),
        ("Items", 1, ("id", "sku"), ())]
    records = [r for r in items if isinstance(r, DataChangeRecord)]
    assert len(records) == 16  # each once
    stamps = [r.commit_timestamp.ns for r in records]
    assert stamps == sorted(stamps)
    current: dict[str, SchemaChange] = {}
    for item in items:  # every record fits the version announced before it
        if isinstance(item, SchemaChange):
            current[item.table] = item
            continue
        known = {c.name: c.type for c in current[item.table_name].columns}
        assert all(known.get(c.name) == c.type for c in item.column_types), item


@pytest.mark.emulator
@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def test_add_and_drop_column_mid_stream_on_the_emulator(spanner_emulator: Any, tmp_path: Path,
                                                        dialect: str) -> None:
    from tests.transforms.tables_alter import V2, V3, AlterCase, AlterWorkload

    case = AlterCase(spanner_emulator, tmp_path, dialect, "unused")
    workload = AlterWorkload(case.database, dialect, seed=11)
    start = Timestamp.now()
    workload.run(2.0, rate=12)
    first = len(workload.changes)
    workload.alter(["ALTER TABLE Orders ADD COLUMN Discount NUMERIC",
                    "ALTER TABLE Orders ADD COLUMN ShippedAt TIMESTAMP"], V2)
    workload.run(2.0, rate=12)
    second = len(workload.changes)
    workload.alter(["ALTER TABLE Orders DROP COLUMN Details"], V3)
    workload.run(2.0, rate=12)
    changes = workload.changes
    end = Timestamp.from_ns(max(c.commit_ns for c in changes) + 1_000_000)

    out = cf.Collect()
    p = cf.Pipeline("schemas-emulator")
    (p | ReadChangeStream(database=case.env["E2E_DB"], stream=case.env["E2E_STREAM"],
                          start_at=start, end_at=end, heartbeat="250ms")
     | SchemaChanges() | out)
    summary = Engine(p, MemoryStore(), InMemoryRunner(workers=2),
                     RunOptions(batch_interval=0.1, max_batch_span=0.5)).run()
    assert summary.reason == "end reached"

    events = [e for e in out.items if isinstance(e, SchemaChange)]
    assert [(e.version, e.added, e.dropped) for e in events] == [
        (1, ("OrderId", "Customer", "Status", "Quantity", "Price", "Details"), ()),
        (2, ("Discount", "ShippedAt"), ()),
        (3, (), ("Details",))]
    # each event comes with the first record of its shape: after every change of the
    # version before, at or before the first INSERT of its own
    for event, lo, hi in ((events[1], first, second), (events[2], second, len(changes))):
        before = max(c.commit_ns for c in changes[:lo]) // 1000
        inserts = min(c.commit_ns for c in changes[lo:hi] if c.mod_type == "INSERT") // 1000
        assert before < event.commit_timestamp.ns // 1000 <= inserts, (event, before, inserts)
    records = [r for r in out.items if isinstance(r, DataChangeRecord)]
    seen = Counter((int(m.keys["OrderId"]), r.commit_timestamp.ns // 1000, r.mod_type)
                   for r in records for m in r.mods)
    assert seen == Counter((c.key, c.commit_ns // 1000, c.mod_type) for c in changes)
    stamps = [r.commit_timestamp.ns for r in records]
    assert stamps == sorted(stamps) and len(changes) > 60
