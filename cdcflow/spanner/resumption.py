"""How a read of one partition resumes after its query failed, without duplicates.

A retry re-issues the query from the timestamp ``T`` of the last record the read gave and
drops what it gave already: records before ``T``, heartbeats at ``T``, and records at ``T``
whose identity (kind, record sequence, server transaction id) was given. The identity test
does not depend on the server returning records at one timestamp in the same order twice.
A partition ends at its first ChildPartitionsRecord (or MUTABLE_KEY_RANGE's
PartitionEndRecord): nothing of it is given past that. :class:`Resumption` keeps what this
needs across the windows and retries of one read (``cdcflow.spanner.client``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from cdcflow.model import (
    ChangeRecord,
    ChildPartitionsRecord,
    DataChangeRecord,
    HeartbeatRecord,
    PartitionEndRecord,
    record_position,
)

__all__ = ["Resumption"]

_ENDS = (ChildPartitionsRecord, PartitionEndRecord)

Identity = tuple[str, str, str]


class Resumption:
    """What one read gave so far (see the module docstring). ``ended``: the read is past
    the partition's end already (the root query, whose records come in one window)."""

    def __init__(self, *, ended: bool = False) -> None:
        self.ended = ended
        self._last: int | None = None  # position of the last record given
        self._at_last: set[Identity] = set()  # identities given at ``_last``
        self._seen: set[Identity] = set()  # while re-reading: those of the failed read
        self._resume: int | None = None  # while re-reading: drop what is at or before it

    def given(self, records: Sequence[ChangeRecord], end: int) -> Sequence[ChangeRecord]:
        """What of a message's ``records`` (not empty) the read gives, in a window ending
        at ``end``: none at or past ``end``, none that a failed query gave, none past the
        partition's end; empty for none."""
        tail = record_position(records[-1])
        given: Sequence[ChangeRecord]
        if self._resume is None and tail < end:
            # The usual case: all of the message, given as it is (positions never decrease
            # in a partition, and the server starts at the window's start).
            given = records
        else:
            given = _kept(records, self._resume, self._seen, end)
            if self._resume is not None and tail > self._resume:
                self._resume = None
            if not given:
                return given
            tail = record_position(given[-1])
        if not self.ended:
            given, self.ended = _through_end(given)
            tail = record_position(given[-1])
        # A query fails between messages only: what a message gives at its last position
        # joins ``_at_last`` once, not record by record.
        if tail != self._last:
            self._last = tail
            self._at_last.clear()
        self._at_last.update(_identities_at_end(given, tail))
        return given

    def failed(self) -> int | None:
        """After a failed query: the position to read again from, dropping what was given
        there (None: nothing was given yet, read the window again from its start)."""
        if self._last is not None:
            self._resume = self._last
            # what was given at ``_last`` by every query so far (it grows while ``_last``
            # holds)
            self._seen = set(self._at_last)
        return self._last

    def next_window(self) -> None:
        """A window was read whole: the next one drops nothing."""
        self._resume, self._seen = None, set()


def _identity(record: ChangeRecord) -> Identity:
    if isinstance(record, DataChangeRecord):
        return ("data", record.record_sequence, record.server_transaction_id)
    sequence = getattr(record, "record_sequence", "")
    return (type(record).__name__, str(sequence), "")


def _identities_at_end(records: Sequence[ChangeRecord], position: int) -> Iterator[Identity]:
    """The identities of the last of ``records``, those at ``position``."""
    at = len(records)
    while at > 0 and record_position(records[at - 1]) == position:
        at -= 1
    for record in records[at:]:
        yield _identity(record)


def _through_end(records: Sequence[ChangeRecord]) -> tuple[Sequence[ChangeRecord], bool]:
    """``records`` through the first that ends the partition, and whether there was one."""
    for at, record in enumerate(records):
        if type(record) in _ENDS:
            return records[:at + 1], True
    return records, False


def _kept(
    records: Sequence[ChangeRecord], resume: int | None, seen: set[Identity], end: int,
) -> list[ChangeRecord]:
    """What of ``records`` a read gives: none at or past ``end``, and while re-reading
    after a failure none at or before ``resume`` that the failed read gave (``seen``), and
    no heartbeat at ``resume``."""
    kept: list[ChangeRecord] = []
    for record in records:
        pos = record_position(record)
        if resume is not None and pos <= resume and (
            pos < resume or isinstance(record, HeartbeatRecord) or _identity(record) in seen
        ):
            continue
        if pos >= end:
            # The server's bounds are inclusive of end - 1 ns; never past it.
            continue
        kept.append(record)
    return kept
