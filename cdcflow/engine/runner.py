"""The Runner protocol and what tasks return.

A runner executes the tasks of a micro-batch and nothing else: planning and committing are
the engine's (cdcflow.engine.loop), one engine for every runner. A task and its program
travel as cloudpickle bytes, exactly as Spark ships them, and every runner calls
``cdcflow.engine.task.execute_task(program, task) -> bytes`` where the task runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from cdcflow.model import BatchPlan, PartitionMetadata, Slice

__all__ = [
    "BatchStats",
    "EngineListener",
    "RunSummary",
    "Runner",
    "Task",
    "TaskResult",
]


@attrs.frozen
class Task:
    """Read one slice of one batch and push its records through the fused transforms."""

    pipeline: str
    batch_id: int
    slice: Slice


@attrs.frozen
class TaskResult:
    """The small result a task returns to the driver.

    ``watermark`` is the position the partition reached: ``slice.end``, or the position at
    which it finished (its child partitions start there) when ``finished``.
    ``sink_messages`` maps a sink's label to its writer's commit message.
    """

    token: str
    watermark: int
    finished: bool
    children: tuple[PartitionMetadata, ...] = ()
    sink_messages: Mapping[str, Any] = attrs.field(factory=dict)
    records: int = 0
    bytes: int = 0
    counters: Mapping[str, int] = attrs.field(factory=dict)


@runtime_checkable
class Runner(Protocol):
    """Executes a batch's tasks, possibly in parallel and elsewhere.

    Contract of ``run_tasks``: returns one result per task, in task order, each the bytes
    ``execute_task(program, task)`` returned; raises if any task failed after the runner's
    own retries (nothing of the batch is committed then, and the engine replays it).
    """

    name: str

    def open(self, app_name: str) -> None: ...

    def run_tasks(self, program: bytes, tasks: Sequence[bytes]) -> list[bytes]: ...

    def close(self) -> None: ...


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


@attrs.frozen
class RunSummary:
    pipeline: str
    batches: int
    records: int
    reason: str  # "end reached", "duration", "max batches", "interrupted"
    low_watermark: int
    partitions: Mapping[str, int]
    splits: int = 0
    merges: int = 0


class EngineListener:
    """Observes a run; every method is a no-op here. The CLI's progress display is one.

    Methods run on the driver, between the engine's steps, in this order per batch:
    ``on_planned`` (plan durable) -> ``on_sinks_committed`` -> ``on_batch`` (store committed).
    """

    def on_start(self, pipeline: str, runner: str, store_url: str) -> None:
        return None

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        return None

    def on_sinks_committed(self, batch_id: int) -> None:
        return None

    def on_batch(self, stats: BatchStats) -> None:
        return None

    def on_stop(self, summary: RunSummary) -> None:
        return None
