"""SQLiteStore: the embedded MetadataStore (``sqlite:///relative.db``, ``sqlite:////abs.db``).

One file holds every pipeline's partitions and batch log. The database runs in WAL mode
with a busy timeout, and every write is one ``BEGIN IMMEDIATE`` transaction, so several
processes may open the same file: writers queue on the lock instead of failing, and a
process that crashes mid-write leaves the previous committed state. Positions are stored as
INTEGER nanoseconds (MAX_NS fits SQLite's signed 64-bit integers).

Faults of the file. Every ``sqlite3`` error becomes a StoreError naming the file and the fix
in one place (:meth:`SQLiteStore._transaction`). A file (or directory) this process cannot
write is opened read-only, so ``cdcflow status`` reads it; its first write raises
StoreSetupError. The store remembers which file it opened (device and inode): a write after
the file was deleted or replaced under it is refused (FencedError from ``renew_lease``, so a
run stops within a third of its lease), instead of going on in a file no one else sees
while a second run starts on a new one.

Opened with ``create=False`` (``cdcflow status``), the store creates and changes nothing:
a file that does not exist, or that holds no cdcflow store, raises StoreNotFoundError,
and a store of an earlier version is not upgraded (StoreSetupError names the upgrade).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from cdcflow.errors import FencedError
from cdcflow.metadata import _rules
from cdcflow.metadata._sqlite_file import SCHEMA_VERSION, SQLiteFile, parse_url, sqlite_url
from cdcflow.model import (
    BatchPlan,
    BatchRecord,
    Lease,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
    Slice,
)

__all__ = ["SCHEMA_VERSION", "SQLiteStore", "sqlite_url"]

_MAX_ID = (1 << 63) - 1

_PARTITION_COLUMNS = (
    "token, parent_tokens, start_ns, end_ns, watermark, state, heartbeat_millis, "
    "created_at, scheduled_at, running_at, finished_at"
)


def _partition(row: Sequence[Any]) -> PartitionMetadata:
    return PartitionMetadata(
        token=row[0], parent_tokens=tuple(json.loads(row[1])), start=row[2], end=row[3],
        watermark=row[4], state=PartitionState(row[5]), heartbeat_millis=row[6],
        created_at=row[7], scheduled_at=row[8], running_at=row[9], finished_at=row[10],
    )


def _partition_row(pipeline: str, p: PartitionMetadata) -> tuple[Any, ...]:
    return (
        pipeline, p.token, json.dumps(list(p.parent_tokens)), p.start, p.end, p.watermark,
        str(p.state), p.heartbeat_millis, p.created_at, p.scheduled_at, p.running_at,
        p.finished_at,
    )


class SQLiteStore:
    """A MetadataStore in one SQLite file; see the protocol for the contract.

    Thread-safe (one connection behind a lock). ``busy_timeout`` is how long a write waits
    for another process's transaction before raising StoreError (a wait of more than 2 s
    is logged as it goes on). ``create=False`` opens
    only a file that holds a store of this version, creating and changing nothing (see the
    module docstring).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        busy_timeout: float = 30.0,
        clock: Callable[[], int] = time.time_ns,
        batch_log_size: int = _rules.DEFAULT_BATCH_LOG_SIZE,
        create: bool = True,
    ) -> None:
        self._clock = clock
        self._batch_log_size = _rules.check_log_size(batch_log_size)
        self._db = SQLiteFile(Path(path).expanduser().absolute(), busy_timeout=busy_timeout,
                              create=create)

    @classmethod
    def from_url(cls, url: str, *, create: bool = True) -> SQLiteStore:
        """``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``; ``create``:
        as the constructor's."""
        return cls(parse_url(url), create=create)

    @property
    def url(self) -> str:
        return self._db.url

    @property
    def path(self) -> Path:
        return self._db.path

    def partitions(self, pipeline: str) -> list[PartitionMetadata]:
        with self._db.read() as c:
            rows = c.execute(
                f"SELECT {_PARTITION_COLUMNS} FROM partitions WHERE pipeline = ? "
                "ORDER BY start_ns, token",
                (pipeline,),
            ).fetchall()
        return [_partition(r) for r in rows]

    def insert_partitions(self, pipeline: str, partitions: Sequence[PartitionMetadata]) -> int:
        with self._db.write() as c:
            return self._insert(c, pipeline, partitions)

    @staticmethod
    def _insert(
        c: sqlite3.Connection, pipeline: str, partitions: Sequence[PartitionMetadata]
    ) -> int:
        cur = c.executemany(
            "INSERT OR IGNORE INTO partitions VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [_partition_row(pipeline, p) for p in partitions],
        )
        return max(cur.rowcount, 0)

    def pending_plan(self, pipeline: str) -> BatchPlan | None:
        with self._db.read() as c:
            return self._pending_plan(c, pipeline)

    @staticmethod
    def _pending_plan(c: sqlite3.Connection, pipeline: str) -> BatchPlan | None:
        row = c.execute(
            "SELECT batch_id, end_ns, slices, planned_at FROM batches "
            "WHERE pipeline = ? AND committed_at IS NULL ORDER BY batch_id DESC LIMIT 1",
            (pipeline,),
        ).fetchone()
        if row is None:
            return None
        slices = tuple(Slice(t, s, e) for t, s, e in json.loads(row[2]))
        return BatchPlan(batch_id=row[0], end=row[1], slices=slices, planned_at=row[3])

    def last_batch_id(self, pipeline: str) -> int:
        with self._db.read() as c:
            return self._last_batch_id(c, pipeline)

    @staticmethod
    def _last_batch_id(c: sqlite3.Connection, pipeline: str) -> int:
        row = c.execute(
            "SELECT MAX(id) FROM (SELECT MAX(batch_id) AS id FROM batches WHERE pipeline = ? "
            "UNION ALL SELECT batch_floor FROM pipelines WHERE pipeline = ?)",
            (pipeline, pipeline),
        ).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def _get(self, c: sqlite3.Connection, pipeline: str, token: str) -> PartitionMetadata | None:
        row = c.execute(
            f"SELECT {_PARTITION_COLUMNS} FROM partitions WHERE pipeline = ? AND token = ?",
            (pipeline, token),
        ).fetchone()
        return _partition(row) if row else None

    def _put(self, c: sqlite3.Connection, pipeline: str, p: PartitionMetadata) -> None:
        c.execute(
            "UPDATE partitions SET watermark = ?, state = ?, scheduled_at = ?, running_at = ?, "
            "finished_at = ? WHERE pipeline = ? AND token = ?",
            (p.watermark, str(p.state), p.scheduled_at, p.running_at, p.finished_at,
             pipeline, p.token),
        )

    def write_plan(
        self,
        pipeline: str,
        plan: BatchPlan,
        transitions: Mapping[str, PartitionState],
        *,
        fence: int | None = None,
    ) -> None:
        with self._db.write() as c:
            _rules.check_fence(pipeline, self._lease(c, pipeline), fence)
            pending = self._pending_plan(c, pipeline)
            if _rules.is_pending(plan, pending):
                return
            _rules.check_new_plan(
                pipeline, plan, self._last_batch_id(c, pipeline),
                pending.batch_id if pending else None,
            )
            now = self._clock()
            for token, state in transitions.items():
                current = self._get(c, pipeline, token)
                if current is None:
                    raise _rules.unknown_partition(pipeline, token)
                self._put(c, pipeline, _rules.transition(pipeline, current, state, now))
            slices = json.dumps([[s.token, s.start, s.end] for s in plan.slices])
            c.execute(
                "INSERT INTO batches (pipeline, batch_id, end_ns, planned_at, slices) "
                "VALUES (?, ?, ?, ?, ?)",
                (pipeline, plan.batch_id, plan.end, plan.planned_at or now, slices),
            )
            # Keep the newest batch_log_size entries (all older ones are committed), and
            # every batch a sink has not made durable (recovery may replay it).
            marks = self._marks(c, pipeline)
            keep_above = min(marks.values()) if marks else _MAX_ID
            c.execute(
                "DELETE FROM batches WHERE pipeline = ? AND committed_at IS NOT NULL AND "
                "batch_id <= ? AND batch_id < (SELECT batch_id FROM batches WHERE pipeline = ? "
                "ORDER BY batch_id DESC LIMIT 1 OFFSET ?)",
                (pipeline, keep_above, pipeline, self._batch_log_size - 1),
            )

    def commit_batch(
        self,
        pipeline: str,
        batch_id: int,
        updates: Sequence[PartitionUpdate],
        children: Sequence[PartitionMetadata],
        records: int = 0,
        *,
        fence: int | None = None,
        durable: Mapping[str, int] | None = None,
        state: bytes | None = None,
        stats: Mapping[str, float] | None = None,
    ) -> bool:
        with self._db.write() as c:
            _rules.check_fence(pipeline, self._lease(c, pipeline), fence)
            row = c.execute(
                "SELECT committed_at FROM batches WHERE pipeline = ? AND batch_id = ?",
                (pipeline, batch_id),
            ).fetchone()
            if row is None:
                raise _rules.not_planned(pipeline, batch_id)
            if row[0] is not None:
                return False
            now = self._clock()
            for u in updates:
                if not u.finished:  # the usual case: one statement, no read
                    cur = c.execute(
                        "UPDATE partitions SET watermark = ? WHERE pipeline = ? AND token = ? "
                        "AND watermark <= ?", (u.watermark, pipeline, u.token, u.watermark),
                    )
                    if cur.rowcount == 1:
                        continue
                # finished, or not updated: unknown, or a regression (said below)
                current = self._get(c, pipeline, u.token)
                if current is None:
                    raise _rules.unknown_partition(pipeline, u.token)
                if u.watermark < current.watermark:
                    raise _rules.regression(pipeline, u.token, current.watermark, u.watermark)
                current = attrs.evolve(current, watermark=u.watermark)
                if u.finished:
                    current = _rules.transition(pipeline, current, PartitionState.FINISHED, now)
                self._put(c, pipeline, current)
            self._insert(c, pipeline, children)
            c.execute(
                "UPDATE batches SET committed_at = ?, records = ?, stats = ? "
                "WHERE pipeline = ? AND batch_id = ?",
                (now, records, _rules.stats_text(stats), pipeline, batch_id),
            )
            if durable:
                self._raise_marks(c, pipeline, durable)
            if state is not None:
                self._ensure_row(c, pipeline)
                c.execute("UPDATE pipelines SET step_state = ? WHERE pipeline = ?",
                          (state, pipeline))
            return True

    def delete_partitions(self, pipeline: str, tokens: Sequence[str]) -> int:
        with self._db.write() as c:
            cur = c.executemany(
                "DELETE FROM partitions WHERE pipeline = ? AND token = ?",
                [(pipeline, t) for t in set(tokens)],
            )
            return max(cur.rowcount, 0)

    def batches(self, pipeline: str, limit: int = 20) -> list[BatchRecord]:
        with self._db.read() as c:
            rows = c.execute(
                "SELECT batch_id, end_ns, planned_at, committed_at, slices, records, stats "
                "FROM batches WHERE pipeline = ? ORDER BY batch_id DESC LIMIT ?",
                (pipeline, max(limit, 0)),
            ).fetchall()
        return [
            BatchRecord(
                batch_id=r[0], end=r[1], planned_at=r[2], committed_at=r[3],
                slices=len(json.loads(r[4])), records=r[5], stats=_rules.parse_stats(r[6]),
            )
            for r in rows
        ]

    def pipelines(self) -> list[str]:
        with self._db.read() as c:
            rows = c.execute(
                "SELECT pipeline FROM partitions UNION SELECT pipeline FROM batches "
                "UNION SELECT pipeline FROM pipelines ORDER BY 1"
            ).fetchall()
        return [r[0] for r in rows]

    def reset(self, pipeline: str) -> None:
        with self._db.write() as c:
            floor = self._last_batch_id(c, pipeline)
            self._ensure_row(c, pipeline)
            c.execute(
                "UPDATE pipelines SET batch_floor = ?, source = NULL, durable = NULL, "
                "step_state = NULL WHERE pipeline = ?",
                (floor, pipeline),
            )
            c.execute("DELETE FROM partitions WHERE pipeline = ?", (pipeline,))
            c.execute("DELETE FROM batches WHERE pipeline = ?", (pipeline,))
            c.execute(  # a record that holds nothing is no stored state
                "DELETE FROM pipelines WHERE pipeline = ? AND lease_owner IS NULL AND "
                "batch_floor = 0 AND source IS NULL AND durable IS NULL AND step_state IS NULL",
                (pipeline,),
            )

    # -- ownership and the source definition ------------------------------------------------

    @staticmethod
    def _ensure_row(c: sqlite3.Connection, pipeline: str) -> None:
        c.execute("INSERT OR IGNORE INTO pipelines (pipeline) VALUES (?)", (pipeline,))

    @staticmethod
    def _lease(c: sqlite3.Connection, pipeline: str) -> Lease | None:
        row = c.execute(
            "SELECT lease_owner, lease_run, lease_token, lease_acquired, lease_renewed, "
            "lease_expires FROM pipelines WHERE pipeline = ?",
            (pipeline,),
        ).fetchone()
        if row is None or row[0] is None:
            return None
        return Lease(row[0], row[1], row[2], row[3], row[4], row[5])

    def _store_lease(self, c: sqlite3.Connection, pipeline: str, lease: Lease) -> None:
        self._ensure_row(c, pipeline)
        c.execute(
            "UPDATE pipelines SET lease_owner = ?, lease_run = ?, lease_token = ?, "
            "lease_acquired = ?, lease_renewed = ?, lease_expires = ? WHERE pipeline = ?",
            (lease.owner, lease.run_id, lease.token, lease.acquired_at, lease.renewed_at,
             lease.expires_at, pipeline),
        )

    def lease(self, pipeline: str) -> Lease | None:
        with self._db.read() as c:
            return self._lease(c, pipeline)

    def acquire_lease(
        self, pipeline: str, owner: str, run_id: str, ttl_ns: int, *, replace: int | None = None
    ) -> Lease:
        with self._db.write() as c:
            lease = _rules.new_lease(
                pipeline, self._lease(c, pipeline), owner, run_id, ttl_ns, self._clock(), replace
            )
            self._store_lease(c, pipeline, lease)
            return lease

    def renew_lease(self, pipeline: str, lease: Lease, ttl_ns: int) -> Lease:
        # A deleted or replaced file fences this run out: the engine's heartbeat stops it.
        with self._db.write(gone=FencedError) as c:
            renewed = _rules.renewed(pipeline, self._lease(c, pipeline), lease, ttl_ns,
                                     self._clock())
            self._store_lease(c, pipeline, renewed)
            return renewed

    def release_lease(self, pipeline: str, lease: Lease) -> None:
        # Unchecked: ending a lease in a file that was deleted or replaced changes nothing.
        with self._db.write(check_file=False) as c:
            c.execute(
                "UPDATE pipelines SET lease_expires = 0 WHERE pipeline = ? AND lease_token = ?",
                (pipeline, lease.token),
            )

    @staticmethod
    def _marks(c: sqlite3.Connection, pipeline: str) -> dict[str, int]:
        row = c.execute(
            "SELECT durable FROM pipelines WHERE pipeline = ?", (pipeline,)
        ).fetchone()
        return {} if row is None or row[0] is None else dict(json.loads(row[0]))

    def _raise_marks(self, c: sqlite3.Connection, pipeline: str, marks: Mapping[str, int]
                     ) -> None:
        stored = self._marks(c, pipeline)
        _rules.raise_marks(stored, marks)
        self._ensure_row(c, pipeline)
        c.execute("UPDATE pipelines SET durable = ? WHERE pipeline = ?",
                  (json.dumps(stored, sort_keys=True), pipeline))

    def durable_marks(self, pipeline: str) -> dict[str, int]:
        with self._db.read() as c:
            return self._marks(c, pipeline)

    def mark_durable(
        self, pipeline: str, marks: Mapping[str, int], *, fence: int | None = None
    ) -> None:
        with self._db.write() as c:
            _rules.check_fence(pipeline, self._lease(c, pipeline), fence)
            self._raise_marks(c, pipeline, marks)

    def step_state(self, pipeline: str) -> bytes | None:
        with self._db.read() as c:
            row = c.execute(
                "SELECT step_state FROM pipelines WHERE pipeline = ?", (pipeline,)
            ).fetchone()
        return None if row is None or row[0] is None else bytes(row[0])

    def logged_plan(self, pipeline: str, batch_id: int) -> BatchPlan | None:
        with self._db.read() as c:
            row = c.execute(
                "SELECT batch_id, end_ns, slices, planned_at FROM batches "
                "WHERE pipeline = ? AND batch_id = ?",
                (pipeline, batch_id),
            ).fetchone()
        if row is None:
            return None
        slices = tuple(Slice(t, s, e) for t, s, e in json.loads(row[2]))
        return BatchPlan(batch_id=row[0], end=row[1], slices=slices, planned_at=row[3])

    def source(self, pipeline: str) -> str | None:
        with self._db.read() as c:
            row = c.execute(
                "SELECT source FROM pipelines WHERE pipeline = ?", (pipeline,)
            ).fetchone()
        return None if row is None else row[0]

    def set_source(self, pipeline: str, source: str) -> None:
        with self._db.write() as c:
            self._ensure_row(c, pipeline)
            c.execute("UPDATE pipelines SET source = ? WHERE pipeline = ?", (source, pipeline))

    def close(self) -> None:
        """Close the connection; later calls raise StoreError. Closing twice is harmless."""
        self._db.close()
