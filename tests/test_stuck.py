"""Stuck-partition detection names the partition that hangs, not the healthy partitions its
batch holds back: the warning line, the metric, and the detector's view."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import attrs
import pytest

import cdcflow as cf
from cdcflow.engine.listener import note_task_done, tasks_done
from cdcflow.model import BatchPlan, PartitionState, Slice
from cdcflow.stuck import StuckDetector, StuckWatch
from cdcflow.testing import ScriptedChangeStream
from tests.test_metrics import NOW, Clock, S, our_threads, part, value
from tests.test_metrics import _Scraper as Scraper


def test_only_the_partition_whose_read_hangs_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cdcflow.stuck")
    began = time.monotonic()
    now = time.time_ns()
    origin = now - 20 * S
    stream = ScriptedChangeStream("Orders", partitions=3, origin=origin)
    for i in range(60):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=origin + (i + 1) * 300_000_000)
    # p1 stops answering for 4 s; p0 and p2 answer at once
    client = stream.stall("p1", 4.0, after=origin + 5 * S)
    out = cf.Collect()
    pipeline = cf.Pipeline("one-hangs")
    (pipeline
     | cf.DetectPartitions(stream="Orders", start_at=origin, end_at=now + 7 * S, client=client)
     | cf.ReadPartition(heartbeat="100ms")
     | out)
    urls: list[str] = []
    scraper = Scraper(urls)
    scraper.start()
    try:
        summary = pipeline.run("memory", "memory://", metrics_port=0, on_metrics=urls.append,
                               stuck_after="1s", batch_interval="100ms", max_batch_span="1s",
                               idle_read_interval=0)
    finally:
        scraper.done.set()
        scraper.join()
    assert summary.reason == "end reached"
    assert len(out.items) == 60

    # the metric: one stuck partition at most, and it is p1
    counts = [(t - began, value(s, "cdcflow_stuck_partitions", pipeline="one-hangs"))
              for t, s in scraper.scrapes]
    assert max(n for _, n in counts) == 1, counts
    flagged = {dict(labels)["token"] for _, s in scraper.scrapes for (name, labels) in s
               if name == "cdcflow_stuck_partition_seconds"}
    assert flagged == {"p1"}, flagged
    # the warning: one line, naming p1, saying the batch waits for its read
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    stuck_lines = [m for m in warnings if "has not advanced" in m]
    assert len(stuck_lines) == 1, warnings
    assert "partition p1 " in stuck_lines[0]
    assert "waiting for this read (2 other reads of it are done)" in stuck_lines[0]
    assert any("partition p1 is moving again" in r.getMessage() for r in caplog.records)
    assert our_threads() == []


@pytest.mark.parametrize("through", ["sink", "quota"])
def test_a_read_held_back_by_a_slow_sink_is_said_to_be(
    caplog: pytest.LogCaptureFixture, through: str,
) -> None:
    """A Consume whose calls are slow holds its task's read back (a full queue, then the
    drain), and a small byte quota holds a read back behind a slow sink too: the partition
    does not advance, but its read does not hang. The warning said it waited "for this
    read"; it names what the task waits for."""
    caplog.set_level(logging.INFO, logger="cdcflow.stuck")
    now = time.time_ns()
    origin = now - 10 * S
    stream = ScriptedChangeStream("Orders", partitions=2, origin=origin)
    for i in range(60):  # one commit timestamp: no batch can split them
        stream.write("Orders", {"id": i}, "INSERT", {"n": "x" * 2000}, at=origin + S)

    class Slow(cf.Sink[Any, int]):
        def open_writer(self, ctx: Any) -> Any:
            class Writer:
                n = 0

                def write(self, element: Any) -> None:
                    time.sleep(0.1)
                    self.n += 1

                def close(self) -> int:
                    return self.n

                def abort(self) -> None:
                    return None

            return Writer()

        def commit(self, batch_id: int, messages: Any) -> None:
            return None

    read = cf.ReadPartition(heartbeat="100ms", max_inflight=4, max_inflight_bytes=4096)
    sink: Any = (cf.Consume(lambda r: time.sleep(0.1), max_inflight=1) if through == "sink"
                 else Slow())
    pipeline = cf.Pipeline(f"held-back-{through}")
    (pipeline
     | cf.DetectPartitions(stream="Orders", start_at=origin, end_at=origin + 7 * S,
                           client=stream)
     | (cf.ReadPartition(heartbeat="100ms") if through == "sink" else read)
     | cf.Map(lambda r: r) | sink)
    summary = pipeline.run("memory", "memory://", stuck_after="1s", batch_interval="100ms",
                           max_batch_span="60s")
    assert summary.reason == "end reached"
    stuck = [r.getMessage() for r in caplog.records
             if r.levelno == logging.WARNING and "has not advanced" in r.getMessage()]
    assert stuck, [r.getMessage() for r in caplog.records][:20]
    by = ("sink 'Consume(<lambda> at test_stuck.py:" if through == "sink" else
          "room in the byte quota (the sinks have not taken earlier elements)")
    for line in stuck:
        assert f"its read is held back, not hung: its task waits for {by}" in line, line
        assert "waiting for this read" not in line


