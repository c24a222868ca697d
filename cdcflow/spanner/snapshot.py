"""Tables read as of a timestamp, as snapshot records: the initial snapshot of a source.

:func:`snapshot_records` turns a table's rows, in Spanner's wire form (the JSON encoding of
column values a change record's mods use), into DataChangeRecords of mod type INSERT with
``is_snapshot=True``, up to :data:`SNAPSHOT_CHUNK_ROWS` rows each, shaped by a
:class:`~cdcflow.spanner.shape.RecordShaper` exactly as change records are (typed values,
the pushed-down filter). Both clients build their snapshot records with it.

:class:`SpannerSnapshotReader` reads a table at an exact read timestamp on Spanner with
partitioned queries (PartitionQuery at the read timestamp, then each partition streamed;
with ``data_boost=True`` each partition runs on Data Boost). Partitioned queries are what
Spanner offers for reading a large table in parallel without holding one long-running
query; the emulator serves them too, so the same path runs in tests. The partitions are
read one after the other within the task (one task per table).

google-cloud-spanner is imported lazily, in the reader's methods only.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import ChangeStreamError, TransientError
from cdcflow.model import (
    ColumnType,
    DataChangeRecord,
    Mod,
    Timestamp,
    snapshot_token,
)
from cdcflow.spanner.decode import plain_value
from cdcflow.spanner.retry import is_transient, status_name
from cdcflow.spanner.shape import RecordShaper
from cdcflow.spanner.transport import GrpcTransport, assemble_rows

__all__ = [
    "SNAPSHOT_CHUNK_ROWS",
    "SNAPSHOT_TRANSACTION_ID",
    "read_snapshot",
    "snapshot_records",
    "table_columns",
]

#: Most rows (mods) in one snapshot record.
SNAPSHOT_CHUNK_ROWS = 1000
#: The ``server_transaction_id`` of every snapshot record.
SNAPSHOT_TRANSACTION_ID = "snapshot"


def snapshot_records(
    table: str,
    read_timestamp_ns: int,
    columns: Sequence[ColumnType],
    rows: Iterable[Mapping[str, Any]],
    shaper: RecordShaper,
    chunk_rows: int = SNAPSHOT_CHUNK_ROWS,
) -> Iterator[DataChangeRecord]:
    """Snapshot records of ``table``'s ``rows`` (column name -> wire value, every column of
    ``columns``), read at ``read_timestamp_ns``.

    One record per ``chunk_rows`` rows, ``record_sequence`` the chunk number (8 digits),
    commit timestamp the read timestamp, ``server_transaction_id`` ``"snapshot"``, value
    capture type NEW_ROW, ``number_of_records_in_transaction`` 0 (rows are streamed, their
    number is not known in advance) and ``is_last_record_in_transaction_in_partition`` on
    the last one. Records the shaper's filter keeps nothing of are not yielded.
    """
    if chunk_rows < 1:
        msg = f"chunk_rows={chunk_rows}: use 1 or more"
        raise ValueError(msg)
    if not shaper.wants(table, "INSERT"):
        return
    keys = [c.name for c in columns if c.is_primary_key]
    others = [c.name for c in columns if not c.is_primary_key]
    token = snapshot_token(table)
    at = Timestamp.from_ns(read_timestamp_ns)
    types = tuple(columns)

    def record(number: int, chunk: list[Mod], last: bool) -> DataChangeRecord | None:
        shaped = shaper.shape(DataChangeRecord(
            partition_token=token, commit_timestamp=at, record_sequence=f"{number:08d}",
            server_transaction_id=SNAPSHOT_TRANSACTION_ID,
            is_last_record_in_transaction_in_partition=last, table_name=table,
            column_types=types, mods=chunk, mod_type="INSERT", value_capture_type="NEW_ROW",
            number_of_records_in_transaction=0, number_of_partitions_in_transaction=1,
            is_snapshot=True,
        ))
        return shaped if isinstance(shaped, DataChangeRecord) else None

    number = 0
    chunk: list[Mod] = []
    for row in rows:
        if len(chunk) == chunk_rows:
            # Held back one row: only a later row tells that this chunk is not the last.
            out = record(number, chunk, last=False)
            if out is not None:
                yield out
            number, chunk = number + 1, []
        chunk.append(Mod({k: row[k] for k in keys}, {c: row[c] for c in others}, {}))
    if chunk:
        out = record(number, chunk, last=True)
        if out is not None:
            yield out


# --- Spanner ----------------------------------------------------------------------------------

#: Runs one metadata query; returns its rows of protobuf ``Value``.
Rows = Callable[[str], list[list[Any]]]
Dialect = Literal["GOOGLE_STANDARD_SQL", "POSTGRESQL"]
_Row = tuple[Any, list[Any]]  # (row type, protobuf values)
_PRIORITIES = {"LOW": 1, "MEDIUM": 2, "HIGH": 3}
_RPC_TIMEOUT = 60.0


def _literal(text: str) -> str:
    """A string literal both dialects read (names come from information_schema)."""
    return "'" + text.replace("'", "''") + "'"


def _split(table: str, dialect: Dialect) -> tuple[str, str]:
    """(schema, table) of a table name as change records spell it."""
    schema, _, name = table.rpartition(".")
    return schema or ("public" if dialect == "POSTGRESQL" else ""), name


def _quote(name: str, dialect: Dialect) -> str:
    if dialect == "POSTGRESQL":
        return '"' + name.replace('"', '""') + '"'
    return "`" + name + "`"  # information_schema's names: no backquote in them


def table_columns(
    rows: Rows, table: str, tracked: Iterable[str], dialect: Dialect
) -> list[tuple[str, bool, int]]:
    """The columns of ``table`` that are in ``tracked`` (the stream's columns of it) or
    keys, in table order: (name, is a key column, ordinal position), from
    information_schema."""
    schema, name = _split(table, dialect)
    where = f"WHERE table_schema = {_literal(schema)} AND table_name = {_literal(name)}"
    ordered = rows(
        f"SELECT column_name, ordinal_position FROM information_schema.columns {where}"
    )
    keys = {
        r[0].string_value for r in rows(
            f"SELECT column_name FROM information_schema.index_columns {where} "
            "AND index_type = 'PRIMARY_KEY'"
        )
    }
    wanted = set(tracked) | keys
    by_position = sorted((int(plain_value(r[1])), r[0].string_value) for r in ordered)
    return [(c, c in keys, n) for n, c in by_position if c in wanted]


def _type_json(type_pb: Any) -> Any:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(type_pb, preserving_proto_field_name=True)


def _pb_timestamp(ns: int) -> Any:
    from google.protobuf.timestamp_pb2 import Timestamp as PbTimestamp

    return PbTimestamp(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000)


def _metadata(database: str) -> list[tuple[str, str]]:
    return [("google-cloud-resource-prefix", database)]


class _Session:
    """A plain session of one snapshot read, created on first use, deleted by
    :meth:`close`.

    A read holds a read-only transaction across PartitionQuery and every partition's
    query. A session runs one transaction at a time (the emulator's and Spanner's regular
    sessions; a new BeginTransaction invalidates the previous one: "Invalid transaction ID.
    Transaction ID must be >= N"), and the tables of a snapshot are read concurrently by
    tasks sharing one client, so each read takes a session of its own instead of the
    transport's shared one.
    """

    def __init__(self, transport: GrpcTransport) -> None:
        self._transport = transport
        self._name: str | None = None

    def __call__(self) -> str:
        if self._name is None:
            created = self._transport._spanner_api().create_session(
                request={"database": self._transport.database},
                metadata=_metadata(self._transport.database), retry=None, timeout=_RPC_TIMEOUT,
            )
            self._name = str(created.name)
        return self._name

    def reset(self) -> None:
        """Forget the session (the server said it no longer exists)."""
        self._name = None

    def close(self) -> None:
        """Delete the session; best effort (the server expires an idle one anyway)."""
        name, self._name = self._name, None
        if name is not None:
            # An expired or unreachable session is deleted by the server anyway.
            with contextlib.suppress(Exception):
                self._transport._spanner_api().delete_session(
                    name=name, metadata=_metadata(self._transport.database), retry=None,
                    timeout=_RPC_TIMEOUT,
                )


def _retried(retry: RetryPolicy, session: _Session, fn: Callable[[], Any]) -> Any:
    """``fn()`` under ``retry``: transient errors and a lost session (renewed) are retried;
    once the policy gives up on a transient error it raises TransientError, which the
    engine answers by running the batch again."""
    def worth(exc: BaseException) -> bool:
        if status_name(exc) == "NOT_FOUND" and "Session not found" in str(exc):
            session.reset()
            return True
        return is_transient(exc)

    try:
        return retry.call(fn, retry_if=worth)
    except Exception as exc:
        if not is_transient(exc):
            raise
        msg = (
            f"the snapshot read kept failing ({status_name(exc)}); check the database's "
            "health and quota, then run again"
        )
        raise TransientError(msg) from exc


def _partitions(
    transport: GrpcTransport, session: _Session, retry: RetryPolicy, sql: str,
    read_timestamp_ns: int,
) -> tuple[Any, list[bytes]]:
    """A read-only transaction at exactly ``read_timestamp_ns`` and the partition tokens of
    ``sql`` in it (an empty list when the query cannot be partitioned)."""
    api = transport._spanner_api()
    meta = _metadata(transport.database)

    def begin() -> Any:
        return api.begin_transaction(
            request={"session": session(), "options": {"read_only": {
                "read_timestamp": _pb_timestamp(read_timestamp_ns),
            }}},
            metadata=meta, retry=None, timeout=_RPC_TIMEOUT,
        )

    txn = _retried(retry, session, begin)

    def partition() -> list[bytes]:
        try:
            answer = api.partition_query(
                request={"session": session(), "transaction": {"id": txn.id},
                         "sql": sql},
                metadata=meta, retry=None, timeout=_RPC_TIMEOUT,
            )
        except Exception as exc:
            if status_name(exc) in ("INVALID_ARGUMENT", "UNIMPLEMENTED"):
                return []  # not root-partitionable here: one plain query instead
            raise
        return [p.partition_token for p in answer.partitions]

    return txn, _retried(retry, session, partition)


def _stream(
    transport: GrpcTransport, session: _Session, retry: RetryPolicy,
    request: Mapping[str, Any], timeout: float,
) -> Iterator[tuple[Any, list[Any]]]:
    """Rows of one query. Failures before its first row are retried; a failure after it
    raises TransientError (the engine replays the batch: rows are not resumable here)."""
    from google.cloud.spanner_v1.types import ExecuteSqlRequest, PartialResultSet

    api = transport._spanner_api()

    def start() -> tuple[Any, Any, Iterator[tuple[Any, list[Any]]]]:
        call = api.execute_streaming_sql(
            request=ExecuteSqlRequest(session=session(), **request),
            metadata=_metadata(transport.database), retry=None, timeout=timeout,
        )
        rows = assemble_rows(PartialResultSet.pb(item) for item in call)
        return call, next(rows, None), rows  # the first row: errors up to here are retried

    call, first, rows = _retried(retry, session, start)
    try:
        if first is None:
            return
        yield first
        yield from rows
    except Exception as exc:
        if not is_transient(exc):
            raise
        msg = (
            f"the snapshot query failed midway ({status_name(exc)}); the batch is read again "
            "under the run's batch_retries"
        )
        raise TransientError(msg) from exc
    finally:
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            cancel()


def read_snapshot(
    transport: GrpcTransport,
    rows: Rows,
    *,
    table: str,
    tracked: Iterable[str],
    read_timestamp_ns: int,
    dialect: Dialect,
    shaper: RecordShaper,
    retry: RetryPolicy,
    priority: str = "MEDIUM",
    timeout: float = 600.0,
    data_boost: bool = False,
) -> Iterator[DataChangeRecord]:
    """``table`` read at exactly ``read_timestamp_ns``, as snapshot records (see
    :func:`snapshot_records`), its ``tracked`` columns only (keys always).

    The query runs as a partitioned query in a read-only transaction at that timestamp
    (each partition on Data Boost with ``data_boost``); a query Spanner cannot partition
    runs as one stale read. Raises ChangeStreamError naming the fix when the timestamp is
    older than the database keeps versions (``version_retention_period``).
    """
    columns = table_columns(rows, table, tracked, dialect)
    if not columns:
        msg = f"table {table!r} has no columns in information_schema: is the name right?"
        raise ChangeStreamError(msg)
    sql = "SELECT {} FROM {}".format(
        ", ".join(_quote(c, dialect) for c, _, _ in columns),
        ".".join(_quote(part, dialect) for part in table.split(".")),
    )
    options = {"request_options": {"priority": _PRIORITIES[priority]}}
    session = _Session(transport)
    try:
        yield from _read(transport, session, retry, sql, columns, table=table,
                         read_timestamp_ns=read_timestamp_ns, shaper=shaper, timeout=timeout,
                         data_boost=data_boost, options=options)
    finally:
        session.close()


def _read(
    transport: GrpcTransport, session: _Session, retry: RetryPolicy, sql: str,
    columns: Sequence[tuple[str, bool, int]], *, table: str, read_timestamp_ns: int,
    shaper: RecordShaper, timeout: float, data_boost: bool, options: Mapping[str, Any],
) -> Iterator[DataChangeRecord]:
    """The body of :func:`read_snapshot`, on ``session``."""
    try:
        txn, tokens = _partitions(transport, session, retry, sql, read_timestamp_ns)
    except Exception as exc:
        raise _too_old(exc, read_timestamp_ns) from exc
    if tokens:
        requests = [
            {"sql": sql, "transaction": {"id": txn.id}, "partition_token": token,
             "data_boost_enabled": data_boost, **options}
            for token in tokens
        ]
    else:
        requests = [{"sql": sql, "transaction": {"id": txn.id}, **options}]
    found = _translated(
        itertools.chain.from_iterable(
            _stream(transport, session, retry, r, timeout) for r in requests
        ),
        read_timestamp_ns,
    )
    first = next(found, None)
    if first is None:
        return
    known = {name: (key, position) for name, key, position in columns}
    types = tuple(
        ColumnType(f.name, _type_json(f.type_), *known[f.name]) for f in first[0].fields
    )
    names = [c.name for c in types]
    wire = (
        {n: plain_value(v) for n, v in zip(names, values, strict=True)}
        for _, values in itertools.chain([first], found)
    )
    yield from snapshot_records(table, read_timestamp_ns, types, wire, shaper)


def _translated(rows: Iterator[_Row], read_timestamp_ns: int) -> Iterator[_Row]:
    try:
        yield from rows
    except Exception as exc:
        translated = _too_old(exc, read_timestamp_ns)
        if translated is exc:
            raise
        raise translated from exc


def _too_old(exc: Exception, read_timestamp_ns: int) -> Exception:
    text = str(getattr(exc, "message", exc))
    lower = text.lower()
    if status_name(exc) == "FAILED_PRECONDITION" and any(
        word in lower for word in ("too old", "staleness", "retention")
    ):
        msg = (
            f"the snapshot reads the tables as of {Timestamp.from_ns(read_timestamp_ns)} (just "
            "before start_at), older than the database keeps row versions; start later, or "
            f"raise the database's version_retention_period ({text})"
        )
        return ChangeStreamError(msg)
    return exc
