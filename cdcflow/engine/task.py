"""Where a task runs: read one slice of one partition and push it through the fused chain.

Every runner ships a :class:`TaskProgram` (built once per run) and one :class:`Task` per
slice as cloudpickle bytes and calls :func:`execute_task` where the task runs (a thread of
the in-memory runner, a Python worker of a Spark executor). Nothing is shuffled: one task
runs the whole chain of ParDos and sinks downstream of ReadPartition, linear or branching.

A task:

1. queries the change stream for its slice (the root partition with a NULL token);
2. claims every record's position on a TimestampRangeTracker and stops when the claim
   fails (the record belongs to a later slice);
3. pushes DataChangeRecords through the chain: a ParDo's outputs go to each successor; a
   sink's elements go to its writer (opened on first use); with ``max_inflight > 1`` on
   ReadPartition the ParDos of several records run concurrently while sink writers still
   receive elements in record order (an InflightTracker releases the contiguous prefix);
4. turns a ChildPartitionsRecord (or MUTABLE_KEY_RANGE's PartitionStart/EndRecord) into
   the partition's end and its children; heartbeats only advance progress;
5. closes the writers and returns a small :class:`~cdcflow.engine.runner.TaskResult`.

On any failure every opened writer is aborted and the error propagates: nothing of the
task is committed, and the engine replays the batch. User functions and sink writes run
under the pipeline's :class:`~cdcflow.policy.ErrorPolicy`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import pickle
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs
import cloudpickle

from cdcflow.engine.runner import Task, TaskResult
from cdcflow.errors import PipelineDefinitionError, PipelineStopped
from cdcflow.inflight import Barrier, InflightTracker
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    MAX_NS,
    ChildPartitionsRecord,
    DataChangeRecord,
    HeartbeatRecord,
    PartitionEndRecord,
    PartitionMetadata,
    PartitionStartRecord,
    PartitionState,
    Timestamp,
    record_position,
)
from cdcflow.policy import ErrorPolicy
from cdcflow.restriction import TimestampRange, TimestampRangeTracker
from cdcflow.stream import ChangeStreamQuery
from cdcflow.transforms.base import ParDo, Sink, SinkWriter, WriterContext
from cdcflow.transforms.source import DetectPartitions, ReadPartition

if TYPE_CHECKING:
    from cdcflow.dag import Dag

__all__ = ["DEAD_LETTER_LABEL", "FailedElement", "TaskProgram", "execute_task", "run_task"]

_log = logging.getLogger("cdcflow.task")

#: Label of the error policy's dead-letter sink when it has none of its own.
DEAD_LETTER_LABEL = "dead-letter"


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


@attrs.frozen
class TaskProgram:
    """Everything a task needs besides its slice; built once per run on the driver.

    ``chain`` holds the cloudpickled transforms downstream of ReadPartition (ParDos and
    sinks, plus the dead-letter sink), keyed by label; every task unpickles its own copy,
    so DoFns never share state across concurrent tasks. ``successors`` maps the read
    label and every chain label to the labels it feeds.
    """

    pipeline: str
    source: DetectPartitions
    read_label: str
    heartbeat_millis: int
    max_inflight: int
    max_inflight_bytes: int
    chain: bytes
    successors: Mapping[str, tuple[str, ...]]
    policy: ErrorPolicy
    sink_labels: tuple[str, ...]
    dead_letter_label: str | None = None

    @classmethod
    def from_pipeline(cls, pipeline: Dag) -> TaskProgram:
        """Build the program of a validated pipeline; raise PipelineDefinitionError on a
        transform kind the runners do not execute."""
        (source_label,) = pipeline.labels_of_kind("Source")
        (read_label,) = pipeline.labels_of_kind("Read")
        source = pipeline.transform(source_label)
        read = pipeline.transform(read_label)
        assert isinstance(source, DetectPartitions) and isinstance(read, ReadPartition)
        nodes: dict[str, ParDo[Any, Any] | Sink[Any, Any]] = {}
        for label, t in pipeline.nodes():
            if label in (source_label, read_label):
                continue
            if not isinstance(t, ParDo | Sink):
                msg = (
                    f"{label!r} is a {type(t).__name__} of kind {t.kind!r}; tasks execute "
                    "ParDo and Sink transforms after ReadPartition (subclass ParDo or Sink)"
                )
                raise PipelineDefinitionError(msg)
            nodes[label] = t
        successors = {label: tuple(pipeline.downstream(label)) for label in (read_label, *nodes)}
        sink_labels = tuple(label for label, t in nodes.items() if isinstance(t, Sink))
        policy = pipeline.error_policy
        dead_label = None
        if policy.dead_letter is not None:
            dead_label = policy.dead_letter.label or DEAD_LETTER_LABEL
            if dead_label in nodes or dead_label in (source_label, read_label):
                msg = (
                    f"the dead-letter sink's label {dead_label!r} is also a step of the "
                    "pipeline; give it another label, e.g. ErrorPolicy(dead_letter="
                    '"failed" >> WriteFiles(...))'
                )
                raise PipelineDefinitionError(msg)
            nodes[dead_label] = policy.dead_letter
            sink_labels = (*sink_labels, dead_label)
        return cls(
            pipeline=pipeline.name,
            source=source,
            read_label=read_label,
            heartbeat_millis=read.heartbeat_millis,
            max_inflight=read.max_inflight,
            max_inflight_bytes=read.max_inflight_bytes,
            chain=cloudpickle.dumps(nodes),
            successors=successors,
            policy=attrs.evolve(policy, dead_letter=None),  # the sink travels in ``chain``
            sink_labels=sink_labels,
            dead_letter_label=dead_label,
        )


# -- entry point ----------------------------------------------------------------------------

_programs: dict[bytes, TaskProgram] = {}
_programs_lock = threading.Lock()
_MAX_PROGRAMS = 4


def _load_program(program: bytes) -> TaskProgram:
    # One program per run: unpickle it once per process so its client (and the client's
    # connections and caches) serves every task of the run in this process.
    key = hashlib.sha256(program).digest()
    with _programs_lock:
        cached = _programs.get(key)
        if cached is None:
            cached = pickle.loads(program)
            if not isinstance(cached, TaskProgram):
                msg = f"execute_task got {type(cached).__name__}, not a TaskProgram"
                raise TypeError(msg)
            while len(_programs) >= _MAX_PROGRAMS:
                del _programs[next(iter(_programs))]
            _programs[key] = cached
        return cached


def execute_task(program: bytes, task: bytes) -> bytes:
    """Run one task: cloudpickled :class:`TaskProgram` and :class:`Task` in, pickled
    :class:`~cdcflow.engine.runner.TaskResult` out. Raises what the task raised."""
    prog = _load_program(program)
    decoded = pickle.loads(task)
    if not isinstance(decoded, Task):
        msg = f"execute_task got {type(decoded).__name__}, not a Task"
        raise TypeError(msg)
    result: bytes = cloudpickle.dumps(run_task(prog, decoded))
    return result


def run_task(program: TaskProgram, task: Task) -> TaskResult:
    """Run ``task`` in this thread (see the module docstring); the unpickled form of
    :func:`execute_task`."""
    sl = task.slice
    root = sl.token == INITIAL_PARTITION_TOKEN
    query = ChangeStreamQuery(
        stream=program.source.stream,
        partition_token=None if root else sl.token,
        start=sl.start,
        end=sl.end,
        heartbeat_millis=program.heartbeat_millis,
    )
    tracker = TimestampRangeTracker(TimestampRange(sl.start, sl.end))
    chain = _Chain(program, task)
    finished_at: int | None = None
    children: dict[str, PartitionMetadata] = {}
    records = size = 0

    def add_children(position: int, tokens: list[tuple[str, tuple[str, ...]]]) -> None:
        for token, parents in tokens:
            children.setdefault(token, PartitionMetadata(
                token=token, parent_tokens=parents or (sl.token,), start=position,
                end=MAX_NS,  # the engine sets the parent's end
                watermark=position, state=PartitionState.CREATED,
                heartbeat_millis=program.heartbeat_millis,
            ))

    try:
        client = program.source.make_client()
        for record in client.read(query):
            position = record_position(record)
            if finished_at is not None:
                # Several child records may share the end position (the root query gives
                # one per partition); anything else after the end is not ours.
                if position != finished_at:
                    break
                if isinstance(record, ChildPartitionsRecord):
                    add_children(position, [(c.token, c.parent_partition_tokens)
                                            for c in record.child_partitions])
                elif isinstance(record, PartitionStartRecord):
                    add_children(position, [(t, ()) for t in record.partition_tokens])
                continue
            if not tracker.try_claim(position):
                break
            if isinstance(record, DataChangeRecord):
                n = _approx_size(record)
                records += 1
                size += n
                chain.push(record, position, n)
            elif isinstance(record, HeartbeatRecord):
                chain.barrier(position)
            elif isinstance(record, ChildPartitionsRecord):
                finished_at = position
                add_children(position, [(c.token, c.parent_partition_tokens)
                                        for c in record.child_partitions])
            elif isinstance(record, PartitionStartRecord):
                add_children(position, [(t, ()) for t in record.partition_tokens])
                if root:
                    finished_at = position
            elif isinstance(record, PartitionEndRecord):
                finished_at = position
            else:  # PartitionEventRecord: key ranges moved; nothing to emit downstream
                chain.barrier(position)
        messages = chain.finish()
    except BaseException:
        chain.abort()
        raise
    return TaskResult(
        token=sl.token,
        watermark=sl.end if finished_at is None else finished_at,
        finished=finished_at is not None,
        children=tuple(children.values()),
        sink_messages=messages,
        records=records,
        bytes=size,
        counters=chain.counters(),
    )


# -- the fused chain --------------------------------------------------------------------------


class _Skipped:
    """An element the error policy skipped, with the last error as text."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class _Failure:
    """An exception raised in the pool, delivered in record order."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


Delivery = tuple[str, Any]  # (sink label, element)


class _Chain:
    """One task's copy of the transforms downstream of ReadPartition, and its writers."""

    def __init__(self, program: TaskProgram, task: Task) -> None:
        self._program = program
        self._task = task
        self._nodes: dict[str, ParDo[Any, Any] | Sink[Any, Any]] = pickle.loads(program.chain)
        self._succ = program.successors
        self._policy = program.policy
        self._attempt = uuid.uuid4().hex  # unique per execution: retries write elsewhere
        self._writers: dict[str, SinkWriter[Any, Any]] = {}
        self._set_up: list[ParDo[Any, Any]] = []
        self._started = False
        self._skipped = 0
        self._retries = 0
        self._count_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: InflightTracker | None = None
        self._released: list[tuple[int, Any]] = []
        self._release_lock = threading.Lock()
        if program.max_inflight > 1:
            self._inflight = InflightTracker(program.max_inflight, program.max_inflight_bytes)

    # -- feeding records ---------------------------------------------------------------------

    def push(self, record: DataChangeRecord, position: int, size: int) -> None:
        self._start()
        if self._inflight is None:
            self._deliver(record, self._evaluate(record))
            return
        assert self._pool is not None
        seq = self._inflight.begin(position, size)
        future = self._pool.submit(self._evaluate, record)
        future.add_done_callback(lambda f: self._completed(seq, record, f))
        self._flush()

    def barrier(self, position: int) -> None:
        if self._inflight is None:
            return
        with self._release_lock:
            self._released.extend(self._inflight.barrier(position))
        self._flush()

    def _completed(
        self, seq: int, record: DataChangeRecord, future: Future[list[Delivery]]
    ) -> None:
        error = CancelledError() if future.cancelled() else future.exception()
        result: Any = _Failure(error) if error is not None else (record, future.result())
        assert self._inflight is not None
        # complete() and the append happen under one lock so released runs stay in order
        with self._release_lock:
            self._released.extend(self._inflight.complete(seq, result))

    def _flush(self) -> None:
        with self._release_lock:
            released, self._released = self._released, []
        for _, result in released:
            if isinstance(result, Barrier):
                continue
            if isinstance(result, _Failure):
                raise result.error
            record, deliveries = result
            self._deliver(record, deliveries)

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        # DoFn.setup runs once per task, before the first element, on this thread.
        for node in self._nodes.values():
            if isinstance(node, ParDo):
                node.fn.setup()
                self._set_up.append(node)
        if self._inflight is not None:
            self._pool = ThreadPoolExecutor(
                self._inflight.max_inflight, thread_name_prefix="cdcflow-inflight"
            )

    # -- running transforms -----------------------------------------------------------------

    def _evaluate(self, record: DataChangeRecord) -> list[Delivery]:
        """Run every ParDo on ``record``; return the sink deliveries in chain order."""
        out: list[Delivery] = []

        def visit(label: str, element: Any) -> None:
            node = self._nodes[label]
            if isinstance(node, Sink):
                out.append((label, element))
                return
            call = functools.partial(_process, node, element)
            outputs = self._guarded(label, record, element, call)
            if isinstance(outputs, _Skipped):
                if self._program.dead_letter_label is not None:
                    out.append((self._program.dead_letter_label,
                                self._failed(label, record, element, outputs)))
                return
            for value in outputs:
                for nxt in self._succ[label]:
                    visit(nxt, value)

        for label in self._succ[self._program.read_label]:
            visit(label, record)
        return out

    def _deliver(self, record: DataChangeRecord, deliveries: list[Delivery]) -> None:
        dead = self._program.dead_letter_label
        for label, element in deliveries:
            writer = self._writer(label)
            if label == dead:
                writer.write(element)  # a failing dead-letter sink fails the task
                continue
            done = self._guarded(label, record, element, functools.partial(writer.write, element))
            if isinstance(done, _Skipped) and dead is not None:
                self._writer(dead).write(self._failed(label, record, element, done))

    def _guarded(
        self, label: str, record: DataChangeRecord, element: Any, call: Callable[[], Any]
    ) -> Any:
        """``call()`` under the error policy: its value, or _Skipped when skipped."""
        policy = self._policy
        attempt = 0
        while True:
            try:
                return call()
            except Exception as exc:
                if attempt < policy.retries:
                    delay = min(policy.max_backoff, policy.backoff * (2**attempt))
                    time.sleep(delay * random.uniform(0.5, 1.0))
                    attempt += 1
                    with self._count_lock:
                        self._retries += 1
                    continue
                where = (
                    f"{label!r} failed on a change of partition {record.partition_token} "
                    f"committed at {record.commit_timestamp} after {attempt + 1} attempt(s): "
                    f"{type(exc).__name__}: {exc}"
                )
                if policy.then == "stop":
                    msg = (
                        f"{where}. Nothing past this record was committed; fix the cause and "
                        "run again to resume, or skip such elements with "
                        "ErrorPolicy(then='skip')"
                    )
                    raise PipelineStopped(msg) from exc
                _log.warning("skipped an element: %s", where)
                with self._count_lock:
                    self._skipped += 1
                return _Skipped(f"{type(exc).__name__}: {exc}")

    def _failed(
        self, label: str, record: DataChangeRecord, element: Any, skipped: _Skipped
    ) -> FailedElement:
        return FailedElement(
            label=label,
            error=skipped.error,
            partition_token=record.partition_token,
            commit_timestamp=record.commit_timestamp,
            element=element,
        )

    def _writer(self, label: str) -> SinkWriter[Any, Any]:
        writer = self._writers.get(label)
        if writer is None:
            sink = self._nodes[label]
            assert isinstance(sink, Sink)
            sl = self._task.slice
            writer = sink.open_writer(WriterContext(
                pipeline=self._program.pipeline, sink_label=label, batch_id=self._task.batch_id,
                partition_token=sl.token, slice_start=sl.start, slice_end=sl.end,
                attempt=self._attempt,
            ))
            self._writers[label] = writer
        return writer

    # -- ending -----------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Drain in-flight work, tear down, close writers; the sink commit messages."""
        if self._inflight is not None:
            self._inflight.drain()
            self._flush()
        self._shutdown()
        teardown, self._set_up = self._set_up, []
        for node in teardown:
            node.fn.teardown()
        messages: dict[str, Any] = {}
        for label in list(self._writers):
            messages[label] = self._writers.pop(label).close()
        return messages

    def abort(self) -> None:
        self._shutdown()
        for node in self._set_up:
            try:
                node.fn.teardown()
            except Exception:
                _log.exception("teardown of a DoFn failed while aborting a task")
        self._set_up = []
        for writer in self._writers.values():
            try:
                writer.abort()
            except Exception:
                _log.exception("aborting a sink writer failed")
        self._writers.clear()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def counters(self) -> dict[str, int]:
        return {"skipped": self._skipped, "retries": self._retries}


def _process(node: ParDo[Any, Any] | Sink[Any, Any], element: Any) -> list[Any]:
    assert isinstance(node, ParDo)
    produced = node.fn.process(element)
    return [] if produced is None else list(produced)


def _approx_size(record: DataChangeRecord) -> int:
    """A cheap estimate of a record's memory in bytes (for the in-flight byte quota)."""
    n = 256
    for mod in record.mods:
        for values in (mod.keys, mod.new_values, mod.old_values):
            for key, value in values.items():
                n += 48 + len(key) + (len(value) if isinstance(value, str | bytes) else 16)
    return n
