"""Restrictions over commit timestamps, their tracker and a manual watermark estimator.

A restriction is a half-open range ``[start, end)`` of positions: integer nanoseconds since
the epoch. The change stream query's bounds are both inclusive, so a range is read with
``end_timestamp = end - 1 ns``; the next range starts at ``end`` and nothing is read twice
or skipped.

The tracker follows the contract of Beam's ``RestrictionTracker`` (and its
``TimestampRangeTracker``): a reader claims every record's position before it emits the
record; when :meth:`TimestampRangeTracker.try_claim` returns False the reader must stop.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs

from cdcflow.errors import TrackerError
from cdcflow.model import MAX_NS

__all__ = ["ManualWatermarkEstimator", "TimestampRange", "TimestampRangeTracker"]


def _check_range(instance: TimestampRange, attribute: Any, value: int) -> None:
    if instance.start > instance.end:
        msg = (
            f"TimestampRange start {instance.start} is after end {instance.end}; "
            "pass start <= end (the range is half-open: [start, end))"
        )
        raise ValueError(msg)


@attrs.frozen
class TimestampRange:
    """The half-open range of positions ``start <= pos < end`` (integer nanoseconds).

    ``start == end`` is the empty range. ``end == MAX_NS`` means the range has no end.
    """

    start: int
    end: int = attrs.field(validator=_check_range)

    def __contains__(self, position: object) -> bool:
        return isinstance(position, int) and self.start <= position < self.end

    @property
    def size(self) -> int:
        """Number of positions in the range."""
        return self.end - self.start

    def is_empty(self) -> bool:
        return self.start == self.end


class TimestampRangeTracker:
    """Tracks which positions of a :class:`TimestampRange` a reader has claimed.

    Contract (as Beam's ``RestrictionTracker``):

    - :meth:`try_claim` must be called with every record's position before the record is
      emitted. Positions never go backwards, but the same position may be claimed again
      (many records share one commit timestamp).
    - If ``try_claim`` returns False the position is outside the (possibly split) range and
      the caller must stop reading without emitting the record.
    - A reader whose query ended without reaching ``end`` claims ``end`` itself (which
      returns False) to mark the range done; :meth:`check_done` then passes.
    - Claims after a checkpoint (:meth:`try_split`) stop at the new end.
    - One thread claims and splits: like Beam's own trackers, this one takes no lock (a
      reader claims every record, and on some machines an uncontended lock costs more than
      the rest of the claim). Splitting from another thread, say a deadline timer, needs a
      lock around both calls, as Beam's ``ThreadsafeRestrictionTracker`` puts there.
    """

    def __init__(self, restriction: TimestampRange) -> None:
        if not isinstance(restriction, TimestampRange):
            msg = f"TimestampRangeTracker needs a TimestampRange, got {restriction!r}"
            raise TypeError(msg)
        self._range = restriction
        self._last_claimed: int | None = None
        self._last_attempted: int | None = None
        # try_claim's two bounds, kept beside the range for the hot path: the least position
        # it accepts (the range start, then the last attempt) and the range's end
        self._floor = restriction.start
        self._end = restriction.end

    def __repr__(self) -> str:
        return (
            f"TimestampRangeTracker({self._range!r}, last_claimed={self._last_claimed}, "
            f"last_attempted={self._last_attempted})"
        )

    @property
    def last_claimed(self) -> int | None:
        """The last position :meth:`try_claim` accepted, or None."""
        return self._last_claimed

    @property
    def last_attempted(self) -> int | None:
        """The last position passed to :meth:`try_claim` (accepted or not), or None."""
        return self._last_attempted

    def current_restriction(self) -> TimestampRange:
        """The range this tracker owns now (shrunk by :meth:`try_split`)."""
        return self._range

    def try_claim(self, position: int) -> bool:
        """Claim ``position``; True if the caller may emit the record at it.

        Returns False when ``position >= end``: the caller must stop. Raises TrackerError
        when ``position < start`` or when it is smaller than the previous attempt.
        """
        if position < self._floor:  # a reader claims each record: the usual case is short
            self._refuse(position)
        self._floor = self._last_attempted = position
        if position >= self._end:
            return False
        self._last_claimed = position
        return True

    def _refuse(self, position: int) -> None:
        if self._last_attempted is not None and position < self._last_attempted:
            msg = (
                f"try_claim({position}) goes backwards from {self._last_attempted}; a "
                "reader must claim positions in non-decreasing order"
            )
            raise TrackerError(msg)
        msg = (
            f"try_claim({position}) is before the range start {self._range.start}; "
            "the reader's query must start at the restriction's start"
        )
        raise TrackerError(msg)

    def try_split(
        self, fraction_of_remainder: float = 0.0
    ) -> tuple[TimestampRange, TimestampRange] | None:
        """Split off the unclaimed rest; return ``(primary, residual)`` or None.

        With ``fraction_of_remainder == 0`` this is a checkpoint: the primary ends right
        after the last claimed position and the residual starts there; if nothing was
        claimed the primary is the empty ``[start, start)`` and the residual the whole
        range. A fraction in (0, 1) keeps that share of the unclaimed rest in the primary.
        Returns None when there is nothing left to split off (the range is done). The
        tracker keeps the primary.
        """
        if not 0.0 <= fraction_of_remainder < 1.0:
            msg = f"try_split fraction must be in [0, 1), got {fraction_of_remainder}"
            raise ValueError(msg)
        start, end = self._range.start, self._range.end
        if self._last_attempted is not None and self._last_attempted >= end:
            return None
        first_unclaimed = start if self._last_claimed is None else self._last_claimed + 1
        split = first_unclaimed + int((end - first_unclaimed) * fraction_of_remainder)
        if split >= end:
            return None
        primary = TimestampRange(start, split)
        residual = TimestampRange(split, end)
        self._range = primary
        self._end = split
        return primary, residual

    def is_done(self) -> bool:
        """True when every position of the current range has been claimed or given up."""
        if self._range.is_empty():
            return True
        return self._last_attempted is not None and self._last_attempted >= self._range.end - 1

    def check_done(self) -> None:
        """Raise TrackerError unless the whole current range was claimed or given up."""
        if self.is_done():
            return
        last = self._last_attempted
        msg = (
            f"range {self._range} is not done: last attempted position {last}; a reader "
            f"whose query ended must call try_claim({self._range.end}) (the range end), "
            "or try_split(0) to hand back the rest"
        )
        raise TrackerError(msg)

    def is_bounded(self) -> bool:
        """False when the range has no end (``end == MAX_NS``)."""
        return self._range.end != MAX_NS


class ManualWatermarkEstimator:
    """A watermark the reader sets explicitly; it never moves backwards.

    :meth:`set_watermark` raises TrackerError on a smaller value, because a regression
    means the reader emitted out of order and downstream completeness would be wrong.
    """

    def __init__(self, initial_ns: int) -> None:
        self._watermark = initial_ns
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"_watermark": self._watermark}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._watermark = state["_watermark"]
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ManualWatermarkEstimator({self._watermark})"

    def current_watermark(self) -> int:
        return self._watermark

    def set_watermark(self, ns: int) -> None:
        """Move the watermark to ``ns`` (equal is fine); raise TrackerError if ``ns`` is smaller."""
        with self._lock:
            if ns < self._watermark:
                msg = (
                    f"watermark cannot move backwards from {self._watermark} to {ns}; "
                    "set it only from positions in the order they were claimed"
                )
                raise TrackerError(msg)
            self._watermark = ns
