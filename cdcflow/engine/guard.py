"""Whether this process's run of a pipeline may still act on the world.

The store fences every plan and commit of a run that lost its lease, but a side effect a
task makes (``Consume`` calling ``fn``) reaches no store. A :class:`RunGuard` stops those
in the process that runs the engine (the in-memory runner's tasks):

- the lease holds until a deadline on this process's monotonic clock, the start of its
  last renewal plus the lease's time to live; past it, another run may own the pipeline
  (a process paused past its lease, or a store that did not answer the renewals), so
  :meth:`RunGuard.check` raises :class:`~cdcflow.errors.LeaseExpiredError` (transient:
  the batch is retried once the lease is renewed);
- a lease found lost, or a run aborted (a second Ctrl-C), revokes the guard: every check
  raises that error from then on.

Tasks find the guard of their pipeline's run with :func:`guard_for`; in another process (a
Spark executor) there is none, and the check does nothing (docs/reliability.md).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cdcflow.errors import LeaseExpiredError, PipelineStopped

__all__ = ["RunGuard", "guard_for", "guarding", "stopping_for"]


class RunGuard:
    """See the module docstring. Thread-safe: checks read two attributes."""

    def __init__(self, pipeline: str, stopping: Callable[[], bool] = lambda: False) -> None:
        self.pipeline = pipeline
        #: True once the run was asked to stop (gracefully: after the current batch)
        self.stopping = stopping
        self._until = math.inf  # monotonic seconds
        self._ttl = 0.0
        self._revoked: BaseException | None = None

    def hold_until(self, deadline: float, ttl: float) -> None:
        """The lease holds until ``deadline`` (``time.monotonic()`` seconds)."""
        self._ttl = ttl
        self._until = deadline

    def revoke(self, error: BaseException) -> None:
        """From now on every check raises ``error`` (the first one given)."""
        if self._revoked is None:
            self._revoked = error

    def check(self) -> None:
        """Raise if this run may no longer act (see the module docstring)."""
        if self._revoked is not None:
            raise self._revoked
        late = time.monotonic() - self._until
        if late > 0:
            msg = (
                f"pipeline {self.pipeline!r}: this run's lease ran out {late:.1f}s ago (its "
                f"time to live is {self._ttl:g}s: the process was paused, or the store did "
                "not answer the renewals), so another run may own the pipeline; nothing "
                "more is done for this batch until the lease is renewed"
            )
            raise LeaseExpiredError(msg)


_GUARDS: dict[str, RunGuard] = {}
_LOCK = threading.Lock()


def _free() -> None:
    return None


def guard_for(pipeline: str) -> Callable[[], None]:
    """The check of this process's run of ``pipeline``, or one that does nothing."""
    guard = _GUARDS.get(pipeline)
    return _free if guard is None else guard.check


def _going_on() -> bool:
    return False


def stopping_for(pipeline: str) -> Callable[[], bool]:
    """Whether this process's run of ``pipeline`` was asked to stop (always False where the
    run is not in this process: a Spark executor)."""
    guard = _GUARDS.get(pipeline)
    return _going_on if guard is None else guard.stopping


@contextmanager
def guarding(guard: RunGuard) -> Iterator[RunGuard]:
    """Make ``guard`` the one tasks of its pipeline find in this process while the block
    runs; a failure (or abort) leaving the block revokes it first, so that tasks still
    running stop acting while the run winds down."""
    with _LOCK:
        previous = _GUARDS.get(guard.pipeline)
        _GUARDS[guard.pipeline] = guard
    try:
        yield guard
    except BaseException as exc:
        guard.revoke(PipelineStopped(
            f"pipeline {guard.pipeline!r}: the run is ending ({type(exc).__name__}); this "
            "task does nothing more, and the next run replays its batch"))
        raise
    finally:
        with _LOCK:
            if previous is None:
                _GUARDS.pop(guard.pipeline, None)
            else:
                _GUARDS[guard.pipeline] = previous
