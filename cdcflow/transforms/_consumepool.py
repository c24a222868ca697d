"""The writer of a Consume sink: one task's pool of threads calling ``fn`` with keyed
concurrency (``consume`` has the sink and its contract).

- ``write`` hands the element to a pool of up to ``max_inflight`` threads, created on the
  first element in the process that runs the task (a Spark executor's Python worker on
  Spark). Calls for one ``key(element)`` run one after another in arrival order; calls for
  different keys run concurrently. ``write`` blocks while ``max_inflight`` elements are in
  flight and ``4 * max_inflight`` more wait (backpressure on the reader). The elements it
  keeps stay charged to the process's byte quota until they are acked or skipped, so
  reading also blocks while they hold the quota, whatever their size.
- ``fn`` returning acks the element; raising nacks it, and the writer's
  :class:`~cdcflow.policy.ErrorPolicy` (``on_error``, else the pipeline's) decides: retry
  after a delay (the key's later elements wait; the element waits apart, holding no
  thread), skip (counted, logged, reported in the commit message, and handed to the
  pipeline's dead-letter sink if it has one), or stop (the task fails with
  PipelineStopped; nothing of the batch commits).
- ``close`` waits until every element is acked or skipped, then returns a small
  :class:`Consumed` message. A batch commits only when all its tasks did, so progress
  never passes an element whose call has not returned.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import attrs

from cdcflow.errors import (
    PipelineDefinitionError,
    PipelineStopped,
    SinkError,
    WriterFailed,
    WriterStopped,
)
from cdcflow.sizes import element_size
from cdcflow.transforms._policy import ErrorPolicy, Retry, Skip
from cdcflow.transforms.base import WriterContext

__all__ = ["ConsumeWriter", "Consumed"]

E = TypeVar("E")

_log = logging.getLogger("cdcflow.consume")

#: Elements that may wait per thread of the pool, on top of those in flight.
_QUEUE_PER_THREAD = 4
#: Skipped elements whose error a commit message carries as text (the count is exact).
_MAX_ERRORS = 10


@attrs.frozen
class Consumed:
    """What a Consume writer did for one task (its commit message), or, summed, what
    :meth:`Consume.stats` reports for the committed batches.

    ``elements``: taken by ``write``; ``acked``: ``fn`` returned; ``skipped``: given up by the
    error policy; ``calls``: calls of ``fn`` (retries included); ``retries``: calls the policy
    asked for again; ``timeouts``: calls that ran past ``timeout``. ``errors``: the errors of
    the first skipped elements, as text (at most 10).
    """

    elements: int = 0
    acked: int = 0
    skipped: int = 0
    calls: int = 0
    retries: int = 0
    timeouts: int = 0
    errors: tuple[str, ...] = ()

    def __add__(self, other: Consumed) -> Consumed:
        return Consumed(
            elements=self.elements + other.elements,
            acked=self.acked + other.acked,
            skipped=self.skipped + other.skipped,
            calls=self.calls + other.calls,
            retries=self.retries + other.retries,
            timeouts=self.timeouts + other.timeouts,
            errors=(self.errors + other.errors)[:_MAX_ERRORS],
        )


class _Call:
    """One element on its way through ``fn``."""

    __slots__ = ("element", "failures", "key", "retried", "size")

    def __init__(self, element: Any, key: Hashable, size: int) -> None:
        self.element = element
        self.key = key
        self.failures = 0
        self.retried = False  # a Retry decision came for it (counted in _retrying)
        self.size = size  # bytes held against the quota (WriterContext.hold)


class _Worker:
    """A pool thread and the call it runs (if any)."""

    __slots__ = ("abandoned", "call", "deadline", "starting", "thread")

    def __init__(self) -> None:
        self.starting = True  # counted as idle until it first looks for a key
        self.call: _Call | None = None
        self.deadline: float | None = None
        self.abandoned = False
        self.thread: threading.Thread | None = None


class _Unique:
    """The key of an element when Consume has no ``key``: equal to nothing else."""

    __slots__ = ()


class ConsumeWriter(Generic[E]):
    """One task's pool: keyed queues, worker threads, a watchdog when there is a timeout.

    Invariants (under ``_lock``): a key is in ``_queues`` while it has waiting calls or a
    call running; it is in ``_ready`` (once) when it has waiting calls, none running and
    its first call is due; in ``_delayed`` (once) when its first call waits out a Retry's
    delay; ``_pending`` counts the calls taken and neither acked nor skipped.
    """

    def __init__(self, fn: Callable[[E], object], key: Callable[[E], Hashable] | None,
                 max_inflight: int, timeout: float | None, drain_timeout: float,
                 on_error: ErrorPolicy | None, ctx: WriterContext) -> None:
        self._fn = fn
        self._key = key
        self._size = max_inflight
        self._capacity = max_inflight * (1 + _QUEUE_PER_THREAD)
        self._timeout = timeout
        self._drain_timeout = drain_timeout
        # how long the writer waits without a call finishing: drain_timeout, and at least
        # a call's timeout (a call may take that long; past it, the watchdog ends it)
        self._quiet = (drain_timeout if timeout is None
                       else max(drain_timeout, timeout + 1.0))
        self._stopping = ctx.stopping
        self._retrying = 0  # pending calls the policy said to retry (once each)
        self._policy: ErrorPolicy = (on_error or ctx.error_policy or ErrorPolicy())
        self._keep_skipped = ctx.dead_letter
        self._skipped: list[tuple[Any, str]] = []  # (element, error) for the dead letter
        self._label = ctx.sink_label
        self._token = ctx.partition_token
        self._guard = ctx.guard
        self._hold = ctx.hold
        self._holding_back = ctx.holding_back
        self._let_go = ctx.let_go
        self._held = 0  # bytes of the calls taken and not done, held against the quota
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a key became ready, or the end
        self._room = threading.Condition(self._lock)  # a call was acked/skipped, or the end
        self._ending = threading.Condition(self._lock)  # the end only (the watchdog)
        self._queues: dict[Hashable, deque[_Call]] = {}
        self._ready: deque[Hashable] = deque()
        # (due, n, key): keys whose first call waits out a Retry's delay, soonest first
        self._delayed: list[tuple[float, int, Hashable]] = []
        self._delays = itertools.count()
        self._pending = 0
        self._workers: list[_Worker] = []
        self._idle = 0  # workers waiting in _next for a key, or starting
        self._abandoned: list[_Worker] = []
        self._started = False
        self._ended = False
        self._failure: BaseException | None = None
        self._counts = dict.fromkeys(
            ("elements", "acked", "skipped", "calls", "retries", "timeouts"), 0
        )
        self._errors: list[str] = []

    # -- the task's thread ----------------------------------------------------------------------

    def write(self, element: E) -> None:
        key: Hashable = _Unique() if self._key is None else self._key(element)
        try:
            hash(key)
        except TypeError:
            msg = (
                f"Consume key returned {key!r}, which is not hashable; return a str, an int "
                "or a tuple"
            )
            raise TypeError(msg) from None
        if not self._started:
            self._start()
        size = element_size(element)
        with self._lock:
            if not self._wait(lambda: self._pending < self._capacity or self._ended):
                msg = (
                    f"Consume {self._label!r}: no call finished for {self._quiet:g}s "
                    f"while the pool and queue of partition {self._token} were full "
                    f"({self._running()} call(s) running, {self._pending} element(s) waiting); "
                    "the task fails, and a replay of the batch calls fn again for its "
                    "elements. "
                    "Find why fn hangs, or bound each call with timeout="
                )
                self._fail(WriterFailed(msg))
            if self._failure is not None:
                raise self._failure
            if self._ended:
                msg = "Consume writer written after close() or abort(); open a new writer"
                raise SinkError(msg)
            call = _Call(element, key, size)
            self._hold(size)
            self._held += size
            queue = self._queues.get(key)
            if queue is None:
                self._queues[key] = deque((call,))
                self._ready.append(key)
                self._work.notify()
                self._grow()
            else:
                queue.append(call)  # picked up when the key's running call ends
            self._pending += 1
            self._counts["elements"] += 1

    def close(self) -> Consumed | None:
        """Wait until every element is acked or skipped; its counts. Raises what stopped
        the writer (PipelineStopped, the handler's error), or SinkError past
        ``drain_timeout`` (the batch is replayed)."""
        if not self._started:
            return None
        with self._lock:
            done = self._wait(lambda: self._pending == 0 or self._failure is not None)
            if not done:
                msg = (
                    f"Consume {self._label!r}: {self._pending} element(s) of partition "
                    f"{self._token} not acknowledged at the task's end: no call finished for "
                    f"{self._quiet:g}s ({self._running()} call(s) still running); the "
                    "task fails, and a replay of the batch calls fn again for its elements. "
                    "Find why fn hangs, raise drain_timeout"
                    + ("" if self._timeout is not None else
                       ", or bound each call with timeout=")
                )
                self._fail(WriterFailed(msg))
            self._end()
            failure = self._failure
        self._join()
        if failure is not None:
            raise failure
        c = self._counts
        return Consumed(
            elements=c["elements"], acked=c["acked"], skipped=c["skipped"], calls=c["calls"],
            retries=c["retries"], timeouts=c["timeouts"], errors=tuple(self._errors),
        )

    def dead_letters(self) -> list[tuple[Any, str]]:
        """The elements skipped by the error policy, with their errors as text, when the
        pipeline has a dead-letter sink (the engine writes them there at the task's end)."""
        return list(self._skipped)

    def policy_counters(self) -> dict[str, int]:
        """What the error policy did in this task (the engine adds it to the task's
        counters: the run summary, ``status`` and the metrics count Consume's skips and
        retries with the pipeline's)."""
        return {"skipped": self._counts["skipped"], "retries": self._counts["retries"]}

    def abort(self) -> None:
        """Drop the waiting elements; wait for the running calls (at most ``timeout``, or
        ``drain_timeout`` without one), so that a replay does not overlap them; not when
        the run is ending (its guard revoked: no replay in this process follows)."""
        if not self._started:
            return
        with self._lock:
            self._end()
            self._ready.clear()
            self._delayed.clear()
        wait = self._drain_timeout if self._timeout is None else self._timeout
        try:
            self._guard()
        except BaseException:
            wait = 0.0
        self._join(min(wait, self._drain_timeout))

    def _running(self) -> int:
        """Calls running now (under the lock)."""
        return sum(1 for w in self._workers if w.call is not None)

    def _progress(self) -> int:
        """Calls that finished: acked, skipped, or failed and to be retried."""
        c = self._counts
        return c["acked"] + c["skipped"] + c["retries"]

    def _wait(self, ready: Callable[[], bool]) -> bool:
        """Wait (under the lock) until ``ready()``, or ``drain_timeout`` seconds without any
        call finishing, not counting the time an element waits out a Retry's delay; False
        then. Checks the run's guard every half second: once the run may no longer act, the
        writer fails with the guard's error (``ready`` then holds: the writer has ended);
        and once the run was asked to stop while calls are being retried, it gives the
        batch up (WriterStopped: the next run replays it) rather than retry on."""
        if ready():
            return True
        self._holding_back(True)
        try:
            return self._wait_until(ready)
        finally:
            self._holding_back(False)

    def _wait_until(self, ready: Callable[[], bool]) -> bool:
        deadline = time.monotonic() + self._quiet
        progress = self._progress()
        while not ready():
            now = time.monotonic()
            if self._progress() != progress:
                progress = self._progress()
                deadline = now + self._quiet
            if self._delayed:  # a retry's delay is not time without progress
                deadline = max(deadline, self._delayed[0][0] + self._quiet)
            if now >= deadline:
                return False
            self._room.wait(min(0.5, deadline - now))
            try:
                self._guard()
            except BaseException as exc:
                self._fail(exc)
            if self._retrying and not self._ended and self._stopping():
                self._fail(WriterStopped(
                    f"Consume {self._label!r}: the run was asked to stop while "
                    f"{self._retrying} element(s) of partition {self._token} were being "
                    "retried; the batch is given up and the next run replays it"))
        return True

    # -- the pool ---------------------------------------------------------------------------

    def _start(self) -> None:
        # Workers start as keys become due (_grow), up to max_inflight: a task with a few
        # elements starts a few threads, however large the pool may grow.
        self._started = True
        if self._timeout is not None:
            threading.Thread(
                target=self._watch, name=f"cdcflow-consume-watchdog-{self._label}", daemon=True
            ).start()

    def _grow(self) -> None:
        """Start a worker (under the lock) when more keys are due than workers wait for
        one, or a key waits out a Retry's delay with no worker waiting to take it when it
        is due; never more than ``max_inflight``."""
        wanted = len(self._ready) + (1 if self._delayed else 0)
        if wanted > self._idle and len(self._workers) < self._size and not self._ended:
            self._spawn()

    def _spawn(self) -> None:
        """Start a worker thread (under the lock)."""
        worker = _Worker()
        self._idle += 1
        # Daemon threads: an abandoned call must not keep the process (a Spark worker) alive.
        worker.thread = threading.Thread(
            target=self._run, args=(worker,), name=f"cdcflow-consume-{self._label}", daemon=True
        )
        self._workers.append(worker)
        worker.thread.start()

    def _next(self, worker: _Worker) -> Hashable | None:
        """Wait (under the lock) for a key whose first call is due: that key, or None once
        the writer ended. A key waiting out a Retry's delay holds no thread: it is due
        again at the end of the delay (nothing of its key passes it)."""
        if worker.starting:
            worker.starting = False
            self._idle -= 1
        while not self._ended:
            delayed = self._delayed
            now = time.monotonic()
            while delayed and delayed[0][0] <= now:
                self._ready.appendleft(heapq.heappop(delayed)[2])
            if self._ready:
                key = self._ready.popleft()
                self._grow()  # the keys still due, and a delay, want workers of their own
                return key
            self._idle += 1
            try:
                self._work.wait(delayed[0][0] - now if delayed else None)
            finally:
                self._idle -= 1
        return None

    def _run(self, worker: _Worker) -> None:
        while True:
            with self._lock:
                key = self._next(worker)
                if key is None:
                    return
                call = self._queues[key].popleft()
                worker.call = call
                try:
                    self._guard()  # the run may still act: its lease holds, not aborted
                except BaseException as exc:
                    self._fail(exc)
                    return
                if self._timeout is not None:
                    worker.deadline = time.monotonic() + self._timeout
                self._counts["calls"] += 1
            if not self._call(worker, call):
                return
            # the element left the quota once acked: this thread must not keep it alive
            # while it waits for the next call
            del call

    def _call(self, worker: _Worker, call: _Call) -> bool:
        """Call ``fn`` on ``call``'s element and ack or nack it; False: the thread ends."""
        error: Exception | None = None
        try:
            result = self._fn(call.element)
            if inspect.isawaitable(result) or inspect.isgenerator(result):
                self._not_called(worker, result)
                return False
        except Exception as exc:
            error = exc
        except BaseException as exc:  # SystemExit, KeyboardInterrupt: stop the run
            with self._lock:
                if not worker.abandoned:
                    msg = (
                        f"Consume {self._label!r}: fn raised {type(exc).__name__}"
                        f"({exc}) on an element of partition {self._token}; a function "
                        "Consume calls may not end the process: raise an exception (the "
                        "error policy decides) instead. Nothing of this batch was "
                        "committed; the next run calls fn again for its elements"
                    )
                    stopped = PipelineStopped(msg)
                    stopped.__cause__ = exc
                    self._fail(stopped)
            return False
        with self._lock:
            if worker.abandoned:
                return False  # the watchdog gave this call up and decided about its element
            worker.call = worker.deadline = None
            if error is None:
                self._counts["acked"] += 1
                self._finish(call)
                return True
        self._nack(call, error)
        return True

    def _not_called(self, worker: _Worker, result: Any) -> None:
        """``fn`` returned an awaitable or a generator: its body did not run. Fail the run
        with the fix (a definition error: a retry would do nothing either)."""
        close = getattr(result, "close", None)
        if close is not None:
            close()  # no "never awaited" warning besides our error
        msg = (
            f"Consume {self._label!r}: fn returned {type(result).__name__} {result!r:.60}, "
            "so its work did not run; Consume calls fn on threads and needs a plain "
            "function: e.g. lambda r: asyncio.run(send(r)) for an async one"
        )
        with self._lock:
            if not worker.abandoned:
                self._fail(PipelineDefinitionError(msg))

    def _finish(self, call: _Call) -> None:
        """``call``'s element is acked or skipped: release its key and its bytes (under the
        lock; once the writer ended, ``_end`` gave every byte back)."""
        self._pending -= 1
        if call.retried:
            self._retrying -= 1
        if not self._ended:
            self._held -= call.size
            self._let_go(call.size)
        queue = self._queues[call.key]
        if queue:
            self._ready.append(call.key)  # the worker that finished takes it, or another
            self._work.notify()
        else:
            del self._queues[call.key]
        self._room.notify_all()

    def _nack(self, call: _Call, error: Exception) -> None:
        """Ask the policy about a failed call (not under the lock: the handler is user code)."""
        call.failures += 1
        try:
            decision = self._policy.decide(error, call.element, self._token, call.failures)
        except BaseException as exc:
            with self._lock:
                self._fail(exc)
            return
        where = (
            f"Consume {self._label!r} failed on an element of partition {self._token} after "
            f"{call.failures} attempt(s): {type(error).__name__}: {error}"
        )
        with self._lock:
            if self._ended:
                return
            if isinstance(decision, Retry):
                self._counts["retries"] += 1
                if not call.retried:
                    call.retried = True
                    self._retrying += 1
                self._queues[call.key].appendleft(call)  # first in line: its key waits
                if decision.after > 0:
                    due = time.monotonic() + decision.after
                    heapq.heappush(self._delayed, (due, next(self._delays), call.key))
                else:
                    self._ready.appendleft(call.key)
                self._work.notify()  # the worker back in _next takes it (or waits for it)
                self._room.notify_all()  # progress, for the drain deadline
                return
            if isinstance(decision, Skip):
                self._counts["skipped"] += 1
                text = f"{type(error).__name__}: {error}"
                if len(self._errors) < _MAX_ERRORS:
                    self._errors.append(text)
                if self._keep_skipped:
                    self._skipped.append((call.element, text))
                self._finish(call)
            else:
                msg = (
                    f"{where}. Nothing of this batch was committed; fix the cause and run "
                    "again to resume (fn is called again for the batch's elements), or skip "
                    "such elements with ErrorPolicy(then='skip') (Consume's on_error, or the "
                    "pipeline's error_policy)"
                )
                stopped = PipelineStopped(msg)
                stopped.__cause__ = error
                self._fail(stopped)
                return
        _log.warning("skipped an element: %s", where)

    def _watch(self) -> None:
        """Give up calls running past the timeout: abandon their thread, start another."""
        assert self._timeout is not None
        limit = 4 * self._size + 4
        while True:
            with self._lock:
                if self._ended:
                    return
                now = time.monotonic()
                overdue = [w for w in self._workers if w.deadline is not None and w.deadline <= now]
                if not overdue:
                    deadlines = [w.deadline for w in self._workers if w.deadline is not None]
                    self._ending.wait(min(deadlines, default=now + self._timeout) - now)
                    continue
                for worker in overdue:
                    worker.abandoned = True
                    self._workers.remove(worker)
                    self._abandoned.append(worker)
                    self._counts["timeouts"] += 1
                    self._spawn()
                self._abandoned = [
                    w for w in self._abandoned if w.thread is not None and w.thread.is_alive()
                ]
                if len(self._abandoned) > limit:
                    msg = (
                        f"Consume {self._label!r}: {len(self._abandoned)} calls are stuck past "
                        f"timeout={self._timeout:g}s; the task fails, and a replay of the "
                        "batch calls fn again. Find why fn hangs, or raise timeout"
                    )
                    self._fail(WriterFailed(msg))
                    return
            for worker in overdue:
                assert worker.call is not None
                error = TimeoutError(f"the call did not return within {self._timeout:g}s")
                self._nack(worker.call, error)

    # -- the end ----------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        """Remember the first error that ends the writer, and end it (under the lock)."""
        if self._failure is None:
            self._failure = error
        self._end()

    def _end(self) -> None:
        """Workers stop taking calls; waiting ones give up; the bytes of every call taken
        go back to the quota (under the lock)."""
        self._ended = True
        held, self._held = self._held, 0
        if held:
            self._let_go(held)
        self._work.notify_all()
        self._room.notify_all()
        self._ending.notify_all()

    def _join(self, timeout: float = 1.0) -> None:
        """Wait for the pool's threads; idle ones exit at once, running calls take time."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [w.thread for w in self._workers if w.thread is not None]
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
