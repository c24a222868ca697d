"""A batch's rows of a column's earlier type, staged in a text file (JSON lines, CSV) of
the table's newer schema version.

A column retyped within a batch takes its newest type and the batch's earlier values are
cast to it (``_tabletask.next_version``). Parquet's Arrow cast does that on the values
(UTF-8 text to bytes and back, numbers to text). A text file holds the values' text forms,
in which STRING is the text itself and BYTES its base64, so there the same cast is made on
the forms: STRING to BYTES encodes the text's UTF-8 as base64, BYTES to STRING decodes it,
element by element in arrays; JSON lines also write an INT64 or BOOL cast to STRING as
text. Other forms read the same under either type and are left as they are.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
import pyarrow as pa

from cdcflow.errors import SinkError
from cdcflow.serialize import json_dumps
from cdcflow.transforms._tablerows import Column, Format, RowStyle, Schema

__all__ = ["recast"]

Cast = Callable[[Any], Any]


def _to_base64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _from_base64(form: str) -> str:
    return base64.b64decode(form).decode()


def _bool_text(value: bool) -> str:
    return "true" if value else "false"


def _cast(old: Any, new: Any, jsonl: bool) -> Cast | None:
    """How a text form of column type ``old`` becomes that of type ``new`` (None: the same)."""
    a, b = Column("", old, False).code, Column("", new, False).code
    if (a, b) == ("STRING", "BYTES"):
        return _to_base64
    if (a, b) == ("BYTES", "STRING"):
        return _from_base64
    if jsonl and b == "STRING" and a in ("INT64", "BOOL"):
        return str if a == "INT64" else _bool_text
    if a == b == "ARRAY" and isinstance(old, Mapping) and isinstance(new, Mapping):
        inner = _cast(old.get("array_element_type", {}), new.get("array_element_type", {}),
                      jsonl)
        if inner is None:
            return None

        def elements(values: list[Any]) -> list[Any]:
            return [None if v is None else inner(v) for v in values]

        if jsonl:
            return elements
        return lambda text: json_dumps(elements(orjson.loads(text))).decode()
    return None


def _casts(columns: Sequence[Column], schema: Schema, jsonl: bool) -> dict[str, Cast]:
    """The group's columns whose forms change under ``schema``, with how."""
    target = {c.name: c.type for c in schema.columns}
    casts: dict[str, Cast] = {}
    for c in columns:
        new = target.get(c.name)  # an unchanged type (the usual case) needs no look
        if new is not None and new != c.type and (cast := _cast(c.type, new, jsonl)):
            casts[c.name] = cast
    return casts


def recast(data: Any, columns: Sequence[Column], schema: Schema, fmt: Format,
           rows: RowStyle) -> Any:
    """A group's ``data`` (the RecordBatch of a CSV group, the lines of a JSON lines one)
    with the forms of ``columns`` (the group's types) made those of ``schema``'s types; the
    data itself when none changes (the usual case) or the format is Parquet."""
    if fmt == "parquet":
        return data
    casts = _casts(columns, schema, fmt == "jsonl")
    if not casts:
        return data
    try:
        if fmt == "jsonl":
            return _lines(data, casts, rows)
        return _batch(data, casts, rows)
    except (ValueError, TypeError) as exc:  # not base64, not UTF-8
        msg = (f"WriteTables: {schema.table}: a value of {', '.join(casts)} does not fit the "
               f"column's new type ({exc})")
        raise SinkError(msg) from exc


def _apply(row: dict[str, Any], casts: Mapping[str, Cast]) -> None:
    for name, cast in casts.items():
        if row.get(name) is not None:
            row[name] = cast(row[name])


def _lines(data: bytes, casts: Mapping[str, Cast], rows: RowStyle) -> bytes:
    out = []
    for line in data.splitlines():
        row = orjson.loads(line)
        for part in ((row,) if rows == "flat" else (row.get("before"), row.get("after"))):
            if part is not None:
                _apply(part, casts)
        out.append(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE))
    return b"".join(out)


def _column(array: pa.Array, cast: Cast) -> pa.Array:
    return pa.array([None if v is None else cast(v) for v in array.to_pylist()], pa.string())


def _batch(batch: pa.RecordBatch, casts: Mapping[str, Cast], rows: RowStyle
           ) -> pa.RecordBatch:
    names = batch.schema.names
    arrays = list(batch.columns)
    if rows == "flat":
        for name, cast in casts.items():
            arrays[names.index(name)] = _column(batch.column(name), cast)
        return pa.RecordBatch.from_arrays(arrays, names=names)
    for side in ("before", "after"):
        struct = batch.column(side)
        fields = [struct.type.field(i) for i in range(struct.type.num_fields)]
        children = [_column(struct.field(f.name), casts[f.name]) if f.name in casts
                    else struct.field(f.name) for f in fields]
        arrays[names.index(side)] = pa.StructArray.from_arrays(
            children, names=[f.name for f in fields], mask=struct.is_null())
    return pa.RecordBatch.from_arrays(arrays, names=names)
