"""Column-wise building of WriteTables rows: a task's records of one table (with one
``column_types`` list) become one Arrow RecordBatch (parquet, csv), with no per-row dict and
no per-record schema check. JSON lines are built from the same columns (``_tablejsonl``).

Values are gathered into one Python list per column and handed to Arrow in one call per
column (C speed for typed values, as the decoder yields them by default); a column Arrow
refuses (wire strings with ``typed=False``, JSON objects) falls back to
:func:`~cdcflow.transforms._tablerows.convert` value by value, so wire and typed values give
the same output. Timestamps go through ``datetime - epoch`` (a C subtraction) plus the
Timestamp's nanoseconds, vectorized.

Everything per record is one list comprehension per field, over all of a group's records at
once: this module is the sink's hot path (``bench/bench_tables.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from operator import attrgetter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from cdcflow.errors import SinkError
from cdcflow.model import DataChangeRecord, Timestamp
from cdcflow.serialize import json_dumps
from cdcflow.transforms._tablerows import (
    _DEBEZIUM_OP,
    Column,
    Format,
    RowStyle,
    Schema,
    Unit,
    arrow_type,
    convert,
    json_form,
    row_op,
    timestamp_ns,
)

__all__: list[str] = []

#: Ops whose rows have no row before them (Debezium's ``before`` is null).
NO_BEFORE = frozenset({"INSERT", "SNAPSHOT"})

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_SUB = datetime.__sub__
_TS = pa.timestamp("ns", tz="UTC")
_TS_US = pa.timestamp("us", tz="UTC")
_LIST_US = pa.list_(_TS_US)
_NS = attrgetter("ns")  # Timestamp.ns; AttributeError for a datetime or text
_SNAPSHOT = attrgetter("is_snapshot")


class Mods:
    """A group's mods, flattened: one entry per row in record order, and the rows' commit
    timestamps as one Arrow array (``commit``)."""

    def __init__(self, records: Sequence[DataChangeRecord], style: RowStyle) -> None:
        mods = [m for r in records for m in r.mods]
        recs: Sequence[DataChangeRecord] = records
        if len(mods) != len(records):  # some record has several mods
            recs = [r for r in records for _ in r.mods]
        self.records = recs
        self.keys: list[Mapping[str, Any]] = [m.keys for m in mods]
        self.ops: list[str] = [r.mod_type for r in recs]
        if any(map(_SNAPSHOT, recs)):
            self.ops = [row_op(r) for r in recs]
        new = [m.new_values for m in mods]
        deletes = "DELETE" in self.ops
        self.old: list[Mapping[str, Any]] = (
            [m.old_values for m in mods] if style == "debezium" or deletes else [])
        # flat: a DELETE's old values, else the new ones; debezium: the new values
        self.values: list[Mapping[str, Any]] = new
        if style == "flat" and deletes:
            self.values = [o if op == "DELETE" else n
                           for op, n, o in zip(self.ops, new, self.old, strict=True)]
        self.commit = timestamps([r.commit_timestamp for r in recs])
        self.txn: list[str] = [r.server_transaction_id for r in recs]
        self.seq: list[str] = [r.record_sequence for r in recs]
        self.part: list[str] = [r.partition_token for r in recs] if style == "debezium" else []

    def __len__(self) -> int:
        return len(self.ops)

    def column(self, c: Column, values: list[Mapping[str, Any]] | None = None) -> list[Any]:
        """The values of column ``c`` (key columns from the keys; None where absent)."""
        name = c.name
        if c.primary_key:
            return [k.get(name) for k in self.keys]
        return [v.get(name) for v in (self.values if values is None else values)]

    def bounds(self) -> tuple[int, int | None]:
        """The earliest commit timestamp (ns) of the rows, and the latest of a row whose
        record lists every column the stream tracks (None without one; see
        :func:`full_ops`): only such a row shows that a column was dropped."""
        ns = self.commit.cast(pa.int64())
        first = pc.min(ns).as_py()
        full = full_ops({r.value_capture_type for r in self.records})
        ops = set(self.ops)
        if ops <= full:
            last = pc.max(ns).as_py()
        elif ops.isdisjoint(full):
            last = None
        else:
            last = pc.max(ns.filter(pa.array([op in full for op in self.ops]))).as_py()
        return int(first), last


def full_ops(captures: set[str]) -> frozenset[str]:
    """The ops whose records list every column the stream tracks, under all of
    ``captures``: an INSERT's do, and so do an UPDATE's and a DELETE's under NEW_ROW capture
    and a DELETE's (old values) under OLD_AND_NEW_VALUES; an UPDATE otherwise lists only the
    columns it wrote."""
    ops = {"INSERT", "SNAPSHOT", "UPDATE", "DELETE"}
    for capture in captures:
        if capture.startswith("NEW_ROW"):
            continue
        ops.discard("UPDATE")
        if capture != "OLD_AND_NEW_VALUES":
            ops.discard("DELETE")
    return frozenset(ops)


def timestamps(values: list[Any], unit: Unit = "ns") -> pa.Array:
    """Timestamps (Timestamp, datetime, RFC 3339 text or None) as timestamp[ns, UTC], or
    with ``unit="us"`` as timestamp[us, UTC] (the digits below a microsecond dropped).

    Raises ValueError naming the first value outside what 64-bit nanoseconds hold
    (1677-09-21 to 2262-04-11; Spanner allows years 1 to 9999, which microseconds hold)."""
    if unit == "us":
        return _micros(values)
    try:
        return _timestamps(values)
    except (OverflowError, pa.ArrowInvalid) as exc:
        bad = next((v for v in values
                    if v is not None and not _NS_MIN <= timestamp_ns(v) <= _NS_MAX), None)
        if bad is None:
            raise
        msg = (f"{Timestamp.from_ns(timestamp_ns(bad)).rfc3339()} is outside what a timestamp in "
               "nanoseconds holds (1677-09-21 to 2262-04-11)")
        raise ValueError(msg) from exc


_NS_MIN, _NS_MAX = -(2**63) + 1, 2**63 - 1  # int64, its minimum being Arrow's null


def _timestamps(values: list[Any]) -> pa.Array:
    try:  # the usual case, Timestamps only (the decoder's): their cached nanoseconds
        return pa.array([None if v is None else _NS(v) for v in values], pa.int64()).cast(_TS)
    except (AttributeError, TypeError):
        pass  # a datetime or text among them (Timestamp.ns reads slots they lack)
    try:
        micros = pa.array([None if v is None else _SUB(v, _EPOCH) for v in values],
                          pa.duration("us")).cast(pa.int64())
        nanos = pa.array([v._nanosecond if v.__class__ is Timestamp else 0 for v in values],
                         pa.int64())
        return pc.add(pc.multiply(micros, 1000), nanos).cast(_TS)  # null stays null
    except (TypeError, pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([convert(v, "TIMESTAMP") for v in values], pa.int64()).cast(_TS)


def _micros(values: list[Any]) -> pa.Array:
    try:  # Timestamps only: their cached nanoseconds
        micros = [None if v is None else _NS(v) // 1000 for v in values]
    except (AttributeError, TypeError):
        micros = [None if v is None else convert(v, "TIMESTAMP") // 1000 for v in values]
    return pa.array(micros, pa.int64()).cast(_TS_US)


#: The first whole second of 64-bit nanoseconds (1677-09-21T00:12:44Z).
_FIRST_WHOLE_SECOND = -(2**63) // 10**9 * 10**9 + 10**9


def rfc3339(ts: pa.Array) -> pa.Array:
    """timestamp[ns, UTC] values as RFC 3339 text with nine fractional digits and ``Z``, as
    ``Timestamp.rfc3339`` prints them (null stays null). Each distinct second is formatted
    once; the fractions are padded in Arrow."""
    least = pc.min(ts.cast(pa.int64())).as_py()
    if least is not None and least < _FIRST_WHOLE_SECOND:
        # its second began before what nanoseconds hold: Arrow's floor would wrap around
        return pa.array([None if ns is None else Timestamp.from_ns(ns).rfc3339()
                         for ns in ts.cast(pa.int64()).to_pylist()], pa.string())
    secs = pc.floor_temporal(ts, unit="second")
    frac = pc.subtract(ts.cast(pa.int64()), secs.cast(pa.int64()))
    unique = pc.unique(secs)
    prefix = pc.strftime(unique.cast(pa.timestamp("s", tz="UTC")),
                         format="%Y-%m-%dT%H:%M:%S.")
    return pc.binary_join_element_wise(
        prefix.take(pc.index_in(secs, value_set=unique)),
        pc.utf8_lpad(frac.cast(pa.string()), width=9, padding="0"), "Z", "")


def array(values: list[Any], c: Column, table: str, *, csv: bool = False,
          unit: Unit = "ns") -> pa.Array:
    """Column ``c``'s values as an Arrow array of its type (see the module docstring),
    timestamps in ``unit``; with ``csv``, BYTES and ARRAY values as text
    (:func:`~cdcflow.transforms._tablerows.json_form`)."""
    code = c.code
    if code == "TIMESTAMP":
        try:
            return timestamps(values, unit)
        except ValueError as exc:
            fix = ("write this table with format='jsonl' (timestamps as RFC 3339 text)"
                   if csv else "write Parquet with timestamp_unit='us' (years 1 to 9999; to "
                   "another URL, as a URL holds one unit) or this table with "
                   "format='jsonl' (timestamps as RFC 3339 text)")
            msg = (f"WriteTables: {table}.{c.name}: {exc}: Parquet and CSV files hold "
                   f"timestamps as such; {fix}")
            raise SinkError(msg) from exc
    if csv and code in ("BYTES", "ARRAY"):
        return pa.array(_texts(values, c, table), pa.string())
    typ = arrow_type(c.type, unit=unit)
    if unit == "us" and typ == _LIST_US:  # ARRAY<TIMESTAMP>: nanoseconds to micros
        micros = [None if v is None else [None if x is None else x // 1000 for x in v]
                  for v in converted(values, c, table)]
        try:
            return pa.array(micros, typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
            msg = (f"WriteTables: {table}.{c.name} does not fit {typ}: {exc}; fix the values "
                   "or map the records before the sink")
            raise SinkError(msg) from exc
    if not _needs_python(code, c.type, values):
        try:
            return pa.array(values, typ)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            pass  # wire strings, JSON objects: converted value by value below
    try:
        return pa.array(converted(values, c, table), typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        msg = (f"WriteTables: {table}.{c.name} does not fit {typ}: {exc}; fix the values or "
               "map the records before the sink")
        raise SinkError(msg) from exc


def _texts(values: list[Any], c: Column, table: str) -> list[str | None]:
    """BYTES as base64, ARRAY as JSON text."""
    forms: list[Any] = converted(values, c, table, json_form)
    if c.code == "BYTES":
        return forms
    return [None if v is None else json_dumps(v).decode() for v in forms]


def _needs_python(code: str, type_: Any, values: list[Any]) -> bool:
    """Whether Arrow would take these values but mean something else (base64 text for
    BYTES, timestamps inside arrays whose nanoseconds Arrow would drop)."""
    if code == "BYTES":
        return any(v.__class__ is str for v in values)
    if code == "JSON":  # Arrow would take a JSON string (typed) as the JSON text
        return any(v is not None and v.__class__ is not str for v in values)
    if code == "ARRAY":
        return Column("", type_.get("array_element_type", {}), False).code in (
            "TIMESTAMP", "BYTES", "ARRAY")
    return False


def converted(values: list[Any], c: Column, table: str, how: Any = convert) -> list[Any]:
    """``how(value, c.type)`` for each value; raises SinkError naming the first bad one."""
    try:
        return [how(v, c.type) for v in values]
    except (ValueError, TypeError, ArithmeticError, AttributeError) as exc:
        bad = next((v for v in values if not _converts(how, v, c.type)), None)
        msg = (f"WriteTables: {table}.{c.name} = {bad!r:.60} is not a {c.type}: {exc}; fix "
               "the value or map the records before the sink")
        raise SinkError(msg) from exc


def _converts(how: Any, value: Any, type_: Any) -> bool:
    try:
        how(value, type_)
    except (ValueError, TypeError, ArithmeticError, AttributeError):
        return False
    return True


def record_batch(mods: Mods, schema: Schema, style: RowStyle,
                 fmt: Format = "parquet", unit: Unit = "ns") -> pa.RecordBatch:
    """The group's rows as a RecordBatch of ``schema.arrow(style, fmt, unit)``."""
    table = schema.table
    csv = fmt == "csv"
    arrow = schema.arrow(style, fmt, unit)
    commit = mods.commit if unit == "ns" else mods.commit.cast(_TS_US, safe=False)
    n = len(mods)
    if style == "flat":
        arrays = [array(mods.column(c), c, table, csv=csv, unit=unit) for c in schema.columns]
        arrays += [pa.array(mods.ops, pa.string()), commit, pa.array(mods.txn, pa.string()),
                   pa.array(mods.seq, pa.string()), pa.repeat(table, n)]
        return pa.RecordBatch.from_arrays(arrays, schema=arrow)
    row_type = arrow.field("after").type
    before_mask = pa.array([op in NO_BEFORE for op in mods.ops])
    after_mask = pa.array([op == "DELETE" for op in mods.ops])
    before = pa.StructArray.from_arrays(
        [array(mods.column(c, mods.old), c, table, csv=csv, unit=unit)
         for c in schema.columns],
        fields=list(row_type), mask=before_mask)
    after = pa.StructArray.from_arrays(
        [array(mods.column(c), c, table, csv=csv, unit=unit) for c in schema.columns],
        fields=list(row_type), mask=after_mask)
    source_type = arrow.field("source").type
    source = pa.StructArray.from_arrays(
        [pa.repeat(table, n), commit, pa.array(mods.txn, pa.string()),
         pa.array(mods.seq, pa.string()), pa.array(mods.part, pa.string())],
        fields=list(source_type))
    ops = pa.array([_DEBEZIUM_OP[op] for op in mods.ops], pa.string())
    ts_ms = pc.divide(mods.commit.cast(pa.int64()), 1_000_000)
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
