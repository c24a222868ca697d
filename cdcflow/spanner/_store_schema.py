"""Tables, URL, value conversions, schema creation and bounded RPCs of the Spanner
metadata store.

The partition table has Beam's PartitionMetadata columns (so Beam's tooling and queries
read it) plus ``PipelineName`` leading the key, because one store serves many pipelines,
and ``GcAfter``, the column of its row deletion policy (see the store's module docstring).
Positions are TIMESTAMP values that keep their nanoseconds. The statements of both dialects
are in :mod:`cdcflow.spanner._store_sql`. google-cloud-spanner is imported lazily.

Bounded RPCs. The stock client retries on its own: UNAVAILABLE commits for up to an hour,
most other calls for 30 s, and streaming reads restart after UNAVAILABLE without bound or
delay. The store retries with its one policy instead, so every RPC it makes here goes out
with ``retry=None`` and a deadline (:func:`bound_rpcs`, :func:`missing_database`,
:func:`ensure_schema`). Within :func:`call_deadline` a thread's RPCs get a shorter one:
the lease's small transactions must notice a dead connection well before the lease lapses.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from cdcflow.errors import BrokenCall, StoreSetupError
from cdcflow.metadata import _rules
from cdcflow.model import (
    BatchPlan,
    Lease,
    PartitionMetadata,
    PartitionState,
    Slice,
    Timestamp,
)
from cdcflow.spanner._store_sql import GOOGLE_SQL, POSTGRESQL, Dialect, StoreSql, Tables
from cdcflow.spanner.connection import Connection, connection_api
from cdcflow.spanner.retry import is_transient
from cdcflow.spanner.transport import emulator_host

__all__ = [
    "BATCH_COLUMNS",
    "DATABASE_PATH",
    "DEFAULT_TABLE",
    "PARTITION_COLUMNS",
    "PIPELINE_COLUMNS",
    "STEP_STATE_COLUMNS",
    "TABLE_NAME",
    "BrokenCall",
    "bound_rpcs",
    "data_connection",
    "detect_dialect",
    "ensure_schema",
    "missing_database",
    "opt_ns",
    "parse_spanner_url",
    "row_to_lease",
    "row_to_partition",
    "row_to_plan",
    "schema_changes",
    "to_ns",
    "to_spanner",
    "transient",
    "use_session_pool_on_emulator",
]

#: Table name used when the URL has no ``?table=``.
DEFAULT_TABLE = "CdcflowPartitions"

_PROJECT = r"[a-z][a-z0-9.:-]{0,62}[a-z0-9]"
_INSTANCE = r"[a-z][a-z0-9-]{0,62}[a-z0-9]"
_DATABASE = r"[a-z][a-z0-9_-]{0,28}[a-z0-9]"
DATABASE_PATH = re.compile(
    rf"^projects/({_PROJECT})/instances/({_INSTANCE})/databases/({_DATABASE})$"
)
# At most 96 characters, leaving room for the suffixes of the companion tables and indexes
# (``_ByStateWatermark`` is the longest; Spanner allows 128).
TABLE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,95}$")

PARTITION_COLUMNS = (
    "PipelineName", "PartitionToken", "ParentTokens", "StartTimestamp", "EndTimestamp",
    "HeartbeatMillis", "State", "Watermark", "CreatedAt", "ScheduledAt", "RunningAt",
    "FinishedAt",
)
BATCH_COLUMNS = (
    "PipelineName", "BatchId", "EndTimestamp", "SliceTokens", "SliceStarts", "SliceEnds",
    "SliceCount", "PlannedAt", "CommittedAt", "Records",
)
PIPELINE_COLUMNS = (
    "PipelineName", "LeaseOwner", "LeaseRunId", "LeaseToken", "LeaseAcquiredAt",
    "LeaseRenewedAt", "LeaseExpiresAt", "BatchFloor", "Source", "Resetting", "DurableMarks",
)


STEP_STATE_COLUMNS = ("PipelineName", "Chunk", "Data")


def parse_spanner_url(url: str) -> tuple[str, str]:
    """Split ``spanner://projects/P/instances/I/databases/D[?table=NAME]`` into
    ``(database path, table name)``; a malformed URL raises StoreURLError with the forms."""
    if not url.startswith("spanner://"):
        raise _rules.url_error(url, "a Spanner store URL starts with spanner://")
    rest = url[len("spanner://"):]
    path, _, query = rest.partition("?")
    if DATABASE_PATH.match(path) is None:
        why = (
            "the Spanner database is written projects/PROJECT/instances/INSTANCE/databases/"
            "DATABASE, with Spanner's ids: lower-case letters, digits and hyphens (and '_' in "
            "a database), starting with a letter; a project and an instance 2-64 "
            "characters, a database 2-30"
        )
        parts = path.split("/")
        if len(parts) == 6 and parts[0::2] == ["projects", "instances", "databases"]:
            for kind, value, rule in zip(("project", "instance", "database"), parts[1::2],
                                         (_PROJECT, _INSTANCE, _DATABASE), strict=True):
                if re.fullmatch(rule, value) is None:
                    why = f"the {kind} id {value!r} is not one Spanner takes; {why}"
                    break
        raise _rules.url_error(url, why)
    table = DEFAULT_TABLE
    for item in query.split("&") if query else ():
        key, sep, value = item.partition("=")
        if key != "table" or not sep:
            raise _rules.url_error(url, f"unknown option {item!r}; the only option is table=NAME")
        table = value
    if TABLE_NAME.match(table) is None:
        why = (
            f"table name {table!r} is not a Spanner identifier (letters, digits and '_', "
            "starting with a letter, at most 96 characters)"
        )
        raise _rules.url_error(url, why)
    return path, table


def detect_dialect(db: Any) -> Dialect:
    """The dialect of ``db``, from its information schema (the emulator leaves the field of
    the admin API's answer unset; this query reads the same in both dialects)."""
    with db.snapshot() as snap:
        rows = StoreSql(GOOGLE_SQL, Tables.named(DEFAULT_TABLE)).dialect_probe().run(snap)
    return POSTGRESQL if rows and rows[0][0] == POSTGRESQL else GOOGLE_SQL


def schema_changes(db: Any, database: str, sql: StoreSql) -> tuple[list[str], list[str]]:
    """What :func:`ensure_schema` would do in ``db``, found by reading its information
    schema only: the DDL statements, and the names of what they create (tables, indexes,
    columns, the policy). Both are empty for a store of this version. A table that exists
    without the store's columns raises StoreSetupError (another table of that name: a
    configuration to fix, exit 2)."""
    t = sql.tables
    with db.snapshot(multi_use=True) as snap:
        objects = {name: ttl for name, ttl in sql.schema_objects().run(snap)}
        columns: dict[str, set[str]] = {}
        for name, column in sql.columns().run(snap):
            columns.setdefault(name, set()).add(column)
    wanted = ((t.partitions, PARTITION_COLUMNS), (t.batches, BATCH_COLUMNS),
              (t.pipelines, PIPELINE_COLUMNS), (t.step_state, STEP_STATE_COLUMNS))
    for name, needed in wanted:
        lacking = [c for c in needed if name in objects and c not in columns.get(name, ())]
        if lacking:
            msg = (
                f"table {name} in {database} is not a cdcflow metadata table (it has no "
                f"column {', '.join(lacking)}); choose another table with ?table=NAME"
            )
            raise StoreSetupError(msg)
    statements = [ddl for name, ddl in sql.create().items() if name not in objects]
    changes = [name for name in sql.create() if name not in objects]
    if t.partitions in objects:
        if "GcAfter" not in columns.get(t.partitions, ()):
            statements.append(sql.add_gc_after())
            changes.append(f"{t.partitions}.GcAfter")
        policy = objects[t.partitions]
        if policy is None or "GcAfter" not in policy:
            statements.append(sql.gc_policy(existing=policy is not None))
            changes.append(f"{t.partitions}'s row deletion policy on GcAfter")
    if t.batches in objects and "Stats" not in columns.get(t.batches, ()):
        statements.append(sql.add_batch_stats())
        changes.append(f"{t.batches}.Stats")
    return statements, changes


def ensure_schema(
    db: Any, admin_api: Any, database: str, sql: StoreSql, timeout: float
) -> list[str]:
    """Create or upgrade the store's tables and indexes; return what was created.

    ``admin_api`` is the client's ``database_admin_api``; ``timeout`` bounds the schema
    change request (waiting for the change to finish takes up to 300 s more). Tables that
    exist must have the store's columns. A partition table of an earlier version (no
    ``GcAfter``, its row deletion policy on ``FinishedAt``) gets the column and has its
    policy moved to it, so the TTL no longer removes finished partitions a resumed run
    needs; a batch log without ``Stats`` gets that column (:func:`schema_changes`). Safe
    to run concurrently and to retry: every statement is idempotent (``IF NOT EXISTS``, or
    replaces the policy with the same one).
    """
    statements, changes = schema_changes(db, database, sql)
    if statements:
        operation = admin_api.update_database_ddl(
            request={"database": database, "statements": statements},
            metadata=_routing(database), retry=None, timeout=timeout,
        )
        operation.result(300)
    return changes


# --- bounded RPCs -----------------------------------------------------------------------

#: The RPCs of google.cloud.spanner_v1's SpannerClient; those in _STREAMING return streams.
_RPCS = frozenset({
    "batch_create_sessions", "batch_write", "begin_transaction", "commit", "create_session",
    "delete_session", "execute_batch_dml", "execute_sql", "execute_streaming_sql",
    "get_session", "list_sessions", "partition_query", "partition_read", "read", "rollback",
    "streaming_read",
})
_STREAMING = frozenset({"batch_write", "execute_streaming_sql", "streaming_read"})


def transient(exc: BaseException) -> bool:
    """The store's retry predicate: :func:`~cdcflow.spanner.retry.is_transient`, or a
    :class:`BrokenCall`."""
    return isinstance(exc, BrokenCall) or is_transient(exc)


def _routing(database: str) -> list[tuple[str, str]]:
    return [("google-cloud-resource-prefix", database)]


def _break(exc: Exception) -> Exception:
    """The BrokenCall to raise from ``exc``, or ``exc`` itself to re-raise as it is."""
    from google.api_core.exceptions import InternalServerError, ServiceUnavailable

    if isinstance(exc, ServiceUnavailable) or (
        isinstance(exc, InternalServerError) and is_transient(exc)
    ):
        return BrokenCall(exc)
    return exc


class _Stream:
    """A response stream whose broken-stream errors arrive as BrokenCall; ``failed`` is
    told every error."""

    def __init__(self, stream: Any, failed: Callable[[BaseException], None]) -> None:
        self._stream = stream
        self._items: Iterator[Any] = iter(stream)
        self._failed = failed

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._items)
        except StopIteration:
            raise
        except Exception as exc:
            self._failed(exc)
            broken = _break(exc)
            if broken is exc:
                raise
            raise broken from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


