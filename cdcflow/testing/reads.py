"""How a scripted partition's query answers: a heartbeat whenever the heartbeat interval
passes without a record, and the failures a test injects. Shared by the scripted streams."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from cdcflow.model import ChangeRecord, HeartbeatRecord, Timestamp, record_position

__all__ = ["failing", "with_heartbeats"]

_R = TypeVar("_R")


def with_heartbeats(
    records: Iterable[ChangeRecord], token: str, start: int, stop: int, every_ns: int
) -> Iterator[ChangeRecord]:
    """``records`` (in position order) up to ``stop``, with a HeartbeatRecord whenever
    ``every_ns`` pass without one, as a partition's query returns them."""
    last = start
    for rec in records:
        ts = record_position(rec)
        if ts >= stop:
            break
        while ts - last > every_ns:
            last += every_ns
            yield HeartbeatRecord(token, Timestamp.from_ns(last))
        yield rec
        last = ts
    while last + every_ns < stop:
        last += every_ns
        yield HeartbeatRecord(token, Timestamp.from_ns(last))


def failing(records: Iterator[_R], after: int, error: type[Exception]) -> Iterator[_R]:
    """``records`` up to ``after`` of them, then ``error``."""
    for i, record in enumerate(records):
        if i >= after:
            break
        yield record
    msg = "scripted failure: UNAVAILABLE (injected by ScriptedChangeStream.fail_reads)"
    raise error(msg)
