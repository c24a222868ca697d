"""Where a task runs: read one slice of one partition and push it through the fused chain
(:mod:`cdcflow.engine.chain`).

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
4. notes where a ChildPartitionsRecord (or MUTABLE_KEY_RANGE's PartitionEndRecord) ends
   the partition and which partitions it (or a PartitionStartRecord) announces;
   heartbeats only advance progress;
5. closes the writers and returns a small :class:`~cdcflow.engine.runner.TaskResult`:
   what it read, never partition state — the lifecycle (:mod:`cdcflow.engine.lifecycle`)
   alone decides what that means for the store.

On any failure every opened writer is aborted and the error propagates: nothing of the
task is committed, and the engine replays the batch. User functions and sink writes run
under the pipeline's :class:`~cdcflow.policy.ErrorPolicy`.
"""

from __future__ import annotations

import hashlib
import pickle
import threading

import cloudpickle

from cdcflow.engine.chain import Chain
from cdcflow.engine.guard import guard_for, stopping_for
from cdcflow.engine.program import DEAD_LETTER_LABEL, TaskProgram
from cdcflow.engine.quota import approx_size
from cdcflow.engine.runner import ChildSeen, CommitTimeSample, Task, TaskResult
from cdcflow.engine.snapshot import run_snapshot_task
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    ChildPartitionsRecord,
    DataChangeRecord,
    HeartbeatRecord,
    PartitionEndRecord,
    PartitionStartRecord,
    is_snapshot_token,
    record_position,
)
from cdcflow.policy import FailedElement
from cdcflow.restriction import TimestampRange, TimestampRangeTracker
from cdcflow.stream import ChangeStreamClient, ChangeStreamQuery
from cdcflow.transforms.source import DetectPartitions

__all__ = [
    "DEAD_LETTER_LABEL",
    "FailedElement",
    "TaskProgram",
    "execute_task",
    "make_client",
    "run_task",
]

# -- entry point ----------------------------------------------------------------------------

_programs: dict[bytes, TaskProgram] = {}
_programs_lock = threading.Lock()
_MAX_PROGRAMS = 4


#: The program loaded last, by the identity of its bytes: a runner passes one bytes object
#: to every task of a batch (the in-memory runner; Spark's broadcast in one worker), and
#: hashing a program that carries a scripted stream (hundreds of KB) cost more than the
#: rest of an idle partition's task.
_last: tuple[bytes, TaskProgram] | None = None


def _load_program(program: bytes) -> TaskProgram:
    # One program per run: unpickle it once per process so its client (and the client's
    # connections and caches) serves every task of the run in this process.
    global _last
    last = _last
    if last is not None and last[0] is program:
        return last[1]
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
        _last = (program, cached)
        return cached


def execute_task(program: bytes, task: bytes) -> bytes:
    """Run one task: cloudpickled :class:`TaskProgram` and :class:`Task` in, pickled
    :class:`~cdcflow.engine.runner.TaskResult` out. Raises what the task raised."""
    prog = _load_program(program)
    decoded = pickle.loads(task)
    if not isinstance(decoded, Task):
        msg = f"execute_task got {type(decoded).__name__}, not a Task"
        raise TypeError(msg)
    result = run_task(prog, decoded)
    try:
        # the standard pickler first: several times faster than cloudpickle, and what it
        # writes is what cloudpickle writes for anything it can pickle by reference (most
        # results: counters, positions, plain sink messages); cloudpickle for the rest (a
        # value of a class the pipeline's code made, a function)
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass
    try:
        return cloudpickle.dumps(result)  # type: ignore[no-any-return]
    except Exception as exc:  # a value of the pipeline's own that cannot travel
        exc.add_note(_unpicklable(result))
        raise


def _unpicklable(result: TaskResult) -> str:
    """Which part of ``result`` cannot be pickled, for the error report: a sink writer's
    ``close()`` value (what Collect keeps are the elements themselves)."""
    for label, message in result.sink_messages.items():
        try:
            cloudpickle.dumps(message)
        except Exception:
            return (f"the value the writer of sink {label!r} returned from close() cannot "
                    "be pickled: it travels to the driver, so it must be picklable (for "
                    "Collect: the elements it collects)")
    return "the task's result cannot be pickled"


