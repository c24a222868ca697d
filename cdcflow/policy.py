"""What happens when a user function or a sink raises."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.durations import parse_duration
from cdcflow.model import Timestamp
from cdcflow.transforms.base import Sink

__all__ = ["ErrorPolicy", "FailedElement"]


def _seconds(value: float | str) -> float:
    return parse_duration(value) if isinstance(value, str) else float(value)


@attrs.frozen
class ErrorPolicy:
    """Retry a failing element ``retries`` times with capped exponential backoff and full
    jitter (:meth:`retry_policy`: waits capped at ``backoff`` doubling up to ``max_backoff``),
    then ``"stop"`` (the batch is not committed; the run exits and resumes at that batch) or
    ``"skip"`` (the element goes to ``dead_letter`` if given, and the run goes on).

    Stopping never commits past the failed record.
    """

    retries: int = 3
    backoff: float = attrs.field(default=0.1, converter=_seconds)
    max_backoff: float = attrs.field(default=10.0, converter=_seconds)
    then: Literal["stop", "skip"] = "stop"
    dead_letter: Sink[Any, Any] | None = None

    def __attrs_post_init__(self) -> None:
        if self.retries < 0:
            msg = f"ErrorPolicy.retries must be >= 0, got {self.retries}"
            raise ValueError(msg)
        if self.then not in ("stop", "skip"):
            msg = f"ErrorPolicy.then must be 'stop' or 'skip', got {self.then!r}"
            raise ValueError(msg)
        if self.dead_letter is not None and self.then != "skip":
            msg = "ErrorPolicy.dead_letter needs then='skip' (stopped elements are not skipped)"
            raise ValueError(msg)

    def retry_policy(self) -> RetryPolicy:
        """The element retries as a :class:`~cdcflow.backoff.RetryPolicy`."""
        return RetryPolicy(
            attempts=self.retries + 1, initial=self.backoff, maximum=self.max_backoff
        )


@attrs.frozen
class FailedElement:
    """What a dead-letter sink receives for an element skipped by the error policy.

    ``label`` is the failing transform or sink; ``error`` its last exception as text;
    ``partition_token`` and ``commit_timestamp`` locate the change record the element
    came from; ``element`` is the input that failed.
    """

    label: str
    error: str
    partition_token: str
    commit_timestamp: Timestamp
    element: Any
