"""Tables, URL and value conversions of the Spanner metadata store.

The partition table has Beam's PartitionMetadata columns (so Beam's tooling and queries
read it) plus ``PipelineName`` leading the key, because one store serves many pipelines.
Positions are TIMESTAMP values that keep their nanoseconds. google-cloud-spanner is imported
lazily.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from cdcflow.errors import StoreError
from cdcflow.metadata import _rules
from cdcflow.model import PartitionMetadata, PartitionState, Timestamp

__all__ = [
    "BATCH_COLUMNS",
    "DATABASE_PATH",
    "DEFAULT_TABLE",
    "PARTITION_COLUMNS",
    "TABLE_NAME",
    "TTL",
    "batch_table",
    "ensure_schema",
    "index_names",
    "opt_ns",
    "parse_spanner_url",
    "row_to_partition",
    "schema_ddl",
    "to_ns",
    "to_spanner",
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


def ensure_schema(db: Any, database: str, table: str) -> list[str]:
    """Create the tables and indexes that are missing; return the names created.

    Tables that exist must have the store's columns. Safe to run concurrently: every
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
        db.update_ddl(schema_ddl(table)).result(300)
    return missing


def to_spanner(ns: int) -> Any:
    """A position as the client's DatetimeWithNanoseconds (a plain datetime loses the ns)."""
    from google.api_core.datetime_helpers import DatetimeWithNanoseconds

    text = Timestamp.from_ns(ns).rfc3339()
    return DatetimeWithNanoseconds.from_rfc3339(text)  # type: ignore[no-untyped-call]


def to_ns(value: Any) -> int:
    return Timestamp.from_datetime(value).ns


def opt_ns(value: Any) -> int | None:
    return None if value is None else to_ns(value)


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
