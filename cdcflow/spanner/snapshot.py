"""Tables read as of a timestamp, as snapshot records: the initial snapshot of a source.

:func:`snapshot_records` turns a table's rows, in Spanner's wire form (the JSON encoding of
column values a change record's mods use), into DataChangeRecords of mod type INSERT with
``is_snapshot=True``, up to :data:`SNAPSHOT_CHUNK_ROWS` rows each, shaped by a
:class:`~cdcflow.spanner.shape.RecordShaper` exactly as change records are (typed values,
the pushed-down filter). Both clients build their snapshot records with it.

:func:`read_snapshot` reads a table, or one key range of it, at an exact read timestamp on
Spanner with partitioned queries (PartitionQuery at the read timestamp, then each
partition streamed; with ``data_boost=True`` each partition runs on Data Boost).
Partitioned queries are what Spanner offers for reading a large table without holding one
long-running query; the emulator serves them too, so the same path runs in tests. The
partitions are read one after the other within the task. :func:`split_snapshot` reads a
table's keys in key order and cuts them into key ranges, each then read by a task of its
own (:mod:`cdcflow.engine.snapshot`). The plumbing (sessions, read-only transactions,
retries) is :mod:`cdcflow.spanner._readonly`'s.

google-cloud-spanner is imported lazily, in the functions only.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import ChangeStreamError, TransientError
from cdcflow.keyrange import Key, KeyRange, range_token, split_ranges
from cdcflow.model import (
    ColumnType,
    DataChangeRecord,
    Mod,
    Timestamp,
    snapshot_token,
)
from cdcflow.spanner._readonly import (
    RPC_TIMEOUT,
    Session,
    call_metadata,
    partitions,
    read_at,
    retried,
    stream_rows,
    too_old,
    translated,
    type_json,
)
from cdcflow.spanner.decode import plain_value
from cdcflow.spanner.keyorder import Dialect, KeyColumn, KeyOrder, Params, order_by, quote
from cdcflow.spanner.shape import RecordShaper
from cdcflow.spanner.transport import GrpcTransport

_log = logging.getLogger("cdcflow.spanner")

__all__ = [
    "SNAPSHOT_CHUNK_ROWS",
    "SNAPSHOT_TRANSACTION_ID",
    "key_columns",
    "read_snapshot",
    "snapshot_records",
    "split_snapshot",
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
    token: str | None = None,
) -> Iterator[DataChangeRecord]:
    """Snapshot records of ``table``'s ``rows`` (column name -> wire value, every column of
    ``columns``), read at ``read_timestamp_ns`` by the snapshot partition ``token`` (the
    table's, :func:`~cdcflow.model.snapshot_token`, by default).

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
    token = snapshot_token(table) if token is None else token
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
_PRIORITIES = {"LOW": 1, "MEDIUM": 2, "HIGH": 3}


def _literal(text: str) -> str:
    """A string literal both dialects read (names come from information_schema)."""
    return "'" + text.replace("'", "''") + "'"


def _split(table: str, dialect: Dialect) -> tuple[str, str]:
    """(schema, table) of a table name as change records spell it."""
    schema, _, name = table.rpartition(".")
    return schema or ("public" if dialect == "POSTGRESQL" else ""), name


def _where_table(table: str, dialect: Dialect) -> str:
    schema, name = _split(table, dialect)
    return f"WHERE table_schema = {_literal(schema)} AND table_name = {_literal(name)}"


def _from(table: str, dialect: Dialect) -> str:
    return ".".join(quote(part, dialect) for part in table.split("."))


def key_columns(rows: Rows, table: str, dialect: Dialect) -> list[KeyColumn]:
    """The primary key columns of ``table`` in key order, with their direction and
    nullability (types unknown: a query's metadata gives them), from information_schema."""
    return [
        KeyColumn(r[0].string_value, {}, r[1].string_value.upper() == "DESC",
                  r[2].string_value.upper() != "NO")
        for r in rows(
            "SELECT column_name, column_ordering, is_nullable "
            f"FROM information_schema.index_columns {_where_table(table, dialect)} "
            "AND index_type = 'PRIMARY_KEY' ORDER BY ordinal_position"
        )
    ]


def table_columns(
    rows: Rows, table: str, tracked: Iterable[str], dialect: Dialect,
    key_order: Sequence[KeyColumn] | None = None,
) -> list[tuple[str, bool, int]]:
    """The columns of ``table`` that are in ``tracked`` (the stream's columns of it) or
    keys, in table order: (name, is a key column, ordinal position), from
    information_schema (``key_order``: the :func:`key_columns` already read)."""
    ordered = rows(
        "SELECT column_name, ordinal_position FROM information_schema.columns "
        + _where_table(table, dialect)
    )
    if key_order is None:
        key_order = key_columns(rows, table, dialect)
    keys = {c.name for c in key_order}
    wanted = set(tracked) | keys
    by_position = sorted((int(plain_value(r[1])), r[0].string_value) for r in ordered)
    return [(c, c in keys, n) for n, c in by_position if c in wanted]


def split_snapshot(
    transport: GrpcTransport,
    rows: Rows,
    *,
    table: str,
    read_timestamp_ns: int,
    dialect: Dialect,
    rows_per_task: int,
    retry: RetryPolicy,
    priority: str = "MEDIUM",
    timeout: float = 600.0,
) -> list[KeyRange]:
    """``table``'s primary keys as of exactly ``read_timestamp_ns``, read in key order
    (keys only) and cut into ranges of about ``rows_per_task`` rows
    (:func:`cdcflow.keyrange.split_ranges`); [] when it has at most that many rows.

    One query ordered by the key (:func:`cdcflow.spanner.keyorder.order_by`: the table's
    own order, so Spanner streams it without sorting); only the bounds are kept. A query
    that fails midway is resumed after the last key it gave (see :func:`_scan_keys`).
    """
    keys = key_columns(rows, table, dialect)
    if not keys:
        msg = f"table {table!r} has no primary key in information_schema: is the name right?"
        raise ChangeStreamError(msg)
    session = Session(transport)
    try:
        scan = _scan_keys(transport, session, retry, keys, table=table, dialect=dialect,
                          read_timestamp_ns=read_timestamp_ns, timeout=timeout,
                          options={"request_options": {"priority": _PRIORITIES[priority]}})
        return split_ranges(scan, rows_per_task)
    finally:
        session.close()


def _scan_keys(
    transport: GrpcTransport, session: Session, retry: RetryPolicy,
    keys: Sequence[KeyColumn], *, table: str, dialect: Dialect, read_timestamp_ns: int,
    timeout: float, options: Mapping[str, Any],
) -> Iterator[Key]:
    """``table``'s keys (wire form) in key order at ``read_timestamp_ns``.

    A query that fails after its first row (the client's policy retries failures before
    it) is issued again for the keys after the last one it gave (:meth:`KeyOrder.where`'s
    ``after``, typed from the first query's metadata), so a long scan is never read again
    from its start; every resumed query has made progress, so resuming ends.
    """
    select = "SELECT {} FROM {}".format(
        ", ".join(quote(c.name, dialect) for c in keys), _from(table, dialect))
    order: KeyOrder | None = None
    last: Key | None = None
    while True:
        request: dict[str, Any] = {"sql": f"{select} {order_by(keys, dialect)}",
                                   "transaction": read_at(read_timestamp_ns), **options}
        if last is not None:
            assert order is not None
            condition, params = order.where(after=last)
            request.update(sql=f"{select} WHERE {condition} {order_by(keys, dialect)}",
                           **_params(params))
        progressed = False
        try:
            for row_type, values in translated(
                stream_rows(transport, session, retry, request, timeout), read_timestamp_ns
            ):
                if order is None:
                    order = KeyOrder([
                        attrs.evolve(c, type=type_json(f.type_))
                        for c, f in zip(keys, row_type.fields, strict=True)
                    ], dialect)
                last = tuple(plain_value(v) for v in values)
                progressed = True
                yield last
            return
        except TransientError:
            if not progressed:
                raise  # the policy's retries before the first row are spent
            _log.info("the key scan of %s failed midway; resuming after %r", table, last)


def _key_order(
    transport: GrpcTransport, session: Session, retry: RetryPolicy,
    keys: Sequence[KeyColumn], table: str, dialect: Dialect, read_timestamp_ns: int,
) -> KeyOrder:
    """``table``'s key order: its key columns' directions (``keys``, from
    information_schema) and their exact types (PostgreSQL's annotations included) from
    the metadata of a query that returns no row."""
    if not keys:
        msg = f"table {table!r} has no primary key in information_schema: is the name right?"
        raise ChangeStreamError(msg)
    sql = "SELECT {} FROM {} LIMIT 0".format(
        ", ".join(quote(c.name, dialect) for c in keys), _from(table, dialect)
    )
    api = transport._spanner_api()

    def query() -> Any:
        return api.execute_sql(
            request={"session": session(), "sql": sql,
                     "transaction": read_at(read_timestamp_ns)},
            metadata=call_metadata(transport.database), retry=None, timeout=RPC_TIMEOUT,
        )

    answer = retried(retry, session, query)
    fields = type(answer).pb(answer).metadata.row_type.fields
    return KeyOrder([
        attrs.evolve(c, type=type_json(f.type_)) for c, f in zip(keys, fields, strict=True)
    ], dialect)


def _params(params: Params) -> dict[str, Any]:
    """``params`` as an ExecuteSqlRequest's (and a PartitionQueryRequest's) fields."""
    from google.cloud.spanner_v1.types import Type
    from google.protobuf.json_format import ParseDict
    from google.protobuf.struct_pb2 import Struct

    struct = Struct()
    types: dict[str, Any] = {}
    for name, (column_type, value) in params.items():
        field = struct.fields[name]
        if isinstance(value, bool):
            field.bool_value = value
        elif isinstance(value, int | float):
            field.number_value = value
        else:
            assert isinstance(value, str)  # NULL bounds are IS NULL tests, not parameters
            field.string_value = value
        types[name] = Type.wrap(ParseDict(dict(column_type), Type.pb()()))
    return {"params": struct, "param_types": types} if params else {}


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
    key_range: KeyRange | None = None,
) -> Iterator[DataChangeRecord]:
    """``table`` (the rows of ``key_range`` only, when given) read at exactly
    ``read_timestamp_ns``, as snapshot records (see :func:`snapshot_records`), its
    ``tracked`` columns only (keys always).

    The query runs as a partitioned query in a read-only transaction at that timestamp
    (each partition on Data Boost with ``data_boost``); a query Spanner cannot partition
    runs as one stale read. A key range is the condition of
    :meth:`cdcflow.spanner.keyorder.KeyOrder.where`, its bounds query parameters. Raises
    ChangeStreamError naming the fix when the timestamp is older than the database keeps
    versions (``version_retention_period``).
    """
    keys = key_columns(rows, table, dialect)
    columns = table_columns(rows, table, tracked, dialect, keys)
    if not columns:
        msg = f"table {table!r} has no columns in information_schema: is the name right?"
        raise ChangeStreamError(msg)
    sql = "SELECT {} FROM {}".format(
        ", ".join(quote(c, dialect) for c, _, _ in columns), _from(table, dialect)
    )
    options: dict[str, Any] = {"request_options": {"priority": _PRIORITIES[priority]}}
    token = snapshot_token(table)
    session = Session(transport)
    try:
        if key_range is not None:
            try:
                order = _key_order(transport, session, retry, keys, table, dialect,
                                   read_timestamp_ns)
            except Exception as exc:
                raise too_old(exc, read_timestamp_ns) from exc
            condition, params = order.where(key_range.lo, key_range.hi)
            sql += f" WHERE {condition}"
            options.update(_params(params))
            token = range_token(table, key_range)
        yield from _read(transport, session, retry, sql, columns, table=table,
                         read_timestamp_ns=read_timestamp_ns, shaper=shaper, timeout=timeout,
                         data_boost=data_boost, options=options, token=token)
    finally:
        session.close()


