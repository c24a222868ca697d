"""Which Spanner errors are transient, and how long to wait before trying again.

Backoff is capped exponential with full jitter: before retry ``n`` (1-based) the reader
sleeps a uniform random time in ``[0, min(maximum, initial * multiplier ** (n - 1))]``.
Attempts are bounded; the stock client's own retry loops are never relied on (its
``ServiceUnavailable`` restart loop has neither a bound nor a delay).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import attrs

__all__ = ["RetryPolicy", "is_transient", "status_name"]

#: gRPC status codes worth retrying: the server may well answer next time.
TRANSIENT_CODES = frozenset({"UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})

#: INTERNAL errors that are really a broken HTTP/2 stream (what the stock client also resumes).
_RESUMABLE_INTERNAL = (
    "RST_STREAM",
    "Received unexpected EOS on DATA frame from server",
    "stream terminated by RST_STREAM",
    "Received RST_STREAM",
)


@attrs.frozen
class RetryPolicy:
    """Bounded, jittered exponential backoff.

    ``attempts`` counts calls, so ``attempts=6`` means at most five retries in a row
    without progress. ``sleep`` and ``rng`` are seams for tests.
    """

    attempts: int = 6
    initial: float = 0.1
    maximum: float = 8.0
    multiplier: float = 2.0
    sleep: Callable[[float], None] = attrs.field(default=time.sleep, eq=False, repr=False)
    rng: random.Random = attrs.field(factory=random.Random, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.attempts < 1:
            msg = f"RetryPolicy(attempts={self.attempts}): use 1 or more"
            raise ValueError(msg)
        if self.initial < 0 or self.maximum < 0 or self.multiplier < 1:
            msg = "RetryPolicy: initial and maximum must be >= 0 and multiplier >= 1"
            raise ValueError(msg)

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1-based): full jitter."""
        cap = min(self.maximum, self.initial * self.multiplier ** (retry - 1))
        return self.rng.uniform(0.0, cap)

    def backoff(self, retry: int) -> None:
        self.sleep(self.delay(retry))


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
