"""Column-wise building of WriteTables output: a task's records of one table (with one
``column_types`` list) become one Arrow RecordBatch (parquet) or a block of JSON lines
(jsonl), with no per-row dict on the parquet path and no per-record schema check.

Values are gathered into one Python list per column and handed to Arrow in one call per
column (C speed for typed values, as the decoder yields them by default); a column Arrow
refuses (wire strings with ``typed=False``, JSON objects) falls back to
:func:`~cdcflow.transforms._tablerows.convert` value by value, so wire and typed values give
the same output. Timestamps go through ``datetime - epoch`` (a C subtraction) plus the
Timestamp's nanoseconds, vectorized; jsonl formats them with Arrow's strftime, which gives
the RFC 3339 text ``Timestamp`` prints (nine fractional digits and ``Z``).
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import tempfile
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import attrs
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from cdcflow.errors import SinkError
from cdcflow.model import DataChangeRecord, Timestamp
from cdcflow.transforms._tablerows import (
    _DEBEZIUM_OP,
    Column,
    RowStyle,
    Schema,
    arrow_type,
    columns_of,
    convert,
    row_op,
)

__all__ = ["TaskRows", "Writer"]

#: Ops whose rows have no row before them (Debezium's ``before`` is null).
_NO_BEFORE = frozenset({"INSERT", "SNAPSHOT"})

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SUB = datetime.__sub__
_TS = pa.timestamp("ns", tz="UTC")
_NATIVE: dict[str, tuple[type, ...]] = {"INT64": (int,), "FLOAT64": (float, int),
                                        "FLOAT32": (float, int), "BOOL": (bool,)}


class _Mods:
    """A group's mods, flattened: one entry per row in record order."""

    def __init__(self, records: Sequence[DataChangeRecord], style: RowStyle) -> None:
        # List comprehensions, one per field: several times faster than appending to nine
        # lists record by record.
        per_record = [r.mods for r in records]
        if sum(map(len, per_record)) == len(records):  # one mod per record
            mods = [m[0] for m in per_record]
            recs: Sequence[DataChangeRecord] = records
        else:
            pairs = [(r, m) for r in records for m in r.mods]
            mods = [m for _, m in pairs]
            recs = [r for r, _ in pairs]
        self.keys: list[Mapping[str, Any]] = [m.keys for m in mods]
        self.ops: list[str] = [row_op(r) for r in recs]
        new = [m.new_values for m in mods]
        self.old: list[Mapping[str, Any]] = (
            [m.old_values for m in mods] if style == "debezium" or "DELETE" in self.ops else [])
        # flat: a DELETE's old values, else the new ones; debezium: the new values
        self.values: list[Mapping[str, Any]] = new
        if style == "flat" and "DELETE" in self.ops:
            self.values = [o if op == "DELETE" else n
                           for op, n, o in zip(self.ops, new, self.old, strict=True)]
        self.at: list[Timestamp] = [r.commit_timestamp for r in recs]
        self.txn: list[str] = [r.server_transaction_id for r in recs]
        self.seq: list[str] = [r.record_sequence for r in recs]
        self.part: list[str] = [r.partition_token for r in recs] if style == "debezium" else []

    def column(self, c: Column, values: list[Mapping[str, Any]] | None = None) -> list[Any]:
        """The values of column ``c`` (key columns from the keys; None where absent)."""
        if c.primary_key:
            return [k.get(c.name) for k in self.keys]
        return [v.get(c.name) for v in (self.values if values is None else values)]


