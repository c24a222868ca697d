"""Rows of :class:`~cdcflow.transforms.tables.WriteTables`: a mod as a typed row, a table's
schema (versions), and its Arrow form.

Values are converted by the record's column type, so wire strings (INT64 as ``"2"``,
TIMESTAMP as RFC 3339 text, BYTES as base64) and typed values (int, datetime, bytes) give the
same row. Timestamps are held as integer nanoseconds since the epoch (Arrow ``timestamp(ns)``
takes them as they are, and no nanosecond is lost).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Iterable, Mapping
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Literal

import attrs
import orjson
import pyarrow as pa

from cdcflow.durations import parse_time
from cdcflow.errors import SinkError
from cdcflow.model import DataChangeRecord, Mod, Timestamp
from cdcflow.serialize import decimal_text, json_dumps, to_json_value

__all__: list[str] = []

RowStyle = Literal["flat", "debezium"]
Format = Literal["parquet", "jsonl", "csv"]
#: The unit of Parquet timestamps: nanoseconds hold 1677-09-21 to 2262-04-11, microseconds
#: every timestamp Spanner holds (years 1 to 9999).
Unit = Literal["ns", "us"]
#: A row's op (:func:`row_op`) in Debezium's envelope; "r" (read) marks a snapshot row.
_DEBEZIUM_OP = {"INSERT": "c", "UPDATE": "u", "DELETE": "d", "SNAPSHOT": "r"}


def row_op(record: DataChangeRecord) -> str:
    """The op of a record's rows: its mod type, or "SNAPSHOT" for a row of the initial
    snapshot (an INSERT of the row as it was before the stream started)."""
    return "SNAPSHOT" if record.is_snapshot else record.mod_type


@attrs.frozen
class Column:
    """One column of a table schema: ``type`` is the change stream's decoded JSON type."""

    name: str
    type: Any
    primary_key: bool

    @property
    def code(self) -> str:
        return _code(self.type)


def _code(type_: Any) -> str:
    if isinstance(type_, Mapping):
        annotation = type_.get("type_annotation")
        if annotation == "PG_NUMERIC":
            return "STRING"  # PostgreSQL NUMERIC has no fixed scale
        if annotation == "PG_JSONB":
            return "JSON"  # written as JSON text, as JSON is
        return str(type_.get("code", "STRING"))
    return str(type_)


def columns_of(record: DataChangeRecord) -> tuple[Column, ...]:
    """The record's columns in ordinal order."""
    ordered = sorted(record.column_types, key=lambda c: c.ordinal_position)
    return tuple(Column(c.name, c.type, c.is_primary_key) for c in ordered)


