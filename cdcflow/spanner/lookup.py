"""LookupRows: the full row of every changed key, read as of the change's commit timestamp.

NEW_VALUES and OLD_AND_NEW_VALUES change streams report only the columns a transaction
wrote. A stale read at a record's commit timestamp returns each changed row as it was right
after that transaction, also a row that a later transaction deleted, so::

    pipeline
     | ReadChangeStream(DB, "OrdersStream", start_at="-10m")
     | LookupRows(database=DB)                  # mods' new_values: every column of the row
     | WriteFiles("out/orders")

One record is one transaction's mods of one table (in one partition), so the lookup makes
ONE read per record: all of the record's keys in one ``KeySet``, at a read timestamp equal
to the record's commit timestamp. Elements are processed one at a time (DoFns are
element-wise), which is why the batching unit is the record and not a group of records.

Values. The read gives the change stream's wire form (INT64 and NUMERIC as text, TIMESTAMP
as RFC 3339 text, BYTES as base64, JSON as its text, FLOAT64 as a number). With
``typed=True`` (the default, as the reader's) they are then typed from the column types
like the stream's own mods; ``typed=False`` keeps the wire form, for a source read with
``typed=False``. Either way a looked-up row and a NEW_ROW stream's row read alike.

RPCs. Reads go out without the stock client's retry loop and with a deadline of
``call_timeout`` seconds; transient errors (:func:`~cdcflow.spanner.retry.is_transient`)
are retried under one :class:`~cdcflow.backoff.RetryPolicy`. A read at a timestamp older
than the database's ``version_retention_period`` (one hour by default) fails permanently,
with a message naming that option.
"""

from __future__ import annotations

import base64
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import ChangeStreamError, ConfigurationError, TransientError
from cdcflow.model import ColumnType, DataChangeRecord, Mod, Timestamp
from cdcflow.spanner.decode import plain_value
from cdcflow.spanner.retry import is_transient, status_name
from cdcflow.spanner.transport import GrpcTransport, Param, assemble_rows
from cdcflow.spanner.values import decode_values, decoders
from cdcflow.transforms.base import DoFn, ParDo

__all__ = ["DEFAULT_LOOKUP_RETRY", "LookupRows"]

#: Retries of one lookup: at most 8 attempts, none starting more than 60 s after the first.
DEFAULT_LOOKUP_RETRY = RetryPolicy(attempts=8, initial=0.05, maximum=4.0, deadline=60.0)
#: How many tables' column lists a task keeps (least recently used ones are dropped).
_COLUMN_CACHE_SIZE = 256
_PRIORITIES = {"LOW": 1, "MEDIUM": 2, "HIGH": 3}
_DATABASE = re.compile(r"^projects/[^/]+/instances/[^/]+/databases/[^/]+$")


@attrs.frozen
class _TableColumns:
    """A table's columns in table order, and its primary key columns in key order."""

    columns: tuple[str, ...]
    key: tuple[str, ...]

    def select(self, wanted: Sequence[str] | None, table: str) -> tuple[str, ...]:
        """The columns to read: the key, then ``wanted`` (all columns when None), each once.

        Raises ConfigurationError naming the table's columns when ``wanted`` names an
        unknown column.
        """
        if wanted is None:
            rest: Iterable[str] = self.columns
        else:
            unknown = [c for c in wanted if c not in self.columns]
            if unknown:
                msg = (
                    f"LookupRows(columns=...): {', '.join(map(repr, unknown))} not in table "
                    f"{table!r} (columns: {', '.join(self.columns)}); fix the column names"
                )
                raise ConfigurationError(msg)
            rest = wanted
        return tuple(dict.fromkeys((*self.key, *rest)))


