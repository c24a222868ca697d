"""Consume: a sink for side effects, calling a function on every element with keyed concurrency.

::

    def notify(r: cf.DataChangeRecord) -> None:
        requests.post(URL, json=..., headers={"Idempotency-Key": idempotency_key(r)})

    pipeline | ... | Consume(notify, max_inflight=16, key=lambda r: r.mods[0].keys["id"])

A task's writer (``_consumepool``) runs the calls: a pool of up to ``max_inflight``
threads per task, one key's calls one after another, backpressure on the reader, the
error policy's decisions, and a ``close`` that waits until every element is acked or
skipped, so progress never passes an element whose call has not returned.

Delivery is at least once: a replayed batch (after a crash, a failed task, a timeout) calls
``fn`` again for its elements, also those that succeeded before, and so does a batch read
ahead while the failed one committed (pipelined batches: it is read again). Make the side effect
idempotent, keyed by what identifies a change: :func:`idempotency_key`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

from cdcflow.durations import positive_seconds
from cdcflow.errors import PipelineDefinitionError
from cdcflow.model import DataChangeRecord
from cdcflow.transforms._consumepool import Consumed, ConsumeWriter
from cdcflow.transforms._policy import ErrorPolicy
from cdcflow.transforms.base import Sink, SinkWriter, WriterContext
from cdcflow.transforms.core import callable_name, function_kind

__all__ = ["Consume", "Consumed", "idempotency_key"]

E = TypeVar("E")

_log = logging.getLogger("cdcflow.consume")

def idempotency_key(record: DataChangeRecord, mod: int | None = None) -> str:
    """A text identifying ``record`` across replays: its commit timestamp (ns), server
    transaction id and record sequence; with ``mod``, one row of it (``record.mods[mod]``:
    a record holds every row its transaction changed in one table, and they share the
    record's key). A replayed batch gives the same keys, so a side effect keyed by it (an
    upsert, an Idempotency-Key header) is not repeated."""
    key = f"{record.commit_timestamp.ns}/{record.server_transaction_id}/{record.record_sequence}"
    return key if mod is None else f"{key}/{mod}"


class _Totals:
    """The driver's counts, shared by a Consume and its labelled copies."""

    def __init__(self) -> None:
        self.batches: set[tuple[str | None, int]] = set()  # (label, batch id) committed
        self.consumed = Consumed()