def test_reads_that_are_done_wait_for_their_batch_and_are_not_stuck() -> None:
    clock = Clock()
    watch = StuckWatch(StuckDetector(5), clock=clock)
    watch.on_start("waits", "memory", "memory://")
    watch.on_partitions([part(t, NOW - S) for t in ("p0", "p1", "p2")], clock.t)
    watch.on_planned(BatchPlan(7, NOW, tuple(Slice(t, NOW - S, NOW) for t in ("p0", "p1", "p2"))),
                     False)
    clock.t += 3 * S
    note_task_done("waits", 7, "p0")
    note_task_done("waits", 7, "p2")
    assert tasks_done("waits", 7) == {"p0", "p2"}
    clock.t += 3 * S
    assert [s.token for s in watch.check()] == ["p1"]
    assert [s.token for s in watch.detector.stuck()] == ["p1"]
    # long after, p0 and p2 still wait for the batch: still not stuck
    clock.t += 60 * S
    assert watch.check() == []
    assert [s.token for s in watch.detector.stuck()] == ["p1"]


def test_without_task_news_every_partition_of_a_hung_batch_is_reported() -> None:
    # What a runner whose tasks run elsewhere (Spark executors) gives the driver: nothing.
    clock = Clock()
    watch = StuckWatch(StuckDetector(5), clock=clock)
    watch.on_start("elsewhere", "spark", "memory://")
    watch.on_planned(BatchPlan(3, NOW, (Slice("p0", NOW - S, NOW), Slice("p1", NOW - S, NOW))),
                     False)
    clock.t += 6 * S
    assert sorted(s.token for s in watch.check()) == ["p0", "p1"]


def test_task_news_is_bounded_to_the_latest_batches() -> None:
    for batch_id in range(100):
        note_task_done("bounded", batch_id, "p0")
    assert tasks_done("bounded", 0) == frozenset()
    assert tasks_done("bounded", 99) == {"p0"}
    threads = [threading.Thread(target=note_task_done, args=("bounded", 99, f"t{i}"))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tasks_done("bounded", 99)) == 9


def test_partitions_waiting_for_parents_and_snapshot_reads_are_not_stuck() -> None:
    clock = Clock()
    watch = StuckWatch(StuckDetector(5), clock=clock)
    watch.on_start("waiting", "memory", "memory://")
    snap = part("snapshot/Orders", NOW - S, "SCHEDULED")
    root = attrs.evolve(part("root", NOW - S + 1, "CREATED"), parent_tokens=(snap.token,))
    lagging = part("p1", NOW - 2 * S)
    merged = attrs.evolve(part("child", NOW - S, "CREATED"), parent_tokens=("gone", "p1"))
    watch.on_partitions([snap, root, lagging, merged], clock.t)
    watch.on_planned(BatchPlan(2, NOW, (Slice(snap.token, NOW - S, NOW - S + 1),
                                        Slice("p1", NOW - 2 * S, NOW))), False)
    clock.t += 60 * S  # a long snapshot read, and p1's read hangs
    assert [s.token for s in watch.check()] == ["p1"]
    # Once the parents are finished, the children are watched like any partition.
    done = [attrs.evolve(snap, state=PartitionState.FINISHED),
            attrs.evolve(lagging, state=PartitionState.FINISHED), root, merged]
    watch.on_partitions(done, clock.t)
    clock.t += 6 * S
    assert sorted(s.token for s in watch.check()) == ["child", "root"]


