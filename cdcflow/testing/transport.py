"""A wire-level twin of Spanner for the change-stream reader: :class:`ScriptedTransport`.

:class:`~cdcflow.spanner.client.SpannerChangeStreamClient` sends its SQL through a
:class:`~cdcflow.spanner.transport.Transport`. This one answers with records built in code,
encoded exactly as Spanner sends them (``PartialResultSet`` protobuf messages of GoogleSQL
STRUCT rows, PostgreSQL JSONB rows or MUTABLE_KEY_RANGE ``ChangeStreamRecord`` protos), so
the real client's decoding, resumption and windowing run without a server, including what
the emulator cannot do (MUTABLE_KEY_RANGE streams, a connection reset after exactly N
messages)::

    from cdcflow.spanner.client import SpannerChangeStreamClient
    from cdcflow.testing import ScriptedTransport

    client = SpannerChangeStreamClient("projects/p/instances/i/databases/d")
    client.transport = ScriptedTransport(records, stream="S", fail_after=[3])
    got = list(client.read(ChangeStreamQuery("S", "tok", start, end)))

Contract. Metadata queries (``information_schema``) describe one database of ``dialect``
holding one change stream ``stream`` in ``partition_mode``, which tracks every column of
the tables its data change records name (with the columns their ``column_types`` list).
A change stream query returns every record whose position lies in the query's
``[start_timestamp, end_timestamp]`` (both inclusive, as the TVF's are; no end means no
upper bound), in the order given, whatever the partition token: script one partition per
transport. Every query is recorded
in :attr:`ScriptedTransport.queries`. With ``fail_after=[n, ...]`` the k-th change stream
query raises ``error`` (default: ``UNAVAILABLE``, which the client retries) after its n-th
message, if it has more than n; queries past the list run clean.

Google's client libraries are imported only when a query runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

import attrs

from cdcflow.model import ChangeRecord, DataChangeRecord, Timestamp, record_position
from cdcflow.spanner import wire
from cdcflow.spanner.transport import Param

__all__ = ["ScriptedQuery", "ScriptedTransport"]

Dialect = Literal["GOOGLE_STANDARD_SQL", "POSTGRESQL"]
PartitionMode = Literal["IMMUTABLE_KEY_RANGE", "MUTABLE_KEY_RANGE"]

# google.spanner.v1.TypeCode.BYTES: the PostgreSQL dialect returns ChangeStreamRecord
# protos as bytes. Set as a number so this module needs no import of the Spanner client.
_TYPE_CODE_BYTES = 7


@attrs.frozen
class ScriptedQuery:
    """One change stream query the transport answered: its SQL, partition token (None for
    the root query) and inclusive bounds in nanoseconds (``end`` None: unbounded)."""

    sql: str
    token: str | None
    start: int
    end: int | None


def _service_unavailable() -> BaseException:
    return wire.service_unavailable("connection reset")


class ScriptedTransport:
    """Serves ``records`` through the change stream wire protocol (see the module doc).

    ``chunk=True`` splits every row across two messages (``chunked_value``), as Spanner
    does with large values; ``rows_per_message`` puts that many rows in a message (1).
    ``error`` builds the exception a ``fail_after`` failure raises (a count of messages).
    Messages are serialized, as :class:`~cdcflow.spanner.transport.GrpcTransport` yields
    them; ``serialized=False`` yields protobuf messages instead (the seam takes both).
    """

    def __init__(
        self,
        records: Sequence[ChangeRecord],
        *,
        stream: str = "S",
        dialect: Dialect = "GOOGLE_STANDARD_SQL",
        partition_mode: PartitionMode = "IMMUTABLE_KEY_RANGE",
        retention: str | None = None,
        fail_after: Sequence[int] = (),
        error: Callable[[], BaseException] = _service_unavailable,
        chunk: bool = False,
        serialized: bool = True,
        rows_per_message: int = 1,
    ) -> None:
        if dialect not in ("GOOGLE_STANDARD_SQL", "POSTGRESQL"):
            msg = f"ScriptedTransport(dialect={dialect!r}): use GOOGLE_STANDARD_SQL or POSTGRESQL"
            raise ValueError(msg)
        if partition_mode not in ("IMMUTABLE_KEY_RANGE", "MUTABLE_KEY_RANGE"):
            msg = (
                f"ScriptedTransport(partition_mode={partition_mode!r}): use "
                "IMMUTABLE_KEY_RANGE or MUTABLE_KEY_RANGE"
            )
            raise ValueError(msg)
        if rows_per_message < 1:
            msg = f"ScriptedTransport(rows_per_message={rows_per_message}): 1 or more"
            raise ValueError(msg)
        if any(n < 0 for n in fail_after):
            msg = f"ScriptedTransport(fail_after={list(fail_after)}): counts are 0 or more"
            raise ValueError(msg)
        self.records = list(records)
        self.stream = stream
        self.dialect = dialect
        self.partition_mode = partition_mode
        self.retention = retention
        self.error = error
        self.chunk = chunk
        self.serialized = serialized
        self.rows_per_message = rows_per_message
        self.queries: list[ScriptedQuery] = []
        self.resets = 0
        self.closed = False
        self._fail_after = list(fail_after)

    # -- Transport ---------------------------------------------------------------------------

    def execute_streaming_sql(
        self, sql: str, params: Mapping[str, Param], *, priority: str, timeout: float,
        idle: float | None = None, stopping: Callable[[], bool] | None = None,
    ) -> Iterator[Any]:
        if "information_schema" in sql:
            return iter(self._metadata(sql))
        return self._change_stream(sql, params)

    def reset_session(self) -> None:
        self.resets += 1

    def close(self) -> None:
        self.closed = True

    # -- answers -----------------------------------------------------------------------------

    def _metadata(self, sql: str) -> list[Any]:
        if "database_options" in sql:
            return wire.string_rows(["option_value"], [[self.dialect]])
        if "change_stream_options" in sql:
            options: list[list[str | None]] = []
            if self.partition_mode == "MUTABLE_KEY_RANGE":
                options.append(["partition_mode", self.partition_mode])
            if self.retention is not None:
                options.append(["retention_period", self.retention])
            return wire.string_rows(["option_name", "option_value"], options)
        tracked = self._tracked()
        if "change_stream_tables" in sql:
            return wire.string_rows(["table_schema", "table_name", "all_columns"],
                                    [["", t, "YES"] for t in sorted(tracked)])
        if "change_stream_columns" in sql or "`ALL`" in sql or '"all"' in sql:
            return wire.string_rows(["table_schema", "table_name", "column_name"], [])
        if "index_columns" in sql or "information_schema.columns" in sql:
            keys_only = "index_columns" in sql
            return wire.string_rows(["table_schema", "table_name", "column_name"], [
                ["", t, c] for t, cols in sorted(tracked.items()) for c, key in cols.items()
                if key or not keys_only
            ])
        return wire.string_rows(["change_stream_name"], [[self.stream]])

    def _tracked(self) -> dict[str, dict[str, bool]]:
        """Table -> column -> is it a key, from the data change records served."""
        out: dict[str, dict[str, bool]] = {}
        for r in self.records:
            if isinstance(r, DataChangeRecord):
                cols = out.setdefault(r.table_name, {})
                for c in r.column_types:
                    cols[c.name] = cols.get(c.name, False) or c.is_primary_key
        return out

    def _change_stream(self, sql: str, params: Mapping[str, Param]) -> Iterator[Any]:
        # GoogleSQL names its parameters (@s, @e, @t); PostgreSQL numbers them ($1, $2, $3).
        names = ("s", "e", "t") if self.dialect == "GOOGLE_STANDARD_SQL" else ("p1", "p2", "p3")
        start_text, end_text, token = (params[n][1] for n in names)
        if start_text is None:
            msg = f"a change stream query without a start timestamp: {sql}"
            raise ValueError(msg)
        query = ScriptedQuery(
            sql, token, Timestamp.parse(start_text).ns,
            None if end_text is None else Timestamp.parse(end_text).ns,
        )
        self.queries.append(query)
        served = [
            r for r in self.records
            if query.start <= record_position(r)
            and (query.end is None or record_position(r) <= query.end)
        ]
        messages = wire.partial_result_sets(
            wire.row_type(self._column_type()), [self._value(r) for r in served],
            rows_per_message=self.rows_per_message, chunk=self.chunk,
        )
        limit = self._fail_after.pop(0) if self._fail_after else None
        return self._stream(messages, limit)

    def _stream(self, messages: list[Any], limit: int | None) -> Iterator[Any]:
        for i, message in enumerate(messages):
            if i == limit:
                raise self.error()
            yield message.SerializeToString() if self.serialized else message

    def _column_type(self) -> Any:
        if self.partition_mode == "MUTABLE_KEY_RANGE":
            column = wire.proto_column_type()
            if self.dialect == "POSTGRESQL":
                column.code = _TYPE_CODE_BYTES
                column.ClearField("proto_type_fqn")
            return column
        if self.dialect == "POSTGRESQL":
            return wire.postgresql_column_type()
        return wire.googlesql_column_type()

    def _value(self, record: ChangeRecord) -> Any:
        if self.partition_mode == "MUTABLE_KEY_RANGE":
            return wire.proto_value(record)
        if self.dialect == "POSTGRESQL":
            return wire.encode_postgresql(record)
        return wire.encode_googlesql([record])
