"""LookupRows' reads: stale reads of rows and the information_schema it needs.

:class:`Reader` makes every call without the stock client's retry loop, with a deadline
per call, retrying transient errors under one :class:`~cdcflow.backoff.RetryPolicy`; one
per process and arguments (:func:`cached_reader`). :class:`StreamColumns` says which
columns of which tables a change stream reports, and whether it can leave writes out.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import (
    ChangeStreamError,
    ConfigurationError,
    MissingColumnError,
    TransientError,
)
from cdcflow.model import Timestamp
from cdcflow.spanner._lookup_rows import Key, TableColumns, unhashable
from cdcflow.spanner.decode import plain_value
from cdcflow.spanner.retry import is_transient, status_name
from cdcflow.spanner.translate import session_gone
from cdcflow.spanner.transport import GrpcTransport, Param, assemble_rows

__all__ = ["PRIORITIES", "Reader", "StreamColumns", "cached_reader"]

PRIORITIES = {"LOW": 1, "MEDIUM": 2, "HIGH": 3}
#: Keys per Read call: a bundle of large transactions may touch a million keys, and a
#: request must stay well under Spanner's request size limit.
MAX_KEYS_PER_READ = 5000

#: Change stream options under which a stream may miss writes to the columns it tracks
#: (a missed DELETE is harmless: an INSERT reports every tracked column).
_LOSSY_OPTIONS = ("allow_txn_exclusion", "exclude_insert", "exclude_update")

# One query for all four views, in each dialect: (kind, stream, schema, table, value).
_STREAM_SQL = {
    "GOOGLE_STANDARD_SQL": (
        "SELECT 'stream', change_stream_name, '', '', CAST(`ALL` AS STRING) "
        "FROM information_schema.change_streams "
        "UNION ALL SELECT 'option', change_stream_name, '', option_name, option_value "
        "FROM information_schema.change_stream_options "
        "UNION ALL SELECT 'table', change_stream_name, table_schema, table_name, "
        "CAST(all_columns AS STRING) FROM information_schema.change_stream_tables "
        "UNION ALL SELECT 'column', change_stream_name, table_schema, table_name, column_name "
        "FROM information_schema.change_stream_columns"
    ),
    "POSTGRESQL": (
        "SELECT 'stream', change_stream_name, '', '', \"all\" "
        "FROM information_schema.change_streams "
        "UNION ALL SELECT 'option', change_stream_name, '', option_name, option_value "
        "FROM information_schema.change_stream_options "
        "UNION ALL SELECT 'table', change_stream_name, table_schema, table_name, all_columns "
        "FROM information_schema.change_stream_tables "
        "UNION ALL SELECT 'column', change_stream_name, table_schema, table_name, column_name "
        "FROM information_schema.change_stream_columns"
    ),
}


def _true(text: str) -> bool:
    return text.strip().lower() in ("true", "yes")


@attrs.frozen
class StreamColumns:
    """What one change stream reports, from information_schema.

    ``lossy``: why the stream may miss writes to the columns it tracks (an option such as
    ``allow_txn_exclusion``, or a MUTABLE_KEY_RANGE partition mode, under which a key's
    changes move between partitions), "" when it does not; ``found``: the stream exists.
    """

    found: bool
    lossy: str = ""
    every_table: bool = False
    whole_tables: frozenset[tuple[str, str]] = frozenset()  # (schema, table)
    columns: Mapping[tuple[str, str], frozenset[str]] = attrs.field(factory=dict)

    def tracks(self, schema: str, table: str) -> frozenset[str] | None:
        """The columns of ``table`` it tracks (empty set: none named), None: all of them."""
        if self.every_table or (schema, table) in self.whole_tables:
            return None
        return self.columns.get((schema, table), frozenset())

    def exact_for(self, schema: str, table: str, info: TableColumns,
                  columns: Sequence[str]) -> str:
        """Why rows of ``table`` cannot be rolled forward from this stream's records for
        ``columns`` (its non-key columns read), or "" when they can."""
        if not self.found:
            return "the stream is not in this database"
        if self.lossy:
            return self.lossy
        generated = sorted(info.generated.intersection(columns))
        if generated:
            return f"change streams do not report generated columns ({', '.join(generated)})"
        tracked = self.tracks(schema, table)
        untracked = [] if tracked is None else [c for c in columns if c not in tracked]
        if untracked:
            return f"the stream does not track {', '.join(untracked)}"
        return ""

    @classmethod
    def from_rows(cls, stream: str, rows: Sequence[Sequence[str]]) -> StreamColumns:
        """Build it from :data:`_STREAM_SQL`'s rows; stream names match case-insensitively
        (PostgreSQL folds unquoted names to lower case)."""
        name = stream.lower()
        mine = [r for r in rows if r[1].lower() == name]
        every = any(kind == "stream" and _true(value) for kind, _, _, _, value in mine)
        lossy = ""
        whole: set[tuple[str, str]] = set()
        columns: dict[tuple[str, str], set[str]] = {}
        for kind, _, schema, table, value in mine:
            if kind == "option":
                option = table.lower()
                if option in _LOSSY_OPTIONS and _true(value):
                    lossy = f"the stream's option {option} is true"
                elif option == "partition_mode" and value.upper() == "MUTABLE_KEY_RANGE":
                    lossy = "the stream's partitions are MUTABLE_KEY_RANGE"
            elif kind == "table" and _true(value):
                whole.add((schema, table))
            elif kind == "column":
                columns.setdefault((schema, table), set()).add(value)
        return cls(
            found=bool(mine), lossy=lossy, every_table=every, whole_tables=frozenset(whole),
            columns={k: frozenset(v) for k, v in columns.items()},
        )


class Reader:
    """Stale reads and schema queries on one database, without the stock retry loop.

    Thread-safe; one per process and arguments (:func:`cached_reader`). ``reads`` counts
    the Read calls made, by the kind the caller names ("bundle": a run's rows at its first
    commit timestamp; "commit": rows at one commit timestamp).
    """

    def __init__(self, database: str, priority: str, call_timeout: float,
                 retry: RetryPolicy) -> None:
        self.database = database
        self.priority = priority
        self.call_timeout = call_timeout
        self.retry = retry
        self.transport = GrpcTransport(database, what=f"LookupRows reading rows of {database}")
        self.reads: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._dialect: str | None = None

    # -- retries ---------------------------------------------------------------------------

    def _retry_if(self, exc: BaseException) -> bool:
        if session_gone(exc):
            self.transport.reset_session()
            return True
        return is_transient(exc)

    def _call(self, what: str, fn: Any) -> Any:
        failed = 1

        def count(retry: int, exc: BaseException, delay: float) -> None:
            nonlocal failed
            failed = retry + 1

        try:
            return self.retry.call(fn, retry_if=self._retry_if, on_retry=count)
        except Exception as exc:
            status = status_name(exc)
            if status is None:
                raise
            text = str(getattr(exc, "message", None) or exc)
            if self._retry_if(exc):
                msg = (
                    f"{what} on {self.database} kept failing after {failed} attempts "
                    f"({status}: {text}); check the database's health and quota, then run again"
                )
                raise TransientError(msg) from exc
            if status == "FAILED_PRECONDITION" and "old" in text.lower():
                msg = (
                    f"{what} on {self.database}: the commit timestamp is older than the "
                    "database's version_retention_period, so the row can no longer be read; "
                    "raise it (ALTER DATABASE ... SET OPTIONS (version_retention_period = "
                    f"'7d')) or read the stream closer to real time ({text})"
                )
                raise ChangeStreamError(msg) from exc
            msg = f"{what} on {self.database} failed ({status}: {text})"
            if status == "NOT_FOUND" and "column not found" in text.lower():
                raise MissingColumnError(msg) from exc
            raise ChangeStreamError(msg) from exc

    # -- schema ----------------------------------------------------------------------------

    def _sql(self, sql: str, params: Mapping[str, Param], at: int | None = None
             ) -> list[list[Any]]:
        def once() -> list[list[Any]]:
            responses = self.transport.execute_streaming_sql(
                sql, params, priority=self.priority, timeout=self.call_timeout, read_at=at
            )
            return [row for _, row in assemble_rows(responses)]

        rows: list[list[Any]] = self._call("a schema query", once)
        return rows

    def dialect(self) -> str:
        if self._dialect is None:
            rows = self._sql(
                "SELECT option_value FROM information_schema.database_options "
                "WHERE option_name = 'database_dialect'", {},
            )
            value = rows[0][0].string_value if rows else "GOOGLE_STANDARD_SQL"
            self._dialect = "POSTGRESQL" if value == "POSTGRESQL" else "GOOGLE_STANDARD_SQL"
        return self._dialect

    def schema_and_name(self, table: str) -> tuple[str, str]:
        """``table`` as (schema, name): "schema.name", or the dialect's default schema."""
        schema, _, name = table.rpartition(".")
        return schema or ("public" if self.dialect() == "POSTGRESQL" else ""), name

    def table_columns(self, table: str, at: int | None = None) -> TableColumns:
        """The table's columns, primary key and generated columns from information_schema:
        now, or as they were at ``at`` (ns; a stale read sees the schema of its time).

        Raises ConfigurationError when the table does not exist."""
        postgres = self.dialect() == "POSTGRESQL"
        schema, name = self.schema_and_name(table)
        where = (
            "table_schema = $1 AND table_name = $2" if postgres
            else "table_schema = @p1 AND table_name = @p2"
        )
        params: dict[str, Param] = {"p1": ("STRING", schema), "p2": ("STRING", name)}
        columns = self._sql(
            f"SELECT column_name, is_generated FROM information_schema.columns WHERE {where} "
            "ORDER BY ordinal_position", params, at,
        )
        key = self._sql(
            f"SELECT column_name FROM information_schema.index_columns WHERE {where} "
            "AND index_name = 'PRIMARY_KEY' ORDER BY ordinal_position", params, at,
        )
        if not columns or not key:
            msg = (
                f"table {table!r} not found in {self.database}: is LookupRows(database=...) "
                "the database the change stream belongs to?"
            )
            raise ConfigurationError(msg)
        return TableColumns(
            tuple(r[0].string_value for r in columns),
            tuple(r[0].string_value for r in key),
            frozenset(r[0].string_value for r in columns if r[1].string_value == "ALWAYS"),
        )

    def stream_columns(self, stream: str) -> StreamColumns:
        """What ``stream`` reports (one query over the change_stream* views)."""
        rows = self._sql(_STREAM_SQL[self.dialect()], {})
        texts = [[plain_value(v) or "" for v in row] for row in rows]
        return StreamColumns.from_rows(stream, texts)

    # -- stale reads -----------------------------------------------------------------------

    def read_at(
        self, table: str, columns: Sequence[str], keys: Sequence[Key], ns: int, kind: str
    ) -> tuple[list[list[Any]], dict[str, Any]]:
        """Rows of ``keys`` (wire form, key order) as of ``ns``: one Read call per
        :data:`MAX_KEYS_PER_READ` keys (one for none). Returns the rows (plain values,
        ``columns`` order) and each column's decoded JSON type (also when no row is found).
        ``kind`` names the calls in :attr:`reads`."""
        rows: list[list[Any]] = []
        types: dict[str, Any] = {}
        for at in range(0, max(1, len(keys)), MAX_KEYS_PER_READ):
            found, types = self._read_once(
                table, columns, keys[at:at + MAX_KEYS_PER_READ], ns, kind
            )
            rows.extend(found)
        return rows, types

    def _read_once(
        self, table: str, columns: Sequence[str], keys: Sequence[Key], ns: int, kind: str
    ) -> tuple[list[list[Any]], dict[str, Any]]:
        def once() -> tuple[list[list[Any]], dict[str, Any]]:
            rows: list[list[Any]] = []
            meta: list[Any] = []

            def tap(stream: Iterator[Any]) -> Iterator[Any]:
                for prs in stream:
                    if not meta:
                        meta.append(prs.metadata.row_type)
                    yield prs

            for _, row in assemble_rows(tap(self._stream(table, columns, keys, ns))):
                rows.append([plain_value(v) for v in row])
            types = {f.name: _type_json(f.type_) for f in meta[0].fields} if meta else {}
            return rows, types

        with self._count_lock:
            self.reads[kind] += 1
        result: tuple[list[list[Any]], dict[str, Any]] = self._call(
            f"reading {table!r} as of {Timestamp.from_ns(ns).rfc3339()}", once
        )
        return result

    def _stream(self, table: str, columns: Sequence[str], keys: Sequence[Key],
                ns: int) -> Iterator[Any]:
        from google.cloud.spanner_v1.types import (
            KeySet,
            PartialResultSet,
            ReadRequest,
            RequestOptions,
            TransactionOptions,
            TransactionSelector,
        )
        from google.protobuf.timestamp_pb2 import Timestamp as PbTimestamp

        seconds, nanos = divmod(ns, 1_000_000_000)
        read_only = TransactionOptions.ReadOnly(
            read_timestamp=PbTimestamp(seconds=seconds, nanos=nanos)
        )
        request = ReadRequest(
            session=self.transport.session(),
            transaction=TransactionSelector(single_use=TransactionOptions(read_only=read_only)),
            table=table,
            columns=list(columns),
            key_set=KeySet(keys=[[unhashable(v) for v in k] for k in keys]),
            request_options=RequestOptions(priority=PRIORITIES[self.priority]),
        )
        api = self.transport._spanner_api()  # the transport's GAPIC client and channel
        stream = api.streaming_read(
            request=request, metadata=[("google-cloud-resource-prefix", self.database)],
            retry=None, timeout=self.call_timeout,
        )
        try:
            for item in stream:
                yield PartialResultSet.pb(item)
        finally:
            cancel = getattr(stream, "cancel", None)
            if cancel is not None:
                cancel()


def _type_json(type_pb: Any) -> Any:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(type_pb, preserving_proto_field_name=True)


_readers: dict[tuple[int, str, str, float, RetryPolicy], Reader] = {}
_readers_lock = threading.Lock()


def cached_reader(database: str, priority: str, call_timeout: float,
                  retry: RetryPolicy) -> Reader:
    """The process's reader for these arguments (keyed by process id too, so a forked
    worker never reuses a channel)."""
    key = (os.getpid(), database, priority, call_timeout, retry)
    with _readers_lock:
        reader = _readers.get(key)
        if reader is None:
            reader = Reader(database, priority, call_timeout, retry)
            _readers[key] = reader
        return reader
