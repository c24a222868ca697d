"""Which Spanner errors are transient (the predicate for cdcflow's one retry policy), and
what change stream queries cost (:class:`QueryStats`, carried to the driver as task counters).

How long to wait and how often to try is :class:`cdcflow.backoff.RetryPolicy` (capped
exponential backoff, full jitter, bounded attempts), re-exported here for older imports.
cdcflow never relies on the stock client's own retry loops (its ``ServiceUnavailable``
restart loop has neither a bound nor a delay); callers pass :func:`is_transient` as
``retry_if``.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cdcflow.backoff import RetryPolicy
from cdcflow.model import ChangeRecord

__all__ = [
    "QUERY_BUCKETS",
    "TRANSIENT_CODES",
    "ObservedRead",
    "QueryStats",
    "RetryLog",
    "RetryPolicy",
    "is_transient",
    "query_bucket_labels",
    "status_name",
]

#: The retries of change stream queries a process logs: one line per this many seconds.
RETRY_LOG_WINDOW_S = 10.0


class RetryLog:
    """The log lines of this process's change stream query retries, at most one per
    ``window`` seconds and level: in an outage every partition's read fails at once, again
    and again, and a line each (with its 200-character token) buried the log. A line
    logged after quiet ones says how many of its level were left out. Thread-safe."""

    def __init__(self, logger: logging.Logger, window: float = RETRY_LOG_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[int, float] = {}  # level -> when its next line may be logged
        self._left_out: dict[int, int] = {}

    def log(self, level: int, msg: str, *args: object) -> None:
        now = self._clock()
        with self._lock:
            if now < self._next.get(level, -math.inf):
                self._left_out[level] = self._left_out.get(level, 0) + 1
                return
            left_out = self._left_out.pop(level, 0)
            self._next[level] = now + self._window
        if left_out:
            msg += " (and %d more failed change stream queries since the last such line)"
            args = (*args, left_out)
        self._logger.log(level, msg, *args)


#: gRPC status codes worth retrying: the server may well answer next time.
TRANSIENT_CODES = frozenset({"UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})

#: INTERNAL errors that are really a broken HTTP/2 stream (what the stock client also resumes).
_RESUMABLE_INTERNAL = (
    "RST_STREAM",
    "Received unexpected EOS on DATA frame from server",
    "stream terminated by RST_STREAM",
    "Received RST_STREAM",
)


def status_name(exc: BaseException) -> str | None:
    """The gRPC status name of an api_core or grpc error (``"UNAVAILABLE"``), else None."""
    code = getattr(exc, "grpc_status_code", None)
    if code is None:
        code_fn = getattr(exc, "code", None)
        if callable(code_fn):
            try:
                code = code_fn()
            except Exception:
                code = None
    name = getattr(code, "name", None)
    return name if isinstance(name, str) else None


def _message(exc: BaseException) -> str:
    text = getattr(exc, "message", None)
    if isinstance(text, str):
        return text
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            return str(details())
        except Exception:
            return str(exc)
    return str(exc)


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry may cure: UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED, and INTERNAL errors caused by a reset HTTP/2 stream."""
    name = status_name(exc)
    if name in TRANSIENT_CODES:
        return True
    if name == "INTERNAL":
        text = _message(exc)
        return any(marker in text for marker in _RESUMABLE_INTERNAL)
    return False


# -- what queries cost ---------------------------------------------------------------------

#: Bucket bounds (seconds) of the change stream query histograms: a slice's query usually
#: ends within a second; a query that stalls runs up to the client's query_timeout.
QUERY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def query_bucket_labels() -> tuple[str, ...]:
    """The ``le`` labels of :data:`QUERY_BUCKETS` as :class:`QueryStats` keys spell them,
    ``+Inf`` last."""
    return (*map(str, QUERY_BUCKETS), "+Inf")


_LABELS = query_bucket_labels()
_QUERY_KEYS = tuple(f"spanner_query_seconds/{le}" for le in _LABELS)
_FIRST_KEYS = tuple(f"spanner_first_response_seconds/{le}" for le in _LABELS)