@attrs.frozen
class Schema:
    """Version ``version`` of a table's columns (what ``_schema/v<version>.json`` holds)."""

    table: str
    version: int
    columns: tuple[Column, ...]
    #: The commit timestamp (ns) of the earliest row of this version's shape, when known: a
    #: row committed before it cannot show that a column was dropped since.
    since: int = 0

    def fits(self, columns: Iterable[Column]) -> bool:
        """Whether rows with ``columns`` fit this schema: every column is known with the same
        type (a record may carry fewer columns, e.g. a DELETE only its keys)."""
        mine = {c.name: c.type for c in self.columns}
        return all(c.name in mine and mine[c.name] == c.type for c in columns)

    def evolve(self, columns: Iterable[Column], dropped: Iterable[str] = (),
               since: int = 0) -> Schema:
        """The next version: these columns without ``dropped``, then new ones appended; a
        column seen with another type takes the new type."""
        merged = {c.name: c for c in self.columns}
        for name in dropped:
            merged.pop(name, None)
        for c in columns:
            merged[c.name] = c
        return Schema(self.table, self.version + 1, tuple(merged.values()), since)

    def checksum(self) -> str:
        body = orjson.dumps([attrs.asdict(c) for c in self.columns], option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(body).hexdigest()

    def to_json(self, rows: RowStyle, fmt: Format = "parquet",
                partition_by: str = "none", unit: Unit = "ns") -> bytes:
        doc: dict[str, Any] = {
            "table": self.table, "version": self.version, "rows": rows, "format": fmt,
            "partition_by": partition_by,
            "columns": [{"name": c.name, "type": c.type, "primary_key": c.primary_key,
                         "arrow": str(arrow_type(c.type, unit=unit))} for c in self.columns],
            "key_columns": [c.name for c in self.columns if c.primary_key],
            "since": self.since,
            "checksum": self.checksum(),
        }
        if unit != "ns":
            doc["timestamp_unit"] = unit
        if fmt == "csv":  # CSV carries no types: the files' columns in order, typed
            doc["csv_columns"] = [{"name": f.name, "arrow": str(f.type),
                                   "duckdb": duckdb_type(f.type)}
                                  for f in csv_columns(self.arrow(rows, "csv"))]
        return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)

    @classmethod
    def parse(cls, data: bytes) -> Schema:
        """Raises KeyError, TypeError or ValueError for anything but a schema file, and
        ValueError when the checksum does not match the columns."""
        doc = orjson.loads(data)
        cols = tuple(Column(str(c["name"]), c["type"], bool(c["primary_key"]))
                     for c in doc["columns"])
        schema = cls(str(doc["table"]), int(doc["version"]), cols, int(doc.get("since", 0)))
        if schema.checksum() != doc["checksum"]:
            msg = f"schema checksum mismatch for {schema.table} v{schema.version}"
            raise ValueError(msg)
        return schema

    def arrow(self, rows: RowStyle, fmt: Format = "parquet", unit: Unit = "ns") -> pa.Schema:
        """The Arrow schema of this version's rows (never a null-typed column), timestamps
        in ``unit``. For ``fmt="csv"``, BYTES, JSON and ARRAY columns are text (see
        :func:`arrow_type`); a CSV file holds this schema flattened (:func:`csv_columns`)."""
        csv = fmt == "csv"
        ts = timestamp_type(unit)
        fields = [pa.field(c.name, arrow_type(c.type, csv=csv, unit=unit)) for c in self.columns]
        if rows == "flat":
            return pa.schema([*fields, pa.field("_op", pa.string()),
                              pa.field("_commit_ts", ts), pa.field("_txn", pa.string()),
                              pa.field("_seq", pa.string()), pa.field("_table", pa.string())])
        source = pa.struct([("table", pa.string()), ("commit_timestamp", ts),
                            ("transaction_id", pa.string()), ("record_sequence", pa.string()),
                            ("partition", pa.string())])
        row = pa.struct(fields)
        return pa.schema([("before", row), ("after", row), ("op", pa.string()),
                          ("source", source), ("ts_ms", pa.int64())])


_TS = pa.timestamp("ns", tz="UTC")
_TS_US = pa.timestamp("us", tz="UTC")
_SCALARS: dict[str, pa.DataType] = {
    "INT64": pa.int64(), "FLOAT64": pa.float64(), "FLOAT32": pa.float32(),
    "NUMERIC": pa.decimal128(38, 9), "BOOL": pa.bool_(), "STRING": pa.string(),
    "BYTES": pa.binary(), "DATE": pa.date32(), "TIMESTAMP": _TS, "JSON": pa.string(),
}


def timestamp_type(unit: Unit = "ns") -> pa.DataType:
    """Arrow's UTC timestamp in ``unit``."""
    return _TS if unit == "ns" else _TS_US


def arrow_type(type_: Any, *, csv: bool = False, unit: Unit = "ns") -> pa.DataType:
    """The Arrow type of a change stream column type, timestamps in ``unit``; unknown
    types are stored as text. With ``csv``, what a CSV field can hold: BYTES as base64
    text and ARRAY as JSON text (as the change stream's JSON gives them; :func:`json_form`)."""
    code = _code(type_)
    if csv and code in ("BYTES", "ARRAY"):
        return pa.string()
    if code == "ARRAY":
        element = type_.get("array_element_type", {"code": "STRING"})
        return pa.list_(arrow_type(element, unit=unit))
    if code == "TIMESTAMP":
        return timestamp_type(unit)
    return _SCALARS.get(code, pa.string())


