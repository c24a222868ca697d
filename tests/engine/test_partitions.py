"""Cost proportional to activity: the engine reads the store's partitions once per run,
and idle partitions of an IMMUTABLE_KEY_RANGE stream are queried less often."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import attrs

import cdcflow as cf
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.partitions import IdleSchedule
from cdcflow.engine.runner import TaskResult
from cdcflow.metadata import MemoryStore
from cdcflow.model import PartitionMetadata, PartitionState
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.stream import StreamInfo
from cdcflow.testing import ScriptedChangeStream, ScriptedMutableStream

S = 1_000_000_000


def _part(token: str) -> PartitionMetadata:
    return PartitionMetadata(token, (), 0, 10**19, 0, PartitionState.RUNNING)


def test_idle_waits_double_up_to_the_cap_and_data_resets_them() -> None:
    idle = IdleSchedule(base_delay=1.0, max_delay=5.0, jitter=0)
    parts = [_part("a"), _part("b")]
    now = 100 * S
    for expected in (1, 2, 4, 5, 5):
        idle.read([TaskResult("a", now, False), TaskResult("b", now, False, records=3)], now)
        assert idle.waiting(parts, now) == {"a"}
        assert idle.waiting(parts, now + expected * S - 1) == {"a"}
        assert idle.waiting(parts, now + expected * S) == set()
    idle.read([TaskResult("a", now, False, records=1)], now)  # data: read every batch again
    assert idle.waiting(parts, now) == set()


def test_partitions_idle_together_spread_their_reads_within_the_cap() -> None:
    idle = IdleSchedule(base_delay=1.0, max_delay=5.0, rng=random.Random(7))
    parts = [_part(f"p{i}") for i in range(10_000)]
    now = 100 * S
    for _ in range(4):  # the waits reach the cap
        idle.read([TaskResult(p.token, now, False) for p in parts], now)
    assert len(idle.waiting(parts, now + int(2.5 * S) - 1)) == 10_000  # at least half the cap
    assert len(idle.waiting(parts, now + 5 * S)) == 0  # the cap bounds every wait
    due_by_second = [10_000 - len(idle.waiting(parts, now + k * S // 2)) for k in range(6, 11)]
    # due in about equal numbers over the last half of the cap, not all at once
    spread = [b - a for a, b in itertools.pairwise(due_by_second)]
    assert all(1_500 < n < 3_500 for n in spread), spread


def test_catching_up_is_never_idle_and_a_zero_cap_reads_everything() -> None:
    idle = IdleSchedule(base_delay=1.0, max_delay=5.0)
    now = 1000 * S
    idle.read([TaskResult("a", now - 60 * S, False)], now)  # a slice far behind the clock
    assert idle.waiting([_part("a")], now) == set()
    off = IdleSchedule(base_delay=1.0, max_delay=0.0)
    off.read([TaskResult("a", now, False)], now)
    assert off.waiting([_part("a")], now) == set()


def test_a_batch_that_took_long_to_read_is_not_catching_up() -> None:
    # A batch of many idle partitions planned at `planned` read to near that time, but its
    # tasks took longer than the cap: judged by the clock after them, every slice would
    # look far behind, be read again at once, and the next batch would be as slow.
    idle = IdleSchedule(base_delay=1.0, max_delay=5.0)
    planned = 1000 * S
    after = planned + 8 * S
    idle.read([TaskResult("a", planned - S // 10, False)], after, planned)
    assert idle.waiting([_part("a")], after) == {"a"}
    idle.read([TaskResult("b", planned - 60 * S, False)], after, planned)  # truly behind
    assert idle.waiting([_part("b")], after) == set()


class _Counting(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def partitions(self, pipeline: str) -> list[PartitionMetadata]:
        self.reads += 1
        return super().partitions(pipeline)


class _Slices(EngineListener):
    def __init__(self) -> None:
        self.slices: list[int] = []

    def on_batch(self, stats: BatchStats) -> None:
        self.slices.append(stats.slices)


def _follow(stream: Any, seconds: float, store: MemoryStore, idle: float) -> list[int]:
    origin = stream.origin
    out: cf.Collect[Any] = cf.Collect()
    p = cf.Pipeline("active")
    (p | cf.DetectPartitions(stream="S", start_at=origin, end_at=origin + int(seconds * S),
                             client=stream)
     | cf.ReadPartition(heartbeat="100ms") | out)
    listener = _Slices()
    opts = RunOptions(batch_interval=0.05, idle_read_interval=idle)
    summary = Engine(p, store, InMemoryRunner(workers=2), opts, listener).run()
    assert summary.reason == "end reached"
    assert len(out.items) == len(stream.expected_records())
    return listener.slices


def test_idle_partitions_are_read_less_often_and_the_store_is_read_once() -> None:
    def reads(idle: float, store: MemoryStore) -> int:
        origin = time.time_ns()
        stream = ScriptedChangeStream("S", partitions=6, origin=origin)
        stream.write("T", 1, "INSERT", {"v": 1}, at=origin + S // 10)
        return sum(_follow(stream, 2.5, store, idle=idle))

    store = _Counting()
    lazy = reads(1.0, store)
    assert store.reads <= 2  # once for the run's view (and once more at the first run)
    eager = reads(0.0, MemoryStore())
    assert lazy < eager / 2, (lazy, eager)


def test_streams_whose_keys_leave_their_lineage_read_every_partition_every_batch() -> None:
    # The emulator: a key's changes move between partitions that are not parent and child,
    # so a partition read later could deliver a key's older change after its newer ones.
    class Emulated(ScriptedChangeStream):
        def describe_stream(self, stream: str) -> StreamInfo:
            return attrs.evolve(super().describe_stream(stream), keys_follow_lineage=False)

    origin = time.time_ns()
    stream = Emulated("S", partitions=3, origin=origin)
    stream.write("T", 1, "INSERT", {"v": 1}, at=origin + S // 10)
    slices = _follow(stream, 1.5, MemoryStore(), idle=1.0)
    assert all(n == 3 for n in slices[2:-1]), slices


def test_mutable_streams_read_every_partition_every_batch() -> None:
    origin = time.time_ns()
    stream = ScriptedMutableStream("S", partitions=["a", "b", "c"], origin=origin)
    stream.write("T", 1, "INSERT", {"v": 1}, at=origin + S // 10)
    slices = _follow(stream, 1.5, MemoryStore(), idle=1.0)
    assert all(n == 3 for n in slices[1:-1])


def test_idle_partitions_never_hold_a_busy_one_back_with_a_short_span() -> None:
    # A span shorter than the idle wait: were the batch end bounded by the idle partitions'
    # watermarks (which lag up to their wait), the busy one would read nothing until they
    # came due, its changes up to that wait late.
    origin = time.time_ns()
    stream = ScriptedChangeStream("S", partitions=4, origin=origin)
    for i in range(30):  # one key: one busy partition, three idle ones
        stream.write("T", 1, "UPDATE", {"v": i}, at=origin + S // 2 + i * S // 10)
    def lag(record: Any) -> tuple[int, float]:  # the value, and how late it was read
        return record.mods[0].new_values["v"], (time.time_ns() - record.commit_timestamp.ns) / S

    out: cf.Collect[tuple[int, float]] = cf.Collect()
    p = cf.Pipeline("busy")
    (p | cf.DetectPartitions(stream="S", start_at=origin, end_at=origin + 4 * S, client=stream)
     | cf.ReadPartition(heartbeat="100ms") | cf.Map(lag) | out)
    opts = RunOptions(batch_interval=0.05, max_batch_span=0.2, idle_read_interval=3.0)
    summary = Engine(p, MemoryStore(), InMemoryRunner(workers=2), opts).run()
    assert summary.reason == "end reached"
    assert [v for v, _ in out.items] == list(range(30))
    lags = [late for _, late in out.items]
    assert max(lags) < 1.0, sorted(lags)[-5:]


def test_a_restart_takes_partitions_read_near_the_clock_as_idle_at_the_cap() -> None:
    """A restarted run knew no partition's wait: its first batches read every partition
    (10,000 reads, about 1.2 s, in each of several batches). Those an earlier run read
    near the clock are now due at random times within the cap of their watermark."""
    now = 1000 * S
    near = [attrs.evolve(_part(f"p{i}"), watermark=now - S) for i in range(10_000)]
    behind = attrs.evolve(_part("behind"), watermark=now - 60 * S)
    done = attrs.evolve(_part("done"), watermark=now - S, state=PartitionState.FINISHED)
    idle = IdleSchedule(base_delay=1.0, max_delay=5.0, rng=random.Random(3))
    idle.read([TaskResult("seen", now, False, records=2)], now)  # this run's own: kept
    parts = [*near, behind, done, attrs.evolve(_part("seen"), watermark=now - S)]
    idle.resume(parts, now)
    waiting = idle.waiting(parts, now)
    assert "behind" not in waiting and "seen" not in waiting and "done" not in waiting
    assert len(waiting) > 9_990  # due at a random time within the wait
    assert idle.waiting(parts, now + 4 * S) == set()  # never past watermark + cap
    due_by_second = [10_000 - len(idle.waiting(near, now + k * S)) for k in range(5)]
    spread = [b - a for a, b in itertools.pairwise(due_by_second)]
    assert all(2_000 < n < 3_000 for n in spread), spread  # a quarter each second
    idle.read([TaskResult("p0", now + 4 * S, False)], now + 4 * S)  # idle again: the cap
    assert idle.waiting(near[:1], now + 4 * S + int(2.5 * S) - 1) == {"p0"}
    off = IdleSchedule(base_delay=1.0, max_delay=0.0)
    off.resume(parts, now)
    assert off.waiting(parts, now) == set()


def test_a_restarted_run_does_not_read_every_partition_in_its_first_batch() -> None:
    origin = time.time_ns()
    stream = ScriptedChangeStream("S", partitions=200, origin=origin, buckets=256)
    stream.write("T", 1, "INSERT", {"v": 1}, at=origin + S // 10)
    store = MemoryStore()

    def run(batches: int | None) -> list[int]:
        p = cf.Pipeline("restarted")
        (p | cf.DetectPartitions(stream="S", start_at=origin, end_at=origin + 3 * S,
                                 client=stream)
         | cf.ReadPartition(heartbeat="100ms") | cf.Collect())
        listener = _Slices()
        opts = RunOptions(batch_interval=0.05, idle_read_interval=2.0, max_batches=batches)
        Engine(p, store, InMemoryRunner(workers=2), opts, listener).run()
        return listener.slices

    first = run(12)
    assert max(first) == 200  # the first run reads them all once
    again = run(None)
    assert again[0] < 100, again[:5]
