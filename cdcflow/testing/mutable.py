"""A scripted MUTABLE_KEY_RANGE change stream: :class:`ScriptedMutableStream`.

In a MUTABLE_KEY_RANGE stream partitions do not split or merge into children; a partition
*announces* new partitions (a PartitionStartRecord) and goes on, key ranges *move* between
live partitions (a PartitionEventRecord with a move-out in the source and a move-in in the
destination, both at the move's timestamp), and a partition that owns no keys any more
*ends* (a PartitionEndRecord). The emulator lacks the mode; this twin scripts it::

    stream = ScriptedMutableStream("S", partitions=["a", "b"], origin=T0)
    stream.write("T", 1, "INSERT", {"v": 1}, at=T0 + 1)
    stream.announce("c", by="a", at=T0 + 5)          # a: PartitionStartRecord(("c",))
    stream.move([1], to="c", at=T0 + 6)              # key 1's bucket: a -> c
    stream.hand_over("a", to="b", at=T0 + 8)         # every bucket a still owns
    stream.end("a", at=T0 + 9)                       # a must own no bucket by then

Reads follow the mode's contract: the root query returns one PartitionStartRecord listing
the partitions alive at the query start; a partition's query returns its data records,
heartbeats, event and start records in timestamp order, and a PartitionEndRecord when it
ends inside the query. Data changes are routed to the owner of their key's bucket at
their commit time, moves included, so the ground truth (:meth:`expected_records`) is the
same as for :class:`~cdcflow.testing.ScriptedChangeStream`.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from cdcflow.errors import ChangeStreamError
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    MAX_NS,
    ChangeRecord,
    MoveInEvent,
    MoveOutEvent,
    PartitionEndRecord,
    PartitionEventRecord,
    PartitionStartRecord,
    Timestamp,
    record_position,
)
from cdcflow.stream import ChangeStreamQuery
from cdcflow.testing.reads import with_heartbeats
from cdcflow.testing.scripted import (
    ScriptedChangeStream,
    TimeLike,
    _bucket,
    _ns,
    _Partition,
)

__all__ = ["ScriptedMutableStream"]


class ScriptedMutableStream(ScriptedChangeStream):
    """A deterministic in-memory MUTABLE_KEY_RANGE stream (see the module docstring).

    ``partitions``, ``buckets``, ``origin`` and ``value_capture_type`` are as for
    :class:`~cdcflow.testing.ScriptedChangeStream`; ``split`` and ``merge`` do not exist in
    this mode and raise.
    """

    def __init__(self, stream: str = "Stream", **kwargs: Any) -> None:
        kwargs.setdefault("partition_mode", "MUTABLE_KEY_RANGE")
        if kwargs["partition_mode"] != "MUTABLE_KEY_RANGE":
            msg = "ScriptedMutableStream is a MUTABLE_KEY_RANGE stream; use ScriptedChangeStream"
            raise ValueError(msg)
        super().__init__(stream, **kwargs)
        self._moves: list[tuple[int, int, str, str]] = []  # (at, bucket, source, destination)
        self._events: dict[str, list[ChangeRecord]] = {}  # token -> start/event records

    # -- scripting --------------------------------------------------------------------------

    def split(self, token: str, at: TimeLike, into: int | Sequence[str] = 2) -> Any:
        msg = "MUTABLE_KEY_RANGE partitions do not split; script announce() and move()"
        raise ValueError(msg)

    def merge(self, tokens: Sequence[str], at: TimeLike, into: str | None = None) -> Any:
        msg = "MUTABLE_KEY_RANGE partitions do not merge; script move() and end()"
        raise ValueError(msg)

    def announce(self, token: str, *, by: str, at: TimeLike) -> ScriptedMutableStream:
        """Partition ``by`` announces a new partition ``token`` that starts at ``at``, owning
        no keys until some move to it."""
        at_ns = _ns(at)
        self._live(by, at_ns)
        self._check_new([token])
        self._parts[token] = _Partition(token, at_ns, (), ())
        self._event(by, PartitionStartRecord(by, at_ns, f"s{len(self._moves):07d}", (token,)))
        return self

    def move(
        self, keys: Sequence[Mapping[str, Any] | Any], *, to: str, at: TimeLike
    ) -> ScriptedMutableStream:
        """Move the key buckets holding ``keys`` (dicts of key columns, or values of ``id``)
        to partition ``to`` at ``at``: changes at or after ``at`` land there."""
        buckets = {_bucket(dict(k) if isinstance(k, Mapping) else {"id": k}, self.buckets)
                   for k in keys}
        return self._move(sorted(buckets), to, _ns(at))

    def hand_over(self, source: str, *, to: str, at: TimeLike) -> ScriptedMutableStream:
        """Move every key bucket ``source`` owns at ``at`` to ``to`` (before :meth:`end`)."""
        at_ns = _ns(at)
        self._live(source, at_ns)
        return self._move([b for b in range(self.buckets) if self._owner(b, at_ns) == source],
                          to, at_ns)

    def _move(self, buckets: list[int], to: str, at_ns: int) -> ScriptedMutableStream:
        self._live(to, at_ns)
        sources: dict[str, list[int]] = {}
        for b in buckets:
            src = self._owner(b, at_ns)
            if src != to:
                sources.setdefault(src, []).append(b)
        for src, moved in sorted(sources.items()):
            for b in moved:
                self._moves.append((at_ns, b, src, to))
            seq = f"m{len(self._moves):07d}"
            self._event(src, PartitionEventRecord(src, at_ns, seq,
                                                  move_out_events=(MoveOutEvent(to),)))
            self._event(to, PartitionEventRecord(to, at_ns, seq,
                                                 move_in_events=(MoveInEvent(src),)))
        self._moves.sort()
        self._compiled = None
        return self

    def end(self, token: str, *, at: TimeLike) -> ScriptedMutableStream:
        """Partition ``token`` ends at ``at``; it must own no key bucket by then."""
        at_ns = _ns(at)
        p = self._live(token, at_ns)
        owned = [b for b in range(self.buckets) if self._owner(b, at_ns) == token]
        if owned:
            msg = (
                f"partition {token!r} still owns {len(owned)} key bucket(s) at {at_ns}: "
                "hand_over() or move() them first"
            )
            raise ValueError(msg)
        p.end = at_ns
        self._compiled = None
        return self

    def _live(self, token: str, at: int) -> _Partition:
        p = self._parts.get(token)
        if p is None or not p.start <= at < p.end:
            known = ", ".join(sorted(self._parts))
            msg = f"partition {token!r} is not alive at {at}; known: {known}"
            raise ValueError(msg)
        return p

    def _event(self, token: str, record: ChangeRecord) -> None:
        events = self._events.setdefault(token, [])
        events.append(record)
        events.sort(key=record_position)

    # -- ownership with moves ---------------------------------------------------------------

    def _owner(self, bucket: int, at: int) -> str:
        owner: str | None = None
        for p in self._parts.values():
            if p.start <= at and bucket in p.buckets:
                owner = p.token
        for when, b, _, dst in self._moves:
            if when > at:
                break
            if b == bucket:
                owner = dst
        if owner is None:
            msg = f"no partition owns bucket {bucket} at {at}"
            raise AssertionError(msg)
        return owner

    # -- reads ------------------------------------------------------------------------------

    def _root(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        alive = self.partitions_at(query.start)
        if not alive:
            msg = f"no partition exists at {query.start}: start reading at or after the origin"
            raise ChangeStreamError(msg)
        yield PartitionStartRecord(INITIAL_PARTITION_TOKEN, Timestamp.from_ns(query.start),
                                   "00000000", tuple(alive))

    def _part(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        token = query.partition_token
        assert token is not None
        p = self._parts.get(token)
        if p is None or not p.start <= query.start <= p.end:
            msg = f"partition token {token!r} is not readable from {query.start}"
            raise ChangeStreamError(msg)
        stop = min(query.end, p.end)
        data = self._records().get(token, [])
        events = self._events.get(token, [])
        lo_d = bisect.bisect_left(data, query.start, key=lambda r: r.commit_timestamp.ns)
        lo_e = bisect.bisect_left(events, query.start, key=record_position)
        merged = heapq.merge(data[lo_d:], events[lo_e:], key=record_position)
        hb = max(1, query.heartbeat_millis) * 1_000_000
        yield from with_heartbeats(merged, token, query.start, stop, hb)
        if p.end < query.end and p.end != MAX_NS:
            yield PartitionEndRecord(token, Timestamp.from_ns(p.end), "e0000000")