def csv_columns(schema: pa.Schema) -> list[pa.Field]:
    """The columns of a CSV file of ``schema``: struct columns flattened to
    ``parent.child`` (Debezium's ``before.<column>``, ``source.table``, ...), as
    ``pyarrow.Table.flatten`` names them."""
    out: list[pa.Field] = []
    for f in schema:
        if pa.types.is_struct(f.type):
            out += csv_columns(pa.schema([pa.field(f"{f.name}.{c.name}", c.type)
                                          for c in f.type]))
        else:
            out.append(f)
    return out


_DUCKDB = {pa.int64(): "BIGINT", pa.float64(): "DOUBLE", pa.float32(): "FLOAT",
           pa.bool_(): "BOOLEAN", pa.string(): "VARCHAR", pa.binary(): "BLOB",
           pa.date32(): "DATE", _TS: "TIMESTAMPTZ_NS"}


def duckdb_type(typ: pa.DataType) -> str:
    """DuckDB's name for a scalar Arrow type of :func:`arrow_type` (for ``read_csv``'s
    ``types``)."""
    if pa.types.is_decimal(typ):
        return f"DECIMAL({typ.precision}, {typ.scale})"
    return _DUCKDB.get(typ, "VARCHAR")


def convert(value: Any, type_: Any) -> Any:
    """``value`` (wire or typed) as the Python value Arrow takes for ``type_``; raises
    ValueError or TypeError when it is not one."""
    if value is None:
        return None
    code = _code(type_)
    if code == "INT64":
        return int(value)
    if code in ("FLOAT64", "FLOAT32"):
        return float(value)
    if code == "NUMERIC":
        return value if isinstance(value, Decimal) else Decimal(str(value))
    if code == "BOOL":
        return value if isinstance(value, bool) else str(value).lower() == "true"
    if code == "BYTES":
        return bytes(value) if isinstance(value, bytes | bytearray) else base64.b64decode(value)
    if code == "DATE":
        return value if isinstance(value, date) else date.fromisoformat(str(value))
    if code == "TIMESTAMP":
        return timestamp_ns(value)
    if code == "JSON":  # a str is JSON text (a wire value); a JsonString is a JSON string
        return value if value.__class__ is str else json_dumps(value).decode()
    if code == "ARRAY":
        items = orjson.loads(value) if isinstance(value, str | bytes) else value
        element = type_.get("array_element_type", {"code": "STRING"})
        return [convert(v, element) for v in items]
    if isinstance(value, Decimal):  # a PostgreSQL NUMERIC, written as text
        return decimal_text(value)
    return value if isinstance(value, str) else str(value)


def json_form(value: Any, type_: Any) -> Any:
    """``value`` (wire or typed) as JSON lines and CSV write it: as :func:`convert` gives
    it, except TIMESTAMP as RFC 3339 text (nine fractional digits), NUMERIC as its text,
    BYTES as base64, DATE as ``YYYY-MM-DD`` and a float that is not finite as ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"`` (the change stream's JSON forms), also inside
    arrays."""
    if value is None:
        return None
    code = _code(type_)
    if code == "ARRAY":
        items = orjson.loads(value) if isinstance(value, str | bytes) else value
        element = type_.get("array_element_type", {"code": "STRING"})
        return [json_form(v, element) for v in items]
    if code == "TIMESTAMP":
        return Timestamp.from_ns(timestamp_ns(value)).rfc3339()
    if code in ("NUMERIC", "BYTES", "DATE") and isinstance(value, str):
        return value
    if code == "BYTES":
        return base64.b64encode(value).decode()
    if code == "NUMERIC":
        return decimal_text(value)
    if code == "DATE":
        return value.isoformat()
    if code in ("FLOAT64", "FLOAT32"):  # NaN and infinities as Spanner's JSON texts them
        return to_json_value(convert(value, type_))
    return convert(value, type_)