def _wire_value(value: Any) -> Any:
    """A key value as the change stream's wire form (what a Spanner ``Value`` holds).

    Mods hold wire values already (``"42"`` for an INT64); typed values (int, Decimal,
    datetime, date, bytes) are turned into the same text, so either kind of key reads."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | Decimal):
        return str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value).replace("inf", "Infinity")
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, datetime):
        return Timestamp.from_datetime(value).rfc3339()
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return [_wire_value(v) for v in value]
    msg = f"a key value of type {type(value).__name__} ({value!r}) cannot be looked up"
    raise TypeError(msg)


def _key_tuple(keys: Mapping[str, Any], key_columns: Sequence[str]) -> tuple[Any, ...]:
    """A mod's key in primary key order, in wire form.

    Raises ChangeStreamError when the mod lacks a key column (the table's key changed, or
    the record belongs to another database than the one LookupRows reads)."""
    missing = [c for c in key_columns if c not in keys]
    if missing:
        msg = (
            f"a mod's keys {sorted(keys)} lack the primary key column(s) {missing}: is "
            "LookupRows(database=...) the database the change stream belongs to?"
        )
        raise ChangeStreamError(msg)
    return tuple(_hashable(_wire_value(keys[c])) for c in key_columns)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _looked_up(
    record: DataChangeRecord,
    table: _TableColumns,
    selected: Sequence[str],
    rows: Mapping[tuple[Any, ...], Mapping[str, Any]],
    types: Mapping[str, Any],
    ordinals: Mapping[str, int],
) -> DataChangeRecord:
    """``record`` with every non-DELETE mod's ``new_values`` replaced by the non-key
    ``selected`` columns of its row in ``rows`` (keyed by :func:`_key_tuple`).

    DELETE mods keep empty ``new_values``; keys and old values stay as they are. The
    column types describe the key and the selected columns (``types`` are the read's
    decoded JSON types, ``ordinals`` the columns' positions in the table). Raises
    ChangeStreamError when a row is missing (the database is not the stream's)."""
    values = [c for c in selected if c not in table.key]
    mods = []
    for mod in record.mods:
        if record.mod_type == "DELETE":
            mods.append(mod)
            continue
        row = rows.get(_key_tuple(mod.keys, table.key))
        if row is None:
            msg = (
                f"row {dict(mod.keys)} of {record.table_name!r} not found at its commit "
                f"timestamp {record.commit_timestamp.rfc3339()}: is LookupRows(database=...) "
                "the database the change stream belongs to?"
            )
            raise ChangeStreamError(msg)
        mods.append(Mod(keys=mod.keys, new_values={c: row[c] for c in values},
                        old_values=mod.old_values))
    if record.mod_type == "DELETE":
        return record
    column_types = tuple(
        ColumnType(c, types[c], c in table.key, ordinals[c]) for c in selected
    )
    return attrs.evolve(record, mods=tuple(mods), column_types=column_types)


class _Reader:
    """Stale reads and schema queries on one database, without the stock retry loop.

    Thread-safe; one per process and arguments (:func:`_cached_reader`)."""

    def __init__(self, database: str, priority: str, call_timeout: float,
                 retry: RetryPolicy) -> None:
        self.database = database
        self.priority = priority
        self.call_timeout = call_timeout
        self.retry = retry
        self.transport = GrpcTransport(database)
        self._dialect: str | None = None

    # -- retries ---------------------------------------------------------------------------

    def _retry_if(self, exc: BaseException) -> bool:
        if status_name(exc) == "NOT_FOUND" and "Session not found" in str(exc):
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
            raise ChangeStreamError(msg) from exc

    # -- schema ----------------------------------------------------------------------------

    def _sql(self, sql: str, params: Mapping[str, Param]) -> list[list[Any]]:
        def once() -> list[list[Any]]:
            responses = self.transport.execute_streaming_sql(
                sql, params, priority=self.priority, timeout=self.call_timeout
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

    def table_columns(self, table: str) -> _TableColumns:
        """The table's columns and primary key from information_schema.

        Raises ConfigurationError when the table does not exist."""
        postgres = self.dialect() == "POSTGRESQL"
        schema, _, name = table.rpartition(".")
        schema = schema or ("public" if postgres else "")
        where = (
            "table_schema = $1 AND table_name = $2" if postgres
            else "table_schema = @p1 AND table_name = @p2"
        )
        params: dict[str, Param] = {"p1": ("STRING", schema), "p2": ("STRING", name)}
        columns = self._sql(
            f"SELECT column_name FROM information_schema.columns WHERE {where} "
            "ORDER BY ordinal_position", params,
        )
        key = self._sql(
            f"SELECT column_name FROM information_schema.index_columns WHERE {where} "
            "AND index_name = 'PRIMARY_KEY' ORDER BY ordinal_position", params,
        )
        if not columns or not key:
            msg = (
                f"table {table!r} not found in {self.database}: is LookupRows(database=...) "
                "the database the change stream belongs to?"
            )
            raise ConfigurationError(msg)
        return _TableColumns(
            tuple(r[0].string_value for r in columns), tuple(r[0].string_value for r in key)
        )

    # -- stale reads -----------------------------------------------------------------------

    def read_at(
        self, table: str, columns: Sequence[str], keys: Sequence[tuple[Any, ...]], ns: int
    ) -> tuple[list[list[Any]], dict[str, Any]]:
        """Rows of ``keys`` (wire form, key order) as of ``ns``, in one Read call; returns
        the rows (plain values, ``columns`` order) and each column's decoded JSON type."""

        def once() -> tuple[list[list[Any]], dict[str, Any]]:
            rows: list[list[Any]] = []
            types: dict[str, Any] = {}
            for row_type, row in assemble_rows(self._stream(table, columns, keys, ns)):
                if not types:
                    types = {f.name: _type_json(f.type_) for f in row_type.fields}
                rows.append([plain_value(v) for v in row])
            return rows, types

        result: tuple[list[list[Any]], dict[str, Any]] = self._call(
            f"reading {table!r} as of {Timestamp.from_ns(ns).rfc3339()}", once
        )
        return result

    def _stream(self, table: str, columns: Sequence[str], keys: Sequence[tuple[Any, ...]],
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
            key_set=KeySet(keys=[[_unhashable(v) for v in k] for k in keys]),
            request_options=RequestOptions(priority=_PRIORITIES[self.priority]),
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


def _unhashable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _type_json(type_pb: Any) -> Any:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(type_pb, preserving_proto_field_name=True)


_readers: dict[tuple[int, str, str, float, RetryPolicy], _Reader] = {}
_readers_lock = threading.Lock()


def _cached_reader(database: str, priority: str, call_timeout: float,
                   retry: RetryPolicy) -> _Reader:
    """The process's reader for these arguments (keyed by process id too, so a forked
    worker never reuses a channel)."""
    key = (os.getpid(), database, priority, call_timeout, retry)
    with _readers_lock:
        reader = _readers.get(key)
        if reader is None:
            reader = _Reader(database, priority, call_timeout, retry)
            _readers[key] = reader
        return reader


class _LookupFn(DoFn[DataChangeRecord, DataChangeRecord]):
    """Looks up the full rows of one record per call; see :class:`LookupRows`."""

    def __init__(self, database: str, columns: tuple[str, ...] | None, priority: str,
                 call_timeout: float, retry: RetryPolicy, typed: bool = True) -> None:
        self.database = database
        self.columns = columns
        self.typed = typed
        self.priority = priority
        self.call_timeout = call_timeout
        self.retry = retry
        self._reader: _Reader | None = None
        self._tables: OrderedDict[str, _TableColumns] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Clients, caches and locks stay in the process that made them.
        state = dict(self.__dict__)
        state.update(_reader=None, _tables=OrderedDict(), _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def setup(self) -> None:
        self._reader = _cached_reader(self.database, self.priority, self.call_timeout,
                                      self.retry)

    def _table(self, reader: _Reader, table: str) -> _TableColumns:
        with self._lock:
            cached = self._tables.get(table)
            if cached is not None:
                self._tables.move_to_end(table)
                return cached
        found = reader.table_columns(table)
        with self._lock:
            self._tables[table] = found
            while len(self._tables) > _COLUMN_CACHE_SIZE:
                self._tables.popitem(last=False)
        return found

    def process(self, element: DataChangeRecord) -> Iterable[DataChangeRecord]:
        if element.mod_type == "DELETE" or not element.mods:
            return (element,)
        if self._reader is None:
            self.setup()
        reader = self._reader
        assert reader is not None
        table = self._table(reader, element.table_name)
        selected = table.select(self.columns, element.table_name)
        keys = list(dict.fromkeys(_key_tuple(m.keys, table.key) for m in element.mods))
        rows, types = reader.read_at(
            element.table_name, selected, keys, element.commit_timestamp.ns
        )
        width = len(table.key)
        by_key = {tuple(_hashable(v) for v in row[:width]): dict(zip(selected, row, strict=True))
                  for row in rows}
        ordinals = {c: i + 1 for i, c in enumerate(table.columns)}
        found = _looked_up(element, table, selected, by_key, types, ordinals)
        if self.typed and found is not element:
            # The stream's records hold typed values (the reader's default): so do these.
            convert = decoders(found.column_types)
            found = attrs.evolve(found, mods=tuple(
                attrs.evolve(m, new_values=decode_values(m.new_values, convert))
                for m in found.mods
            ))
        return (found,)

    def __repr__(self) -> str:
        return f"LookupRows({self.database})"


class LookupRows(ParDo[DataChangeRecord, DataChangeRecord]):
    """Every DataChangeRecord with its mods' ``new_values`` holding the whole row.

    ``database`` is ``projects/P/instances/I/databases/D``, the database of the change
    stream (records do not carry it; pass the string given to ReadChangeStream).
    ``columns`` limits the lookup to those columns (default: every column of the table).
    For INSERT and UPDATE records each mod's ``new_values`` becomes the row's non-key
    columns as of the record's commit timestamp (keys stay in ``keys``, ``old_values``
    stay as they are) and ``column_types`` describes the key and the looked-up columns;
    DELETE records pass unchanged (their rows no longer exist at that timestamp).

    One read per record (one transaction's mods of one table), at most ``call_timeout``
    seconds per call, transient errors retried under ``retry``; table columns are read
    from information_schema once per table per task. The client is built in ``setup`` in
    the process that runs the task and is never pickled.
    """

    def __init__(
        self,
        database: str,
        columns: Sequence[str] | None = None,
        *,
        priority: str = "MEDIUM",
        call_timeout: float = 30.0,
        retry: RetryPolicy = DEFAULT_LOOKUP_RETRY,
        typed: bool = True,
    ) -> None:
        if not isinstance(database, str) or not _DATABASE.match(database):
            msg = (
                f"LookupRows(database={database!r}): write the full path "
                "projects/PROJECT/instances/INSTANCE/databases/DATABASE, the one the change "
                "stream belongs to"
            )
            raise ConfigurationError(msg)
        if isinstance(columns, str):
            msg = f"LookupRows(columns={columns!r}): pass a list of column names"
            raise ConfigurationError(msg)
        priority = priority.upper()
        if priority not in _PRIORITIES:
            msg = f"LookupRows(priority={priority!r}): use one of {', '.join(_PRIORITIES)}"
            raise ConfigurationError(msg)
        if not call_timeout > 0:
            msg = f"LookupRows(call_timeout={call_timeout}): use a positive number of seconds"
            raise ConfigurationError(msg)
        self.database = database
        self.columns = None if columns is None else tuple(columns)
        super().__init__(
            _LookupFn(database, self.columns, priority, float(call_timeout), retry, typed)
        )

    def default_label(self) -> str:
        return "LookupRows"

    def describe_params(self) -> str:
        cols = "" if self.columns is None else f" columns={','.join(self.columns)}"
        return f"database={self.database}{cols}"
