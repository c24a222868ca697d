"""The error policy and its decisions; import them from :mod:`cdcflow.policy` (or ``cdcflow``).

They are defined here, at the transforms layer, because sinks that call user code
(:class:`~cdcflow.transforms.consume.Consume`) take a policy of their own, and transforms
may not import the modules above them (``make lint`` checks the layers).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.durations import parse_duration
from cdcflow.errors import PipelineStopped, describe
from cdcflow.transforms.base import Sink
from cdcflow.transforms.core import callable_name

__all__ = ["Decision", "ErrorHandler", "ErrorPolicy", "Retry", "Skip", "Stop"]


def _to_seconds(value: Any, owner: str) -> float:
    """Seconds from a number or a duration such as ``"250ms"``; an error names the
    argument (``owner``, e.g. ``"ErrorPolicy(backoff=...)"``)."""
    where = owner.replace("...", repr(value))
    if isinstance(value, bool):
        msg = f"{where}: {value} is not a time: use seconds or a duration such as '250ms'"
        raise TypeError(msg)
    try:
        return parse_duration(value) if isinstance(value, str) else float(value)
    except (TypeError, ValueError) as exc:
        text = str(exc) if isinstance(value, str) else "use seconds or a duration such as '250ms'"
        raise ValueError(f"{where}: {text}") from None


# the converters, named (what attrs' typing takes)
def _after_seconds(value: Any) -> float:
    return _to_seconds(value, "Retry(after=...)")


def _backoff_seconds(value: Any) -> float:
    return _to_seconds(value, "ErrorPolicy(backoff=...)")


def _max_backoff_seconds(value: Any) -> float:
    return _to_seconds(value, "ErrorPolicy(max_backoff=...)")


@attrs.frozen
class Retry:
    """Call again with the same element after ``after`` seconds (a number, or a duration
    such as ``"250ms"``). The element's later elements wait: nothing passes it."""

    after: float = attrs.field(default=0.0, converter=_after_seconds)

    def __attrs_post_init__(self) -> None:
        # Written as "not (x >= 0)" so that NaN is refused too.
        if not (self.after >= 0 and math.isfinite(self.after)):
            msg = f"Retry(after={self.after}): use a finite number of seconds >= 0"
            raise ValueError(msg)


@attrs.frozen
class Skip:
    """Give the element up and go on: it goes to the dead-letter sink, if there is one."""


@attrs.frozen
class Stop:
    """Stop the run: the batch is not committed (nothing past the failed element is), the
    run ends with :class:`~cdcflow.errors.PipelineStopped`, and the next run resumes there."""


#: What an :class:`ErrorPolicy` decides about one failure.
Decision: TypeAlias = Retry | Skip | Stop

#: ``handler(error, element, partition_token, attempt) -> Decision``: ``error`` is the
#: exception the call raised, ``element`` its input, ``partition_token`` the partition of
#: the change record the element came from, ``attempt`` how many calls with this element
#: failed so far (1 at the first failure).
ErrorHandler: TypeAlias = Callable[[Exception, Any, str, int], Decision]