class QueryStats:
    """What the change stream queries of one read cost, as task counters (``counters``,
    string -> int, summed over tasks by the engine like every task counter).

    Keys (only those that are not 0 are present):

    - ``spanner_queries``: queries issued, each retry one more;
    - ``spanner_query_seconds/<le>``: queries whose duration fell in the bucket of upper
      bound ``le`` (one of :func:`query_bucket_labels`; each query counts in one bucket,
      not cumulatively), ``spanner_query_us``: their total duration in microseconds. A
      query's duration is the time it spent in the reader (waiting for Spanner, decoding)
      from issue to its end, failure or abandonment, without the time the caller held its
      records;
    - ``spanner_first_response_seconds/<le>`` and ``spanner_first_response_us``: the same
      for the time from issue to the first row (queries that returned none are not in it);
    - ``spanner_errors/<CODE>``: errors by gRPC status name (``UNAVAILABLE``), every one
      the reader saw, retried or not.

    Not thread-safe: one read (one thread) owns it.
    """

    __slots__ = ("counters",)

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}

    def query(self, seconds: float, first_response: float | None) -> None:
        """Count one query that took ``seconds``, its first row after ``first_response``
        seconds (None: it returned no row)."""
        c = self.counters
        c["spanner_queries"] = c.get("spanner_queries", 0) + 1
        key = _QUERY_KEYS[bisect_left(QUERY_BUCKETS, seconds)]
        c[key] = c.get(key, 0) + 1
        c["spanner_query_us"] = c.get("spanner_query_us", 0) + int(seconds * 1e6)
        if first_response is not None:
            key = _FIRST_KEYS[bisect_left(QUERY_BUCKETS, first_response)]
            c[key] = c.get(key, 0) + 1
            c["spanner_first_response_us"] = (
                c.get("spanner_first_response_us", 0) + int(first_response * 1e6)
            )

    def error(self, exc: BaseException) -> None:
        """Count ``exc`` by its gRPC status name; errors that are not RPC errors (cdcflow's
        own, a bug) are not Spanner's and are not counted."""
        name = status_name(exc)
        if name is not None:
            key = f"spanner_errors/{name}"
            self.counters[key] = self.counters.get(key, 0) + 1


class ObservedRead(Iterator[ChangeRecord]):
    """The records of one change stream read, and what its queries cost.

    Iterating it iterates the records (``iter()`` hands out the records' iterator itself: no
    cost per record; :meth:`of_runs` makes one of records given in runs, flattened in C).
    :meth:`counters` ends the read (a query still open is closed, so its duration is
    counted) and returns the read's :class:`QueryStats` counters: call it once the records
    are consumed or abandoned; records are not available after it. :meth:`size_of` tells
    the size the decoder measured of the record just read.
    """

    __slots__ = ("_records", "_sizes", "_source", "_stats")

    def __init__(self, records: Iterator[ChangeRecord], stats: QueryStats,
                 sizes: dict[int, int] | None = None) -> None:
        self._records = records
        self._source: Iterator[Any] = records  # what close() closes
        self._stats = stats
        self._sizes = sizes if sizes is not None else {}

    @classmethod
    def of_runs(cls, runs: Iterator[Sequence[ChangeRecord]], stats: QueryStats,
                sizes: dict[int, int] | None = None) -> ObservedRead:
        """The read of records given in runs (the Spanner reader gives a message's at a
        time)."""
        read = cls(itertools.chain.from_iterable(runs), stats, sizes)
        read._source = runs
        return read

    def size_of(self, record: ChangeRecord) -> int | None:
        """The bytes the decoder measured for ``record``, the record just read (the
        measure of ``cdcflow.sizes.approx_size``, taken from the wire), or None
        when it did not measure it. Ask before reading the next record."""
        return self._sizes.get(id(record))

    def __iter__(self) -> Iterator[ChangeRecord]:
        return self._records

    def __next__(self) -> ChangeRecord:
        return next(self._records)

    def close(self) -> None:
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def counters(self) -> dict[str, int]:
        self.close()
        return dict(self._stats.counters)
