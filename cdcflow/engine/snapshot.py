"""Where a snapshot partition is read: a table, or a key range of it, as of the instant
before the stream.

A source with ``snapshot=`` gets one partition per table on its first run
(:meth:`cdcflow.engine.loop.Engine._first_run`): token ``snapshot/<table>``, range
``[start - 1 ns, start)``, and the stream's root partition lists them all as its parents.

A task of a table's partition asks the client's :class:`~cdcflow.stream.SnapshotClient`
for the table's key ranges at the read timestamp ``start - 1 ns`` (the slice's start): it
reads the table's primary keys in key order, keys only, and cuts them every
``snapshot_rows_per_task`` keys. A table of at most that many rows has no ranges: the
task reads its rows itself. A larger one is reported split: the task returns its key
ranges as children (``snapshot/<table>/<n>/[lo, hi]``, :mod:`cdcflow.keyrange`), emits no
row, and the lifecycle inserts them once, CREATED, with the table's partition as their
parent and the same 1 ns range. Each range is then read by a task of its own, in a later
batch, in parallel with the others (at most ``snapshot_tasks_per_batch`` snapshot
partitions per batch).

Every snapshot task reports its slice read to its end with ``ended=True``: the partition
finishes in this one slice. What the store holds is thus exactly which tables were split
into which ranges and which ranges are done. A task that fails commits nothing, and the
batch is replayed with the same slices: the same tables and ranges at the same timestamp,
so the same rows (and the same split), and sinks commit idempotently per batch id. A
FINISHED range is never read again. The stream's root waits for every snapshot partition,
ranges included (:func:`cdcflow.engine.lifecycle.ready_partitions`).
"""

from __future__ import annotations

from collections.abc import Callable

from cdcflow.engine.chain import Chain
from cdcflow.engine.program import TaskProgram
from cdcflow.engine.quota import approx_size
from cdcflow.engine.runner import ChildSeen, Task, TaskResult
from cdcflow.errors import PipelineDefinitionError, RunnerContractError
from cdcflow.keyrange import range_token, token_range
from cdcflow.model import (
    PartitionMetadata,
    PartitionState,
    Timestamp,
    snapshot_table,
    snapshot_token,
)
from cdcflow.stream import ChangeStreamClient, SnapshotClient
from cdcflow.transforms.source import DetectPartitions

__all__ = ["run_snapshot_task", "snapshot_partitions"]


def snapshot_partitions(
    program: TaskProgram, start: int, now_ns: int,
    make_client: Callable[[DetectPartitions], ChangeStreamClient],
) -> list[PartitionMetadata]:
    """The snapshot partitions of a first run whose stream starts at ``start``: one per
    table the source snapshots (checked against the tables the stream tracks), each
    ``[start - 1, start)`` and CREATED; none without ``snapshot=``. Their tokens are the
    root partition's parents."""
    source = program.source
    if not source.snapshot:
        return []
    tables = source.snapshot_tables(_snapshot_client(make_client(source)).snapshot_tables(
        source.stream
    ))
    return [
        PartitionMetadata(
            token=snapshot_token(table), parent_tokens=(), start=start - 1, end=start,
            watermark=start - 1, state=PartitionState.CREATED,
            heartbeat_millis=program.heartbeat_millis, created_at=now_ns,
        )
        for table in tables
    ]


def _snapshot_client(client: ChangeStreamClient) -> SnapshotClient:
    if not isinstance(client, SnapshotClient):
        msg = (
            f"{type(client).__name__} cannot read a snapshot: use a client with "
            "snapshot_tables, snapshot_split and snapshot methods "
            "(cdcflow.stream.SnapshotClient)"
        )
        raise PipelineDefinitionError(msg)
    return client


def run_snapshot_task(program: TaskProgram, task: Task, client: ChangeStreamClient) -> TaskResult:
    """Read the snapshot slice of ``task`` with ``client`` (see the module docstring).

    Raises RunnerContractError for a slice that is not a whole snapshot partition (one
    nanosecond wide), and PipelineDefinitionError when the client cannot read tables.
    ``client`` is passed in (task.py's make_client) because this module is below task.py.
    """
    sl = task.slice
    table = snapshot_table(sl.token)
    key_range = token_range(sl.token)
    if sl.end != sl.start + 1:
        msg = (
            f"snapshot partition {sl.token!r} got the slice [{sl.start}, {sl.end}); a snapshot "
            "is read in one slice of 1 ns (its read timestamp): the plan is not this engine's"
        )
        raise RunnerContractError(msg)
    reader = _snapshot_client(client)
    stream, read_at = program.source.stream, sl.start
    chain = Chain(program, task)
    records = size = 0
    children: tuple[ChildSeen, ...] = ()
    try:
        ranges = [] if key_range is not None else reader.snapshot_split(
            stream, table, read_at, program.source.snapshot_rows_per_task
        )
        if ranges:
            # Split: the ranges are this partition's children; their tasks read the rows.
            children = tuple(
                ChildSeen(range_token(table, r), (sl.token,), read_at) for r in ranges
            )
        else:
            for record in reader.snapshot(stream, table, read_at, key_range):
                if record.commit_timestamp.ns != read_at:
                    msg = (
                        f"{type(client).__name__}.snapshot gave a record of {table!r} at "
                        f"{record.commit_timestamp}, not at its read timestamp "
                        f"{Timestamp.from_ns(read_at)}"
                    )
                    raise RunnerContractError(msg)
                n = approx_size(record)
                records += 1
                size += n
                chain.push(record, read_at, n)
        messages = chain.finish()
    except BaseException:
        chain.abort()
        raise
    # No commit times: the read timestamp is when the run started, not a commit, and would
    # only skew the commit-to-sink latency.
    return chain.result(messages, position=sl.end, ended=True, records=records, size=size,
                        children=children)
