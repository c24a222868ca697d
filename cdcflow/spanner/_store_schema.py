"""Tables, URL, value conversions and bounded RPCs of the Spanner metadata store.

The partition table has Beam's PartitionMetadata columns (so Beam's tooling and queries
read it) plus ``PipelineName`` leading the key, because one store serves many pipelines.
Positions are TIMESTAMP values that keep their nanoseconds. google-cloud-spanner is imported
lazily.

Bounded RPCs. The stock client retries on its own: UNAVAILABLE commits for up to an hour,
most other calls for 30 s, and streaming reads restart after UNAVAILABLE without bound or
delay. The store retries with its one policy instead, so every RPC it makes here goes out
with ``retry=None`` and a deadline (:func:`bound_rpcs`, :func:`database_exists`,
:func:`ensure_schema`).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from cdcflow.errors import BrokenCall, StoreError
from cdcflow.metadata import _rules
from cdcflow.model import BatchPlan, PartitionMetadata, PartitionState, Slice, Timestamp
from cdcflow.spanner.retry import is_transient

__all__ = [
    "BATCH_COLUMNS",
    "DATABASE_PATH",
    "DEFAULT_TABLE",
    "PARTITION_COLUMNS",
    "TABLE_NAME",
    "TTL",
    "BrokenCall",
    "batch_table",
    "bound_rpcs",
    "database_exists",
    "ensure_schema",
    "index_names",
    "opt_ns",
    "parse_spanner_url",
    "row_to_partition",
    "row_to_plan",
    "schema_ddl",
    "to_ns",
    "to_spanner",
    "transient",
    "use_session_pool_on_emulator",
]

#: Table name used when the URL has no ``?table=``.
DEFAULT_TABLE = "CdcflowPartitions"

#: How long a FINISHED partition's row is kept (Beam's metadata table keeps it one day).
TTL = "INTERVAL 1 DAY"

_PROJECT = r"[a-z][a-z0-9.:-]{0,62}[a-z0-9]"
_INSTANCE = r"[a-z][a-z0-9-]{0,62}[a-z0-9]"
_DATABASE = r"[a-z][a-z0-9_-]{0,28}[a-z0-9]"
DATABASE_PATH = re.compile(
    rf"^projects/({_PROJECT})/instances/({_INSTANCE})/databases/({_DATABASE})$"
)
# At most 96 characters, leaving room for the suffixes of the companion table and indexes
# (Spanner allows 128).
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
            "DATABASE (lower-case ids)"
        )
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


def batch_table(table: str) -> str:
    return f"{table}_Batches"


def index_names(table: str) -> tuple[str, str]:
    return f"{table}_ByStateWatermark", f"{table}_ByCreatedAtStart"


def schema_ddl(table: str) -> list[str]:
    """The statements creating the store's tables and indexes (each ``IF NOT EXISTS``)."""
    by_state, by_created = index_names(table)
    return [
        f"""CREATE TABLE IF NOT EXISTS {table} (
  PipelineName STRING(MAX) NOT NULL,
  PartitionToken STRING(MAX) NOT NULL,
  ParentTokens ARRAY<STRING(MAX)> NOT NULL,
  StartTimestamp TIMESTAMP NOT NULL,
  EndTimestamp TIMESTAMP NOT NULL,
  HeartbeatMillis INT64 NOT NULL,
  State STRING(MAX) NOT NULL,
  Watermark TIMESTAMP NOT NULL,
  CreatedAt TIMESTAMP NOT NULL OPTIONS (allow_commit_timestamp=true),
  ScheduledAt TIMESTAMP OPTIONS (allow_commit_timestamp=true),
  RunningAt TIMESTAMP OPTIONS (allow_commit_timestamp=true),
  FinishedAt TIMESTAMP OPTIONS (allow_commit_timestamp=true),
) PRIMARY KEY (PipelineName, PartitionToken),
  ROW DELETION POLICY (OLDER_THAN(FinishedAt, {TTL}))""",
        f"CREATE INDEX IF NOT EXISTS {by_state} ON {table} (State, Watermark)",
        f"CREATE INDEX IF NOT EXISTS {by_created} ON {table} (CreatedAt, StartTimestamp)",
        # No TTL on the batch log: batch ids must stay monotonic per pipeline (sinks commit
        # idempotently per batch id); the store prunes the oldest committed entries instead.
        f"""CREATE TABLE IF NOT EXISTS {batch_table(table)} (
  PipelineName STRING(MAX) NOT NULL,
  BatchId INT64 NOT NULL,
  EndTimestamp TIMESTAMP NOT NULL,
  SliceTokens ARRAY<STRING(MAX)> NOT NULL,
  SliceStarts ARRAY<TIMESTAMP> NOT NULL,
  SliceEnds ARRAY<TIMESTAMP> NOT NULL,
  SliceCount INT64 NOT NULL,
  PlannedAt TIMESTAMP NOT NULL,
  CommittedAt TIMESTAMP OPTIONS (allow_commit_timestamp=true),
  Records INT64 NOT NULL,
) PRIMARY KEY (PipelineName, BatchId)""",
    ]


