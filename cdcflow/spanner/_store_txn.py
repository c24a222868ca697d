"""What each read-write transaction of the Spanner metadata store does.

Every function taking ``txn`` runs inside one read-write transaction and may run several
times (the store retries after ABORTED and after an unknown outcome), so it reads what it
depends on within the transaction and derives its writes from that. Each writes at most
what its caller sized it for (:mod:`cdcflow.spanner._store_limits`); the store cuts larger
operations into several of these steps (see :mod:`cdcflow.spanner.store`).

Contract checks use the shared rules of :mod:`cdcflow.metadata._rules`, so refusals read
the same as the memory and SQLite stores'.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import attrs

from cdcflow.errors import StoreError
from cdcflow.metadata import _rules
from cdcflow.model import (
    BatchPlan,
    Lease,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
)
from cdcflow.spanner._store_limits import STATE_CHUNK_BYTES
from cdcflow.spanner._store_schema import (
    BATCH_COLUMNS,
    PARTITION_COLUMNS,
    PIPELINE_COLUMNS,
    STEP_STATE_COLUMNS,
    row_to_lease,
    row_to_partition,
    row_to_plan,
    to_ns,
    to_spanner,
)
from cdcflow.spanner._store_sql import StoreSql

__all__ = [
    "Record",
    "acquire_lease",
    "commit_step",
    "delete",
    "insert",
    "logged",
    "mark_durable",
    "plan_step",
    "read_record",
    "release_lease",
    "renew_lease",
    "reset_step",
    "resetting_error",
    "set_source",
    "step_state",
]

# Stands for "the commit timestamp" among the integer times _rules.transition assigns.
_COMMIT_NOW = -(1 << 62) - 7
_MUTABLE = ("PipelineName", "PartitionToken", "Watermark", "State", "ScheduledAt",
            "RunningAt", "FinishedAt")


@attrs.define
class Record:
    """A pipeline's record: what outlives a reset (the lease, the batch id floor), the
    source definition, each sink's durable batch, and whether a reset is under way (it took
    several transactions)."""

    lease: Lease | None = None
    floor: int = 0
    source: str | None = None
    resetting: bool = False
    durable: dict[str, int] = attrs.field(factory=dict)

    def empty(self) -> bool:
        return self.lease is None and not self.floor and self.source is None and not (
            self.resetting or self.durable
        )


def _keys(keys: Iterable[Sequence[Any]]) -> Any:
    from google.cloud.spanner import KeySet

    return KeySet(keys=[list(k) for k in keys])  # type: ignore[no-untyped-call]


def _prefix(pipeline: str, last: Any = None) -> Any:
    """The keys of ``pipeline`` (up to ``last`` included, if given) as one key range."""
    from google.cloud.spanner import KeyRange, KeySet

    end = [pipeline] if last is None else [pipeline, last]
    span = KeyRange(start_closed=[pipeline], end_closed=end)  # type: ignore[no-untyped-call]
    return KeySet(ranges=[span])  # type: ignore[no-untyped-call]


def _at(ns: int | None, commit_ts: Any, ceiling: int | None = None) -> Any:
    """A time for a commit-timestamp column: the commit timestamp for _COMMIT_NOW, else the
    value, lowered to ``ceiling`` (Spanner's clock) since such columns refuse future times."""
    if ns is None:
        return None
    if ns == _COMMIT_NOW:
        return commit_ts
    return to_spanner(ns if ceiling is None else min(ns, ceiling))


def resetting_error(pipeline: str) -> StoreError:
    return StoreError(
        f"pipeline {pipeline!r}: a reset was interrupted before it removed every partition; "
        "run with --reset again (or call reset) to finish it"
    )


# -- the pipeline record ------------------------------------------------------------------


def read_record(reader: Any, sql: StoreSql, pipeline: str) -> Record:
    """The pipeline's record in ``reader`` (a snapshot or a transaction); empty if none."""
    rows = list(reader.read(sql.tables.pipelines, PIPELINE_COLUMNS[1:], _keys([[pipeline]])))
    if not rows:
        return Record()
    owner, run_id, token, acquired, renewed, expires, floor, source, resetting, marks = rows[0]
    lease = row_to_lease(owner, run_id, token, acquired, renewed, expires)
    durable = {str(k): int(v) for k, v in json.loads(marks).items()} if marks else {}
    return Record(lease, int(floor), source, bool(resetting), durable)


def _write_record(txn: Any, sql: StoreSql, pipeline: str, rec: Record) -> None:
    """Store ``rec``; an empty record is removed, so a pipeline reset back to nothing is not
    listed any more."""
    table = sql.tables.pipelines
    if rec.empty():
        txn.delete(table, _keys([[pipeline]]))
        return
    lease = rec.lease
    times = (None, None, None) if lease is None else (
        to_spanner(lease.acquired_at), to_spanner(lease.renewed_at),
        to_spanner(lease.expires_at))
    txn.insert_or_update(table, PIPELINE_COLUMNS, [(
        pipeline, lease.owner if lease else None, lease.run_id if lease else None,
        lease.token if lease else 0, *times, rec.floor, rec.source, rec.resetting or None,
        json.dumps(rec.durable, sort_keys=True) if rec.durable else None,
    )])


def _guarded(txn: Any, sql: StoreSql, pipeline: str, fence: int | None) -> Record:
    """The record, after the checks every progress write makes: the fence, no unfinished
    reset."""
    rec = read_record(txn, sql, pipeline)
    _rules.check_fence(pipeline, rec.lease, fence)
    if rec.resetting:
        raise resetting_error(pipeline)
    return rec


def _now(txn: Any, sql: StoreSql) -> int:
    ((now,),) = sql.now().run(txn)
    return to_ns(now)


# -- partitions -----------------------------------------------------------------------------


def _read_partitions(
    txn: Any, sql: StoreSql, pipeline: str, tokens: Iterable[str]
) -> dict[str, PartitionMetadata]:
    keys = list(dict.fromkeys(tokens))
    if not keys:
        return {}
    rows = txn.read(sql.tables.partitions, PARTITION_COLUMNS[1:],
                    _keys([pipeline, t] for t in keys))
    return {row[0]: row_to_partition(row) for row in rows}


def _put(txn: Any, sql: StoreSql, pipeline: str, rows: Sequence[PartitionMetadata]) -> None:
    """Write the mutable columns of existing partitions (UPDATE_PARTITION mutations each)."""
    from google.cloud.spanner import COMMIT_TIMESTAMP

    if rows:
        txn.update(sql.tables.partitions, _MUTABLE, [
            (pipeline, p.token, to_spanner(p.watermark), str(p.state),
             _at(p.scheduled_at, COMMIT_TIMESTAMP), _at(p.running_at, COMMIT_TIMESTAMP),
             _at(p.finished_at, COMMIT_TIMESTAMP))
            for p in rows
        ])


def insert(
    txn: Any, sql: StoreSql, pipeline: str, partitions: Sequence[PartitionMetadata],
    *, guard: bool = True,
) -> int:
    """Insert the partitions whose tokens are absent; return how many were inserted."""
    from google.cloud.spanner import COMMIT_TIMESTAMP

    if guard:
        _guarded(txn, sql, pipeline, None)
    tokens = list(dict.fromkeys(p.token for p in partitions))
    if not tokens:
        return 0
    # Spanner's clock bounds the caller's times (a client clock running ahead must not make
    # the write fail). The present tokens are read by key: a query for thousands of tokens
    # is much slower, on the emulator at least.
    ceiling = _now(txn, sql)
    stored = txn.read(sql.tables.partitions, ["PartitionToken"],
                      _keys([pipeline, t] for t in tokens))
    present: set[str] = {row[0] for row in stored}
    rows = []
    for p in partitions:
        if p.token in present:
            continue
        present.add(p.token)
        rows.append((
            pipeline, p.token, list(p.parent_tokens), to_spanner(p.start), to_spanner(p.end),
            p.heartbeat_millis, str(p.state), to_spanner(p.watermark),
            _at(p.created_at, COMMIT_TIMESTAMP, ceiling),
            _at(p.scheduled_at, COMMIT_TIMESTAMP, ceiling),
            _at(p.running_at, COMMIT_TIMESTAMP, ceiling),
            _at(p.finished_at, COMMIT_TIMESTAMP, ceiling),
        ))
    if rows:
        txn.insert(sql.tables.partitions, PARTITION_COLUMNS, rows)
    return len(rows)


def delete(txn: Any, sql: StoreSql, pipeline: str, tokens: Sequence[str]) -> int:
    """Remove the named partitions; return how many existed."""
    present = _read_partitions(txn, sql, pipeline, tokens)
    if present:
        txn.delete(sql.tables.partitions, _keys([pipeline, t] for t in present))
    return len(present)


# -- plans and commits ----------------------------------------------------------------------


def logged(reader: Any, sql: StoreSql, pipeline: str, batch_id: int) -> BatchPlan | None:
    """The plan logged as batch ``batch_id``, if any (``reader``: snapshot or transaction)."""
    columns = ["BatchId", "EndTimestamp", "SliceTokens", "SliceStarts", "SliceEnds",
               "PlannedAt"]
    rows = list(reader.read(sql.tables.batches, columns, _keys([[pipeline, batch_id]])))
    return row_to_plan(*rows[0]) if rows else None


def plan_step(
    txn: Any, sql: StoreSql, keep: int, pipeline: str, plan: BatchPlan,
    transitions: Mapping[str, PartitionState], apply: Collection[str], *, final: bool,
    fence: int | None,
) -> bool:
    """One transaction of ``write_plan``; False when ``plan`` is pending already (the
    caller stops: an earlier attempt logged it).

    Checks the fence and that ``plan`` may be logged next, validates every transition in
    ``transitions`` (an unknown token or a backward move raises before anything is
    written), writes those of ``apply`` that change something, and when ``final`` logs
    the plan (keeping the newest ``keep`` entries of the batch log, and every batch above
    a sink's durable mark: recovery may replay it to that sink).
    """
    rec = _guarded(txn, sql, pipeline, fence)
    ((last, pending, prune_to),) = sql.log_state(pipeline, keep - 1).run(txn)
    if pending is not None and _rules.is_pending(plan, logged(txn, sql, pipeline, pending)):
        return False
    _rules.check_new_plan(pipeline, plan, max(int(last or 0), rec.floor), pending)
    stored = _read_partitions(txn, sql, pipeline, transitions)
    changed = []
    for token, state in transitions.items():
        current = stored.get(token)
        if current is None:
            raise _rules.unknown_partition(pipeline, token)
        moved = _rules.transition(pipeline, current, state, _COMMIT_NOW)
        if token in apply and moved != current:
            changed.append(moved)
    _put(txn, sql, pipeline, changed)
    if final:
        if prune_to is not None and rec.durable:
            prune_to = min(prune_to, min(rec.durable.values()))
        if prune_to is not None:
            txn.delete(sql.tables.batches, _prefix(pipeline, prune_to))
        txn.insert(sql.tables.batches, BATCH_COLUMNS, [(
            pipeline, plan.batch_id, to_spanner(plan.end),
            [s.token for s in plan.slices], [to_spanner(s.start) for s in plan.slices],
            [to_spanner(s.end) for s in plan.slices], len(plan.slices),
            to_spanner(plan.planned_at), None, 0,
        )])
    return True


def commit_step(
    txn: Any, sql: StoreSql, pipeline: str, batch_id: int,
    updates: Sequence[PartitionUpdate], apply: Collection[str],
    children: Sequence[PartitionMetadata], records: int, *, final: bool, fence: int | None,
    durable: Mapping[str, int] | None = None, state: bytes | None = None,
    stats: str | None = None,
) -> bool | None:
    """One transaction of ``commit_batch``: False when the batch is committed already (the
    caller stops), True when this step committed it (``final``), None otherwise.

    Checks the fence and that the batch is pending, validates every update in ``updates``
    (an unknown partition or a smaller watermark raises before anything is written),
    writes those whose token is in ``apply`` (watermarks, FINISHED with its time), inserts
    the absent ``children``, and when ``final`` marks the batch committed, raises the
    sinks' ``durable`` marks and replaces the BatchSteps' ``state`` (when not None).
    """
    from google.cloud.spanner import COMMIT_TIMESTAMP

    rec = _guarded(txn, sql, pipeline, fence)
    log = list(txn.read(sql.tables.batches, ["CommittedAt"], _keys([[pipeline, batch_id]])))
    if not log:
        raise _rules.not_planned(pipeline, batch_id)
    if log[0][0] is not None:
        return False
    rows = _read_partitions(txn, sql, pipeline, (u.token for u in updates))
    before = dict(rows)
    for u in updates:
        current = rows.get(u.token)
        if current is None:
            raise _rules.unknown_partition(pipeline, u.token)
        if u.watermark < current.watermark:
            raise _rules.regression(pipeline, u.token, current.watermark, u.watermark)
        current = attrs.evolve(current, watermark=u.watermark)
        if u.finished:
            current = _rules.transition(pipeline, current, PartitionState.FINISHED,
                                        _COMMIT_NOW)
        rows[u.token] = current
    _put(txn, sql, pipeline, [p for t, p in rows.items() if t in apply and p != before[t]])
    insert(txn, sql, pipeline, children, guard=False)
    if not final:
        return None
    txn.update(sql.tables.batches,
               ["PipelineName", "BatchId", "CommittedAt", "Records", "Stats"],
               [(pipeline, batch_id, COMMIT_TIMESTAMP, records, stats)])
    if durable and _raised(rec, durable):
        _write_record(txn, sql, pipeline, rec)
    if state is not None:
        _write_state(txn, sql, pipeline, state)
    return True


def _write_state(txn: Any, sql: StoreSql, pipeline: str, state: bytes) -> None:
    """Replace the pipeline's step state: its chunks, then no chunk past the last."""
    from google.cloud.spanner import KeyRange, KeySet

    parts = [state[i:i + STATE_CHUNK_BYTES] for i in range(0, len(state), STATE_CHUNK_BYTES)]
    parts = parts or [b""]
    # The client takes and gives BYTES values base64-encoded.
    txn.insert_or_update(sql.tables.step_state, STEP_STATE_COLUMNS,
                         [(pipeline, i, base64.b64encode(part)) for i, part in enumerate(parts)])
    beyond = KeyRange(  # type: ignore[no-untyped-call]
        start_closed=[pipeline, len(parts)], end_closed=[pipeline])
    txn.delete(sql.tables.step_state, KeySet(ranges=[beyond]))  # type: ignore[no-untyped-call]


def step_state(reader: Any, sql: StoreSql, pipeline: str) -> bytes | None:
    """The pipeline's step state, its chunks joined in order (None: none stored)."""
    rows = list(reader.read(sql.tables.step_state, ["Chunk", "Data"], _prefix(pipeline)))
    if not rows:
        return None
    return b"".join(base64.b64decode(data) for _, data in sorted(rows, key=lambda r: int(r[0])))


def _raised(rec: Record, marks: Mapping[str, int]) -> bool:
    """Raise ``rec``'s durable marks to ``marks`` (a mark only moves forward); True if one
    moved."""
    before = dict(rec.durable)
    for label, batch_id in marks.items():
        if batch_id > rec.durable.get(label, -1):
            rec.durable[label] = batch_id
    return rec.durable != before


def mark_durable(
    txn: Any, sql: StoreSql, pipeline: str, marks: Mapping[str, int], fence: int | None
) -> None:
    rec = read_record(txn, sql, pipeline)
    _rules.check_fence(pipeline, rec.lease, fence)
    if _raised(rec, marks):
        _write_record(txn, sql, pipeline, rec)


def reset_step(txn: Any, sql: StoreSql, pipeline: str, rows: int) -> bool:
    """One transaction of ``reset``, removing at most ``rows`` partitions; True when the
    reset is complete.

    Raises the batch id floor to the largest id ever logged, forgets the source, the sinks'
    durable marks and the batch log, and keeps the lease. While partitions remain after this
    step, the record says a reset is under way, so that reads and writes refuse the
    half-reset pipeline.
    """
    rec = read_record(txn, sql, pipeline)
    ((last, _),) = sql.last_batch_id(pipeline).run(txn)
    rec.floor = max(rec.floor, int(last or 0))
    rec.source = None
    rec.durable = {}
    txn.delete(sql.tables.batches, _prefix(pipeline))  # one key range: one mutation
    txn.delete(sql.tables.step_state, _prefix(pipeline))
    tokens = [row[0] for row in sql.some_tokens(pipeline, rows + 1).run(txn)]
    if len(tokens) <= rows:
        # Reading them locked the range, so the range delete removes exactly these.
        txn.delete(sql.tables.partitions, _prefix(pipeline))
        rec.resetting = False
    else:
        txn.delete(sql.tables.partitions, _keys([pipeline, t] for t in tokens[:rows]))
        rec.resetting = True
    _write_record(txn, sql, pipeline, rec)
    return not rec.resetting


# -- ownership and the source definition ----------------------------------------------------


def acquire_lease(
    txn: Any, sql: StoreSql, pipeline: str, owner: str, run_id: str, ttl_ns: int,
    replace: int | None,
) -> Lease:
    rec = read_record(txn, sql, pipeline)
    rec.lease = _rules.new_lease(
        pipeline, rec.lease, owner, run_id, ttl_ns, _now(txn, sql), replace
    )
    _write_record(txn, sql, pipeline, rec)
    return rec.lease


def renew_lease(txn: Any, sql: StoreSql, pipeline: str, lease: Lease, ttl_ns: int) -> Lease:
    rec = read_record(txn, sql, pipeline)
    rec.lease = _rules.renewed(pipeline, rec.lease, lease, ttl_ns, _now(txn, sql))
    _write_record(txn, sql, pipeline, rec)
    return rec.lease


def release_lease(txn: Any, sql: StoreSql, pipeline: str, lease: Lease) -> None:
    rec = read_record(txn, sql, pipeline)
    if rec.lease is not None and rec.lease.token == lease.token:
        rec.lease = attrs.evolve(rec.lease, expires_at=0)
        _write_record(txn, sql, pipeline, rec)


def set_source(txn: Any, sql: StoreSql, pipeline: str, source: str) -> None:
    rec = read_record(txn, sql, pipeline)
    rec.source = source
    _write_record(txn, sql, pipeline, rec)