#: The deadline of RPCs made inside call_deadline(), per thread (None: outside).
_SHORTER = threading.local()


def current_call_deadline() -> float | None:
    """The shorter RPC deadline :func:`call_deadline` set for this thread, if any."""
    seconds: float | None = getattr(_SHORTER, "seconds", None)
    return seconds


@contextlib.contextmanager
def call_deadline(seconds: float) -> Iterator[None]:
    """The store RPCs this thread makes inside the block get a deadline of at most
    ``seconds`` (each store's own ``call_timeout`` still applies if it is shorter)."""
    outer: float | None = getattr(_SHORTER, "seconds", None)
    _SHORTER.seconds = seconds if outer is None else min(outer, seconds)
    try:
        yield
    finally:
        _SHORTER.seconds = outer


class _BoundedApi:
    """A SpannerClient whose RPCs carry ``retry=None`` and a ``timeout`` deadline (shorter
    inside :func:`call_deadline`), through ``connection`` (a new one after a call passed
    its deadline)."""

    def __init__(self, connection: Connection, timeout: float) -> None:
        self._connection = connection
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        if name not in _RPCS:
            return getattr(self._connection.api(), name)
        return functools.partial(self._call, name, name in _STREAMING)

    def _call(self, rpc: str, streaming: bool, /, *args: Any, **kwargs: Any) -> Any:
        api = self._connection.api()
        shorter: float | None = getattr(_SHORTER, "seconds", None)
        kwargs["retry"] = None
        kwargs["timeout"] = self._timeout if shorter is None else min(shorter, self._timeout)
        try:
            result = getattr(api, rpc)(*args, **kwargs)
        except Exception as exc:
            self._connection.failed(api, exc)
            broken = _break(exc)
            if broken is exc:
                raise
            raise broken from exc
        if not streaming:
            return result
        return _Stream(result, functools.partial(self._connection.failed, api))