def _existing(db: Any) -> set[str]:
    sql = (
        "SELECT table_name FROM information_schema.tables WHERE table_schema = '' "
        "UNION ALL SELECT index_name FROM information_schema.indexes "
        "WHERE table_schema = '' AND index_type = 'INDEX'"
    )
    with db.snapshot() as snap:
        return {row[0] for row in snap.execute_sql(sql)}


def _check_columns(db: Any, database: str, table: str, columns: Iterable[str]) -> None:
    from google.cloud.spanner import param_types

    sql = (
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_schema = '' AND table_name = @t"
    )
    with db.snapshot() as snap:
        rows = snap.execute_sql(sql, params={"t": table}, param_types={"t": param_types.STRING})
        have = {row[0] for row in rows}
    lacking = [c for c in columns if c not in have]
    if lacking:
        msg = (
            f"table {table} in {database} is not a cdcflow metadata table (it has no column "
            f"{', '.join(lacking)}); choose another table with ?table=NAME"
        )
        raise StoreError(msg)


def ensure_schema(
    db: Any, admin_api: Any, database: str, table: str, timeout: float
) -> list[str]:
    """Create the tables and indexes that are missing; return the names created.

    ``admin_api`` is the client's ``database_admin_api``; ``timeout`` bounds the schema
    change request (waiting for the change to finish takes up to 300 s more). Tables that
    exist must have the store's columns. Safe to run concurrently and to retry: every
    statement is ``IF NOT EXISTS``.
    """
    wanted = [table, *index_names(table), batch_table(table)]
    existing = _existing(db)
    for name, columns in ((table, PARTITION_COLUMNS), (batch_table(table), BATCH_COLUMNS)):
        if name in existing:
            _check_columns(db, database, name, columns)
    missing = [name for name in wanted if name not in existing]
    if missing:
        # The emulator and Cloud Spanner both accept ROW DELETION POLICY on GoogleSQL
        # databases, so the TTL is always part of the table.
        operation = admin_api.update_database_ddl(
            request={"database": database, "statements": schema_ddl(table)},
            metadata=_routing(database), retry=None, timeout=timeout,
        )
        operation.result(300)
    return missing


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
    """A response stream whose broken-stream errors arrive as BrokenCall."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._items: Iterator[Any] = iter(stream)

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._items)
        except StopIteration:
            raise
        except Exception as exc:
            broken = _break(exc)
            if broken is exc:
                raise
            raise broken from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _BoundedApi:
    """A SpannerClient whose RPCs carry ``retry=None`` and a ``timeout`` deadline."""

    def __init__(self, api: Any, timeout: float) -> None:
        self._api = api
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._api, name)
        if name not in _RPCS:
            return attr
        return functools.partial(self._call, attr, name in _STREAMING)

    def _call(self, rpc: Callable[..., Any], streaming: bool, *args: Any, **kwargs: Any) -> Any:
        kwargs["retry"] = None
        kwargs["timeout"] = self._timeout
        try:
            result = rpc(*args, **kwargs)
        except Exception as exc:
            broken = _break(exc)
            if broken is exc:
                raise
            raise broken from exc
        return _Stream(result) if streaming else result


def bound_rpcs(db: Any, timeout: float) -> None:
    """Make every data RPC of ``db`` (a ``google.cloud.spanner`` Database) go out without
    the stock retry and with a deadline of ``timeout`` seconds.

    Sessions, snapshots and transactions all reach the server through the database's
    ``spanner_api``, which the Database builds once and keeps in ``_spanner_api``; that
    attribute is the one place to bound them all (the client has no setting for it).
    """
    api = db.spanner_api
    if not isinstance(api, _BoundedApi):
        db._spanner_api = _BoundedApi(api, timeout)


def use_session_pool_on_emulator() -> None:
    """Against the emulator, run read-write transactions on pooled sessions (call it before
    the client makes its first session); an explicit setting wins."""
    # The emulator runs one read-write transaction at a time per session. On a multiplexed
    # session (the client's default), overlapping transactions fail with NotFound or
    # FailedPrecondition instead of a retryable ABORTED; with pooled sessions the emulator
    # answers ABORTED, which the store retries.
    if os.environ.get("SPANNER_EMULATOR_HOST"):
        os.environ.setdefault("GOOGLE_CLOUD_SPANNER_MULTIPLEXED_SESSIONS_FOR_RW", "false")


def database_exists(admin_api: Any, database: str, timeout: float) -> bool:
    """Whether ``database`` exists: ``Database.exists()`` without its hour of retries."""
    from google.api_core.exceptions import NotFound

    try:
        admin_api.get_database_ddl(
            database=database, metadata=_routing(database), retry=None, timeout=timeout
        )
    except NotFound:
        return False
    return True


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
