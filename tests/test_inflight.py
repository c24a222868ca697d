"""InflightTracker: ordered release, barriers, item and byte quotas, drain."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcflow.errors import TrackerError
from cdcflow.inflight import Barrier, InflightStats, InflightTracker


def _begin_in_thread(
    tracker: InflightTracker, position: int, size: int
) -> tuple[threading.Thread, threading.Event, list[int]]:
    """Start begin() in a thread; the event is set once begin() returned."""
    admitted = threading.Event()
    seqs: list[int] = []

    def run() -> None:
        seqs.append(tracker.begin(position, size))
        admitted.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, admitted, seqs


def test_sequence_numbers_and_in_order_release() -> None:
    t = InflightTracker(max_inflight=3)
    assert [t.begin(10), t.begin(20), t.begin(30)] == [0, 1, 2]
    assert t.complete(1, "b") == []
    assert t.progress is None
    assert t.complete(0, "a") == [(0, "a"), (1, "b")]
    assert t.progress == 20
    assert t.complete(2, "c") == [(2, "c")]
    assert t.progress == 30
    assert t.stats() == InflightStats(
        inflight=0, inflight_bytes=0, held=0, pending_barriers=0, released=3
    )


@given(st.permutations(range(12)), st.lists(st.integers(0, 5), min_size=12, max_size=12))
def test_progress_follows_contiguous_prefix(order: list[int], gaps: list[int]) -> None:
    positions: list[int] = []
    pos = 0
    for gap in gaps:
        pos += gap
        positions.append(pos)
    t = InflightTracker(max_inflight=len(positions))
    seqs = [t.begin(p) for p in positions]
    done: set[int] = set()
    released: list[int] = []
    for seq in order:
        out = t.complete(seqs[seq], f"r{seq}")
        done.add(seq)
        released += [s for s, _ in out]
        assert all(r == f"r{s}" for s, r in out)
        prefix = 0
        while prefix in done:
            prefix += 1
        assert released == list(range(prefix))
        assert t.progress == (positions[prefix - 1] if prefix else None)


@given(st.lists(st.sampled_from(["item", "barrier"]), max_size=20), st.randoms())
def test_barriers_release_in_order(kinds: list[str], rnd: Any) -> None:
    t = InflightTracker(max_inflight=100)
    items: list[int] = []
    released: list[tuple[int, Any]] = []
    expected_positions: list[int] = []
    for pos, kind in enumerate(kinds):
        if kind == "item":
            items.append(t.begin(pos))
        else:
            released += t.barrier(pos)
    rnd.shuffle(items)
    for seq in items:
        released += t.complete(seq, seq)
    seqs = [s for s, _ in released]
    assert seqs == sorted(seqs)
    # positions released never go backwards, and everything ends released
    for _seq, result in released:
        if isinstance(result, Barrier):
            expected_positions.append(result.position)
    assert expected_positions == sorted(expected_positions)
    stats = t.stats()
    assert stats.inflight == 0 and stats.pending_barriers == 0 and stats.held == 0
    if kinds:
        assert t.progress == len(kinds) - 1


def test_barrier_waits_for_earlier_work_and_merges() -> None:
    t = InflightTracker(max_inflight=4)
    a = t.begin(10)
    assert t.barrier(15) == []
    assert t.barrier(17) == []  # merges into the pending barrier
    assert t.stats().pending_barriers == 1
    b = t.begin(20)
    assert t.complete(b, "b") == []
    assert t.complete(a, "a") == [(a, "a"), (1, Barrier(17)), (b, "b")]
    assert t.progress == 20
    # with nothing pending a barrier releases at once and takes a new number
    assert t.barrier(25) == [(b + 1, Barrier(25))]
    assert t.barrier(30) == [(b + 2, Barrier(30))]
    assert t.progress == 30


def test_positions_must_not_go_backwards() -> None:
    t = InflightTracker(max_inflight=4)
    t.begin(10)
    with pytest.raises(TrackerError, match="position order"):
        t.begin(9)
    with pytest.raises(TrackerError, match="position order"):
        t.barrier(5)


def test_complete_misuse_raises() -> None:
    t = InflightTracker(max_inflight=4)
    s = t.begin(1)
    t.begin(2)
    t.complete(s)
    with pytest.raises(TrackerError, match="exactly once"):
        t.complete(s)
    with pytest.raises(TrackerError, match="exactly once"):
        t.complete(7)


def test_max_inflight_blocks_until_complete() -> None:
    t = InflightTracker(max_inflight=2)
    first = t.begin(1)
    t.begin(2)
    thread, admitted, seqs = _begin_in_thread(t, 3, 0)
    assert not admitted.wait(0.05)
    assert t.stats().inflight == 2
    t.complete(first)
    assert admitted.wait(5)
    thread.join(5)
    assert seqs == [2]


def test_byte_quota_blocks_until_complete() -> None:
    t = InflightTracker(max_inflight=10, max_bytes=100)
    first = t.begin(1, size=60)
    t.begin(2, size=30)
    thread, admitted, _ = _begin_in_thread(t, 3, 20)  # 110 bytes > 100
    assert not admitted.wait(0.05)
    assert t.stats().inflight_bytes == 90
    t.complete(first)
    assert admitted.wait(5)
    thread.join(5)
    assert t.stats().inflight_bytes == 50


def test_oversized_item_admitted_when_alone() -> None:
    t = InflightTracker(max_inflight=10, max_bytes=100)
    big = t.begin(1, size=500)  # nothing else in flight: admitted
    thread, admitted, _ = _begin_in_thread(t, 2, 1)
    assert not admitted.wait(0.05)
    t.complete(big)
    assert admitted.wait(5)
    thread.join(5)


def test_begin_timeout() -> None:
    t = InflightTracker(max_inflight=1)
    t.begin(1)
    with pytest.raises(TimeoutError, match="max_inflight"):
        t.begin(2, timeout=0.01)


def test_drain_waits_for_completion_from_other_threads() -> None:
    t = InflightTracker(max_inflight=8)
    seqs = [t.begin(i) for i in range(8)]
    with pytest.raises(TimeoutError, match="still in flight"):
        t.drain(timeout=0.01)
    go = threading.Event()

    def worker(seq: int) -> None:
        go.wait(5)
        t.complete(seq, seq)

    threads = [threading.Thread(target=worker, args=(s,)) for s in reversed(seqs)]
    for th in threads:
        th.start()
    go.set()
    t.drain(timeout=10)
    for th in threads:
        th.join(5)
    assert t.progress == 7
    assert t.stats().released == 8


def test_invalid_limits() -> None:
    with pytest.raises(ValueError, match="max_inflight"):
        InflightTracker(max_inflight=0)
    with pytest.raises(ValueError, match="max_bytes"):
        InflightTracker(max_bytes=0)


def test_a_slow_head_bounds_what_is_admitted_and_held() -> None:
    # One slow item at the head: completed items behind it stay held, and they count
    # against the window and the byte quota until the head completes and releases them.
    t = InflightTracker(max_inflight=2, max_bytes=100)
    head = t.begin(1, size=40)
    second = t.begin(2, size=40)
    assert t.complete(second, "b") == []  # held behind the head
    with pytest.raises(TimeoutError):
        t.begin(3, size=10, timeout=0.05)  # two unreleased: no room, however fast the pool
    assert t.stats().held == 1 and t.stats().inflight_bytes == 80
    assert [r for _, r in t.complete(head, "a")] == ["a", "b"]
    assert t.stats().inflight_bytes == 0
    t.begin(3, size=10, timeout=0.05)  # room again


def test_the_byte_quota_counts_held_results() -> None:
    t = InflightTracker(max_inflight=10, max_bytes=100)
    head = t.begin(1, size=10)
    for i in range(2, 6):
        t.complete(t.begin(i, size=20), i)  # 10 + 4 * 20 = 90 bytes unreleased
    with pytest.raises(TimeoutError):
        t.begin(6, size=20, timeout=0.05)  # 110 > 100
    t.complete(head, 1)
    t.begin(6, size=20, timeout=0.05)
