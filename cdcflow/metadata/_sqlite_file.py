"""One SQLite store file, open: the URL, the connection, the table layout (created and
upgraded in place), the transactions every statement runs in, and the one place that turns
an error of SQLite into a StoreError naming the file and the fix. The store's operations
(``sqlite.SQLiteStore``) run their SQL through :meth:`SQLiteFile.write` and
:meth:`SQLiteFile.read`; see ``sqlite``'s docstring for the file's faults.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from urllib.parse import quote

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import StoreError, StoreNotFoundError, StoreSetupError
from cdcflow.metadata import _rules

__all__ = ["SCHEMA_VERSION", "SQLiteFile", "parse_url", "sqlite_url"]

#: Version of the table layout this module writes; a file with a newer version is refused.
SCHEMA_VERSION = 4

PREFIX = "sqlite:///"

#: A write that has waited this long (seconds) for another process's write lock says so
#: in a warning, then waits out the rest of its busy timeout.
LOCK_NOTE_AFTER = 2.0

_log = logging.getLogger("cdcflow.store")

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

def sqlite_url(path: str | Path) -> str:
    """The absolute ``sqlite:////...`` URL of a database file."""
    return PREFIX + str(Path(path).expanduser().absolute())


def parse_url(url: str) -> Path:
    if not url.startswith(PREFIX):
        why = "a SQLite URL has three slashes before a relative path, four before an absolute one"
        raise _rules.url_error(url, why)
    rest = url[len(PREFIX):]
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


class SQLiteFile:
    """An open store file. Thread-safe (one connection behind a lock). ``busy_timeout``:
    how long a write waits for another process's transaction before raising StoreError.
    ``create=False`` opens only a file that holds a store of this version, creating and
    changing nothing."""

    def __init__(self, path: Path, *, busy_timeout: float, create: bool) -> None:
        self._path = path
        self._create = create
        self._busy_timeout = busy_timeout
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
                msg += ("choose a writable location (cdcflow run --metadata sqlite:///PATH, "
                        "or pipeline.run(metadata=...))")
                raise StoreSetupError(msg) from e
        # A store this process cannot write is opened read-only: reads (cdcflow status)
        # work, and the first write says what to fix (StoreSetupError).
        self._read_only = _unwritable(self._path) if self._path.is_file() else None
        try:
            conn = self._connect(busy_timeout)
        except sqlite3.Error as e:
            msg = (f"cannot open the SQLite store {self._path}: {e}; check the path and "
                   "permissions, or choose another location (cdcflow run --metadata "
                   "sqlite:///PATH, or pipeline.run(metadata=...))")
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
        with self.write(check_file=False) as c:
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
            msg = (f"{where} stayed locked by another process for {self._busy_timeout:g} s "
                   f"({e}): another run of this pipeline, or a program using the file, "
                   "holds its write lock; a run that is paused or hung (a stopped process, "
                   "a stalled VM) keeps it until it goes on or ends, and --takeover cannot "
                   "break it: end that process (a killed run loses nothing: the next run "
                   "replays its batch), then run again")
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
            setup = True  # a damaged page found later is the same bad file (exit 2)
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

    @property
    def url(self) -> str:
        return sqlite_url(self._path)

    @property
    def path(self) -> Path:
        return self._path

    def connection(self) -> sqlite3.Connection:
        if self._conn is None:
            msg = f"the SQLite store {self._path} is closed; open it again with open_store(url)"
            raise StoreError(msg)
        return self._conn

    @contextmanager
    def write(
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
    def read(self) -> Iterator[sqlite3.Connection]:
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
            conn = self.connection()
            try:
                if begin == "BEGIN":
                    conn.execute(begin)  # a reader in WAL mode waits for no lock
                else:
                    self._begin_writing(conn, begin)
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

    def _begin_writing(self, conn: sqlite3.Connection, begin: str) -> None:
        """``begin`` a write transaction, waiting up to the busy timeout for another
        process's write lock; a wait past LOCK_NOTE_AFTER is logged as it goes on, so a
        run that waits on a paused one says why it is silent."""
        timeout = self._busy_timeout
        if timeout <= LOCK_NOTE_AFTER:
            conn.execute(begin)
            return
        conn.execute(f"PRAGMA busy_timeout = {int(LOCK_NOTE_AFTER * 1000)}")
        try:
            try:
                conn.execute(begin)
                return
            except sqlite3.OperationalError as e:
                if not _error_name(e).startswith(("SQLITE_BUSY", "SQLITE_LOCKED")):
                    raise
            _log.warning(
                "the SQLite store %s is locked by another process (another run of this "
                "pipeline, or a program using the file); waiting up to %g s more for its "
                "write lock. A run that is paused or hung keeps it until it goes on or ends",
                self._path, timeout - LOCK_NOTE_AFTER)
            conn.execute(f"PRAGMA busy_timeout = {int((timeout - LOCK_NOTE_AFTER) * 1000)}")
            conn.execute(begin)
        finally:
            conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")

    def close(self) -> None:
        """Close the connection; later calls raise StoreError. Closing twice is harmless."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

