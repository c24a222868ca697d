"""The byte quota of a worker process: how many bytes of read records may be held at once.

Every task running in one process (the driver of the in-memory runner, or one Python
worker of a Spark executor) shares one :class:`ByteQuota`, :func:`process_quota`. A task
charges a record's size (:func:`approx_size`) when it reads it and
gives it back only when every sink has taken the record's outputs (written or spilled
them), so the bytes held by reading, by ParDos in flight and by results waiting for an
earlier record stay below the quota however slow the sinks are: reading blocks at the
quota (TiCDC's memory quota is the model).

The limit is ``ReadPartition(max_inflight_bytes=...)``; a pipeline that leaves it unset
gets :data:`DEFAULT_QUOTA_BYTES` (256 MiB), or the ``CDCFLOW_MAX_INFLIGHT_BYTES``
environment variable of the process where the tasks run. One quota per process: when
tasks of pipelines with different limits share a process, the last one to start sets it.

What the quota does not count: what a sink keeps after ``write`` returns, unless it says
so (Consume holds its queued elements' bytes through ``WriterContext.hold`` until they are
acked: :meth:`ByteQuota.take`). Other writers stream or spill (WriteFiles, WriteSpark's
staging files, WriteTables' and Print's local spool files) and keep little; Collect, for
tests, keeps its whole slice until the task ends, as its commit message.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable

import attrs

from cdcflow.durations import parse_size
from cdcflow.errors import ConfigurationError, PipelineDefinitionError
from cdcflow.sizes import approx_size

__all__ = [
    "DEFAULT_QUOTA_BYTES",
    "ByteQuota",
    "QuotaStats",
    "approx_size",
    "current_quota",
    "process_quota",
    "quota_limit",
]

#: The quota of a process when the pipeline sets no ``max_inflight_bytes``.
DEFAULT_QUOTA_BYTES = 256 << 20

_ENV = "CDCFLOW_MAX_INFLIGHT_BYTES"


@attrs.frozen
class QuotaStats:
    """A snapshot of a :class:`ByteQuota`.

    ``used``: bytes held now; ``peak``: the most held at once since the last
    :meth:`ByteQuota.reset_peak`; ``waits``: acquisitions that had to block;
    ``waited_seconds``: the time they blocked, summed; ``oversized``: elements larger than
    the limit, admitted alone.
    """

    limit: int
    used: int
    peak: int
    waits: int
    waited_seconds: float
    oversized: int


class ByteQuota:
    """A counting semaphore of bytes, shared by threads. Thread-safe.

    Contract:

    - :meth:`acquire` admits ``n`` bytes when they fit under the limit, or when nothing is
      held at all (an element larger than the whole quota is admitted alone, so it cannot
      deadlock). Waiters are admitted in arrival order, so a large element is not starved
      by a stream of small ones.
    - Every admitted byte must be given back with :meth:`release` exactly once, also when
      the work fails, or the quota shrinks for good.
    - A waiter that holds bytes itself must be able to give them back while it waits, or
      two such waiters can block each other forever: pass ``until`` (a cheap, lock-free
      check, e.g. "some of my work completed") and call :meth:`notify` when it may have
      become true; :meth:`acquire` then returns False so the caller can release and retry.
    """

    def __init__(self, limit: int = DEFAULT_QUOTA_BYTES) -> None:
        _check_limit(limit)
        self._limit = limit
        # the condition's lock, taken directly where nothing waits (a C-level `with`)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._used = 0
        self._peak = 0
        self._waits = 0
        self._waited = 0.0
        self._oversized = 0
        self._queue: deque[object] = deque()  # tickets of blocked acquirers, oldest first

    def __repr__(self) -> str:
        return f"ByteQuota(limit={self._limit}, used={self._used}, peak={self._peak})"

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def used(self) -> int:
        with self._cond:
            return self._used

    @property
    def waiting(self) -> int:
        """Acquirers blocked now, waiting for room."""
        with self._cond:
            return len(self._queue)

    def resize(self, limit: int) -> None:
        """Change the limit; bytes already held stay held, waiters re-check at once."""
        _check_limit(limit)
        with self._cond:
            self._limit = limit
            self._cond.notify_all()

    def _fits(self, n: int) -> bool:
        return self._used == 0 or self._used + n <= self._limit

    def _admit(self, n: int) -> None:
        if n > self._limit:
            self._oversized += 1
        self._used += n
        self._peak = max(self._peak, self._used)

    def try_acquire(self, n: int) -> bool:
        """Take ``n`` bytes if :meth:`acquire` would admit them at once (nobody waits and
        they fit); else take nothing and return False."""
        if n < 0:
            msg = f"try_acquire({n}): a size is 0 bytes or more"
            raise ValueError(msg)
        with self._lock:
            used = self._used
            if self._queue or not (used == 0 or used + n <= self._limit):
                return False
            if n > self._limit:
                self._oversized += 1
            used = self._used = used + n
            if used > self._peak:
                self._peak = used
            return True

    def acquire(
        self, n: int, *, timeout: float | None = None, until: Callable[[], bool] | None = None
    ) -> bool:
        """Take ``n`` bytes, blocking while they do not fit (see the class contract).

        Returns True once admitted; False, admitting nothing, when ``until()`` became true
        first (checked on every wake-up) or ``timeout`` seconds passed.
        """
        if n < 0:
            msg = f"acquire({n}): a size is 0 bytes or more"
            raise ValueError(msg)
        with self._cond:
            used = self._used
            if not self._queue and (used == 0 or used + n <= self._limit):
                # _admit, inline: the path of nearly every element
                if n > self._limit:
                    self._oversized += 1
                used = self._used = used + n
                if used > self._peak:
                    self._peak = used
                return True
            if until is not None and until():
                return False
            ticket = object()
            self._queue.append(ticket)
            self._waits += 1
            began = time.monotonic()
            deadline = None if timeout is None else began + timeout
            try:
                while True:
                    if self._queue[0] is ticket and self._fits(n):
                        self._admit(n)
                        return True
                    if until is not None and until():
                        return False
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._queue.remove(ticket)
                self._waited += time.monotonic() - began
                self._cond.notify_all()  # the next in line may fit now

    def take(self, n: int) -> None:
        """Take ``n`` bytes now, whether or not they fit: bytes that move from one holder
        to another (a sink writer keeping elements whose reader gives their bytes back
        right after), not new ones. Waiting acquirers wait the longer."""
        if n < 0:
            msg = f"take({n}): a size is 0 bytes or more"
            raise ValueError(msg)
        with self._lock:
            self._admit(n)

    def release(self, n: int) -> None:
        """Give back ``n`` bytes taken with :meth:`acquire` (or :meth:`take`)."""
        if n < 0:
            msg = f"release({n}): a size is 0 bytes or more"
            raise ValueError(msg)
        with self._lock:
            if n > self._used:
                msg = (
                    f"release({n}) with only {self._used} bytes held: release exactly what "
                    "acquire() admitted, once"
                )
                raise ValueError(msg)
            self._used -= n
            if self._queue:  # only a queued acquire waits on the condition
                self._cond.notify_all()

    def notify(self) -> None:
        """Wake every waiter so that it re-checks its ``until``."""
        with self._cond:
            self._cond.notify_all()

    def reset_peak(self) -> None:
        """Start the peak over from what is held now (benchmarks and tests)."""
        with self._cond:
            self._peak = self._used

    def stats(self) -> QuotaStats:
        with self._cond:
            return QuotaStats(
                limit=self._limit, used=self._used, peak=self._peak, waits=self._waits,
                waited_seconds=self._waited, oversized=self._oversized,
            )


def _check_limit(limit: int) -> None:
    if limit < 1:
        msg = f"a byte quota of {limit} bytes: use 1 or more (max_inflight_bytes)"
        raise ValueError(msg)


def quota_limit(max_inflight_bytes: int | None) -> int:
    """The quota a pipeline asks for: its ``max_inflight_bytes``, or when None this
    process's ``CDCFLOW_MAX_INFLIGHT_BYTES``, or :data:`DEFAULT_QUOTA_BYTES`."""
    if max_inflight_bytes is not None:
        return max_inflight_bytes
    text = os.environ.get(_ENV)
    if not text:
        return DEFAULT_QUOTA_BYTES
    try:
        limit = parse_size(text)
    except PipelineDefinitionError:
        limit = 0
    if limit < 1:
        msg = (f"{_ENV}={text!r}: set it to a size of 1 byte or more (e.g. 256MiB or "
               "268435456), or unset it for the default 256MiB")
        raise ConfigurationError(msg)
    return limit


_process: ByteQuota | None = None
_process_lock = threading.Lock()


def current_quota() -> ByteQuota | None:
    """This process's quota if a task made it (what metrics read live), else None."""
    return _process


def process_quota(limit: int | None = None) -> ByteQuota:
    """This process's quota, created on first use. ``limit`` resizes it (a task passes
    :func:`quota_limit` of its pipeline when it starts, so the last one to start sets it);
    None leaves it as it is (at first, ``quota_limit(None)``)."""
    global _process
    with _process_lock:
        if _process is None:
            _process = ByteQuota(quota_limit(limit))
        elif limit is not None and limit != _process.limit:
            _process.resize(limit)
        return _process
