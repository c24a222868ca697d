"""The SQL of the Spanner metadata store, in both of Spanner's dialects.

The store runs on GoogleSQL and on PostgreSQL-dialect databases (users of PostgreSQL
databases keep their metadata beside their data, as Beam's SpannerIO allows). Both dialects
get the same table and column names: PostgreSQL's are double-quoted, so they keep their
case, and the read and mutation APIs, which name tables and columns as they are, work the
same on both.

Queries are written once, in a neutral form that :meth:`StoreSql.query` renders for the
dialect: identifiers in backticks (GoogleSQL's quotes; PostgreSQL's are double quotes) and
parameters as ``@name`` (``$1``, ``$2``, ... in PostgreSQL). The DDL differs in more than
quoting (types, commit timestamps, the TTL clause), so it is written out per dialect.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

import attrs

__all__ = [
    "GOOGLE_SQL",
    "POSTGRESQL",
    "TTL_DAYS",
    "Dialect",
    "Query",
    "StoreSql",
    "Tables",
]

Dialect = Literal["GOOGLE_STANDARD_SQL", "POSTGRESQL"]
GOOGLE_SQL: Dialect = "GOOGLE_STANDARD_SQL"
POSTGRESQL: Dialect = "POSTGRESQL"

#: Days a row is kept after its ``GcAfter`` time (Beam's metadata table keeps one day).
TTL_DAYS = 1

_PARAM = re.compile(r"@([A-Za-z_][A-Za-z0-9_]*)")


@attrs.frozen
class Tables:
    """The names of the store's tables and indexes, all derived from the partition table's."""

    partitions: str
    batches: str
    pipelines: str
    by_state: str
    by_created: str
    step_state: str

    @classmethod
    def named(cls, table: str) -> Tables:
        return cls(table, f"{table}_Batches", f"{table}_Pipelines",
                   f"{table}_ByStateWatermark", f"{table}_ByCreatedAtStart",
                   f"{table}_StepState")

    def all(self) -> tuple[str, ...]:
        """Every name, in creation order."""
        return (self.partitions, self.by_state, self.by_created, self.batches, self.pipelines,
                self.step_state)


@attrs.frozen
class Query:
    """A statement ready for ``execute_sql(sql, params=params, param_types=types)``."""

    sql: str
    params: dict[str, Any]
    types: dict[str, Any]

    def run(self, reader: Any) -> list[Any]:
        """The rows of this query in ``reader`` (a snapshot or a transaction)."""
        return list(reader.execute_sql(self.sql, params=self.params, param_types=self.types))


def _type(value: Any) -> Any:
    from google.cloud.spanner import param_types

    if isinstance(value, bool):
        return param_types.BOOL
    if isinstance(value, int):
        return param_types.INT64
    if isinstance(value, str):
        return param_types.STRING
    msg = f"no Spanner parameter type for {value!r}"
    raise TypeError(msg)


class StoreSql:
    """The statements of one store: its tables' names, in its database's dialect."""

    def __init__(self, dialect: Dialect, tables: Tables) -> None:
        self.dialect = dialect
        self.tables = tables
        self.schema = "public" if dialect == POSTGRESQL else ""

    def query(self, text: str, **params: Any) -> Query:
        """``text`` (the neutral form in the module docstring) for this dialect."""
        if self.dialect == GOOGLE_SQL:
            return Query(text, dict(params), {k: _type(v) for k, v in params.items()})
        order: dict[str, int] = {}

        def number(m: re.Match[str]) -> str:
            return f"${order.setdefault(m.group(1), len(order) + 1)}"

        sql = _PARAM.sub(number, text.replace("`", '"'))
        return Query(
            sql,
            {f"p{n}": params[name] for name, n in order.items()},
            {f"p{n}": _type(params[name]) for name, n in order.items()},
        )

    # -- the store's queries -------------------------------------------------------------

    def partitions(self, pipeline: str, columns: Sequence[str]) -> Query:
        """The pipeline's partitions, each row ending with the pipeline's Resetting flag."""
        t = self.tables
        cols = ", ".join(f"`{c}`" for c in columns)
        return self.query(
            f"SELECT {cols}, (SELECT `Resetting` FROM `{t.pipelines}` "
            "WHERE `PipelineName` = @p) "
            f"FROM `{t.partitions}` WHERE `PipelineName` = @p "
            "ORDER BY `StartTimestamp`, `PartitionToken`",
            p=pipeline,
        )

    def pending_plan(self, pipeline: str) -> Query:
        return self.query(
            "SELECT `BatchId`, `EndTimestamp`, `SliceTokens`, `SliceStarts`, `SliceEnds`, "
            f"`PlannedAt` FROM `{self.tables.batches}` "
            "WHERE `PipelineName` = @p AND `CommittedAt` IS NULL "
            "ORDER BY `BatchId` DESC LIMIT 1",
            p=pipeline,
        )

    def last_batch_id(self, pipeline: str) -> Query:
        """One row: the largest logged batch id and the batch id floor (either NULL)."""
        t = self.tables
        return self.query(
            f"SELECT (SELECT MAX(`BatchId`) FROM `{t.batches}` WHERE `PipelineName` = @p), "
            f"(SELECT `BatchFloor` FROM `{t.pipelines}` WHERE `PipelineName` = @p)",
            p=pipeline,
        )

    def batches(self, pipeline: str, limit: int) -> Query:
        return self.query(
            "SELECT `BatchId`, `EndTimestamp`, `PlannedAt`, `CommittedAt`, `SliceCount`, "
            f"`Records`, `Stats` FROM `{self.tables.batches}` WHERE `PipelineName` = @p "
            "ORDER BY `BatchId` DESC LIMIT @n",
            p=pipeline, n=limit,
        )

    def pipelines(self) -> Query:
        t = self.tables
        return self.query(
            f"SELECT `PipelineName` FROM `{t.partitions}` UNION DISTINCT "
            f"SELECT `PipelineName` FROM `{t.batches}` UNION DISTINCT "
            f"SELECT `PipelineName` FROM `{t.pipelines}`"
        )

    def log_state(self, pipeline: str, keep: int) -> Query:
        """One row: the largest logged batch id, the pending one, and the id of the entry
        that becomes the oldest kept when ``keep`` entries stay (older ones are pruned)."""
        t = self.tables
        return self.query(
            "SELECT MAX(`BatchId`), MAX(CASE WHEN `CommittedAt` IS NULL THEN `BatchId` END), "
            f"(SELECT `BatchId` FROM `{t.batches}` WHERE `PipelineName` = @p "
            "ORDER BY `BatchId` DESC LIMIT 1 OFFSET @k) "
            f"FROM `{t.batches}` WHERE `PipelineName` = @p",
            p=pipeline, k=keep,
        )

    def now(self) -> Query:
        return self.query("SELECT CURRENT_TIMESTAMP")

    def some_tokens(self, pipeline: str, limit: int) -> Query:
        return self.query(
            f"SELECT `PartitionToken` FROM `{self.tables.partitions}` "
            "WHERE `PipelineName` = @p LIMIT @n",
            p=pipeline, n=limit,
        )

    # -- the information schema ----------------------------------------------------------

    def dialect_probe(self) -> Query:
        """The database's dialect; the same text runs on both dialects."""
        return self.query(
            "SELECT option_value FROM information_schema.database_options "
            "WHERE option_name = 'database_dialect'"
        )

    def schema_objects(self) -> Query:
        """Names of the tables and indexes, with each table's row deletion policy."""
        return self.query(
            "SELECT table_name, row_deletion_policy_expression FROM information_schema.tables "
            "WHERE table_schema = @s UNION ALL SELECT index_name, NULL "
            "FROM information_schema.indexes WHERE table_schema = @s AND index_type = 'INDEX'",
            s=self.schema,
        )

    def columns(self) -> Query:
        """(table, column) of every column in the database's default schema."""
        return self.query(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = @s",
            s=self.schema,
        )

    # -- DDL -------------------------------------------------------------------------------

    def create(self) -> dict[str, str]:
        """Name -> the statement creating it (``IF NOT EXISTS``), in creation order."""
        return (_postgresql_ddl if self.dialect == POSTGRESQL else _google_sql_ddl)(self.tables)

    def add_gc_after(self) -> str:
        """Adds the ``GcAfter`` column to a partition table of an earlier version."""
        t = self.tables.partitions
        if self.dialect == POSTGRESQL:
            return f'ALTER TABLE "{t}" ADD COLUMN IF NOT EXISTS "GcAfter" spanner.commit_timestamp'
        return (
            f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS GcAfter TIMESTAMP "
            "OPTIONS (allow_commit_timestamp=true)"
        )

    def add_batch_stats(self) -> str:
        """Adds the ``Stats`` column to a batch log table of an earlier version."""
        t = self.tables.batches
        if self.dialect == POSTGRESQL:
            return f'ALTER TABLE "{t}" ADD COLUMN IF NOT EXISTS "Stats" text'
        return f"ALTER TABLE {t} ADD COLUMN IF NOT EXISTS Stats STRING(MAX)"

    def gc_policy(self, existing: bool) -> str:
        """Puts the row deletion policy on ``GcAfter``, replacing an ``existing`` one."""
        t = self.tables.partitions
        if self.dialect == POSTGRESQL:
            verb = "ALTER" if existing else "ADD"
            return f'ALTER TABLE "{t}" {verb} TTL INTERVAL \'{TTL_DAYS} days\' ON "GcAfter"'
        verb = "REPLACE" if existing else "ADD"
        return (
            f"ALTER TABLE {t} {verb} ROW DELETION POLICY "
            f"(OLDER_THAN(GcAfter, INTERVAL {TTL_DAYS} DAY))"
        )


