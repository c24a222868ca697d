"""The process byte quota: ByteQuota's contract, and a slow sink facing a backlog.

The backlog comes from bench._backlog.LazyBacklog, which makes records while they are read:
the memory measured is the pipeline's, not the script's.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import pytest

import cdcflow as cf
from bench._backlog import LazyBacklog
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.quota import (
    DEFAULT_QUOTA_BYTES,
    ByteQuota,
    approx_size,
    process_quota,
    quota_limit,
)
from cdcflow.errors import ConfigurationError
from cdcflow.metadata import MemoryStore
from cdcflow.model import DataChangeRecord
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.transforms import DetectPartitions, Map, ReadPartition, Sink
from cdcflow.transforms.base import WriterContext

S = 1_000_000_000
T0 = 1_700_000_000 * S

# -- ByteQuota ------------------------------------------------------------------------------


def _later(fn: Any, delay: float = 0.05) -> threading.Thread:
    def run() -> None:
        time.sleep(delay)
        fn()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_acquire_blocks_until_release() -> None:
    q = ByteQuota(100)
    assert q.acquire(60) and q.acquire(40)
    assert not q.acquire(1, timeout=0.05)  # full
    released = threading.Event()

    def release_once_blocked() -> None:
        while q.stats().waits < 2:  # the acquire below is waiting
            time.sleep(0.005)
        released.set()
        q.release(60)

    t = threading.Thread(target=release_once_blocked)
    t.start()
    assert q.acquire(50)
    assert released.is_set()  # admitted only after the release
    t.join()
    s = q.stats()
    assert (s.used, s.peak, s.waits) == (90, 100, 2)


def test_an_element_larger_than_the_quota_is_admitted_alone() -> None:
    q = ByteQuota(10)
    assert q.acquire(1000)  # nothing held: admitted, so it cannot deadlock
    assert not q.acquire(1, timeout=0.02)
    q.release(1000)
    assert q.acquire(5)
    assert not q.acquire(1000, timeout=0.02)  # not alone now
    assert q.stats().oversized == 1


def test_waiters_are_admitted_in_arrival_order() -> None:
    q = ByteQuota(100)
    q.acquire(100)
    order: list[str] = []

    def take(name: str, n: int) -> None:
        q.acquire(n)
        order.append(name)

    big = threading.Thread(target=take, args=("big", 100))
    big.start()
    time.sleep(0.05)
    small = threading.Thread(target=take, args=("small", 1))
    small.start()
    time.sleep(0.05)
    assert order == []  # the small one waits behind the big one, though 1 byte would fit
    q.release(100)
    big.join(1)
    assert order == ["big"]
    q.release(100)
    small.join(1)
    assert order == ["big", "small"]


def test_until_lets_a_waiter_give_back_what_it_holds() -> None:
    q = ByteQuota(100)
    q.acquire(100)
    done = threading.Event()
    _later(lambda: (done.set(), q.notify()))
    assert q.acquire(10, until=done.is_set) is False
    assert q.used == 100
    assert q.stats().waits == 1
    q.release(100)
    assert q.acquire(10, until=done.is_set) is True  # it fits: admitted without waiting


def test_release_of_more_than_held_is_refused() -> None:
    q = ByteQuota(100)
    q.acquire(10)
    with pytest.raises(ValueError, match="release exactly what"):
        q.release(11)
    with pytest.raises(ValueError, match="1 or more"):
        ByteQuota(0)


def test_process_quota_is_one_object_sized_by_the_last_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q = process_quota(1 << 20)
    assert process_quota(2 << 20) is q and q.limit == 2 << 20
    assert process_quota() is q and q.limit == 2 << 20  # None leaves it as it is
    monkeypatch.delenv("CDCFLOW_MAX_INFLIGHT_BYTES", raising=False)
    assert quota_limit(None) == DEFAULT_QUOTA_BYTES == 256 << 20
    assert quota_limit(77) == 77
    monkeypatch.setenv("CDCFLOW_MAX_INFLIGHT_BYTES", "12345")
    assert quota_limit(None) == 12345
    monkeypatch.setenv("CDCFLOW_MAX_INFLIGHT_BYTES", "64MiB")
    assert quota_limit(None) == 64 << 20
    for bad in ("lots", "0", "-5", "10XB"):
        monkeypatch.setenv("CDCFLOW_MAX_INFLIGHT_BYTES", bad)
        with pytest.raises(ConfigurationError, match=f"CDCFLOW_MAX_INFLIGHT_BYTES='{bad}'"):
            quota_limit(None)


# -- a slow sink facing a backlog -------------------------------------------------------------

# (opened, closed) of every writer. The in-memory runner unpickles the sink in this process
# and this module travels by reference, so its writers append here.
_lifetimes: list[tuple[float, float]] = []


class _SlowWriter:
    def __init__(self, delay: float) -> None:
        self._delay = delay
        self._count = 0
        self._opened = time.monotonic()

    def write(self, element: Any) -> None:
        time.sleep(self._delay)
        self._count += 1  # the element is dropped: a streaming sink keeps nothing

    def close(self) -> int:
        _lifetimes.append((self._opened, time.monotonic()))
        return self._count

    def abort(self) -> None:
        return None


class _SlowSink(Sink[Any, int]):
    """Takes each element after ``delay`` seconds and keeps only a count."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.count = 0
        self._done: set[int] = set()

    def open_writer(self, ctx: WriterContext) -> _SlowWriter:
        return _SlowWriter(self.delay)

    def commit(self, batch_id: int, messages: Sequence[int]) -> None:
        if batch_id not in self._done:
            self._done.add(batch_id)
            self.count += sum(messages)


