"""JSON lines of WriteTables, built from a group's columns (``_tablebuild.Mods``).

A line holds the columns its mod carries, in the change stream's JSON forms: TIMESTAMP as
RFC 3339 text with nine fractional digits, NUMERIC as text, BYTES as base64, DATE as
``YYYY-MM-DD``, JSON as text, a float that is not finite as ``"NaN"``, ``"Infinity"`` or
``"-Infinity"``, arrays as JSON arrays of those forms. The forms are made
column by column (timestamps in Arrow), so orjson writes each line without calling back
into Python.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from math import isfinite
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from cdcflow.model import Timestamp
from cdcflow.serialize import decimal_text, json_dumps
from cdcflow.transforms._tablebuild import (
    NO_BEFORE,
    Mods,
    converted,
    rfc3339,
    timestamps,
)
from cdcflow.transforms._tablerows import (
    _DEBEZIUM_OP,
    Column,
    RowStyle,
    Schema,
    convert,
    json_form,
)

__all__: list[str] = []

_FLOAT = (float, int)
_NATIVE: dict[str, tuple[type, ...]] = {"INT64": (int,), "FLOAT64": _FLOAT, "FLOAT32": _FLOAT,
                                        "BOOL": (bool,)}


def _default(value: Any) -> Any:
    # Values a column-wise form did not reach (a Decimal in a STRING column, say).
    if isinstance(value, Decimal):
        return decimal_text(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime):
        return Timestamp.from_datetime(value).rfc3339()
    msg = f"cannot write {type(value).__name__} as JSON"
    raise TypeError(msg)


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value, default=_default, option=orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError:  # an integer past 64 bits: json_dumps writes it
        return json_dumps(value, default=_default) + b"\n"


def _texts(values: list[Any], to_text: Callable[[Any], str]) -> list[Any]:
    return [v if v is None or v.__class__ is str else to_text(v) for v in values]


def _b64(value: bytes) -> str:
    return base64.b64encode(value).decode()


def _forms(mods: Mods, columns: Sequence[Column], table: str,
           values: list[Mapping[str, Any]]) -> list[tuple[str, list[Any]]]:
    """(column, JSON-ready values) for the columns whose values orjson would not write as
    the column type says (see the module docstring); other columns are written as they
    are."""
    fixes: list[tuple[str, list[Any]]] = []
    for c in columns:
        code = c.code
        if code in ("STRING", "DATE"):
            continue  # orjson writes a date as YYYY-MM-DD
        vals = mods.column(c, values)
        if code == "TIMESTAMP":
            try:
                fixes.append((c.name, rfc3339(timestamps(vals)).to_pylist()))
            except ValueError:  # beyond nanoseconds in 64 bits (years 1..1677, 2262..9999)
                fixes.append((c.name, converted(vals, c, table, json_form)))
        elif code in _NATIVE:
            native = _NATIVE[code]
            if not all(v is None or v.__class__ in native for v in vals):
                fixes.append((c.name, converted(vals, c, table,
                                                json_form if native is _FLOAT else convert)))
            elif native is _FLOAT and not all(v is None or isfinite(v) for v in vals):
                fixes.append((c.name, converted(vals, c, table, json_form)))
        elif code == "JSON":
            if not all(v is None or v.__class__ is str for v in vals):
                fixes.append((c.name, converted(vals, c, table, convert)))
        elif code == "NUMERIC":
            fixes.append((c.name, _texts(vals, decimal_text)))
        elif code == "BYTES":
            fixes.append((c.name, _texts(vals, _b64)))
        else:
            fixes.append((c.name, converted(vals, c, table, json_form)))
    return fixes


def _apply(rows: list[Any], fixes: list[tuple[str, list[Any]]]) -> None:
    for name, fixed in fixes:
        for row, value in zip(rows, fixed, strict=True):
            if row is not None and name in row:
                row[name] = value


def jsonl_lines(mods: Mods, schema: Schema, style: RowStyle) -> bytes:
    """The group's rows as JSON lines (a row holds the columns its mod carries)."""
    table = schema.table
    commit = rfc3339(mods.commit).to_pylist()
    if style == "flat":
        rows = [{**v, **k, "_op": op, "_commit_ts": ts, "_txn": txn, "_seq": seq,
                 "_table": table}
                for v, k, op, ts, txn, seq in zip(mods.values, mods.keys, mods.ops, commit,
                                                  mods.txn, mods.seq, strict=True)]
        _apply(rows, _forms(mods, schema.columns, table, mods.values))
        return b"".join(map(_dumps, rows))
    after: list[Any] = [None if op == "DELETE" else {**v, **k}
                        for op, v, k in zip(mods.ops, mods.values, mods.keys, strict=True)]
    before: list[Any] = [None if op in NO_BEFORE else {**v, **k}
                         for op, v, k in zip(mods.ops, mods.old, mods.keys, strict=True)]
    _apply(after, _forms(mods, schema.columns, table, mods.values))
    _apply(before, _forms(mods, schema.columns, table, mods.old))
    ms = pc.divide(mods.commit.cast(pa.int64()), 1_000_000).to_pylist()
    return b"".join(map(_dumps, [
        {"before": b, "after": a, "op": _DEBEZIUM_OP[op],
         "source": {"table": table, "commit_timestamp": ts, "transaction_id": txn,
                    "record_sequence": seq, "partition": part},
         "ts_ms": t}
        for b, a, op, ts, txn, seq, part, t in zip(
            before, after, mods.ops, commit, mods.txn, mods.seq, mods.part, ms,
            strict=True)]))
