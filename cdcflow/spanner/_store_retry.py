"""How the Spanner metadata store retries its operations (:class:`StoreRetries`).

Every operation runs under the store's :class:`~cdcflow.backoff.RetryPolicy` and none of
the client library's own retries. A failure being retried is logged at once and then every
30 s while failures go on (an outage would otherwise show only as stuck partitions), and
the store's recovery once. While the run using the store is stopping, a failure is not
retried: a stop during an outage ends the run instead of waiting out the policy's deadline.
Nor is a call that does not answer waited for (a stalled connection, until its
``call_timeout``): while a run uses the store, each attempt runs on a thread of its own,
and once the run is stopping the caller gives an attempt :data:`STOP_PATIENCE` seconds
more, then fails it. The attempt may still land; every store write is safe to repeat and
its outcome is read back by the next run, as after a crash.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import StoreError
from cdcflow.spanner import _store_schema as schema
from cdcflow.spanner.retry import status_name

__all__ = ["StoreRetries"]

_T = TypeVar("_T")
_log = logging.getLogger("cdcflow.spanner")
#: Seconds between two warnings of a store that keeps failing.
WARN_EVERY = 30.0
#: Seconds a call may go on after the run was asked to stop before it is given up.
STOP_PATIENCE = 2.0


def _abandonable(
    fn: Callable[[], _T], stopping: Callable[[], bool], given_up: str
) -> Callable[[], _T]:
    """``fn`` run on a thread of its own (with this thread's RPC deadline), waited for
    until it ends, or until ``STOP_PATIENCE`` seconds after ``stopping()`` turned True:
    then StoreError(``given_up``) (the thread goes on until its call's deadline)."""

    def attempt() -> _T:
        results: list[_T] = []
        errors: list[BaseException] = []
        done = threading.Event()
        shorter = schema.current_call_deadline()

        def run() -> None:
            try:
                if shorter is None:
                    results.append(fn())
                else:
                    with schema.call_deadline(shorter):
                        results.append(fn())
            except BaseException as exc:  # raised in the caller's thread
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="cdcflow-store-call", daemon=True).start()
        stopped_at: float | None = None
        while not done.wait(0.1):
            if stopped_at is None and stopping():
                stopped_at = time.monotonic()
            if stopped_at is not None and time.monotonic() - stopped_at > STOP_PATIENCE:
                raise StoreError(given_up)
        if errors:
            raise errors[0]
        return results[0]

    return attempt


def _text(exc: BaseException) -> str:
    cause = exc.error if isinstance(exc, schema.BrokenCall) else exc
    return str(getattr(cause, "message", None) or cause)


class StoreRetries:
    """The retries of one store (``url`` names it in messages); thread-safe."""

    def __init__(self, url: str) -> None:
        self.url = url
        #: transaction attempts Spanner aborted and that were retried
        self.aborted_attempts = 0
        self._stopping: Callable[[], bool] | None = None
        self._warned_at: float | None = None  # when a failure was last logged
        self._lock = threading.Lock()

    def set_stopping(self, stopping: Callable[[], bool] | None) -> None:
        """While ``stopping()`` is True, a failed operation is not tried again (None:
        always retry)."""
        self._stopping = stopping

    def call(
        self, policy: RetryPolicy, what: str, fn: Callable[[], _T], *,
        retry_if: Callable[[BaseException], bool] = schema.transient, fix: str = "",
        quiet_if: Callable[[BaseException], bool] = lambda exc: False,
    ) -> _T:
        """``fn()`` under ``policy``; an RPC error it gives up on becomes a StoreError
        saying ``what`` failed (and ``fix``, for permanent errors). StoreErrors (the
        contract's refusals) pass through at once; so do errors that are not RPC errors
        (bugs). A retry of an error ``quiet_if`` accepts is not warned about."""
        from google.api_core.exceptions import GoogleAPICallError

        failed = 1
        stopping = self._stopping

        def retried(retry: int, exc: BaseException, delay: float) -> None:
            nonlocal failed
            failed = retry + 1
            if status_name(exc) == "ABORTED":
                self.aborted_attempts += 1
            elif not quiet_if(exc):
                self._warn(policy, what, exc)

        def worth_it(exc: BaseException) -> bool:
            return retry_if(exc) and not (stopping is not None and stopping())

        if stopping is not None:  # (a StoreError is never retried)
            fn = _abandonable(fn, stopping, (
                f"the Spanner store {self.url}: {what} did not answer within "
                f"{STOP_PATIENCE:g}s of the stop request; given up (the next run reads what "
                "it left)"))
        try:
            result = policy.call(fn, retry_if=worth_it, on_retry=retried)
        except (GoogleAPICallError, schema.BrokenCall) as e:
            raise self._error(e, what, failed, retry_if, fix) from e
        if self._warned_at is not None:
            with self._lock:
                recovered, self._warned_at = self._warned_at is not None, None
            if recovered:
                _log.info("the Spanner store %s answers again", self.url)
        return result

    def _error(self, e: BaseException, what: str, failed: int,
               retry_if: Callable[[BaseException], bool], fix: str) -> StoreError:
        cause = e.error if isinstance(e, schema.BrokenCall) else e
        text = _text(e)
        where = f"the Spanner store {self.url}: {what}"
        if not retry_if(e):
            msg = f"{where} failed: {text}"
            return StoreError(f"{msg}; {fix}" if fix else msg)
        if status_name(e) == "ABORTED":
            return StoreError(
                f"{where} was aborted {failed} times in a row by concurrent transactions; "
                "make sure one run drives each pipeline, then retry"
            )
        attempts = "1 attempt" if failed == 1 else f"{failed} attempts"
        return StoreError(
            f"{where} kept failing after {attempts} "
            f"({status_name(cause) or type(cause).__name__}: {text}); check that "
            "Spanner is reachable and within its quota, then retry"
        )

    def _warn(self, policy: RetryPolicy, what: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            if self._warned_at is not None and now - self._warned_at < WARN_EVERY:
                return
            self._warned_at = now
        cause = exc.error if isinstance(exc, schema.BrokenCall) else exc
        # What bounds the retries: a failure that comes at once (a refused connection) runs
        # out of attempts long before the deadline.
        bounds = [f"{policy.attempts} attempts"]
        if policy.deadline is not None:
            bounds.append(f"{policy.deadline:.0f}s")
        _log.warning("the Spanner store %s: %s failed (%s: %.200s); retrying (at most %s)",
                     self.url, what, status_name(cause) or type(cause).__name__,
                     " ".join(_text(exc).split()), " or ".join(bounds))
