"""MUTABLE_KEY_RANGE streams through the engine: partitions announced mid-stream, key ranges
moving between partitions, partitions that end without children.

The emulator lacks the mode, so the stream is built in code: each partition is a list of
records; keys move between partitions with partition event records.
"""

from __future__ import annotations

from collections.abc import Iterator

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import MemoryStore
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    ChangeRecord,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    MoveInEvent,
    MoveOutEvent,
    PartitionEndRecord,
    PartitionEventRecord,
    PartitionStartRecord,
    PartitionState,
    record_position,
)
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.stream import ChangeStreamQuery, StreamInfo

S = 1_000_000_000
T0 = 1_700_000_000 * S
END = T0 + 20 * S


class _MutableStream:
    """Partitions as record lists; ``read`` serves the half-open query window."""

    def __init__(self, partitions: dict[str | None, list[ChangeRecord]]) -> None:
        self.partitions = partitions

    def describe_stream(self, stream: str) -> StreamInfo:
        return StreamInfo(stream, partition_mode="MUTABLE_KEY_RANGE")

    def read(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        records = sorted(self.partitions[query.partition_token], key=record_position)
        return iter([r for r in records if query.start <= record_position(r) < query.end])

    def close(self) -> None:
        return None


def _data(token: str, at: int, key: int, v: int) -> DataChangeRecord:
    return DataChangeRecord(
        partition_token=token, commit_timestamp=at, record_sequence=f"{v:08d}",
        server_transaction_id=f"t{v}", is_last_record_in_transaction_in_partition=True,
        table_name="T", column_types=(), mods=(Mod({"k": key}, {"v": v}),), mod_type="UPDATE",
        value_capture_type="NEW_ROW", number_of_records_in_transaction=1,
        number_of_partitions_in_transaction=1,
    )


def _stream() -> tuple[_MutableStream, list[tuple[int, int]]]:
    """Root announces a and b. At 5 s, a announces c; key 1 moves from a to c at 6 s; a ends
    at 9 s without children; b runs to the end; c ends at 15 s and its key moves to b."""
    root = INITIAL_PARTITION_TOKEN
    truth: list[tuple[int, int]] = []  # (key, value) in commit order per key
    a: list[ChangeRecord] = []
    b: list[ChangeRecord] = []
    c: list[ChangeRecord] = []
    v = 0

    def put(part: list[ChangeRecord], token: str, at: int, key: int) -> None:
        nonlocal v
        part.append(_data(token, at, key, v))
        truth.append((key, v))
        v += 1

    for i in range(1, 6):
        put(a, "a", T0 + i * S - 1, 1)  # key 1 in a until its move at 6 s
        put(b, "b", T0 + i * S, 2)
    a.append(PartitionStartRecord("a", T0 + 5 * S, "x", ("c",)))
    a.append(PartitionEventRecord("a", T0 + 6 * S, "y",
                                  move_out_events=(MoveOutEvent("c"),)))
    a.append(HeartbeatRecord("a", T0 + 8 * S))
    a.append(PartitionEndRecord("a", T0 + 9 * S, "z"))
    c.append(PartitionEventRecord("c", T0 + 6 * S, "y", move_in_events=(MoveInEvent("a"),)))
    for i in range(6, 15):
        put(c, "c", T0 + i * S + 1, 1)  # key 1 now in c
        put(b, "b", T0 + i * S + 2, 2)
    c.append(PartitionEventRecord("c", T0 + 15 * S, "w", move_out_events=(MoveOutEvent("b"),)))
    c.append(PartitionEndRecord("c", T0 + 15 * S + 1, "e"))
    b.append(PartitionEventRecord("b", T0 + 15 * S, "w", move_in_events=(MoveInEvent("c"),)))
    for i in range(16, 19):
        put(b, "b", T0 + i * S, 1)  # key 1 moved on to b
    partitions: dict[str | None, list[ChangeRecord]] = {
        None: [PartitionStartRecord(root, T0, "0", ("a", "b"))], "a": a, "b": b, "c": c,
    }
    return _MutableStream(partitions), truth


def _run(stream: _MutableStream, span: float, store: MemoryStore) -> list[DataChangeRecord]:
    out = cf.Collect()
    p = cf.Pipeline("mutable")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=END - 1, client=stream)
     | cf.ReadPartition() | out)
    opts = RunOptions(batch_interval=0, max_batch_span=span, gc_ttl=0)
    # the real clock (past END): the store stamps finished_at with it too
    summary = Engine(p, store, InMemoryRunner(workers=2), opts).run()
    assert summary.reason == "end reached", summary
    return list(out.items)


def test_a_partition_announced_mid_stream_is_read_at_once_and_nothing_stalls() -> None:
    stream, truth = _stream()
    store = MemoryStore()
    got = _run(stream, span=2.0, store=store)
    values = [(r.mods[0].keys["k"], r.mods[0].new_values["v"]) for r in got]
    assert sorted(values) == sorted(truth), "every change exactly once"
    for key in (1, 2):  # per-key commit order across the moves a -> c -> b
        mine = [v for k, v in values if k == key]
        assert mine == sorted(mine)
    parts = {p.token: p for p in store.partitions("mutable")}
    # c was announced by a, not a child waiting for it
    assert all(p.state == PartitionState.FINISHED for p in parts.values())


def test_partitions_that_end_without_children_are_garbage_collected() -> None:
    stream, _ = _stream()
    store = MemoryStore()
    _run(stream, span=2.0, store=store)
    left = {p.token for p in store.partitions("mutable")}
    # a and c ended mid-stream without children; the root's children all started;
    # b read to the pipeline's end and stays as the record of how far it got
    assert left == {"b"}
