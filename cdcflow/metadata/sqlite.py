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
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import quote

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import FencedError, StoreError, StoreNotFoundError, StoreSetupError
from cdcflow.metadata import _rules
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

#: Version of the table layout this module writes; a file with a newer version is refused.
SCHEMA_VERSION = 4

_PREFIX = "sqlite:///"
_MAX_ID = (1 << 63) - 1

_SCHEMA = """
CREATE TABLE partitions (
    pipeline         TEXT    NOT NULL,
    token            TEXT    NOT NULL,
    parent_tokens    TEXT    NOT NULL,  -- JSON list of tokens
    start_ns         INTEGER NOT NULL,
    end_ns           INTEGER NOT NULL,  -- exclusive, MAX_NS: no end
    watermark        INTEGER NOT NULL,
    state            TEXT    NOT NULL,
    heartbeat_millis INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    scheduled_at     INTEGER,
    running_at       INTEGER,
    finished_at      INTEGER,
    PRIMARY KEY (pipeline, token)
) WITHOUT ROWID;
CREATE INDEX partitions_by_state ON partitions (pipeline, state, watermark);
CREATE TABLE batches (
    pipeline     TEXT    NOT NULL,
    batch_id     INTEGER NOT NULL,
    end_ns       INTEGER NOT NULL,
    planned_at   INTEGER NOT NULL,
    committed_at INTEGER,               -- NULL while the batch is pending
    slices       TEXT    NOT NULL,      -- JSON list of [token, start, end]
    records      INTEGER NOT NULL DEFAULT 0,
    stats        TEXT,                  -- version 4: JSON batch statistics
    PRIMARY KEY (pipeline, batch_id)
) WITHOUT ROWID;
"""

# Version 2: what survives a reset (the lease, the batch id floor) and the source definition.
_PIPELINES = """
CREATE TABLE IF NOT EXISTS pipelines (
    pipeline       TEXT    NOT NULL PRIMARY KEY,
    lease_owner    TEXT,
    lease_run      TEXT,
    lease_token    INTEGER NOT NULL DEFAULT 0,
    lease_acquired INTEGER,
    lease_renewed  INTEGER,
    lease_expires  INTEGER,
    batch_floor    INTEGER NOT NULL DEFAULT 0,  -- the largest batch id before the last reset
    source         TEXT,                        -- JSON source definition; NULL: unknown
    durable        TEXT,                        -- JSON {sink label: durable batch id}
    step_state     BLOB                         -- version 3: the BatchSteps' state
) WITHOUT ROWID
"""

_PARTITION_COLUMNS = (
    "token, parent_tokens, start_ns, end_ns, watermark, state, heartbeat_millis, "
    "created_at, scheduled_at, running_at, finished_at"
)


def sqlite_url(path: str | Path) -> str:
    """The absolute ``sqlite:////...`` URL of a database file."""
    return _PREFIX + str(Path(path).expanduser().absolute())


def _parse_url(url: str) -> Path:
    if not url.startswith(_PREFIX):
        why = "a SQLite URL has three slashes before a relative path, four before an absolute one"
        raise _rules.url_error(url, why)
    rest = url[len(_PREFIX):]
    if not rest or rest == "/":
        raise _rules.url_error(url, "the SQLite URL names no file")
    if "?" in rest or "#" in rest:
        raise _rules.url_error(url, "SQLite URLs take no query parameters")
    if rest == ":memory:":
        raise _rules.url_error(url, "for a store in memory use memory:// or memory://NAME")
    return Path(rest).expanduser()


def _writable(path: Path) -> bool:
    """access(2) for writing with the effective ids: it also answers no for an immutable
    file (``chattr +i``) and a read-only mount, for root too."""
    if os.access in os.supports_effective_ids:
        return os.access(path, os.W_OK, effective_ids=True)
    return os.access(path, os.W_OK)  # pragma: no cover - every Linux and macOS has them