@attrs.frozen
class ErrorPolicy:
    """What happens when a user function or a sink raises on an element.

    Without a ``handler``: retry the element ``retries`` times with capped exponential
    backoff and full jitter (:meth:`retry_policy`: waits capped at ``backoff`` doubling up
    to ``max_backoff``), then ``"stop"`` (the batch is not committed; the run exits and
    resumes at that batch) or ``"skip"`` (the element goes to ``dead_letter`` if given, and
    the run goes on).

    With a ``handler`` (see :data:`ErrorHandler`), every failure is decided by calling it:
    :class:`Retry` ``(after=seconds)``, :class:`Skip` ``()`` or :class:`Stop` ``()``;
    ``retries``, ``backoff``, ``max_backoff`` and ``then`` are not used. A handler runs
    where the task runs (pickled with it), possibly on several threads at once; one that
    raises fails the task, and the batch is replayed by the next run. A handler that keeps
    answering Retry retries for ever.

    Stopping never commits past the failed record. ``dead_letter`` receives every element
    given up: by ``then="skip"``, a handler's :class:`Skip`, or a ``Consume`` whose own
    ``on_error`` skips (so a pipeline may stop on its functions' errors and still keep what
    its consumer skips).
    """

    retries: int = 3
    backoff: float = attrs.field(default=0.1, converter=_backoff_seconds)
    max_backoff: float = attrs.field(default=10.0, converter=_max_backoff_seconds)
    then: Literal["stop", "skip"] = "stop"
    dead_letter: Sink[Any, Any] | None = None
    handler: ErrorHandler | None = None

    def __attrs_post_init__(self) -> None:
        retries = self.retries
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            msg = f"ErrorPolicy(retries={retries!r}): use a whole number >= 0"
            raise ValueError(msg)
        for name, seconds in (("backoff", self.backoff), ("max_backoff", self.max_backoff)):
            if not (seconds >= 0 and math.isfinite(seconds)):  # NaN is refused too
                msg = f"ErrorPolicy({name}={seconds}): use a finite number of seconds >= 0"
                raise ValueError(msg)
        if self.then not in ("stop", "skip"):
            msg = f"ErrorPolicy.then must be 'stop' or 'skip', got {self.then!r}"
            raise ValueError(msg)
        if self.handler is not None and not callable(self.handler):
            msg = (
                f"ErrorPolicy.handler must be a function (error, element, partition_token, "
                f"attempt) -> Retry | Skip | Stop, got {self.handler!r}"
            )
            raise TypeError(msg)
        if self.dead_letter is not None and not isinstance(self.dead_letter, Sink):
            msg = (f"ErrorPolicy(dead_letter={self.dead_letter!r}): pass a sink, e.g. "
                   "dead_letter=cf.WriteFiles('dead')")
            raise TypeError(msg)

    def retry_policy(self) -> RetryPolicy:
        """The element retries as a :class:`~cdcflow.backoff.RetryPolicy`."""
        return RetryPolicy(
            attempts=self.retries + 1, initial=self.backoff, maximum=self.max_backoff
        )

    def decide(
        self, error: Exception, element: Any, partition_token: str, attempt: int
    ) -> Decision:
        """The decision about the ``attempt``-th failed call (1-based) with ``element``.

        The handler's answer when there is a handler (TypeError if it is not a Decision);
        otherwise Retry after a jittered backoff while ``attempt <= retries``, then Stop or
        Skip as ``then`` says. The caller must sleep ``Retry.after`` seconds and call again,
        or give the element up (Skip), or stop and commit nothing past it (Stop).
        """
        if attempt < 1:
            msg = f"ErrorPolicy.decide(attempt={attempt}): attempts are numbered from 1"
            raise ValueError(msg)
        if self.handler is None:
            if attempt <= self.retries:
                return Retry(self.retry_policy().delay(attempt))
            return Skip() if self.then == "skip" else Stop()
        try:
            decision = self.handler(error, element, partition_token, attempt)
        except Exception as exc:
            msg = (
                f"the ErrorPolicy handler {callable_name(self.handler)} raised "
                f"{describe(exc)} deciding about {describe(error)} "
                f"(partition {partition_token}, attempt {attempt}); nothing past that element "
                "was committed: fix the handler and run again"
            )
            raise PipelineStopped(msg) from exc
        if not isinstance(decision, Retry | Skip | Stop):
            # a fault of the handler found while the pipeline runs, as one it raises: the
            # run stops on an error (exit 1), not on bad input
            msg = (
                f"the ErrorPolicy handler {callable_name(self.handler)} returned {decision!r} "
                f"for {type(error).__name__} (partition {partition_token}, attempt "
                f"{attempt}); nothing past that element was committed: return "
                "Retry(after=seconds), Skip() or Stop(), and run again"
            )
            raise PipelineStopped(msg)
        return decision
