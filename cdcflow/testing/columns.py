"""Column types for scripted values, and the view of a scripted stream with read options.

:class:`~cdcflow.testing.ScriptedChangeStream` reports a Spanner column type for the
Python values a script writes, encodes them in Spanner's wire form for that type and
decodes them with the real decoder's converters, so its records hold exactly what a read
of Spanner gives:

==========================  ===================================================
value written               column type
==========================  ===================================================
bool                        BOOL
int                         INT64 (FLOAT64 when the column also has floats,
                            NUMERIC when it also has Decimals)
float                       FLOAT64
decimal.Decimal             NUMERIC
bytes                       BYTES
datetime.date               DATE
datetime (Timestamp too)    TIMESTAMP (a naive datetime is taken as UTC)
dict, model.JsonString      JSON (a JsonString: a JSON value that is a string)
list/tuple of one scalar    ARRAY of that type (an empty list: ARRAY<STRING>)
other lists                 JSON
str, anything else          STRING (kept as it is)
None                        the column's type so far, else STRING
==========================  ===================================================

A column's type is inferred from every value it gets in one transaction (per table);
values of types that do not mix raise ValueError when the transaction commits. A column
that gets only None (or empty lists) in a transaction keeps the type the table's earlier
transactions gave it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from datetime import date, datetime
from decimal import Decimal
from typing import Any, Protocol

from cdcflow.keyrange import KeyRange
from cdcflow.model import ChangeRecord, DataChangeRecord, JsonString
from cdcflow.spanner.shape import RecordShaper
from cdcflow.stream import ChangeStreamQuery, RecordFilter, StreamInfo

__all__ = ["ScriptedView", "column_types", "value_type"]

ColumnTypeJSON = dict[str, Any]
Change = tuple[str, Mapping[str, Any], str, Mapping[str, Any], Mapping[str, Any]]

_EMPTY_ARRAY: ColumnTypeJSON = {"code": "ARRAY"}  # element type not known yet
_STRING: ColumnTypeJSON = {"code": "STRING"}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "BOOL"
    if isinstance(value, int):
        return "INT64"
    if isinstance(value, float):
        return "FLOAT64"
    if isinstance(value, Decimal):
        return "NUMERIC"
    if isinstance(value, bytes | bytearray | memoryview):
        return "BYTES"
    if isinstance(value, datetime):
        return "TIMESTAMP"
    if isinstance(value, date):
        return "DATE"
    if isinstance(value, dict | JsonString):
        return "JSON"
    return "STRING"


def value_type(value: Any) -> ColumnTypeJSON | None:
    """The column type of one value (None for None; see the module docstring)."""
    if value is None:
        return None
    if isinstance(value, list | tuple):
        element: ColumnTypeJSON | None = None
        for item in value:
            t = value_type(item)
            if t is not None:
                element = t if element is None else _merge(element, t)
                if element is None:  # elements of types that do not mix
                    return {"code": "JSON"}
        if element is None:
            return dict(_EMPTY_ARRAY)
        if element["code"] in ("JSON", "ARRAY"):
            return {"code": "JSON"}  # nested lists and objects: one JSON value
        return {"code": "ARRAY", "array_element_type": element}
    return {"code": _scalar(value)}


_WIDER = {frozenset({"INT64", "FLOAT64"}): "FLOAT64", frozenset({"INT64", "NUMERIC"}): "NUMERIC"}


def _merge(a: ColumnTypeJSON, b: ColumnTypeJSON) -> ColumnTypeJSON | None:
    """The type of a column with values of types ``a`` and ``b``; None if they do not mix."""
    if a == b:
        return a
    codes = {a["code"], b["code"]}
    wider = _WIDER.get(frozenset(codes))
    if wider is not None:
        return {"code": wider}
    if codes == {"ARRAY"}:
        if a == _EMPTY_ARRAY or b == _EMPTY_ARRAY:
            return b if a == _EMPTY_ARRAY else a
        element = _merge(a["array_element_type"], b["array_element_type"])
        if element is None:
            return {"code": "JSON"}
        return {"code": "ARRAY", "array_element_type": element}
    if codes == {"ARRAY", "JSON"}:
        return {"code": "JSON"}
    return None


def _final(t: ColumnTypeJSON | None) -> ColumnTypeJSON:
    if t is None:
        return dict(_STRING)
    if t == _EMPTY_ARRAY:
        return {"code": "ARRAY", "array_element_type": dict(_STRING)}
    return t


def column_types(
    changes: Iterable[Change], known: dict[str, dict[str, ColumnTypeJSON]] | None = None
) -> dict[str, dict[str, ColumnTypeJSON]]:
    """Table -> column -> type for the changes of one transaction ``(table, keys,
    mod_type, new_values, old_values)``. Raises ValueError naming a column whose values
    have types that do not mix.

    ``known`` holds the types earlier transactions gave (table -> column -> type) and is
    updated with this one's: a column whose values here are all None (or empty lists) keeps
    the type it had, as a Spanner column does."""
    found: dict[str, dict[str, ColumnTypeJSON | None]] = {}
    for table, keys, _, new, old in changes:
        columns = found.setdefault(table, {})
        for values in (keys, new, old):
            for name, value in values.items():
                t = value_type(value)
                seen = columns.get(name)
                if t is None or seen is None:
                    columns[name] = t if seen is None else seen
                    continue
                merged = _merge(seen, t)
                if merged is None:
                    msg = (
                        f"column {name!r} of {table!r} gets a {type(value).__name__} value "
                        f"({value!r:.40}) and {seen['code']} values in one transaction; a "
                        "Spanner column has one type: write values of one type"
                    )
                    raise ValueError(msg)
                columns[name] = merged
    out: dict[str, dict[str, ColumnTypeJSON]] = {}
    for table, cols in found.items():
        prior = known.setdefault(table, {}) if known is not None else {}
        types = out[table] = {}
        for name, t in cols.items():
            had = prior.get(name)
            if had is not None and (t is None or (
                    t == _EMPTY_ARRAY and had["code"] in ("ARRAY", "JSON"))):
                types[name] = had
                continue
            types[name] = _final(t)
            if t is not None and t != _EMPTY_ARRAY:
                prior[name] = types[name]
    return out


TimeLike = int | str | datetime


class _Scripted(Protocol):
    """What a view needs of the stream (ScriptedChangeStream, which imports this module)."""

    def describe_stream(self, stream: str) -> StreamInfo: ...
    def tables(self) -> dict[str, set[str]]: ...
    def close(self) -> None: ...
    def with_options(
        self, *, typed: bool = True, filter: RecordFilter | None = None
    ) -> ScriptedView: ...
    def _read(self, query: ChangeStreamQuery, shaper: RecordShaper
              ) -> Iterator[ChangeRecord]: ...
    def _expected(self, start: TimeLike | None, end: TimeLike | None, shaper: RecordShaper
                  ) -> list[DataChangeRecord]: ...
    def _snapshot(self, stream: str, table: str, read_timestamp_ns: int, shaper: RecordShaper,
                  key_range: KeyRange | None = None) -> Iterator[DataChangeRecord]: ...
    def snapshot_split(self, stream: str, table: str, read_timestamp_ns: int,
                       rows_per_task: int) -> list[KeyRange]: ...


class ScriptedView:
    """A :class:`~cdcflow.testing.ScriptedChangeStream` read with other options: mod values
    typed or in the wire form, and a :class:`~cdcflow.stream.RecordFilter` applied as the
    real reader applies it (a record the filter drops becomes a HeartbeatRecord at its
    commit timestamp). It shares the script: writes made to the stream after the view was
    made are read too. :meth:`describe_stream` checks the filter's names against the
    tables and columns written so far. Other attributes are the stream's.
    """

    def __init__(
        self, base: _Scripted, typed: bool, filter: RecordFilter | None
    ) -> None:
        self.base = base
        self.typed = typed
        self.filter = filter
        self._shaper = RecordShaper(typed, filter)

    def __repr__(self) -> str:
        return f"{self.base!r}.with_options(typed={self.typed}, filter={self.filter!r})"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # keeps pickling and copying away from the stream
            raise AttributeError(name)
        return getattr(self.base, name)

    def describe_stream(self, stream: str) -> StreamInfo:
        info = self.base.describe_stream(stream)
        if self.filter is not None and self.filter.names():
            self.filter.check(info.name, self.base.tables())
        return info

    def read(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        return self.base._read(query, self._shaper)

    def snapshot_split(self, stream: str, table: str, read_timestamp_ns: int,
                       rows_per_task: int) -> list[KeyRange]:
        """The stream's key ranges of ``table`` (keys are never filtered)."""
        return self.base.snapshot_split(stream, table, read_timestamp_ns, rows_per_task)

    def snapshot(self, stream: str, table: str, read_timestamp_ns: int,
                 key_range: KeyRange | None = None) -> Iterator[DataChangeRecord]:
        """The stream's snapshot of ``table`` (``key_range`` of it), shaped with these
        options."""
        return self.base._snapshot(stream, table, read_timestamp_ns, self._shaper, key_range)

    def close(self) -> None:
        self.base.close()

    def with_options(
        self, *, typed: bool = True, filter: RecordFilter | None = None
    ) -> ScriptedView:
        return self.base.with_options(typed=typed, filter=filter)

    def expected_records(
        self, start: TimeLike | None = None, end: TimeLike | None = None
    ) -> list[DataChangeRecord]:
        """What a complete read of ``[start, end)`` delivers with these options."""
        return self.base._expected(start, end, self._shaper)
