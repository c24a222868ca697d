"""GrpcTransport's read-ahead: messages in order, errors after the messages before them,
and a reader that leaves early cancels the call (ending the receiving thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cdcflow.spanner.transport import GrpcTransport, _prefetched


class _Stream:
    """A gRPC response iterator's twin: ``items`` (an Exception is raised when reached),
    then, unless ``finite``, blocks until cancelled, like a call waiting for the server."""

    def __init__(self, items: list[Any], *, finite: bool = True) -> None:
        self.items = items
        self.finite = finite
        self.cancelled = threading.Event()
        self.received = 0

    def __iter__(self) -> Iterator[Any]:
        for item in self.items:
            if isinstance(item, Exception):
                raise item
            self.received += 1
            yield item
        if not self.finite:
            self.cancelled.wait(10)
            raise RuntimeError("cancelled")

    def cancel(self) -> None:
        self.cancelled.set()


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "cdcflow-prefetch"]


def _wait_no_prefetch_threads() -> None:
    deadline = time.monotonic() + 5
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _prefetch_threads()


def test_items_arrive_in_order_converted() -> None:
    stream = _Stream(list(range(100)))
    assert list(_prefetched(stream, lambda x: x * 2, 3)) == [x * 2 for x in range(100)]
    _wait_no_prefetch_threads()


def test_reads_at_most_depth_ahead() -> None:
    stream = _Stream(list(range(50)))
    reading = _prefetched(stream, lambda x: x, 2)
    assert next(reading) == 0
    time.sleep(0.2)  # room for the thread to run ahead as far as it may
    # one taken, two waiting in the queue, one received and waiting for room
    assert stream.received <= 4
    reading.close()
    _wait_no_prefetch_threads()


def test_an_error_comes_after_the_items_before_it() -> None:
    error = ValueError("stream broke")
    stream = _Stream([1, 2, error, 3])
    got = []
    with pytest.raises(ValueError, match="stream broke") as caught:
        for item in _prefetched(stream, lambda x: x, 2):
            got.append(item)
    assert got == [1, 2]
    assert caught.value is error  # the stream's own exception: retry rules see its type
    _wait_no_prefetch_threads()


def test_leaving_early_cancels_a_call_waiting_for_the_server() -> None:
    stream = _Stream([1, 2], finite=False)
    reading = _prefetched(stream, lambda x: x, 4)
    assert next(reading) == 1
    reading.close()
    assert stream.cancelled.is_set()
    _wait_no_prefetch_threads()


def test_prefetch_is_on_by_default() -> None:
    assert GrpcTransport.prefetch >= 1


def test_a_stream_silent_past_the_idle_bound_stalled_and_is_cancelled() -> None:
    from google.api_core.exceptions import DeadlineExceeded

    stream = _Stream([1, 2], finite=False)  # two messages, then an open, silent call
    got = []
    began = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="stalled"):
        for item in _prefetched(stream, lambda x: x, 2, idle=0.3):
            got.append(item)
    assert got == [1, 2] and 0.3 <= time.monotonic() - began < 5
    assert stream.cancelled.is_set()
    _wait_no_prefetch_threads()


def test_once_the_run_stops_a_silent_stream_is_given_up_before_its_idle_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from google.api_core.exceptions import DeadlineExceeded

    from cdcflow.spanner import transport

    monkeypatch.setattr(transport, "STOP_SILENCE_S", 0.3)
    monkeypatch.setattr(transport, "STOP_POLL_S", 0.05)
    stop = threading.Event()
    stream = _Stream([1, 2], finite=False)
    got = []
    began = time.monotonic()
    threading.Timer(0.5, stop.set).start()  # silent past STOP_SILENCE_S before the stop
    with pytest.raises(DeadlineExceeded, match="and the run was asked to stop"):
        for item in _prefetched(stream, lambda x: x, 2, idle=60, stopping=stop.is_set):
            got.append(item)
    assert got == [1, 2] and 0.5 <= time.monotonic() - began < 5  # not the 60 s bound
    assert stream.cancelled.is_set()
    _wait_no_prefetch_threads()

    # a stream that answers is not given up: the stop waits for its batch
    stop.set()
    slow = _Stream(list(range(5)))
    assert list(_prefetched(slow, lambda x: x, 2, idle=60, stopping=stop.is_set)) == [
        0, 1, 2, 3, 4]


def test_the_idle_bound_counts_only_the_readers_wait() -> None:
    # A reader that holds each message longer than the bound (a slow sink) is not a stall:
    # the messages were there when it asked.
    stream = _Stream(list(range(4)))
    got = []
    for item in _prefetched(stream, lambda x: x, 2, idle=0.2):
        got.append(item)
        time.sleep(0.3)
    assert got == [0, 1, 2, 3]


def test_a_change_stream_query_stalls_after_several_heartbeats() -> None:
    from cdcflow.spanner.client import STALL_MIN_S, SpannerChangeStreamClient

    client = SpannerChangeStreamClient("projects/p/instances/i/databases/d")
    assert client._stall_after(10_000) == STALL_MIN_S  # 6 heartbeats of 10 s: the minimum
    assert client._stall_after(60_000) == 360.0
    short = SpannerChangeStreamClient("projects/p/instances/i/databases/d", query_timeout=30)
    assert short._stall_after(10_000) == 30.0  # never past the query's own timeout
