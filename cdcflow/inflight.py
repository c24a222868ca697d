"""Ordered acknowledgements for work that completes out of order.

A reader hands records to a pool (a sink or user function running with ``max_inflight``
> 1). Completions arrive in any order, but progress may only advance through the
contiguous prefix of completed work: if record 3 is done and record 2 is not, a crash
must replay from record 2. :class:`InflightTracker` numbers the work, releases results in
order, and bounds memory with an item count and a byte quota (reading blocks while the
quota is used up).

Resolved positions that carry no work (a heartbeat, a child-partitions record) enter as
barriers: they take a sequence number, complete at once, and are released only after
everything before them, so progress never passes unfinished work.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import attrs

from cdcflow.errors import TrackerError

__all__ = ["Barrier", "InflightStats", "InflightTracker"]


@attrs.frozen
class Barrier:
    """The result a released barrier carries: the resolved ``position`` it stands for."""

    position: int


@attrs.frozen
class InflightStats:
    """A snapshot of an :class:`InflightTracker`.

    ``inflight``: items begun and not completed. ``inflight_bytes``: the sizes of every
    unreleased item (in flight or held). ``held``: items completed but waiting for an
    earlier one. ``pending_barriers``:
    barriers waiting for earlier work. ``released``: entries (items and barriers)
    released so far.
    """

    inflight: int
    inflight_bytes: int
    held: int
    pending_barriers: int
    released: int


class _Entry:
    __slots__ = ("barrier", "done", "position", "result", "size")

    def __init__(self, position: int, size: int, barrier: bool) -> None:
        self.position = position
        self.size = size
        self.barrier = barrier
        self.done = barrier
        self.result: Any = None


class InflightTracker:
    """Sequence numbers for in-flight work, released in order. Thread-safe.

    Contract:

    - :meth:`begin` before handing an item to the pool; it blocks while ``max_inflight``
      items are unreleased (in flight, or completed and held behind an earlier one) or
      while their bytes plus ``size`` would exceed ``max_bytes`` (an item larger than the
      quota is admitted once nothing else is unreleased, so it cannot deadlock). Memory is
      therefore bounded even while one slow item holds up everything after it. Positions
      passed to :meth:`begin` and :meth:`barrier` must be non-decreasing.
    - :meth:`complete` exactly once per sequence number, from any thread, in any order —
      also for items that failed (pass the error as the result), or :meth:`drain` never
      returns. It returns the newly released ``(seq, result)`` pairs in sequence order.
    - :attr:`progress` is the position of the last released entry: everything up to it is
      complete. A released barrier's result is a :class:`Barrier`.
    """

    def __init__(self, max_inflight: int = 1, max_bytes: int = 64 << 20) -> None:
        if max_inflight < 1:
            msg = f"max_inflight must be 1 or more, got {max_inflight}"
            raise ValueError(msg)
        if max_bytes < 1:
            msg = f"max_bytes must be 1 or more, got {max_bytes}"
            raise ValueError(msg)
        self._max_inflight = max_inflight
        self._max_bytes = max_bytes
        self._cond = threading.Condition()
        self._entries: deque[_Entry] = deque()  # unreleased entries, from seq _base on
        self._base = 0  # sequence number of _entries[0]
        self._inflight = 0
        self._inflight_bytes = 0
        self._held = 0
        self._pending_barriers = 0
        self._released = 0
        self._last_position: int | None = None
        self._progress: int | None = None

    def __repr__(self) -> str:
        return f"InflightTracker({self.stats()}, progress={self._progress})"

    @property
    def max_inflight(self) -> int:
        return self._max_inflight

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def progress(self) -> int | None:
        """Position of the last released entry (None before the first release)."""
        with self._cond:
            return self._progress

    def _has_room(self, size: int) -> bool:
        unreleased = self._inflight + self._held
        if unreleased == 0:
            return True
        if unreleased >= self._max_inflight:
            return False
        return self._inflight_bytes + size <= self._max_bytes

    def _check_position(self, position: int) -> None:
        if self._last_position is not None and position < self._last_position:
            msg = (
                f"position {position} is before the previous position {self._last_position}; "
                "begin() and barrier() must be called in position order"
            )
            raise TrackerError(msg)

    def begin(self, position: int, size: int = 0, timeout: float | None = None) -> int:
        """Admit an item at ``position`` of ``size`` bytes; return its sequence number.

        Blocks until there is room (see the class contract); raises TimeoutError if
        ``timeout`` seconds pass first.
        """
        if size < 0:
            msg = f"size must be 0 or more bytes, got {size}"
            raise ValueError(msg)
        with self._cond:
            self._check_position(position)
            if not self._cond.wait_for(lambda: self._has_room(size), timeout):
                msg = (
                    f"no room for an item of {size} bytes within {timeout}s "
                    f"({self._inflight} items, {self._inflight_bytes} bytes in flight); "
                    "raise max_inflight / max_inflight_bytes or make the pool faster"
                )
                raise TimeoutError(msg)
            self._check_position(position)  # another thread may have begun meanwhile
            seq = self._base + len(self._entries)
            self._entries.append(_Entry(position, size, barrier=False))
            self._last_position = position
            self._inflight += 1
            self._inflight_bytes += size
            return seq

    def complete(self, seq: int, result: Any = None) -> list[tuple[int, Any]]:
        """Mark ``seq`` complete with ``result``; return what is newly released, in order."""
        with self._cond:
            index = seq - self._base
            if index < 0 or index >= len(self._entries):
                msg = (
                    f"complete({seq}): not an unreleased sequence number (next to release "
                    f"is {self._base}); complete each number begin() returned exactly once"
                )
                raise TrackerError(msg)
            entry = self._entries[index]
            if entry.done:
                what = "a barrier" if entry.barrier else "already completed"
                msg = f"complete({seq}): {what}; complete each begun item exactly once"
                raise TrackerError(msg)
            entry.done = True
            entry.result = result
            self._inflight -= 1
            self._held += 1
            released = self._release()
            self._cond.notify_all()
            return released

    def barrier(self, position: int) -> list[tuple[int, Any]]:
        """Add a resolved ``position`` released after everything begun before it.

        Returns what is newly released (the barrier itself when nothing is pending before
        it). A barrier that would directly follow another pending barrier merges into it
        (the merged barrier keeps the larger position and its sequence number).
        """
        with self._cond:
            self._check_position(position)
            self._last_position = position
            if self._entries and self._entries[-1].barrier:
                # the previous barrier is still pending: nothing between, one is enough
                self._entries[-1].position = position
                return []
            self._entries.append(_Entry(position, 0, barrier=True))
            self._pending_barriers += 1
            return self._release()

    def _release(self) -> list[tuple[int, Any]]:
        released: list[tuple[int, Any]] = []
        while self._entries and self._entries[0].done:
            entry = self._entries.popleft()
            if entry.barrier:
                self._pending_barriers -= 1
                released.append((self._base, Barrier(entry.position)))
            else:
                self._held -= 1
                self._inflight_bytes -= entry.size  # its result goes to the caller now
                released.append((self._base, entry.result))
            self._progress = entry.position
            self._base += 1
        self._released += len(released)
        return released

    def drain(self, timeout: float | None = None) -> None:
        """Block until nothing is in flight; raise TimeoutError after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._inflight == 0, timeout):
                msg = (
                    f"{self._inflight} items still in flight after {timeout}s; every begun "
                    "item must be completed (also when it fails)"
                )
                raise TimeoutError(msg)

    def stats(self) -> InflightStats:
        with self._cond:
            return InflightStats(
                inflight=self._inflight,
                inflight_bytes=self._inflight_bytes,
                held=self._held,
                pending_barriers=self._pending_barriers,
                released=self._released,
            )
