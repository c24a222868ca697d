"""The Runner protocol, and the task and result that travel between driver and workers.

A runner executes the tasks of a micro-batch and nothing else: planning and committing are
the engine's (cdcflow.engine.loop), one engine for every runner. A task and its program
travel as cloudpickle bytes, exactly as Spark ships them, and every runner calls
``cdcflow.engine.task.execute_task(program, task) -> bytes`` where the task runs.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, wait
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs

from cdcflow.model import Slice

__all__ = [
    "COMMIT_TIME_SAMPLE", "LEVELS", "ChildSeen", "CommitTimeSample", "Runner", "Task",
    "TaskResult", "add_counters", "outcome", "settle",
]

_T = TypeVar("_T")
#: How long a wait for another thread blocks at a time (see :func:`outcome`).
_WAKE_S = 0.25


def settle(future: Future[Any]) -> None:
    """Wait until ``future`` is done, in short steps: a signal delivered to another thread
    of the process (Ctrl-C, SIGTERM) is handled by the main thread only once it runs Python
    code again, which a wait without a timeout would never let it do."""
    while not future.done():
        wait([future], timeout=_WAKE_S)


def outcome(future: Future[_T]) -> _T:
    """``future.result()``, waited for with :func:`settle`."""
    settle(future)
    return future.result()


@attrs.frozen
class Task:
    """Read one slice of one batch and push its records through the fused transforms.

    ``sinks``: deliver only to these sink labels (a replay for sinks that had not made the
    batch durable); None delivers to every sink.
    """

    pipeline: str
    batch_id: int
    slice: Slice
    sinks: tuple[str, ...] | None = None


@attrs.frozen
class ChildSeen:
    """A partition a task read about. ``start`` is the position of the record that named it,
    where the new partition starts reading.

    ``announced=False``: a child partitions record named it, with ``parent_tokens`` as the
    record lists them; it continues its parents' key ranges and waits for them to finish.
    ``announced=True``: a MUTABLE_KEY_RANGE partition start record named it; it is read at
    once, beside the partition that announced it (which goes on).
    """

    token: str
    parent_tokens: tuple[str, ...]
    start: int
    announced: bool = False


@attrs.frozen
class TaskResult:
    """The small result a task returns to the driver: what it read, not what it means.

    ``position``: how far the slice was read — its end, or, when ``ended``, the position of
    the record that ended the partition (a child partitions record or a partition end
    record). ``children``: the partitions the slice announced. ``sink_messages`` maps a
    sink's label to its writer's commit message. ``step_inputs`` maps a BatchStep's label
    to the pickled list of the elements that reached it, in record order (the engine folds
    them on the driver). The engine's lifecycle
    (:func:`cdcflow.engine.lifecycle.fold`) alone turns this into partition state.
    """

    token: str
    position: int
    ended: bool
    children: tuple[ChildSeen, ...] = ()
    sink_messages: Mapping[str, Any] = attrs.field(factory=dict)
    records: int = 0
    bytes: int = 0
    counters: Mapping[str, int] = attrs.field(factory=dict)
    commit_times: tuple[int, ...] = ()
    step_inputs: Mapping[str, builtins.bytes] = attrs.field(factory=dict)


#: Task counters that are levels, not counts: the largest of several chains' (the
#: tasks' of a batch, a batch step's downstream chains), not their sum.
LEVELS = frozenset({"inflight_bytes_peak", "inflight_bytes_limit"})


def add_counters(total: dict[str, int], more: Mapping[str, int]) -> None:
    """Add a chain's counters ``more`` to ``total``: counts summed, :data:`LEVELS` the
    largest."""
    for key, value in more.items():
        if key in LEVELS:
            total[key] = max(total.get(key, value), value)
        else:
            total[key] = total.get(key, 0) + value


#: Most commit timestamps a task samples for the commit-to-sink latency.
COMMIT_TIME_SAMPLE = 64


class CommitTimeSample:
    """An even, deterministic sample of a stream of values: every ``stride``-th value, the
    stride doubling (and every other kept value dropped) each time the sample is full."""

    __slots__ = ("_n", "_stride", "values")

    def __init__(self) -> None:
        self.values: list[int] = []
        self._stride = 1
        self._n = 0

    def add(self, value: int) -> None:
        if self._n % self._stride == 0:
            self.values.append(value)
            if len(self.values) >= 2 * COMMIT_TIME_SAMPLE:
                self.values = self.values[::2]
                self._stride *= 2
        self._n += 1

    def sample(self) -> tuple[int, ...]:
        return tuple(self.values[:: max(1, len(self.values) // COMMIT_TIME_SAMPLE)])


@runtime_checkable
class Runner(Protocol):
    """Executes a batch's tasks, possibly in parallel and elsewhere.

    Contract of ``run_tasks``: returns one result per task, in task order, each the bytes
    ``execute_task(program, task)`` returned; raises if any task failed after the runner's
    own retries (nothing of the batch is committed then, and the engine replays it).

    Optionally ``abandon()``: what the engine calls instead of waiting in ``close`` when a
    run aborts (a second Ctrl-C): cancel what is queued, wait for no running task (one may
    never return). ``close`` is still called after it.

    Optionally ``interrupt()``: what the engine calls when the run is asked to stop (once),
    for a runner whose tasks cannot see the stop: it may cancel a batch that still runs
    after a grace period, ``run_tasks`` then raising
    :class:`~cdcflow.errors.BatchInterrupted` (the batch is replayed next run).
    """

    name: str

    def open(self, app_name: str) -> None: ...

    def run_tasks(self, program: bytes, tasks: Sequence[bytes]) -> list[bytes]: ...

    def close(self) -> None: ...