def timestamps(values: list[Any]) -> pa.Array:
    """Timestamps (Timestamp, datetime, RFC 3339 text or None) as timestamp[ns, UTC]."""
    try:
        micros = pa.array([None if v is None else _SUB(v, _EPOCH) for v in values],
                          pa.duration("us")).cast(pa.int64())
        nanos = pa.array([v._nanosecond if v.__class__ is Timestamp else 0 for v in values],
                         pa.int64())
        return pc.add(pc.multiply(micros, 1000), nanos).cast(_TS)  # null stays null
    except (TypeError, pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([convert(v, "TIMESTAMP") for v in values], pa.int64()).cast(_TS)


def array(values: list[Any], c: Column, table: str) -> pa.Array:
    """Column ``c``'s values as an Arrow array of its type (see the module docstring)."""
    code = c.code
    if code == "TIMESTAMP":
        return timestamps(values)
    typ = arrow_type(c.type)
    if not _needs_python(c.type, values):
        try:
            return pa.array(values, typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            pass  # wire strings, JSON objects: converted value by value below
    try:
        return pa.array(_converted(values, c, table), typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        msg = (f"WriteTables: {table}.{c.name} does not fit {typ}: {exc}; fix the values or "
               "map the records before the sink")
        raise SinkError(msg) from exc


def _needs_python(type_: Any, values: list[Any]) -> bool:
    """Whether Arrow would take these values but mean something else (base64 text for
    BYTES, timestamps inside arrays whose nanoseconds Arrow would drop)."""
    code = _code_of(type_)
    if code == "BYTES":
        return any(v.__class__ is str for v in values)
    if code == "ARRAY":
        return _code_of(type_.get("array_element_type", {})) in ("TIMESTAMP", "BYTES", "ARRAY")
    return False


def _code_of(type_: Any) -> str:
    return Column("", type_, False).code


def _converted(values: list[Any], c: Column, table: str) -> list[Any]:
    try:
        return [convert(v, c.type) for v in values]
    except (ValueError, TypeError, ArithmeticError) as exc:
        bad = next((v for v in values if not _converts(v, c.type)), None)
        msg = (f"WriteTables: {table}.{c.name} = {bad!r:.60} is not a {c.type}: {exc}; fix "
               "the value or map the records before the sink")
        raise SinkError(msg) from exc


def _converts(value: Any, type_: Any) -> bool:
    try:
        convert(value, type_)
    except (ValueError, TypeError, ArithmeticError):
        return False
    return True


def record_batch(records: Sequence[DataChangeRecord], schema: Schema,
                 style: RowStyle) -> pa.RecordBatch:
    """The group's rows as a RecordBatch of ``schema.arrow(style)``."""
    mods = _Mods(records, style)
    table = schema.table
    commit = timestamps(mods.at)
    n = len(mods.ops)
    if style == "flat":
        arrays = [array(mods.column(c), c, table) for c in schema.columns]
        arrays += [pa.array(mods.ops, pa.string()), commit, pa.array(mods.txn, pa.string()),
                   pa.array(mods.seq, pa.string()), pa.repeat(table, n)]
        return pa.RecordBatch.from_arrays(arrays, schema=schema.arrow(style))
    arrow = schema.arrow(style)
    row_type = arrow.field("after").type
    before_mask = pa.array([op in _NO_BEFORE for op in mods.ops])
    after_mask = pa.array([op == "DELETE" for op in mods.ops])
    before = pa.StructArray.from_arrays(
        [array(mods.column(c, mods.old), c, table) for c in schema.columns],
        fields=list(row_type), mask=before_mask)
    after = pa.StructArray.from_arrays(
        [array(mods.column(c), c, table) for c in schema.columns],
        fields=list(row_type), mask=after_mask)
    source_type = arrow.field("source").type
    source = pa.StructArray.from_arrays(
        [pa.repeat(table, n), commit, pa.array(mods.txn, pa.string()),
         pa.array(mods.seq, pa.string()), pa.array(mods.part, pa.string())],
        fields=list(source_type))
    ops = pa.array([_DEBEZIUM_OP[op] for op in mods.ops], pa.string())
    ts_ms = pc.divide(commit.cast(pa.int64()), 1_000_000)
    return pa.RecordBatch.from_arrays([before, after, ops, source, ts_ms], schema=arrow)


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with the columns of ``schema`` (a later version of its table: columns it
    lacks are null, a column whose type changed is cast)."""
    if batch.schema.equals(schema, check_metadata=False):
        return batch
    try:
        arrays = [_conform(batch.column(f.name) if f.name in batch.schema.names else None,
                           f.type, batch.num_rows) for f in schema]
        return pa.RecordBatch.from_arrays(arrays, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        msg = f"WriteTables: rows do not fit the table's schema: {exc}"
        raise SinkError(msg) from exc


def _conform(column: pa.Array | None, typ: pa.DataType, n: int) -> pa.Array:
    if column is None:
        return pa.nulls(n, typ)
    if column.type.equals(typ):
        return column
    if pa.types.is_struct(typ) and pa.types.is_struct(column.type):
        names = [column.type.field(i).name for i in range(column.type.num_fields)]
        children = [_conform(column.field(f.name) if f.name in names else None, f.type, n)
                    for f in typ]
        return pa.StructArray.from_arrays(children, fields=list(typ), mask=column.is_null())
    return column.cast(typ)


# -- jsonl ----------------------------------------------------------------------------------


def _json_default(value: Any) -> Any:
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime):
        return Timestamp.from_ns(convert(value, "TIMESTAMP")).rfc3339()
    msg = f"cannot write {type(value).__name__} as JSON"
    raise TypeError(msg)


def _texts(ts: pa.Array) -> list[str | None]:
    texts: list[str | None] = pc.strftime(ts, format="%Y-%m-%dT%H:%M:%SZ").to_pylist()
    return texts


def _json_fixes(mods: _Mods, columns: Sequence[Column], table: str,
                values: list[Mapping[str, Any]]) -> list[tuple[str, list[Any]]]:
    """(column, JSON-ready values) for the columns whose values orjson would not write as
    the column type says: timestamps (as RFC 3339 text), wire strings of numbers and bools,
    JSON values (as text), arrays. Other columns are written as they are (orjson's default
    writes Decimal as text, bytes as base64, which is also their wire form)."""
    fixes: list[tuple[str, list[Any]]] = []
    for c in columns:
        code = c.code
        if code in ("STRING", "NUMERIC", "BYTES", "DATE"):
            continue
        vals = mods.column(c, values)
        if code == "TIMESTAMP":
            fixes.append((c.name, _texts(timestamps(vals))))
        elif code in _NATIVE:
            native = _NATIVE[code]
            if not all(v is None or v.__class__ in native for v in vals):
                fixes.append((c.name, _converted(vals, c, table)))
        elif code == "JSON":
            if not all(v is None or v.__class__ is str for v in vals):
                fixes.append((c.name, _converted(vals, c, table)))
        else:
            fixes.append((c.name, _converted(vals, c, table)))
    return fixes


def _apply(rows: list[dict[str, Any]], fixes: list[tuple[str, list[Any]]]) -> None:
    for name, fixed in fixes:
        for row, value in zip(rows, fixed, strict=True):
            if row is not None and name in row:
                row[name] = value


def jsonl_lines(records: Sequence[DataChangeRecord], schema: Schema, style: RowStyle) -> bytes:
    """The group's rows as JSON lines (a row holds the columns its mod carries)."""
    mods = _Mods(records, style)
    table = schema.table
    commit = _texts(timestamps(mods.at))
    dumps: Callable[..., bytes] = orjson.dumps
    option = orjson.OPT_APPEND_NEWLINE
    if style == "flat":
        rows = [{**v, **k} for v, k in zip(mods.values, mods.keys, strict=True)]
        _apply(rows, _json_fixes(mods, schema.columns, table, mods.values))
        return b"".join([
            dumps({**row, "_op": op, "_commit_ts": ts, "_txn": txn, "_seq": seq,
                   "_table": table}, default=_json_default, option=option)
            for row, op, ts, txn, seq in zip(rows, mods.ops, commit, mods.txn, mods.seq,
                                             strict=True)])
    after: list[Any] = [None if op == "DELETE" else {**v, **k}
                        for op, v, k in zip(mods.ops, mods.values, mods.keys, strict=True)]
    before: list[Any] = [None if op in _NO_BEFORE else {**v, **k}
                         for op, v, k in zip(mods.ops, mods.old, mods.keys, strict=True)]
    _apply(after, _json_fixes(mods, schema.columns, table, mods.values))
    _apply(before, _json_fixes(mods, schema.columns, table, mods.old))
    return b"".join([
        dumps({"before": b, "after": a, "op": _DEBEZIUM_OP[op],
               "source": {"table": table, "commit_timestamp": ts, "transaction_id": txn,
                          "record_sequence": seq, "partition": part},
               "ts_ms": ns // 1_000_000}, default=_json_default, option=option)
        for b, a, op, ts, txn, seq, part, ns in zip(
            before, after, mods.ops, commit, mods.txn, mods.seq, mods.part,
            timestamps(mods.at).cast(pa.int64()).to_pylist(), strict=True)])


# -- the task side ---------------------------------------------------------------------------


@attrs.frozen
class _Group:
    """Rows of one (table, partition directory, column list) from one task: a RecordBatch
    of the group's own columns (parquet) or JSON lines (jsonl)."""

    table: str
    directory: str
    columns: tuple[Column, ...]
    rows: int
    data: Any  # pa.RecordBatch | bytes
    nbytes: int
    #: the earliest commit timestamp (ns) of the group's records
    first_ns: int = 0
    #: the latest commit timestamp (ns) of a record that carries every column the stream
    #: tracks (see :func:`_full`), None without one: only such a record shows a dropped column
    full_ns: int | None = None


@attrs.frozen
class TaskRows:
    """A writer's commit message: its rows inline, or the path of a local spool file."""

    groups: tuple[_Group, ...] = ()
    spool: str | None = None

    def load(self) -> tuple[_Group, ...]:
        if self.spool is None:
            return self.groups
        groups: list[_Group] = []
        try:
            with open(self.spool, "rb") as f:
                while True:
                    try:
                        groups.extend(pickle.load(f))
                    except EOFError:
                        break
        except OSError as exc:
            msg = (f"WriteTables cannot read the task's spool {self.spool}: {exc}; tasks spool "
                   "to local disk: on a cluster set spool_size=None (rows travel inline)")
            raise SinkError(msg) from exc
        return tuple(groups)


class Writer:
    """Groups a task's records by (table, directory, column list) and builds each group
    column-wise at close (or when ``spool_size`` is passed, into a local spool file).

    A group's column list is recognised by identity first (the decoder shares one tuple
    among a table's records with the same columns), then by equality: no per-record
    schema work."""

    def __init__(self, style: RowStyle, fmt: str, partition_by: str,
                 spool_size: int | None) -> None:
        self.style: RowStyle = style
        self.format = fmt
        self.partition_by = partition_by
        self.spool_size = spool_size
        # (table, directory) -> [(column_types, records)]
        self.groups: dict[tuple[str, str], list[tuple[Any, list[DataChangeRecord]]]] = {}
        self.last: tuple[Any, Any, list[DataChangeRecord]] | None = None  # (key, types, recs)
        self.dirs: dict[tuple[int, int, int, int], str] = {}
        self.count = 0
        self.spool: str | None = None

    def write(self, element: DataChangeRecord) -> None:
        last = self.last
        # The common case: the same table and column list (the same object) as the record
        # before, which _place checked was a DataChangeRecord.
        if (last is not None and last[1] is getattr(element, "column_types", None)
                and self.partition_by == "none" and last[0][0] == element.table_name):
            last[2].append(element)
        else:
            self._add(element)
        self.count += len(element.mods)
        if self.spool_size is not None and self.count * 256 >= self.spool_size:
            self._spill()

    def _add(self, element: DataChangeRecord) -> None:
        if not isinstance(element, DataChangeRecord):
            msg = (f"WriteTables takes DataChangeRecords, got {type(element).__name__}; "
                   "put it right after ReadPartition (or a Filter)")
            raise SinkError(msg)
        directory = ("" if self.partition_by == "none"
                     else self._directory(element.commit_timestamp))
        key = (element.table_name, directory)
        last = self.last
        if last is not None and last[1] is element.column_types and last[0] == key:
            last[2].append(element)
        else:
            self._place(key, element.column_types, element)

    def _place(self, key: tuple[str, str], types: Any, element: DataChangeRecord) -> None:
        groups = self.groups.setdefault(key, [])
        records = next((recs for have, recs in groups if have is types or have == types), None)
        if records is None:
            records = []
            groups.append((types, records))
        records.append(element)
        self.last = (key, types, records)

    def _directory(self, ts: Timestamp) -> str:
        hour = (ts.year, ts.month, ts.day, ts.hour)
        found = self.dirs.get(hour)
        if found is None:
            found = self.dirs[hour] = _directory(ts, self.partition_by)
        return found

    def _batch(self) -> list[_Group]:
        out = []
        for (table, directory), groups in self.groups.items():
            for _, records in groups:
                columns = columns_of(records[0])
                schema = Schema(table, 0, columns)
                if self.format == "jsonl":
                    data: Any = jsonl_lines(records, schema, self.style)
                    nbytes = len(data)
                else:
                    data = record_batch(records, schema, self.style)
                    nbytes = data.nbytes
                stamps = [r.commit_timestamp.ns for r in records]
                full = [ns for r, ns in zip(records, stamps, strict=True) if _full(r)]
                out.append(_Group(table, directory, columns, data.num_rows
                                  if self.format != "jsonl" else data.count(b"\n"),
                                  data, nbytes, min(stamps), max(full, default=None)))
        self.groups, self.last, self.count = {}, None, 0
        return out

    def _spill(self) -> None:
        if self.spool is None:
            fd, self.spool = tempfile.mkstemp(prefix="cdcflow-tables-", suffix=".spool")
            os.close(fd)
        with open(self.spool, "ab") as f:
            pickle.dump(self._batch(), f, protocol=pickle.HIGHEST_PROTOCOL)

    def close(self) -> TaskRows | None:
        if self.spool is not None:
            self._spill()
            return TaskRows(spool=self.spool)
        groups = self._batch()
        return TaskRows(groups=tuple(groups)) if groups else None

    def abort(self) -> None:
        self.groups, self.last = {}, None
        if self.spool is not None:
            with contextlib.suppress(OSError):
                os.remove(self.spool)


def _full(record: DataChangeRecord) -> bool:
    """Whether ``record``'s column types list every column the stream tracks: an INSERT's
    do, and so do an UPDATE's and a DELETE's under NEW_ROW capture and a DELETE's (old
    values) under OLD_AND_NEW_VALUES; an UPDATE otherwise lists only the columns it wrote."""
    capture = record.value_capture_type
    return (record.mod_type == "INSERT" or capture.startswith("NEW_ROW")
            or (record.mod_type == "DELETE" and capture == "OLD_AND_NEW_VALUES"))


def _directory(ts: Timestamp, partition_by: str) -> str:
    if partition_by == "day":
        return f"date={ts:%Y-%m-%d}"
    if partition_by == "hour":
        return f"date={ts:%Y-%m-%d}/hour={ts:%H}"
    return ""