def data_connection(db: Any, client: Any, what: str, timeout: float) -> Connection:
    """The connection the data RPCs of ``db`` (a ``google.cloud.spanner`` Database of
    ``client``) go out on: its own API first, then, after a call passed its deadline, a
    new one (see :mod:`cdcflow.spanner.connection`). ``what`` names the caller in logs."""
    stock = db.spanner_api
    emulator = client.instance(db.name.split("/")[3]).emulator_host

    def open_api(connection: int) -> Any:
        return stock if connection == 0 else connection_api(client, emulator)

    return Connection(open_api, what, timeout)


def bound_rpcs(db: Any, timeout: float, connection: Connection | None = None) -> None:
    """Make every data RPC of ``db`` (a ``google.cloud.spanner`` Database) go out without
    the stock retry and with a deadline of ``timeout`` seconds, through ``connection``
    (:func:`data_connection`; by default, ``db``'s own API, never replaced).

    Sessions, snapshots and transactions all reach the server through the database's
    ``spanner_api``, which the Database builds once and keeps in ``_spanner_api``; that
    attribute is the one place to bound them all (the client has no setting for it).
    """
    if isinstance(getattr(db, "_spanner_api", None), _BoundedApi):
        return
    if connection is None:
        api = db.spanner_api
        connection = Connection(lambda _: api, db.name, timeout)
    db._spanner_api = _BoundedApi(connection, timeout)