class Consume(Sink[E, Consumed]):
    """Calls ``fn(element)`` for every element, for its side effects (see the module doc).

    ``max_inflight``: calls that may run at once in one task. ``key``: elements with equal
    ``key(element)`` (hashable) are never called at once and are called in arrival order;
    without a key, elements run in any order when ``max_inflight > 1``. In an
    IMMUTABLE_KEY_RANGE stream a key's changes within a batch come from one partition, and
    a batch starts after the previous one committed, so per-key order holds across tasks
    and batches too (replays aside). In a MUTABLE_KEY_RANGE stream a key can move between
    two partitions read in one batch: its changes from the two are then called by two
    tasks, possibly at once and out of order (across batches order holds); there, make
    ``fn`` order-proof, e.g. by writing only if the change's commit timestamp is newer
    than what the target holds.

    ``timeout`` (seconds or a duration, None: no bound): a call still running past it is a
    failure. A thread cannot be killed: the stuck call is abandoned (it runs on in the
    background, its result ignored), a fresh thread takes its place in the pool, and the
    policy decides about the element, so a retry may start while the stuck call still runs.
    More than ``4 * max_inflight + 4`` abandoned calls alive at once fail the task.

    ``drain_timeout``: how long ``close`` (the task's end) and ``write`` (a full pool and
    queue: a call that hangs holds its key's later elements in the queue) wait without any
    call finishing (with a ``timeout``, at least that plus a second: a call may take that
    long); the time elements wait out a Retry's delay does not count. Past it the
    task fails with SinkError: the batch is not committed and is replayed (by Spark's task
    retry, or by the next run), calling ``fn`` again for all its elements. While it waits,
    the task also stops once the run may no longer act (its guard: a second Ctrl-C, a lost
    lease), and once the run was asked to stop (a signal, ``--for``) while elements are
    being retried: the batch is given up then, and the next run replays it. (A Spark
    executor sees neither the guard nor the stop: there a second signal aborts the run.)

    ``on_error``: the :class:`~cdcflow.policy.ErrorPolicy` for failed calls; without one,
    the pipeline's (``Pipeline(error_policy=...)``; by default: retry 3 times with
    backoff, then stop). Its ``then='skip'`` (or a handler's Skip) gives the element up: it
    is logged with its error, counted in the commit message, and written to the
    pipeline's dead-letter sink when it has one (a ``dead_letter`` of Consume's own policy
    is refused: give it to the pipeline's).

    ``fn`` is a plain function: an ``async def`` or generator function is refused (its
    call would return without doing anything), and so is a call that returns an awaitable.

    At least once: ``commit`` only keeps counts (:meth:`stats`); a replayed batch calls
    ``fn`` again for its elements. Make the side effect idempotent, keyed by
    :func:`idempotency_key` of the change record (commit timestamp, transaction id, record
    sequence). ``fn`` and ``key`` are pickled into every task: create clients lazily in
    the process that runs them (a module-level cache), not in the pipeline file.
    """

    def __init__(
        self,
        fn: Callable[[E], object],
        *,
        max_inflight: int = 1,
        key: Callable[[E], Hashable] | None = None,
        timeout: float | str | None = None,
        drain_timeout: float | str = 30.0,
        on_error: ErrorPolicy | None = None,
    ) -> None:
        if not callable(fn):
            msg = f"Consume takes a function called with each element, got {fn!r}"
            raise TypeError(msg)
        if key is not None and not callable(key):
            msg = f"Consume(key={key!r}): pass a function of the element, e.g. key=lambda r: ..."
            raise TypeError(msg)
        if isinstance(max_inflight, bool) or not isinstance(max_inflight, int) or max_inflight < 1:
            msg = f"Consume(max_inflight={max_inflight!r}): use a whole number >= 1"
            raise PipelineDefinitionError(msg)
        kind = function_kind(fn)
        if kind is not None:
            msg = (
                f"Consume({callable_name(fn)}): fn is {kind}, and Consume calls it on "
                "threads: calling it would do nothing. Pass a plain function, e.g. "
                "lambda r: asyncio.run(send(r)) for an async one"
            )
            raise PipelineDefinitionError(msg)
        if on_error is not None and not isinstance(on_error, ErrorPolicy):
            msg = f"Consume(on_error={on_error!r}): pass a cdcflow.ErrorPolicy"
            raise TypeError(msg)
        if on_error is not None and on_error.dead_letter is not None:
            msg = (
                "Consume(on_error=ErrorPolicy(dead_letter=...)): Consume's skipped elements "
                "go to the pipeline's dead-letter sink; give it there: "
                "Pipeline(name, error_policy=ErrorPolicy(then='skip', dead_letter=...))"
            )
            raise PipelineDefinitionError(msg)
        self.fn = fn
        self.key = key
        self._fn_name = callable_name(fn)  # named where the pipeline is built (see Map)
        self.max_inflight = max_inflight
        self.timeout = (None if timeout is None
                        else positive_seconds(timeout, "Consume(timeout=...)", "5s"))
        self.drain_timeout = positive_seconds(drain_timeout, "Consume(drain_timeout=...)",
                                              "30s")
        #: Consume's own policy; None: the pipeline's
        self.on_error = on_error
        self._totals = _Totals()

    def __getstate__(self) -> dict[str, Any]:
        # tasks need the function and the settings; the driver's counts stay on the driver
        state = self.__dict__.copy()
        state["_totals"] = _Totals()
        return state

    def default_label(self) -> str:
        return f"Consume({self._fn_name})"

    def describe_params(self) -> str:
        parts = [f"max_inflight={self.max_inflight}"]
        if self.key is not None:
            parts.append(f"key={callable_name(self.key)}")
        if self.timeout is not None:
            parts.append(f"timeout={self.timeout:g}s")
        return ", ".join(parts)

    def open_writer(self, ctx: WriterContext) -> SinkWriter[E, Consumed]:
        return ConsumeWriter(self.fn, self.key, self.max_inflight, self.timeout,
                             self.drain_timeout, self.on_error, ctx)

    def commit(self, batch_id: int, messages: Sequence[Consumed]) -> None:
        """Add the batch's counts to :meth:`stats`, once per batch id. Nothing else: the
        calls already happened in the tasks."""
        totals = self._totals
        if (self.label, batch_id) in totals.batches:
            return
        totals.batches.add((self.label, batch_id))
        batch = sum(messages, Consumed())
        totals.consumed += batch
        if batch.skipped:
            _log.warning(
                "%s skipped %d element(s) in batch %d, e.g. %s",
                self.label or self.default_label(), batch.skipped, batch_id,
                "; ".join(batch.errors[:3]),
            )

    def stats(self) -> Consumed:
        """The summed counts of the batches committed through this instance (on the
        driver; pickled copies start at zero). A batch counts once, even when replayed."""
        return self._totals.consumed

    def metrics(self) -> Mapping[str, float]:
        """:meth:`stats` as ``cdcflow_sink_<name>_total{sink}`` counters: an element this
        sink skipped was written to it (its ``cdcflow_sink_writes_total``) and skipped (the
        pipeline's ``cdcflow_skipped_total``), so ``skipped_total`` is what keeps the
        metrics' accounting of records exact."""
        c = self._totals.consumed
        return {"acked_total": c.acked, "skipped_total": c.skipped, "calls_total": c.calls,
                "retries_total": c.retries, "timeouts_total": c.timeouts}

    def last_committed_batch(self) -> int:
        """The highest batch id committed through this instance (a run with a new store
        plans its batches above it, so they are not taken for replays)."""
        return max((batch for _, batch in self._totals.batches), default=0)

    @property
    def committed_batches(self) -> int:
        """How many batch ids were committed through this instance."""
        return len({batch for _, batch in self._totals.batches})