def _read(
    transport: GrpcTransport, session: Session, retry: RetryPolicy, sql: str,
    columns: Sequence[tuple[str, bool, int]], *, table: str, read_timestamp_ns: int,
    shaper: RecordShaper, timeout: float, data_boost: bool, options: Mapping[str, Any],
    token: str,
) -> Iterator[DataChangeRecord]:
    """The body of :func:`read_snapshot`, on ``session``; ``options`` hold the request
    options and the query's parameters."""
    params = {k: v for k, v in options.items() if k in ("params", "param_types")}
    try:
        txn, tokens = partitions(transport, session, retry, sql, read_timestamp_ns, params)
    except Exception as exc:
        raise too_old(exc, read_timestamp_ns) from exc
    if tokens:
        requests = [
            {"sql": sql, "transaction": {"id": txn.id}, "partition_token": partition,
             "data_boost_enabled": data_boost, **options}
            for partition in tokens
        ]
    else:
        requests = [{"sql": sql, "transaction": {"id": txn.id}, **options}]
    found = translated(
        itertools.chain.from_iterable(
            stream_rows(transport, session, retry, r, timeout) for r in requests
        ),
        read_timestamp_ns,
    )
    first = next(found, None)
    if first is None:
        return
    known = {name: (key, position) for name, key, position in columns}
    types = tuple(
        ColumnType(f.name, type_json(f.type_), *known[f.name]) for f in first[0].fields
    )
    names = [c.name for c in types]
    wire = (
        {n: plain_value(v) for n, v in zip(names, values, strict=True)}
        for _, values in itertools.chain([first], found)
    )
    yield from snapshot_records(table, read_timestamp_ns, types, wire, shaper, token=token)