def timestamp_ns(value: Any) -> int:
    """Nanoseconds since the epoch of a Timestamp, a datetime or RFC 3339 text."""
    if isinstance(value, Timestamp):
        return value.ns
    return parse_time(value if isinstance(value, datetime) else str(value))


def _values(values: Mapping[str, Any], types: Mapping[str, Any], table: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        try:
            out[name] = convert(value, types.get(name, "STRING"))
        except (ValueError, TypeError, ArithmeticError) as exc:
            msg = (f"WriteTables: {table}.{name} = {value!r} is not a {types.get(name)}: "
                   f"{exc}; fix the value or map the records before the sink")
            raise SinkError(msg) from exc
    return out


def rows_of(record: DataChangeRecord, style: RowStyle, *, arrow: bool = True
            ) -> list[dict[str, Any]]:
    """One row per mod of ``record`` (see WriteTables for both styles). ``arrow``: values
    converted by column type as Arrow takes them (timestamps as integer nanoseconds);
    otherwise as the reader decoded them, the commit timestamp a Timestamp (the ``Rows``
    step)."""
    types = {c.name: c.type for c in record.column_types}
    table = record.table_name

    def values(mapping: Mapping[str, Any]) -> dict[str, Any]:
        return _values(mapping, types, table) if arrow else dict(mapping)

    ts: Any = record.commit_timestamp.ns if arrow else record.commit_timestamp
    shape = _flat if style == "flat" else _debezium
    return [shape(record, mod, values, ts) for mod in record.mods]


_Values = Callable[[Mapping[str, Any]], dict[str, Any]]


def _flat(record: DataChangeRecord, mod: Mod, values: _Values, ts: Any) -> dict[str, Any]:
    # keys first (as in the table), and the keys' own values win
    row = values({**mod.keys, **(mod.old_values if record.mod_type == "DELETE"
                                  else mod.new_values), **mod.keys})
    row.update(_op=row_op(record), _commit_ts=ts, _txn=record.server_transaction_id,
               _seq=record.record_sequence, _table=record.table_name)
    return row


def _debezium(record: DataChangeRecord, mod: Mod, values: _Values, ts: Any) -> dict[str, Any]:
    keys = values(mod.keys)
    before = after = None
    if record.mod_type != "INSERT":
        before = {**keys, **values(mod.old_values), **keys}
    if record.mod_type != "DELETE":
        after = {**keys, **values(mod.new_values), **keys}
    source = {"table": record.table_name, "commit_timestamp": ts,
              "transaction_id": record.server_transaction_id,
              "record_sequence": record.record_sequence, "partition": record.partition_token}
    return {"before": before, "after": after, "op": _DEBEZIUM_OP[row_op(record)],
            "source": source, "ts_ms": record.commit_timestamp.ns // 1_000_000}


def json_value(value: Any) -> Any:
    """orjson's ``default`` for a jsonl row: decimals as text, bytes as base64."""
    if isinstance(value, Decimal):
        return decimal_text(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    msg = f"cannot write {type(value).__name__} as JSON"
    raise TypeError(msg)


def jsonl_row(row: Mapping[str, Any], schema: Schema, style: RowStyle) -> dict[str, Any]:
    """A row for jsonl: timestamps as RFC 3339 text (nanoseconds kept)."""
    ts_cols = {c.name for c in schema.columns if c.code == "TIMESTAMP"}

    def fix(values: Mapping[str, Any] | None) -> Any:
        if values is None:
            return None
        return {k: (str(Timestamp.from_ns(v)) if k in ts_cols and v is not None else v)
                for k, v in values.items()}

    if style == "flat":
        out = fix(row)
        out["_commit_ts"] = str(Timestamp.from_ns(row["_commit_ts"]))
        return dict(out)
    source = dict(row["source"])
    source["commit_timestamp"] = str(Timestamp.from_ns(source["commit_timestamp"]))
    return {**row, "before": fix(row["before"]), "after": fix(row["after"]), "source": source}