def _google_sql_ddl(t: Tables) -> dict[str, str]:
    return {
        t.partitions: f"""CREATE TABLE IF NOT EXISTS {t.partitions} (
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
  GcAfter TIMESTAMP OPTIONS (allow_commit_timestamp=true),
) PRIMARY KEY (PipelineName, PartitionToken),
  ROW DELETION POLICY (OLDER_THAN(GcAfter, INTERVAL {TTL_DAYS} DAY))""",
        t.by_state: f"CREATE INDEX IF NOT EXISTS {t.by_state} ON {t.partitions} (State, Watermark)",
        t.by_created: (
            f"CREATE INDEX IF NOT EXISTS {t.by_created} ON {t.partitions} "
            "(CreatedAt, StartTimestamp)"
        ),
        # No TTL on the batch log: batch ids must stay monotonic per pipeline (sinks commit
        # idempotently per batch id); the store prunes the oldest committed entries instead.
        t.batches: f"""CREATE TABLE IF NOT EXISTS {t.batches} (
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
  Stats STRING(MAX),
) PRIMARY KEY (PipelineName, BatchId)""",
        # What outlives a reset: the lease and the batch id floor; and the source definition
        # (text, compared as written) and each sink's durable batch (JSON text).
        t.pipelines: f"""CREATE TABLE IF NOT EXISTS {t.pipelines} (
  PipelineName STRING(MAX) NOT NULL,
  LeaseOwner STRING(MAX),
  LeaseRunId STRING(MAX),
  LeaseToken INT64 NOT NULL,
  LeaseAcquiredAt TIMESTAMP,
  LeaseRenewedAt TIMESTAMP,
  LeaseExpiresAt TIMESTAMP,
  BatchFloor INT64 NOT NULL,
  Source STRING(MAX),
  Resetting BOOL,
  DurableMarks STRING(MAX),
) PRIMARY KEY (PipelineName)""",
        # The BatchSteps' state as of the last committed batch, cut into chunks below the
        # 10 MiB limit of a BYTES cell (added after the first release: an older database
        # gets it when a store opens it).
        t.step_state: f"""CREATE TABLE IF NOT EXISTS {t.step_state} (
  PipelineName STRING(MAX) NOT NULL,
  Chunk INT64 NOT NULL,
  Data BYTES(MAX) NOT NULL,
) PRIMARY KEY (PipelineName, Chunk)""",
    }


