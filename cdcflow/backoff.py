"""The one retry policy: capped exponential backoff with full jitter, bounded attempts.

Before retry ``n`` (1-based) a caller waits a uniform random time in
``[0, min(maximum, initial * multiplier ** (n - 1))]``. Full jitter spreads the retries of
many clients over the whole window instead of bunching them at its end, which is what
overloads a recovering server (see AWS's "Exponential Backoff And Jitter"). Attempts are
bounded (``attempts`` counts calls, the first one included) and so, optionally, is the
total time (``deadline`` seconds from the start of the first call).

Two ways to use a policy:

- :meth:`RetryPolicy.call` runs a function and retries it while a predicate says the
  error is worth it and the bounds allow, then re-raises the last error with a note.
- Loops that must keep their own structure (a stream reader that resumes where it
  stopped) ask :meth:`RetryPolicy.allows`, :meth:`RetryPolicy.delay` and
  :meth:`RetryPolicy.backoff`.

The engine's retries map onto it like this::

    # a batch whose tasks failed transiently: batch_retries retries, doubling from retry_backoff
    RetryPolicy(attempts=batch_retries + 1, initial=retry_backoff, maximum=math.inf)
    # an element under ErrorPolicy(retries, backoff, max_backoff)
    RetryPolicy(attempts=retries + 1, initial=backoff, maximum=max_backoff)

``sleep``, ``clock`` and ``rng`` are seams for tests: a test passes a list's ``append`` as
``sleep`` and a fake clock, and takes no real time. A policy is immutable, safe to share
between threads and picklable (it travels inside tasks).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import TypeVar

import attrs

from cdcflow.errors import CdcflowError

__all__ = ["RetryPolicy"]

_T = TypeVar("_T")


def _plural(n: int) -> str:
    return f"{n} attempt" if n == 1 else f"{n} attempts"


@attrs.frozen
class RetryPolicy:
    """Bounded, fully jittered, capped exponential backoff.

    ``attempts`` counts calls, so ``attempts=6`` allows at most five retries in a row;
    ``attempts=1`` never retries. ``maximum`` caps every delay (``math.inf``: no cap).
    ``deadline`` (seconds, None for none) bounds the time from the start of the first call:
    no retry starts, and no backoff sleeps, past it. ``sleep`` waits, ``clock`` is a
    monotonic clock in seconds, ``rng`` draws the jitter.
    """

    attempts: int = 6
    initial: float = 0.1
    maximum: float = 8.0
    multiplier: float = 2.0
    deadline: float | None = None
    sleep: Callable[[float], None] = attrs.field(default=time.sleep, eq=False, repr=False)
    clock: Callable[[], float] = attrs.field(default=time.monotonic, eq=False, repr=False)
    rng: random.Random = attrs.field(factory=random.Random, eq=False, repr=False)
    #: What the attempts are of, and the setting that bounds them, for the note on the
    #: error it re-raises (None: "the retry policy (attempts=N)").
    bounded_by: str | None = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.attempts < 1:
            msg = f"RetryPolicy(attempts={self.attempts}): use 1 or more (1 never retries)"
            raise ValueError(msg)
        # Written as "not (x >= 0)" so that NaN is refused too.
        if not (self.initial >= 0 and self.maximum >= 0 and self.multiplier >= 1):
            msg = (
                f"RetryPolicy(initial={self.initial}, maximum={self.maximum}, "
                f"multiplier={self.multiplier}): use initial and maximum >= 0 and "
                "multiplier >= 1"
            )
            raise ValueError(msg)
        if self.deadline is not None and not self.deadline >= 0:
            msg = f"RetryPolicy(deadline={self.deadline}): use seconds >= 0, or None for none"
            raise ValueError(msg)

    @property
    def retries(self) -> int:
        """The most retries a call gets: ``attempts - 1``."""
        return self.attempts - 1

    def cap(self, retry: int) -> float:
        """The longest wait before retry ``retry`` (1-based):
        ``min(maximum, initial * multiplier ** (retry - 1))``; never decreases with ``retry``."""
        if retry < 1:
            msg = f"RetryPolicy.cap({retry}): retries are numbered from 1"
            raise ValueError(msg)
        if self.initial == 0:
            return 0.0
        try:
            grown = self.initial * self.multiplier ** (retry - 1)
        except OverflowError:  # float ** int raises instead of giving inf
            grown = math.inf
        return min(self.maximum, grown)

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry ``retry`` (1-based): uniform in ``[0, cap(retry)]``."""
        cap = self.cap(retry)
        if cap == 0:
            return 0.0
        return min(cap, self.rng.uniform(0.0, cap))

    def backoff(self, retry: int) -> float:
        """Sleep :meth:`delay` ``(retry)`` seconds; return how long that was."""
        seconds = self.delay(retry)
        self.sleep(seconds)
        return seconds

    def allows(self, failed: int, elapsed: float = 0.0, delay: float = 0.0) -> bool:
        """True if, after ``failed`` calls failed in a row and ``elapsed`` seconds since the
        first of them began, another call may start after waiting ``delay`` seconds.

        If this returns False the caller must stop retrying and report the last error.
        """
        if failed >= self.attempts:
            return False
        return self.deadline is None or elapsed + delay <= self.deadline

    def call(
        self,
        fn: Callable[[], _T],
        *,
        retry_if: Callable[[BaseException], bool],
        on_retry: Callable[[int, BaseException, float], None] | None = None,
    ) -> _T:
        """``fn()``'s result, calling it again after an error while ``retry_if(error)`` is
        True and the attempt bound and the deadline allow.

        Before retry ``n`` (1-based), ``on_retry(n, error, delay)`` is called with the error
        of the failed call and the seconds about to be slept; an error it raises ends the
        loop. When the policy stops, the last error is re-raised as it is, with a note saying
        how many attempts were made and why they stopped (no note when the first call failed
        with an error ``retry_if`` refuses). Only ``Exception`` is caught: KeyboardInterrupt
        and SystemExit pass through at once.
        """
        started = self.clock()
        failed = 0
        while True:
            try:
                return fn()
            except Exception as exc:
                failed += 1
                if not retry_if(exc):
                    # (cdcflow's own refusals, a lease held or lost, say all there is)
                    if failed > 1 and not isinstance(exc, CdcflowError):
                        exc.add_note(
                            f"gave up after {_plural(failed)}: this error is not retryable"
                        )
                    raise
                if not self.allows(failed):
                    exc.add_note(
                        f"gave up after {_plural(failed)}, all that "
                        f"{self.bounded_by or f'the retry policy (attempts={self.attempts})'} "
                        "allows"
                    )
                    raise
                delay = self.delay(failed)
                elapsed = self.clock() - started
                if not self.allows(failed, elapsed, delay):
                    exc.add_note(
                        f"gave up after {_plural(failed)} in {elapsed:.3g}s: the next one would "
                        f"start past the retry policy's deadline of {self.deadline:g}s"
                    )
                    raise
                if on_retry is not None:
                    on_retry(failed, exc, delay)
                self.sleep(delay)
