"""Observing a run: what the engine reports after each batch and at the end.

:class:`EngineListener` is the typed seam the CLI's progress display (and any user code)
implements; :class:`BatchStats` and :class:`RunSummary` are what it is told.

While a batch runs, :func:`tasks_done` tells which of its tasks finished in this process
(tasks note it with :func:`note_task_done`): where tasks run in the driver's process (the
in-memory runner) an observer can tell a read that hangs from the reads that are done and
wait for the batch to commit. Elsewhere (Spark executors) it knows nothing and says so.
Likewise :func:`tasks_held_back` tells which tasks wait for something other than their
read (a sink that has not taken their elements, the byte quota), now or a moment ago.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import attrs

from cdcflow.model import BatchPlan, PartitionMetadata

__all__ = [
    "BatchStats",
    "EngineListener",
    "RunSummary",
    "note_task_done",
    "note_task_held_back",
    "tasks_done",
    "tasks_held_back",
]

# (pipeline, batch id) -> tokens whose task of that batch finished in this process. Only
# the latest batches are kept: nothing has to clear it, and a worker process cannot grow it.
_done: OrderedDict[tuple[str, int], set[str]] = OrderedDict()
_done_lock = threading.Lock()
_DONE_BATCHES = 16


def note_task_done(pipeline: str, batch_id: int, token: str) -> None:
    """Note that the task reading ``token`` in batch ``batch_id`` of ``pipeline`` finished
    (its result is on its way to the driver)."""
    key = (pipeline, batch_id)
    with _done_lock:
        _held_back.pop((pipeline, batch_id, token), None)
        tokens = _done.get(key)
        if tokens is None:
            tokens = _done[key] = set()
            while len(_done) > _DONE_BATCHES:
                _done.popitem(last=False)
        tokens.add(token)


def tasks_done(pipeline: str, batch_id: int) -> frozenset[str]:
    """The tokens whose task of batch ``batch_id`` finished in this process (see the module
    docstring: empty when the tasks run in other processes)."""
    with _done_lock:
        return frozenset(_done.get((pipeline, batch_id), ()))


# (pipeline, batch id, token) -> what the task reading that partition waits for, and when
# it last stopped waiting (None: it waits now). Kept until the task is done, so that a read
# that waits again and again (a slow sink) is said to be held back between two waits too.
_held_back: dict[tuple[str, int, str], tuple[str, float | None]] = {}
#: A read that waited this many seconds ago at most counts as held back still.
HELD_BACK_RECENTLY = 2.0
_HELD_BACK_KEPT = 4096  # entries past this: those of reads that stopped waiting go first


def note_task_held_back(pipeline: str, batch_id: int, token: str, by: str | None) -> None:
    """Note that the task reading ``token`` in batch ``batch_id`` of ``pipeline`` waits for
    ``by`` (a sink that has not taken its elements, the byte quota), not for its read; None
    once it no longer does."""
    key = (pipeline, batch_id, token)
    now = time.monotonic()
    with _done_lock:
        if by is not None:
            _held_back[key] = (by, None)
            if len(_held_back) > _HELD_BACK_KEPT:
                for old in [k for k, (_, since) in _held_back.items() if since is not None]:
                    del _held_back[old]
        elif (last := _held_back.get(key)) is not None:
            _held_back[key] = (last[0], now)


def tasks_held_back(pipeline: str, batch_id: int) -> dict[str, str]:
    """Token -> what its task of batch ``batch_id`` waits for, for the tasks of this
    process that wait now or did :data:`HELD_BACK_RECENTLY` (see
    :func:`note_task_held_back`)."""
    recently = time.monotonic() - HELD_BACK_RECENTLY
    with _done_lock:
        return {token: by for (p, b, token), (by, since) in _held_back.items()
                if p == pipeline and b == batch_id and (since is None or since >= recently)}


@attrs.frozen
class BatchStats:
    """What one committed batch did; given to listeners after the store commit."""

    batch_id: int
    end: int  # the batch end T
    slices: int
    records: int  # data change records read
    bytes: int
    seconds: float  # wall time from plan to store commit
    low_watermark: int  # the pipeline's low watermark after the commit
    partitions: Mapping[str, int]  # state name -> count, after the commit
    new_partitions: int = 0  # children inserted by this batch
    splits: int = 0  # parents that reported two or more children
    merges: int = 0  # children reported with two or more parents
    replayed: bool = False  # the batch was planned by an earlier run and replayed
    #: seconds per phase: "plan", "execute", "sink_commit", "store_commit", "gc"
    phases: Mapping[str, float] = attrs.field(factory=dict)
    #: the tasks' counters summed (see cdcflow.engine.chain.Chain.counters)
    counters: Mapping[str, int] = attrs.field(factory=dict)
    #: a sample of the batch's records' commit timestamps (ns), and when the sinks had
    #: committed them (ns): their differences are commit-to-sink latencies
    commit_times: tuple[int, ...] = ()
    sinks_committed_at: int = 0
    #: what each sink reports after the batch (``Sink.metrics()``), by sink label
    sink_metrics: Mapping[str, Mapping[str, float]] = attrs.field(factory=dict)
    #: the span of commit time the next batch plans (see cdcflow.engine.pacing)
    next_span_ns: int = 0


@attrs.frozen
class RunSummary:
    pipeline: str
    batches: int
    records: int
    reason: str  # "end reached", "duration", "max batches", "interrupted", "output closed"
    low_watermark: int
    partitions: Mapping[str, int]
    splits: int = 0
    merges: int = 0
    skipped: int = 0  # elements the error policy skipped (dead-lettered ones included)
    retried: int = 0  # element retries under the error policy
    dead_lettered: int = 0  # skipped elements written to the dead-letter sink


class EngineListener:
    """Observes a run; every method is a no-op here. The CLI's progress display is one.

    Methods run on the driver, between the engine's steps, in this order per batch:
    ``on_planned`` (plan durable) -> ``on_sinks_committed`` -> ``on_partitions`` ->
    ``on_batch`` (store committed).
    """

    def on_start(self, pipeline: str, runner: str, store_url: str) -> None:
        return None

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        return None

    def on_sinks_committed(self, batch_id: int) -> None:
        return None

    def on_batch(self, stats: BatchStats) -> None:
        return None

    def on_batch_retry(self, batch_id: int, error: BaseException) -> None:
        """An attempt of the batch failed with a transient ``error`` (a reader's retries
        spent, a sink's storage fault) and the batch is about to run again."""
        return None

    def on_partitions(self, partitions: Sequence[PartitionMetadata], now_ns: int) -> None:
        """The stored partitions after a batch committed (before garbage collection), and
        the engine's clock: for per-partition lag and stuck-partition detection. Called
        just before ``on_batch``; the sequence must not be kept or modified."""
        return None

    def on_batches_done(self, summary: RunSummary) -> None:
        """The run's last batch is over (``summary`` says why); what is left is making the
        staged sinks' output durable, which may wait on their storage, then ``on_stop``.
        Not called when the run fails."""
        return None

    def on_stop(self, summary: RunSummary) -> None:
        return None