def use_session_pool_on_emulator() -> None:
    """Against the emulator, run read-write transactions on pooled sessions (call it before
    the client makes its first session); an explicit setting wins."""
    # The emulator runs one read-write transaction at a time per session. On a multiplexed
    # session (the client's default), overlapping transactions fail with NotFound or
    # FailedPrecondition instead of a retryable ABORTED; with pooled sessions the emulator
    # answers ABORTED, which the store retries.
    if emulator_host() is not None:
        os.environ.setdefault("GOOGLE_CLOUD_SPANNER_MULTIPLEXED_SESSIONS_FOR_RW", "false")


def missing_database(admin_api: Any, database: str, timeout: float) -> str | None:
    """None when ``database`` exists; else what is missing, ``"instance"`` or ``"database"``
    (``Database.exists()`` without its hour of retries; the server's NotFound says which)."""
    from google.api_core.exceptions import NotFound

    try:
        admin_api.get_database_ddl(
            database=database, metadata=_routing(database), retry=None, timeout=timeout
        )
    except NotFound as e:
        text = str(getattr(e, "message", "") or e).lower()
        return "instance" if text.startswith("instance not found") else "database"
    return None


def to_spanner(ns: int) -> Any:
    """A position as the client's DatetimeWithNanoseconds (a plain datetime loses the ns)."""
    from google.api_core.datetime_helpers import DatetimeWithNanoseconds

    text = Timestamp.from_ns(ns).rfc3339()
    return DatetimeWithNanoseconds.from_rfc3339(text)  # type: ignore[no-untyped-call]


def to_ns(value: Any) -> int:
    return Timestamp.from_datetime(value).ns


def opt_ns(value: Any) -> int | None:
    return None if value is None else to_ns(value)


def row_to_plan(
    batch_id: Any, end: Any, tokens: Sequence[str], starts: Sequence[Any],
    ends: Sequence[Any], planned: Any,
) -> BatchPlan:
    """A batch log row (BatchId, EndTimestamp, SliceTokens, SliceStarts, SliceEnds,
    PlannedAt) as the plan it logged."""
    triples = zip(tokens, starts, ends, strict=True)
    slices = [Slice(t, to_ns(s), to_ns(e)) for t, s, e in triples]
    return BatchPlan(int(batch_id), to_ns(end), slices, to_ns(planned))


def row_to_partition(row: Sequence[Any]) -> PartitionMetadata:
    """A row of PARTITION_COLUMNS without PipelineName."""
    (token, parents, start, end, heartbeat, state, watermark,
     created, scheduled, running, finished) = row
    return PartitionMetadata(
        token=token,
        parent_tokens=tuple(parents or ()),
        start=to_ns(start),
        end=to_ns(end),
        watermark=to_ns(watermark),
        state=PartitionState(state),
        heartbeat_millis=int(heartbeat),
        created_at=to_ns(created),
        scheduled_at=opt_ns(scheduled),
        running_at=opt_ns(running),
        finished_at=opt_ns(finished),
    )


def row_to_lease(owner: Any, run_id: Any, token: Any, acquired: Any, renewed: Any,
                 expires: Any) -> Lease | None:
    """The Lease* columns of a pipeline record as the lease (None: it never had one)."""
    if owner is None:
        return None
    return Lease(owner, run_id, int(token), to_ns(acquired), to_ns(renewed), to_ns(expires))