def test_the_root_waits_for_key_ranges_of_the_snapshot_without_being_stuck() -> None:
    clock = Clock()
    watch = StuckWatch(StuckDetector(5), clock=clock)
    watch.on_start("ranges", "memory", "memory://")
    table = part("snapshot/Orders", NOW - S + 1, "FINISHED")
    key_range = attrs.evolve(part('snapshot/Orders/00001/[["7"],null]', NOW - S, "RUNNING"),
                             parent_tokens=(table.token,))
    root = attrs.evolve(part("root", NOW - S + 1, "CREATED"), parent_tokens=(table.token,))
    watch.on_partitions([table, key_range, root], clock.t)
    clock.t += 60 * S  # a long read of the range: the root's parent finished long ago
    assert watch.check() == []
    watch.on_partitions([table, attrs.evolve(key_range, state=PartitionState.FINISHED), root],
                        clock.t)
    clock.t += 6 * S
    assert [s.token for s in watch.check()] == ["root"]  # watched once the snapshot is done


class _SlowFlush(cf.Sink[Any, int]):
    """A staging sink whose final flush takes ``seconds`` (a slow storage)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def open_writer(self, ctx: Any) -> Any:
        return _NoWriter()

    def durable_batch(self) -> int:
        return 0

    def commit(self, batch_id: int, messages: Any) -> None:
        pass

    def flush(self) -> None:
        time.sleep(self.seconds)


class _NoWriter:
    def write(self, element: Any) -> None:
        pass

    def close(self) -> None:
        return None

    def abort(self) -> None:
        pass


def test_no_partition_is_stuck_while_the_final_flush_waits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Once the batches are over, partitions do not move: the watch stops, rather than
    blaming them for a slow storage."""
    caplog.set_level(logging.INFO, logger="cdcflow.stuck")
    now = time.time_ns()
    stream = ScriptedChangeStream("Orders", partitions=2, origin=now - 2 * S)
    pipeline = cf.Pipeline("slow-flush")
    (pipeline
     | cf.DetectPartitions(stream="Orders", start_at=now - 2 * S, client=stream)
     | cf.ReadPartition(heartbeat="100ms")
     | _SlowFlush(2.5))
    summary = pipeline.run("memory", "memory://", stuck_after="1s", batch_interval="100ms",
                           duration="1s", idle_read_interval=0)
    assert summary.reason == "duration"
    assert not [r.getMessage() for r in caplog.records if "has not advanced" in r.getMessage()]


def test_a_created_partition_a_batch_reads_is_reported_as_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    watch = StuckWatch(StuckDetector(5), clock=clock)
    watch.on_start("born", "memory", "memory://")
    watch.on_partitions([part("child", NOW - S, "CREATED")], clock.t)  # stored as CREATED
    watch.on_planned(BatchPlan(2, NOW, (Slice("child", NOW - S, NOW),)), False)  # read now
    clock.t += 6 * S
    with caplog.at_level(logging.WARNING):
        (stuck,) = watch.check()
    assert stuck.state == PartitionState.RUNNING
    assert "partition child (running) has not advanced" in caplog.text


def test_a_read_that_waits_again_and_again_stays_held_back_between_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A slow sink lets a read go for a moment now and then: a check at such a moment
    still says the read is held back, until it has gone on for a while without waiting."""
    from cdcflow.engine import listener

    listener.note_task_held_back("again", 4, "p0", "sink 'slow' to take its elements")
    assert listener.tasks_held_back("again", 4) == {"p0": "sink 'slow' to take its elements"}
    listener.note_task_held_back("again", 4, "p0", None)  # admitted: it reads on, briefly
    assert listener.tasks_held_back("again", 4) == {"p0": "sink 'slow' to take its elements"}
    monkeypatch.setattr(listener, "HELD_BACK_RECENTLY", 0.0)
    time.sleep(0.01)
    assert listener.tasks_held_back("again", 4) == {}  # reading on for a while: not held back
    listener.note_task_held_back("again", 4, "p0", "room in the byte quota")
    note_task_done("again", 4, "p0")
    assert listener.tasks_held_back("again", 4) == {}  # done: it waits for nothing