#: A task checks its run's guard once in this many records (:func:`run_task`).
GUARD_EVERY = 16


def make_client(source: DetectPartitions) -> ChangeStreamClient:
    """The client tasks read ``source`` with: its own client (tests pass a
    ScriptedChangeStream), else the Spanner reader, cached per worker process."""
    if source.client is not None:
        return source.client
    from cdcflow.spanner.client import cached_client  # only a Spanner source needs it

    assert source.database is not None
    return cached_client(
        source.database, priority=source.priority, query_timeout=source.query_timeout,
        typed=source.typed, filter=source.filter, data_boost=source.data_boost,
    )


def run_task(program: TaskProgram, task: Task) -> TaskResult:
    """Run ``task`` in this thread (see the module docstring); the unpickled form of
    :func:`execute_task`."""
    sl = task.slice
    if is_snapshot_token(sl.token):  # a table's initial snapshot (cdcflow.engine.snapshot)
        return run_snapshot_task(program, task, make_client(program.source))
    root = sl.token == INITIAL_PARTITION_TOKEN
    query = ChangeStreamQuery(
        stream=program.source.stream,
        partition_token=None if root else sl.token,
        start=sl.start,
        end=sl.end,
        heartbeat_millis=program.heartbeat_millis,
        stopping=stopping_for(program.pipeline),
    )
    tracker = TimestampRangeTracker(TimestampRange(sl.start, sl.end))
    chain = Chain(program, task)
    ended_at: int | None = None
    children: dict[str, ChildSeen] = {}
    records = size = 0
    commit_times = CommitTimeSample()

    def announce(position: int, record: ChildPartitionsRecord | PartitionStartRecord) -> None:
        if isinstance(record, ChildPartitionsRecord):
            for c in record.child_partitions:
                children.setdefault(
                    c.token, ChildSeen(c.token, tuple(c.parent_partition_tokens), position)
                )
        else:
            for token in record.partition_tokens:
                children.setdefault(token, ChildSeen(token, (), position, announced=True))

    reading = make_client(program.source).read(query)
    # A reader that measured its records while decoding them (the Spanner reader) says
    # their size; any other record is measured here.
    size_of = getattr(reading, "size_of", None)
    claim, push, sample = tracker.try_claim, chain.push, commit_times.add
    # The run's guard (where the run is in this process): a run aborted (a second Ctrl-C),
    # or one whose lease ran out or was lost, has its tasks stop within GUARD_EVERY records
    # instead of pushing the rest of their slices through the user's functions.
    check = guard_for(program.pipeline)
    try:
        for record in reading:
            if ended_at is None and isinstance(record, DataChangeRecord):  # the hot path
                position = record.commit_timestamp.ns
                if not claim(position):
                    break
                n = (size_of(record) if size_of is not None else None) or approx_size(record)
                records += 1
                if not records % GUARD_EVERY:
                    check()
                size += n
                sample(position)
                push(record, position, n)
                continue
            position = record_position(record)
            if ended_at is not None:
                # Several child records may share the end position (the root query gives
                # one per partition); anything else after the end is not ours.
                if position != ended_at:
                    break
                if isinstance(record, ChildPartitionsRecord | PartitionStartRecord):
                    announce(position, record)
                continue
            if not tracker.try_claim(position):
                break
            if isinstance(record, HeartbeatRecord):
                chain.barrier(position)
            elif isinstance(record, ChildPartitionsRecord):
                ended_at = position
                announce(position, record)
            elif isinstance(record, PartitionStartRecord):
                announce(position, record)
                if root:
                    ended_at = position
            elif isinstance(record, PartitionEndRecord):
                ended_at = position
            else:  # PartitionEventRecord: key ranges moved; nothing to emit downstream
                chain.barrier(position)
        messages = chain.finish()
    except BaseException:
        chain.abort()
        raise
    # A client that measures its queries (the Spanner reader's ObservedRead) says what
    # they cost; its counters travel with the task's, to the driver's metrics.
    query_counters = getattr(reading, "counters", None)
    return chain.result(
        messages, position=sl.end if ended_at is None else ended_at, ended=ended_at is not None,
        records=records, size=size, children=tuple(children.values()),
        counters=query_counters() if callable(query_counters) else None,
        commit_times=commit_times.sample(),
    )