def _body_length(record: DataChangeRecord) -> int:
    body = record.mods[0].new_values["body"]
    if int(body[:16]) % 64 == 0:
        time.sleep(0.1)  # a slow head: the records after it complete and wait behind it
    return len(body)


class _Peaks(EngineListener):
    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.limits: list[int] = []

    def on_batch(self, stats: BatchStats) -> None:
        self.peaks.append(stats.counters.get("inflight_bytes_peak", 0))
        self.limits.append(stats.counters.get("inflight_bytes_limit", 0))


_listener = _Peaks()


def _run_backlog(
    backlog: LazyBacklog, quota: int, max_inflight: int, delay: float
) -> tuple[_SlowSink, int]:
    """Run the backlog through a slow sink on 4 threads; (sink, traced peak growth)."""
    sink = _SlowSink(delay)
    p = cf.Pipeline("quota")
    (p
     | DetectPartitions(stream="B", start_at=backlog.origin, end_at=backlog.end, client=backlog)
     | ReadPartition(heartbeat="1s", max_inflight=max_inflight, max_inflight_bytes=quota)
     | Map(_body_length)
     | sink)
    _lifetimes.clear()
    _listener.peaks.clear()
    _listener.limits.clear()
    return sink, _traced_run(p, quota, _listener)


def _traced_run(p: cf.Pipeline, quota: int, listener: EngineListener | None = None) -> int:
    """Run ``p`` to its end on 4 threads, the quota's peak reset; the traced peak growth."""
    process_quota(quota).reset_peak()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        # One batch holds the whole backlog (no pacing): the quota alone bounds what is held.
        opts = RunOptions(batch_interval=0, max_batch_span=3600.0, batch_retries=0,
                          max_task_bytes=None)
        Engine(p, MemoryStore(), InMemoryRunner(workers=4), opts, listener=listener).run()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _overlapping(lifetimes: list[tuple[float, float]]) -> int:
    """The most writers open at one time."""
    events = sorted([(a, 1) for a, _ in lifetimes] + [(b, -1) for _, b in lifetimes])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _backlog(records: int, payload: int) -> LazyBacklog:
    return LazyBacklog("B", partitions=4, records=records, payload=payload, origin=T0,
                       span_ns=10 * S)


QUOTA = 256 << 10


def test_a_slow_sink_keeps_held_bytes_under_the_shared_quota() -> None:
    backlog = _backlog(records=256, payload=16384)  # 16 MiB of payload, 64x the quota
    sink, traced = _run_backlog(backlog, QUOTA, max_inflight=128, delay=0.0002)
    assert sink.count == 1024  # every record reached the sink, once
    stats = process_quota().stats()
    assert stats.limit == QUOTA and stats.peak <= QUOTA and stats.used == 0
    assert _overlapping(_lifetimes) >= 2  # tasks ran at once, sharing the one quota
    # a batch reports the largest of its tasks' peaks (their sum would pass the quota)
    assert 0 < max(_listener.peaks) <= QUOTA and set(_listener.limits) == {QUOTA}
    # Everything the run allocated at its peak (records, results, futures): the quota and
    # about 1.5 MiB of the engine's own (8 MiB in the control below).
    assert traced < QUOTA + (2 << 20), f"traced peak {traced} bytes"