def _unwritable(path: Path) -> str | None:
    """Why this process cannot write the existing store file ``path`` (SQLite in WAL mode
    also writes ``-wal`` and ``-shm`` beside it, creating them in its directory), or None."""
    if not _writable(path):
        return f"the file {path} is not writable"
    missing = False
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            if not _writable(side):
                return f"the file {side} is not writable"
        else:
            missing = True
    if missing and not _writable(path.parent):
        return f"its directory {path.parent} is not writable"
    return None


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _error_name(e: sqlite3.Error) -> str:
    name = getattr(e, "sqlite_errorname", None)
    if isinstance(name, str):
        return name
    text = str(e).lower()  # an error raised by the sqlite3 module itself has no code
    for needle, guess in (("readonly", "SQLITE_READONLY"), ("locked", "SQLITE_BUSY"),
                          ("disk i/o", "SQLITE_IOERR"), ("is full", "SQLITE_FULL")):
        if needle in text:
            return guess
    return ""


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
    for another process's transaction before raising StoreError. ``create=False`` opens
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
        self._path = Path(path).expanduser().absolute()
        self._create = create
        self._clock = clock
        self._batch_log_size = _rules.check_log_size(batch_log_size)
        self._lock = threading.RLock()
        self._opening = True  # every failure until the store is open is a setup error
        self._wrote = False  # a write committed since: a refused write is no setup error
        if not create:
            if not self._path.is_file():
                what = "it is a directory" if self._path.is_dir() else "no such file"
                raise self._not_found(what)
        else:
            try:
                self._path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                msg = f"cannot create the directory of the SQLite store {self._path}: {e}; "
                msg += "choose a writable location"
                raise StoreSetupError(msg) from e
        # A store this process cannot write is opened read-only: reads (cdcflow status)
        # work, and the first write says what to fix (StoreSetupError).
        self._read_only = _unwritable(self._path) if self._path.is_file() else None
        try:
            conn = self._connect(busy_timeout)
        except sqlite3.Error as e:
            msg = f"cannot open the SQLite store {self._path}: {e}; check the path and permissions"
            raise StoreSetupError(msg) from e
        self._conn: sqlite3.Connection | None = conn
        try:
            self._setup(conn, busy_timeout)
        except BaseException:
            conn.close()
            self._conn = None
            raise
        # Which file this store writes: a write checks that the path still names it.
        self._file = _file_id(self._path)
        self._opening = False
        self._wrote = False  # setting the file up may have written nothing

    def _connect(self, busy_timeout: float) -> sqlite3.Connection:
        # isolation_level=None: transactions are begun and ended explicitly below.
        if self._read_only is None and self._create:
            return sqlite3.connect(
                self._path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )
        if self._read_only is None:  # mode=rw: a file removed meanwhile is not made anew
            return sqlite3.connect(f"file:{quote(str(self._path))}?mode=rw", uri=True,
                                   timeout=busy_timeout, isolation_level=None,
                                   check_same_thread=False)
        uri = f"file:{quote(str(self._path))}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            # No -shm, and it cannot be created (a read-only directory). Without a -wal
            # the file holds every commit and no run can write it: read it as immutable.
            conn.close()
            if self._path.with_name(self._path.name + "-wal").exists():
                raise
        return sqlite3.connect(f"{uri}&immutable=1", uri=True, timeout=busy_timeout,
                               isolation_level=None, check_same_thread=False)

    def _setup(self, conn: sqlite3.Connection, busy_timeout: float) -> None:
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            if self._read_only is not None or not self._create:
                self._check_existing(conn)
            if self._read_only is not None:
                return
            if not self._create:  # a store of this version is in WAL mode already
                conn.execute("PRAGMA synchronous = FULL")
                return
            # Switching to WAL does not wait on the busy timeout: two processes opening a
            # new file at once would see "database is locked". Retry it within the timeout.
            RetryPolicy(attempts=1_000, initial=0.01, maximum=0.2, deadline=busy_timeout).call(
                lambda: conn.execute("PRAGMA journal_mode = WAL"),
                retry_if=lambda e: isinstance(e, sqlite3.OperationalError) and "locked" in str(e),
            )
            # FULL: a committed plan must survive power loss too, because sinks may have
            # committed output under its batch id.
            conn.execute("PRAGMA synchronous = FULL")
        except sqlite3.DatabaseError as e:
            raise self._store_error(e) from e
        with self._write(check_file=False) as c:
            c.execute("CREATE TABLE IF NOT EXISTS cdcflow_schema (version INTEGER NOT NULL)")
            row = c.execute("SELECT MAX(version) FROM cdcflow_schema").fetchone()
            version = row[0] if row else None
            if version is None:
                for statement in _SCHEMA.split(";"):  # the schema has no ";" in comments
                    if statement.strip():
                        c.execute(statement)
            if version is None or version < SCHEMA_VERSION:
                c.execute(_PIPELINES)  # version 1 -> 2: a table added, nothing rewritten
                columns = {row[1] for row in c.execute("PRAGMA table_info(pipelines)")}
                if "step_state" not in columns:  # version 2 -> 3: a column added
                    c.execute("ALTER TABLE pipelines ADD COLUMN step_state BLOB")
                columns = {row[1] for row in c.execute("PRAGMA table_info(batches)")}
                if "stats" not in columns:  # version 3 -> 4: a column added
                    c.execute("ALTER TABLE batches ADD COLUMN stats TEXT")
                c.execute("INSERT INTO cdcflow_schema (version) VALUES (?)", (SCHEMA_VERSION,))
            elif version > SCHEMA_VERSION:
                raise self._newer(version)

    def _check_existing(self, conn: sqlite3.Connection) -> None:
        """A read-only file, or one opened with ``create=False``, must hold a store of this
        version already: it is not set up or upgraded."""
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        row = (conn.execute("SELECT MAX(version) FROM cdcflow_schema").fetchone()
               if "cdcflow_schema" in tables else None)
        version = row[0] if row else None
        if version is not None and version > SCHEMA_VERSION:
            raise self._newer(version)
        if version != SCHEMA_VERSION and not self._create:
            if version is None:
                raise self._not_found("it has no cdcflow tables")
            msg = (f"the SQLite store {self._path} has schema version {version}, which this "
                   f"cdcflow upgrades in place when it writes: upgrade it with `cdcflow "
                   f"metadata init {self.url}` (or a run of a pipeline), then try again")
            raise StoreSetupError(msg)
        if version != SCHEMA_VERSION:
            what = "holds no cdcflow store" if version is None else (
                f"has schema version {version}, which this cdcflow upgrades in place")
            msg = f"the SQLite store {self._path} {what}, but {self._read_only}; "
            msg += "make it writable, or point the URL at a writable location"
            raise StoreSetupError(msg)

    def _not_found(self, why: str) -> StoreNotFoundError:
        return StoreNotFoundError(
            f"{self.url} holds no cdcflow metadata ({why}): check the URL, or run a pipeline "
            f"(or `cdcflow metadata init {self.url}`) to create it"
        )

    def _newer(self, version: int) -> StoreSetupError:
        return StoreSetupError(
            f"the SQLite store {self._path} has schema version {version}, written by a "
            f"newer cdcflow; this one reads up to version {SCHEMA_VERSION}: upgrade "
            "cdcflow, or use another file"
        )

    def _store_error(self, e: sqlite3.Error) -> StoreError:
        """The StoreError an error of SQLite stands for: the one place that names causes
        and fixes. StoreSetupError (exit 2) while opening, and for a refused write before
        any write of this store succeeded; never for a lock held too long."""
        name = _error_name(e)
        where = f"the SQLite store {self._path}"
        setup = self._opening
        if name.startswith(("SQLITE_READONLY", "SQLITE_PERM", "SQLITE_CANTOPEN", "SQLITE_AUTH")):
            msg = (f"{where} cannot be written ({e}): make the file, its -wal and -shm files "
                   "and its directory writable by this user, or point the URL at a writable "
                   "location")
            setup = setup or not self._wrote
        elif name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
            msg = (f"{where} stayed locked by another process ({e}); stop the other run of "
                   "this pipeline or raise busy_timeout")
            setup = False  # contention, not a store that cannot be used
        elif name.startswith("SQLITE_FULL"):
            msg = f"the disk of {where} is full ({e}); free space, then run again"
        elif name.startswith("SQLITE_IOERR"):
            msg = (f"{where} failed to read or write ({e}); check the disk, and that the "
                   "file and its -wal and -shm files are still there and writable, then run "
                   "again")
        elif self._opening or name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")):
            msg = (f"{self._path} is not a usable SQLite database ({e}); point the URL at "
                   "a new file or at a cdcflow store")
        else:
            msg = f"{where} failed: {type(e).__name__}: {e}"
        return StoreSetupError(msg) if setup else StoreError(msg)

    def _check_file(self, error: type[StoreError]) -> None:
        """Refuse to write when the path no longer names the file this store opened."""
        if self._file is None or _file_id(self._path) == self._file:
            return
        msg = (
            f"the SQLite store {self._path} was deleted or replaced while this process used "
            "it; this run stops without writing anything more: a new file there is a new, "
            "empty store (another run may have started on it), so stop every run of this "
            "pipeline and run again with the store you mean to keep"
        )
        raise error(msg)

    @classmethod
    def from_url(cls, url: str, *, create: bool = True) -> SQLiteStore:
        """``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db``; ``create``:
        as the constructor's."""
        return cls(_parse_url(url), create=create)

    @property
    def url(self) -> str:
        return sqlite_url(self._path)

    @property
    def path(self) -> Path:
        return self._path

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            msg = f"the SQLite store {self._path} is closed; open it again with open_store(url)"
            raise StoreError(msg)
        return self._conn

    @contextmanager
    def _write(
        self, *, check_file: bool = True, gone: type[StoreError] = StoreError
    ) -> Iterator[sqlite3.Connection]:
        """One write transaction; IMMEDIATE takes the write lock up front, so a
        read-then-write check (pending plan, watermark) cannot race another process.
        ``check_file``: first make sure the path still names the file opened (``gone``
        is raised otherwise)."""
        if self._read_only is not None:
            msg = (f"the SQLite store {self._path} cannot be written: {self._read_only}; "
                   "make it writable by this user, or point the URL at a writable location")
            raise StoreSetupError(msg)
        with self._transaction("BEGIN IMMEDIATE", gone if check_file else None) as conn:
            yield conn

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """A consistent snapshot for reads that span several statements."""
        with self._transaction("BEGIN") as conn:
            yield conn

    @contextmanager
    def _transaction(
        self, begin: str, gone: type[StoreError] | None = None
    ) -> Iterator[sqlite3.Connection]:
        """Every statement of the store runs in here: an error of SQLite leaves nothing
        written and becomes a StoreError (``_store_error``)."""
        with self._lock:
            conn = self._connection()
            try:
                conn.execute(begin)
                if gone is not None:
                    self._check_file(gone)  # under the write lock: one stat per write
                yield conn
                conn.execute("COMMIT")
            except BaseException as e:
                if conn.in_transaction:
                    # A failed ROLLBACK: SQLite rolled back on its own, or the connection
                    # is unusable; either way the error to report is the first one.
                    with suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error):
                    raise self._store_error(e) from e
                raise
            if begin != "BEGIN":
                self._wrote = True

    def partitions(self, pipeline: str) -> list[PartitionMetadata]:
        with self._read() as c:
            rows = c.execute(
                f"SELECT {_PARTITION_COLUMNS} FROM partitions WHERE pipeline = ? "
                "ORDER BY start_ns, token",
                (pipeline,),
            ).fetchall()
        return [_partition(r) for r in rows]

    def insert_partitions(self, pipeline: str, partitions: Sequence[PartitionMetadata]) -> int:
        with self._write() as c:
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
        with self._read() as c:
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
        with self._read() as c:
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
        with self._write() as c:
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
        with self._write() as c:
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
        with self._write() as c:
            cur = c.executemany(
                "DELETE FROM partitions WHERE pipeline = ? AND token = ?",
                [(pipeline, t) for t in set(tokens)],
            )
            return max(cur.rowcount, 0)

    def batches(self, pipeline: str, limit: int = 20) -> list[BatchRecord]:
        with self._read() as c:
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
        with self._read() as c:
            rows = c.execute(
                "SELECT pipeline FROM partitions UNION SELECT pipeline FROM batches "
                "UNION SELECT pipeline FROM pipelines ORDER BY 1"
            ).fetchall()
        return [r[0] for r in rows]

    def reset(self, pipeline: str) -> None:
        with self._write() as c:
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
        with self._read() as c:
            return self._lease(c, pipeline)

    def acquire_lease(
        self, pipeline: str, owner: str, run_id: str, ttl_ns: int, *, replace: int | None = None
    ) -> Lease:
        with self._write() as c:
            lease = _rules.new_lease(
                pipeline, self._lease(c, pipeline), owner, run_id, ttl_ns, self._clock(), replace
            )
            self._store_lease(c, pipeline, lease)
            return lease

    def renew_lease(self, pipeline: str, lease: Lease, ttl_ns: int) -> Lease:
        # A deleted or replaced file fences this run out: the engine's heartbeat stops it.
        with self._write(gone=FencedError) as c:
            renewed = _rules.renewed(pipeline, self._lease(c, pipeline), lease, ttl_ns,
                                     self._clock())
            self._store_lease(c, pipeline, renewed)
            return renewed

    def release_lease(self, pipeline: str, lease: Lease) -> None:
        # Unchecked: ending a lease in a file that was deleted or replaced changes nothing.
        with self._write(check_file=False) as c:
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
        with self._read() as c:
            return self._marks(c, pipeline)

    def mark_durable(
        self, pipeline: str, marks: Mapping[str, int], *, fence: int | None = None
    ) -> None:
        with self._write() as c:
            _rules.check_fence(pipeline, self._lease(c, pipeline), fence)
            self._raise_marks(c, pipeline, marks)

    def step_state(self, pipeline: str) -> bytes | None:
        with self._read() as c:
            row = c.execute(
                "SELECT step_state FROM pipelines WHERE pipeline = ?", (pipeline,)
            ).fetchone()
        return None if row is None or row[0] is None else bytes(row[0])

    def logged_plan(self, pipeline: str, batch_id: int) -> BatchPlan | None:
        with self._read() as c:
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
        with self._read() as c:
            row = c.execute(
                "SELECT source FROM pipelines WHERE pipeline = ?", (pipeline,)
            ).fetchone()
        return None if row is None else row[0]

    def set_source(self, pipeline: str, source: str) -> None:
        with self._write() as c:
            self._ensure_row(c, pipeline)
            c.execute("UPDATE pipelines SET source = ? WHERE pipeline = ?", (source, pipeline))

    def close(self) -> None:
        """Close the connection; later calls raise StoreError. Closing twice is harmless."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
