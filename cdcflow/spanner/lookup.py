"""LookupRows: the full row of every changed key, as of the change's commit timestamp.

NEW_VALUES and OLD_AND_NEW_VALUES change streams report only the columns a transaction
wrote. LookupRows gives each INSERT and UPDATE mod the whole row (or ``columns=``) as it was
right after the record's transaction, also for a row that a later transaction deleted::

    pipeline
     | ReadChangeStream(DB, "OrdersStream", start_at="-10m")
     | LookupRows(database=DB)                  # mods' new_values: every column of the row
     | WriteFiles("out/orders")

Reads. A task hands LookupRows its records in bundles of consecutive records (up to
``bundle_size``; see :class:`~cdcflow.transforms.base.DoFn`). For each table of a bundle
it reads the rows of the keys it needs ONCE, at the commit timestamp of the bundle's
first record of that table, then rolls forward through the bundle's records in order,
applying each mod's new values (:mod:`cdcflow.spanner._lookup_rows` says why that is
exact). That needs every write to the columns read to be a record of the bundle, so it is
done only when

- LookupRows reads ReadPartition's records directly, from a source that filters no
  columns or mod types (checked when the pipeline is validated);
- the change stream tracks every column read (none is generated), and neither allows
  transactions to be excluded nor excludes INSERTs or UPDATEs, nor has MUTABLE_KEY_RANGE
  partitions (information_schema, once per task);
- the source types values as LookupRows does (``typed``).

Otherwise records are read at their own commit timestamps, one read per (table, commit
timestamp) of a bundle: several records of one transaction and table share it. A row
the records cannot settle is read the same way. Tables' columns come from
information_schema once per table per task (the only cache).

Values. Reads give the change stream's wire form; with ``typed=True`` (the default, as the
reader's) they are then typed from the column types like the stream's own mods;
``typed=False`` keeps the wire form, for a source read with ``typed=False``.

RPCs. Reads go out without the stock client's retry loop and with a deadline of
``call_timeout`` seconds; transient errors are retried under one
:class:`~cdcflow.backoff.RetryPolicy`. A read at a timestamp older than the database's
``version_retention_period`` (one hour by default) fails permanently, naming that option.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import ConfigurationError, MissingColumnError
from cdcflow.model import ColumnType, DataChangeRecord
from cdcflow.spanner._lookup_read import PRIORITIES, Reader, StreamColumns, cached_reader
from cdcflow.spanner._lookup_rows import (
    Key,
    Row,
    TableColumns,
    key_tuple,
    keys_to_read,
    looked_up,
    roll_forward,
)
from cdcflow.spanner.values import decode_values, decoders
from cdcflow.transforms.base import DoFn, ParDo, PrimitiveTransform
from cdcflow.transforms.source import DetectPartitions, ReadPartition

__all__ = ["DEFAULT_LOOKUP_RETRY", "LookupRows"]

_log = logging.getLogger("cdcflow.lookup")

#: Retries of one lookup: at most 8 attempts, none starting more than 60 s after the first.
DEFAULT_LOOKUP_RETRY = RetryPolicy(attempts=8, initial=0.05, maximum=4.0, deadline=60.0)
#: How many tables' column lists a task keeps (least recently used ones are dropped).
_COLUMN_CACHE_SIZE = 256
_DATABASE = re.compile(r"^projects/[^/]+/instances/[^/]+/databases/[^/]+$")
_CAPTURE_TYPES = frozenset(
    {"NEW_VALUES", "OLD_AND_NEW_VALUES", "NEW_ROW", "NEW_ROW_AND_OLD_VALUES"}
)


_told: set[str] = set()
_told_lock = threading.Lock()


def _tell_once(message: str) -> None:
    """Log ``message`` once per process (every task has its own LookupRows)."""
    with _told_lock:
        if message in _told:
            return
        _told.add(message)
    _log.info(message)


class _LookupFn(DoFn[DataChangeRecord, DataChangeRecord]):
    """Looks up full rows, a bundle of records at a time; see :class:`LookupRows`.

    ``stream``: the change stream the records come from, set by pipeline validation when
    nothing between the source and LookupRows drops records or columns (rows may then be
    rolled forward); None reads every record at its commit timestamp."""

    def __init__(self, database: str, columns: tuple[str, ...] | None, priority: str,
                 call_timeout: float, retry: RetryPolicy, typed: bool = True,
                 bundle_size: int = 1000) -> None:
        self.database = database
        self.columns = columns
        self.typed = typed
        self.priority = priority
        self.call_timeout = call_timeout
        self.retry = retry
        self.bundle_size = bundle_size
        self.stream: str | None = None
        self._reader: Reader | None = None
        self._tables: OrderedDict[str, TableColumns] = OrderedDict()
        self._stream_columns: StreamColumns | None = None
        self._types: dict[str, dict[str, Any]] = {}  # per table: column -> JSON type
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # Clients, caches and locks stay in the process that made them.
        state = dict(self.__dict__)
        state.update(_reader=None, _tables=OrderedDict(), _stream_columns=None, _types={},
                     _lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def setup(self) -> None:
        self._reader = cached_reader(self.database, self.priority, self.call_timeout,
                                     self.retry)

    def _get_reader(self) -> Reader:
        if self._reader is None:
            self.setup()
        assert self._reader is not None
        return self._reader

    def _table(self, reader: Reader, table: str) -> TableColumns:
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

    # -- processing ------------------------------------------------------------------------

    def process(self, element: DataChangeRecord) -> Iterable[DataChangeRecord]:
        return self.process_bundle([element])[0]

    def process_bundle(
        self, elements: Sequence[DataChangeRecord]
    ) -> Sequence[Iterable[DataChangeRecord]]:
        out: list[Iterable[DataChangeRecord]] = [(e,) for e in elements]
        by_table: dict[str, list[int]] = {}
        for i, element in enumerate(elements):
            if not isinstance(element, DataChangeRecord):
                msg = (
                    f"LookupRows takes DataChangeRecords, got {type(element).__name__}; "
                    "apply it to ReadPartition's output"
                )
                raise TypeError(msg)
            if element.mods:
                by_table.setdefault(element.table_name, []).append(i)
        for table, indexes in by_table.items():
            found = self._table_bundle(table, [elements[i] for i in indexes])
            for i, record in zip(indexes, found, strict=True):
                out[i] = (record,)
        return out

    def _table_bundle(self, table: str, records: list[DataChangeRecord]
                      ) -> list[DataChangeRecord]:
        """Full rows for ``records`` (of ``table``, in record order)."""
        if all(r.mod_type == "DELETE" for r in records):
            return records  # a deleted row is gone at its commit timestamp: nothing to read
        reader = self._get_reader()
        info = self._table(reader, table)
        selected = info.select(self.columns, table)
        values = [c for c in selected if c not in info.key]
        why = self._why_not_roll(reader, table, info, values, records)
        if why:
            _tell_once(f"LookupRows reads {table} of {self.database} at each commit "
                       f"timestamp: {why}")
            return self._read_each(reader, table, info, selected, records)
        types = self._types.setdefault(table, {})
        for record in records:
            for column in record.column_types:
                types.setdefault(column.name, column.type)
        needed = keys_to_read(records, info.key, values)
        base: dict[Key, Row] = {}
        if needed or any(c not in types for c in selected):
            try:
                rows, read_types = reader.read_at(
                    table, selected, needed, records[0].commit_timestamp.ns, "bundle"
                )
            except MissingColumnError:  # the table had fewer columns then (ALTER TABLE)
                return self._read_each(reader, table, info, selected, records)
            types.update(read_types)
            base = self._rows(info, selected, rows, types, typed=self.typed)
        out: list[DataChangeRecord | None] = []
        for record, rolled in zip(
            records, roll_forward(records, info.key, values, base), strict=True
        ):
            out.append(None if rolled is None else looked_up(record, info, selected,
                                                             rolled, types))
        unsettled = [r for r, o in zip(records, out, strict=True) if o is None]
        if unsettled:
            read = iter(self._read_each(reader, table, info, selected, unsettled))
            out = [next(read) if o is None else o for o in out]
        return [o for o in out if o is not None]

    def _why_not_roll(self, reader: Reader, table: str, info: TableColumns,
                      values: Sequence[str], records: Sequence[DataChangeRecord]) -> str:
        if self.stream is None:
            return "records may be missing before it (see LookupRows)"
        odd = {r.value_capture_type for r in records} - _CAPTURE_TYPES
        if odd:
            return f"unknown value capture type {sorted(odd)}"
        if self._stream_columns is None:
            self._stream_columns = reader.stream_columns(self.stream)
        schema, name = reader.schema_and_name(table)
        reason = self._stream_columns.exact_for(schema, name, info, values)
        return f"{reason} (change stream {self.stream})" if reason else ""

    def _read_each(self, reader: Reader, table: str, info: TableColumns,
                   selected: Sequence[str], records: Sequence[DataChangeRecord]
                   ) -> list[DataChangeRecord]:
        """Each record's rows read at its own commit timestamp: one read per timestamp."""
        groups: dict[int, set[Key]] = {}
        for record in records:
            if record.mod_type != "DELETE":
                keys = groups.setdefault(record.commit_timestamp.ns, set())
                keys.update(key_tuple(m.keys, info.key) for m in record.mods)
        found: dict[int, tuple[TableColumns, tuple[str, ...], dict[Key, Row], dict[str, Any]]] = {}
        for ns, keys in groups.items():
            at, columns = info, tuple(selected)
            try:
                read, types = reader.read_at(table, columns, sorted(keys, key=repr), ns, "commit")
            except MissingColumnError:
                # A column added since: read the columns the table had then (its rows then
                # had no such column, so they come out without it).
                at = reader.table_columns(table, ns)
                columns = tuple(c for c in selected if c in at.columns)
                read, types = reader.read_at(table, columns, sorted(keys, key=repr), ns, "commit")
            found[ns] = (at, columns, self._rows(at, columns, read, types, typed=False), types)
        out = []
        for record in records:
            if record.mod_type == "DELETE":
                out.append(record)
                continue
            at, columns, rows, types = found[record.commit_timestamp.ns]
            result = looked_up(record, at, columns, rows, types)
            if self.typed:
                # The stream's records hold typed values (the reader's default): so do these.
                convert = decoders(result.column_types)
                result = attrs.evolve(result, mods=tuple(
                    attrs.evolve(m, new_values=decode_values(m.new_values, convert))
                    for m in result.mods
                ))
            out.append(result)
        return out

    @staticmethod
    def _rows(info: TableColumns, selected: Sequence[str], rows: list[list[Any]],
              types: Mapping[str, Any], *, typed: bool) -> dict[Key, Row]:
        """Read rows by key (wire form), their values typed when ``typed``."""
        width = len(info.key)
        convert = decoders([ColumnType(c, types[c], c in info.key, 0) for c in selected]
                           ) if typed else {}
        return {
            tuple(tuple(v) if isinstance(v, list) else v for v in row[:width]):
                decode_values(dict(zip(selected, row, strict=True)), convert)
            for row in rows
        }

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

    Reads (see the module docstring): for a bundle of up to ``bundle_size`` consecutive
    records of a task, one read per table at the bundle's first commit timestamp, rows
    rolled forward through the records, when the stream reports every write to the
    columns read; else one read per (table, commit timestamp). At most ``call_timeout``
    seconds per call, transient errors retried under ``retry``. The client is built in
    ``setup`` in the process that runs the task and is never pickled.
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
        bundle_size: int = 1000,
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
        if priority not in PRIORITIES:
            msg = f"LookupRows(priority={priority!r}): use one of {', '.join(PRIORITIES)}"
            raise ConfigurationError(msg)
        if not call_timeout > 0:
            msg = f"LookupRows(call_timeout={call_timeout}): use a positive number of seconds"
            raise ConfigurationError(msg)
        if isinstance(bundle_size, bool) or not isinstance(bundle_size, int) or bundle_size < 1:
            msg = f"LookupRows(bundle_size={bundle_size!r}): use a number of records, 1 or more"
            raise ConfigurationError(msg)
        self.database = database
        self.columns = None if columns is None else tuple(columns)
        super().__init__(_LookupFn(database, self.columns, priority, float(call_timeout),
                                   retry, typed, bundle_size))

    def check_upstream(self, path: Sequence[PrimitiveTransform[Any, Any]]) -> None:
        """Roll rows forward only when LookupRows sees every record of the stream's
        partitions with every column written: it reads ReadPartition directly, from a
        source that filters no columns or mod types and types values as it does."""
        fn = self.fn
        assert isinstance(fn, _LookupFn)
        source = path[0] if path else None
        stream = None
        if (isinstance(source, DetectPartitions) and len(path) == 2
                and isinstance(path[1], ReadPartition) and source.typed == fn.typed
                and (source.filter is None
                     or (not source.filter.columns and source.filter.mod_types is None))):
            stream = source.stream
        if stream != fn.stream:
            # A copy: the same LookupRows object may sit in another pipeline.
            configured = copy.copy(fn)
            configured.stream = stream
            self.fn = configured

    def default_label(self) -> str:
        return "LookupRows"

    def describe_params(self) -> str:
        cols = "" if self.columns is None else f" columns={','.join(self.columns)}"
        return f"database={self.database}{cols}"
