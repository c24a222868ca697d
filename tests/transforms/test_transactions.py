"""GroupTransactions' fold on its own, and through cdcflow.testing.run."""

from __future__ import annotations

import pytest

import cdcflow as cf
import cdcflow.testing
from cdcflow.model import DataChangeRecord, Mod, Timestamp
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import (
    Filter,
    GroupTransactions,
    IncompleteTransactionError,
    ReadPartition,
    Transaction,
)
from cdcflow.transforms.source import DetectPartitions

T0 = 1_700_000_000 * 10**9


def rec(txn: str, at: int, seq: str, token: str, *, records: int = 2, parts: int = 2,
        table: str = "T") -> DataChangeRecord:
    return DataChangeRecord(
        partition_token=token, commit_timestamp=Timestamp.from_ns(at), record_sequence=seq,
        server_transaction_id=txn, is_last_record_in_transaction_in_partition=True,
        table_name=table, column_types=(), mods=(Mod({"id": 1}, {}, {}),), mod_type="INSERT",
        value_capture_type="NEW_VALUES", number_of_records_in_transaction=records,
        number_of_partitions_in_transaction=parts, transaction_tag="tag",
    )


def test_a_transaction_waits_for_the_watermark_then_comes_out_whole_and_ordered() -> None:
    step = GroupTransactions()
    state = step.initial_state()
    second = rec("x", T0 + 5, "00000010", "b", table="U")
    state, out = step.process_batch(state, [second], Timestamp.from_ns(T0 + 5))
    assert list(out) == [] and len(state) == 1  # the watermark has not passed it
    first = rec("x", T0 + 5, "2", "a")
    other = rec("w", T0 + 3, "1", "a", records=1, parts=1)
    kept = dict(state)
    new, out = step.process_batch(state, [first, other], Timestamp.from_ns(T0 + 6))
    assert state == kept  # the given state is not changed in place
    assert new == {}
    got = list(out)
    assert [t.server_transaction_id for t in got] == ["w", "x"]  # commit timestamp order
    assert got[1] == Transaction(Timestamp.from_ns(T0 + 5), "x", "tag", (first, second))
    assert got[1].tables == ("T", "U") and got[1].mods == 2 and got[1].partitions == ("a", "b")


def test_same_timestamp_transactions_come_out_by_transaction_id() -> None:
    step = GroupTransactions()
    _, out = step.process_batch(
        {}, [rec(i, T0, "1", "a", records=1, parts=1) for i in "cab"], Timestamp.from_ns(T0 + 1)
    )
    assert [t.server_transaction_id for t in out] == ["a", "b", "c"]


def test_missing_records_raise_naming_the_transaction_and_counts() -> None:
    step = GroupTransactions()
    with pytest.raises(IncompleteTransactionError, match=r"transaction x committed at .* has "
                       r"1 record\(s\) from 1 partition\(s\), but its records say 2 record\(s\) "
                       r"from 2 partition\(s\); likely cause: records were lost"):
        step.process_batch({}, [rec("x", T0, "1", "a")], Timestamp.from_ns(T0 + 1))


def test_too_many_records_raise_even_when_partial_transactions_are_allowed() -> None:
    step = GroupTransactions()
    source = DetectPartitions(stream="S", start_at=T0, client=ScriptedChangeStream("S"))
    step.check_upstream([source, ReadPartition(),
                         Filter(bool)])
    three = [rec("x", T0, str(i), "a") for i in range(3)]
    with pytest.raises(IncompleteTransactionError, match="delivered twice"):
        step.process_batch({}, three, Timestamp.from_ns(T0 + 1))
    _, out = step.process_batch({}, three[:1], Timestamp.from_ns(T0 + 1))
    assert [t.complete for t in out] == [False]


def test_elements_that_are_not_records_are_refused() -> None:
    with pytest.raises(TypeError, match="apply it to ReadPartition's output"):
        GroupTransactions().process_batch({}, ["text"], Timestamp.from_ns(T0))  # type: ignore[list-item]


def test_through_the_test_harness() -> None:
    stream = ScriptedChangeStream("S", partitions=2, buckets=8, origin=T0)
    with stream.transaction(at=T0 + 1_000) as tx:
        for key in range(8):
            tx.write("Orders", key, "INSERT", {"total": key})
    stream.write("Items", 3, "DELETE", at=T0 + 2_000)
    out = cf.Collect()
    p = cf.Pipeline("harness")
    (p | cf.ReadChangeStream(stream="S", start_at=T0, end_at=T0 + 3_000, client=stream)
     | GroupTransactions() | out)
    cdcflow.testing.run(p)
    assert [(t.tables, len(t.records), len(t.partitions), t.mods) for t in out.items] == [
        (("Orders",), 2, 2, 8), (("Items",), 1, 1, 1)]


def test_snapshot_rows_come_first_each_record_its_own_unit() -> None:
    stream = ScriptedChangeStream(
        "S", partitions=2, buckets=8, origin=T0,
        snapshot_rows={"Orders": [({"id": i}, {"total": i}) for i in range(1500)]})
    with stream.transaction(at=T0 + 2_000) as tx:
        for key in range(4):
            tx.write("Orders", key, "UPDATE", {"total": -key})
    out = cf.Collect()
    p = cf.Pipeline("snapshot-then-transactions")
    (p | cf.ReadChangeStream(stream="S", start_at=T0 + 1_000, end_at=T0 + 3_000,
                             client=stream, snapshot=True)
     | GroupTransactions() | out)
    cdcflow.testing.run(p)
    got: list[Transaction] = out.items
    # 1500 rows: two snapshot records (1000 + 500 rows), each its own unit, then the stream's
    # one transaction, whole, from both partitions.
    assert [(t.server_transaction_id, t.mods) for t in got[:2]] == [("snapshot", 1000),
                                                                  ("snapshot", 500)]
    assert all(t.records[0].is_snapshot and t.complete for t in got[:2])
    assert len(got) == 3 and got[2].mods == 4 and len(got[2].partitions) == 2
    assert not any(r.is_snapshot for r in got[2].records)