def _postgresql_ddl(t: Tables) -> dict[str, str]:
    return {
        t.partitions: f"""CREATE TABLE IF NOT EXISTS "{t.partitions}" (
  "PipelineName" text NOT NULL,
  "PartitionToken" text NOT NULL,
  "ParentTokens" text[] NOT NULL,
  "StartTimestamp" timestamptz NOT NULL,
  "EndTimestamp" timestamptz NOT NULL,
  "HeartbeatMillis" bigint NOT NULL,
  "State" text NOT NULL,
  "Watermark" timestamptz NOT NULL,
  "CreatedAt" spanner.commit_timestamp NOT NULL,
  "ScheduledAt" spanner.commit_timestamp,
  "RunningAt" spanner.commit_timestamp,
  "FinishedAt" spanner.commit_timestamp,
  "GcAfter" spanner.commit_timestamp,
  PRIMARY KEY ("PipelineName", "PartitionToken")
) TTL INTERVAL '{TTL_DAYS} days' ON """ + '"GcAfter"',
        t.by_state: (
            f'CREATE INDEX IF NOT EXISTS "{t.by_state}" ON "{t.partitions}" '
            '("State", "Watermark")'
        ),
        t.by_created: (
            f'CREATE INDEX IF NOT EXISTS "{t.by_created}" ON "{t.partitions}" '
            '("CreatedAt", "StartTimestamp")'
        ),
        t.batches: f"""CREATE TABLE IF NOT EXISTS "{t.batches}" (
  "PipelineName" text NOT NULL,
  "BatchId" bigint NOT NULL,
  "EndTimestamp" timestamptz NOT NULL,
  "SliceTokens" text[] NOT NULL,
  "SliceStarts" timestamptz[] NOT NULL,
  "SliceEnds" timestamptz[] NOT NULL,
  "SliceCount" bigint NOT NULL,
  "PlannedAt" timestamptz NOT NULL,
  "CommittedAt" spanner.commit_timestamp,
  "Records" bigint NOT NULL,
  "Stats" text,
  PRIMARY KEY ("PipelineName", "BatchId")
)""",
        # Source is text, not jsonb: jsonb would normalise the definition (key order,
        # spacing) and the store must give back what it was given.
        t.pipelines: f"""CREATE TABLE IF NOT EXISTS "{t.pipelines}" (
  "PipelineName" text NOT NULL,
  "LeaseOwner" text,
  "LeaseRunId" text,
  "LeaseToken" bigint NOT NULL,
  "LeaseAcquiredAt" timestamptz,
  "LeaseRenewedAt" timestamptz,
  "LeaseExpiresAt" timestamptz,
  "BatchFloor" bigint NOT NULL,
  "Source" text,
  "Resetting" boolean,
  "DurableMarks" text,
  PRIMARY KEY ("PipelineName")
)""",
        t.step_state: f"""CREATE TABLE IF NOT EXISTS "{t.step_state}" (
  "PipelineName" text NOT NULL,
  "Chunk" bigint NOT NULL,
  "Data" bytea NOT NULL,
  PRIMARY KEY ("PipelineName", "Chunk")
)""",
    }