def test_without_a_binding_quota_the_same_run_holds_far_more() -> None:
    # The control for the test above: the same run with a 64 MiB quota holds several MiB
    # behind the slow records (3.5 to 6 MiB, by how far reading gets while a head sleeps on
    # a loaded machine). If it did not, the test above would not show that the quota binds.
    backlog = _backlog(records=256, payload=16384)
    sink, traced = _run_backlog(backlog, 64 << 20, max_inflight=128, delay=0.0002)
    assert sink.count == 1024
    assert process_quota().stats().peak > 8 * QUOTA
    assert traced > 3 << 20


def test_tasks_reading_one_record_at_a_time_share_the_quota() -> None:
    # A quota below two records' size: across 4 concurrent tasks at most one record is
    # held at any time (per-task quotas would allow four).
    backlog = _backlog(records=50, payload=4096)
    first = next(r for r in backlog.read(_query("p0")) if isinstance(r, DataChangeRecord))
    one = approx_size(first)
    sink, _ = _run_backlog(backlog, one + 100, max_inflight=1, delay=0.002)
    assert sink.count == 200
    stats = process_quota().stats()
    # the limit admits one record but never two (sizes differ by a few bytes of id)
    assert stats.peak <= one + 100 < 2 * (one - 100) and stats.waits > 0
    assert _overlapping(_lifetimes) >= 2


_consumed: list[int] = []


def _slow_call(record: DataChangeRecord) -> None:
    time.sleep(0.01)
    _consumed.append(len(record.mods[0].new_values["body"]))


@pytest.mark.parametrize("quota", [QUOTA, 64 << 20])
def test_consume_keeps_the_elements_it_queues_charged_to_the_quota(quota: int) -> None:
    # Consume(max_inflight=16) queues up to 80 elements per task after write returns; they
    # stay charged until acked, so reading stops at the quota (4 tasks, 16 KiB records:
    # 5 MiB queued without the charge). The 64 MiB run is the control: it does queue.
    backlog = _backlog(records=48, payload=16384)  # 3 MiB of payload
    p = cf.Pipeline("consume-quota")
    (p
     | DetectPartitions(stream="B", start_at=backlog.origin, end_at=backlog.end, client=backlog)
     | ReadPartition(heartbeat="1s", max_inflight_bytes=quota)
     | cf.Consume(_slow_call, max_inflight=16))
    _consumed.clear()
    traced = _traced_run(p, quota)
    assert sorted(_consumed) == [16384] * 192  # every element, once
    stats = process_quota().stats()
    assert stats.used == 0  # every byte given back
    if quota == QUOTA:
        # an element moves from reader to writer before the reader gives it back: at most
        # one record per task over the limit
        assert stats.peak <= QUOTA + 4 * (16384 + 1024), stats
        assert traced < QUOTA + (2 << 20), f"traced peak {traced} bytes"
    else:
        # queued far past what the small quota lets through (its peak: about QUOTA); the
        # traced peak grows with it, by how much depends on how fast the calls drain the
        # queue on a busy machine (2.1-5 MiB measured)
        assert stats.peak > 4 * QUOTA and traced > QUOTA + (1 << 20), (stats, traced)


def test_small_records_take_the_quota_in_lots_and_give_every_byte_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Far from the limit a chain takes bytes ahead, a lot (1/64 of the quota) at a time, so
    # the quota's lock is taken once a lot rather than once a record; the lot it has not
    # used yet goes back with the rest when the task ends.
    calls = [0]
    stock = ByteQuota.try_acquire

    def counting(self: ByteQuota, n: int) -> bool:
        calls[0] += 1
        return stock(self, n)

    monkeypatch.setattr(ByteQuota, "try_acquire", counting)
    backlog = _backlog(records=2000, payload=64)  # 8000 small records
    sink = _SlowSink(0.0)
    p = cf.Pipeline("lots")
    (p
     | DetectPartitions(stream="B", start_at=backlog.origin, end_at=backlog.end, client=backlog)
     | ReadPartition(heartbeat="1s", max_inflight_bytes=1 << 20)
     | sink)
    process_quota(1 << 20).reset_peak()
    opts = RunOptions(batch_interval=0, max_batch_span=3600.0, batch_retries=0)
    Engine(p, MemoryStore(), InMemoryRunner(workers=4), opts).run()
    assert sink.count == 8000
    stats = process_quota().stats()
    assert stats.used == 0 and stats.peak <= 1 << 20
    assert 0 < calls[0] < 8000 // 10, calls[0]


def _query(token: str) -> Any:
    from cdcflow.stream import ChangeStreamQuery

    return ChangeStreamQuery(stream="B", partition_token=token, start=T0, end=T0 + 10 * S + 1,
                             heartbeat_millis=1000)
