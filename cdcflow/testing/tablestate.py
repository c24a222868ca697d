"""The table contents a :class:`~cdcflow.testing.ScriptedChangeStream` implies, and its
snapshot records.

A scripted stream may start with rows (``snapshot_rows=``: the tables' contents at its
origin); its transactions then change them: an INSERT sets a row to its new values (an
INSERT of an existing key replaces the row, like Spanner's insert-or-update), an UPDATE
merges its new values into the row (creating it if missing), a DELETE removes it. A table
as of a timestamp is the initial rows with every transaction committed at or before it
applied, which is what a stale read of Spanner at that timestamp returns.

Key ranges (a table split for a snapshot read in parallel) follow GoogleSQL's ascending
key order over the key columns, in the order the rows name them: NULL first, then NaN,
then the values, compared as the typed values a read decodes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from cdcflow.keyrange import Key, KeyRange, range_token, split_ranges
from cdcflow.model import ColumnType, DataChangeRecord, snapshot_token
from cdcflow.spanner.shape import RecordShaper
from cdcflow.spanner.snapshot import snapshot_records
from cdcflow.spanner.values import decode_values, decoders, encode_values, encoders
from cdcflow.testing.columns import column_types
from cdcflow.testing.transaction import _Txn

__all__ = ["Row", "initial_rows", "rows_at", "snapshot_of", "split_of"]

#: A row: (its key columns, its other columns), Python values.
Row = tuple[dict[str, Any], dict[str, Any]]
RowKey = tuple[tuple[str, Any], ...]


def _key(keys: Mapping[str, Any]) -> RowKey:
    return tuple(sorted(keys.items()))


def initial_rows(
    snapshot_rows: Mapping[str, Iterable[tuple[Any, Mapping[str, Any]]]] | None,
) -> dict[str, list[Row]]:
    """``snapshot_rows`` checked: table -> rows ``(key, values)``, where ``key`` is a dict
    of key columns or a single value for the column ``id`` (as in ``write``). Raises
    ValueError for a key given twice or values whose types no column can hold."""
    out: dict[str, list[Row]] = {}
    for table, rows in (snapshot_rows or {}).items():
        seen: set[RowKey] = set()
        parsed: list[Row] = []
        for key, values in rows:
            keys = dict(key) if isinstance(key, Mapping) else {"id": key}
            if _key(keys) in seen:
                msg = f"snapshot_rows[{table!r}] has the key {keys!r} twice; give each row once"
                raise ValueError(msg)
            seen.add(_key(keys))
            parsed.append((keys, dict(values)))
        column_types([(table, k, "INSERT", v, {}) for k, v in parsed])
        out[table] = parsed
    return out


def rows_at(initial: Sequence[Row], txns: Iterable[_Txn], table: str, at: int) -> list[Row]:
    """``table``'s rows as of ``at`` (every transaction committed at or before it
    applied), sorted by key."""
    state: dict[RowKey, Row] = {_key(k): (dict(k), dict(v)) for k, v in initial}
    for txn in sorted(txns, key=lambda t: (t.at, t.seq)):
        if txn.at > at:
            break
        for name, keys, mod_type, new, _ in txn.changes:
            if name != table:
                continue
            key = _key(keys)
            if mod_type == "DELETE":
                state.pop(key, None)
            elif mod_type == "INSERT" or key not in state:
                state[key] = (dict(keys), dict(new))
            else:
                state[key][1].update(new)
    return [state[k] for k in sorted(state, key=repr)]


def _layout(table: str, rows: Sequence[Row]) -> tuple[tuple[ColumnType, ...], list[str]]:
    """The columns ``rows`` imply (keys first, typed from the values) and the key names."""
    types = column_types([(table, k, "INSERT", v, {}) for k, v in rows])[table]
    key_names = list(dict.fromkeys(n for k, _ in rows for n in k))
    names = key_names + [n for n in dict.fromkeys(n for _, v in rows for n in v)
                         if n not in key_names]
    columns = tuple(
        ColumnType(n, types.get(n, {"code": "STRING"}), n in key_names, i)
        for i, n in enumerate(names, 1)
    )
    return columns, key_names


def _rank(value: Any) -> tuple[Any, ...]:
    # GoogleSQL's ascending key order: NULL, then NaN, then the values.
    if value is None:
        return (0,)
    if isinstance(value, float) and value != value:
        return (1,)
    return (2, value)


class _KeyOrder:
    """The twin's key order: key columns in the order rows name them, each ascending with
    NULL first (GoogleSQL's), compared on the typed values a read decodes from the wire."""

    def __init__(self, columns: Sequence[ColumnType], key_names: Sequence[str]) -> None:
        keys = [c for c in columns if c.is_primary_key]
        self.names = list(key_names)
        self._encode = encoders(keys)
        self._decode = decoders(keys)

    def wire(self, keys: Mapping[str, Any]) -> Key:
        """A row's key in the wire form, in key order."""
        encoded = encode_values({n: keys.get(n) for n in self.names}, self._encode)
        return tuple(encoded[n] for n in self.names)

    def rank(self, key: Key) -> tuple[tuple[Any, ...], ...]:
        """What orders ``key`` (a key or a prefix of one, in the wire form)."""
        typed = decode_values(dict(zip(self.names, key, strict=False)), self._decode)
        return tuple(_rank(typed[n]) for n in self.names[: len(key)])

    def sorted(self, rows: Sequence[Row]) -> list[Row]:
        return sorted(rows, key=lambda row: self.rank(self.wire(row[0])))

    def within(self, rows: Sequence[Row], key_range: KeyRange) -> list[Row]:
        """The rows of ``rows`` whose key is in ``[lo, hi)``, in key order."""
        lo = None if key_range.lo is None else self.rank(key_range.lo)
        hi = None if key_range.hi is None else self.rank(key_range.hi)
        out = []
        for row in self.sorted(rows):
            at = self.rank(self.wire(row[0]))
            if (lo is None or at >= lo) and (hi is None or at < hi):
                out.append(row)
        return out


def split_of(table: str, rows: Sequence[Row], rows_per_task: int) -> list[KeyRange]:
    """``rows`` (a table as of a timestamp) cut into key ranges of about ``rows_per_task``
    rows (:func:`cdcflow.keyrange.split_ranges`), bounds in the wire form; [] when there
    are at most that many rows."""
    if len(rows) <= rows_per_task:
        return []
    order = _KeyOrder(*_layout(table, rows))
    return split_ranges((order.wire(k) for k, _ in order.sorted(rows)), rows_per_task)


def snapshot_of(
    table: str, rows: Sequence[Row], read_timestamp_ns: int, shaper: RecordShaper,
    key_range: KeyRange | None = None,
) -> Iterator[DataChangeRecord]:
    """The snapshot records of ``rows`` (see :func:`cdcflow.spanner.snapshot.
    snapshot_records`), of the keys in ``key_range`` only when given: values in the wire
    form of the column types the values imply, shaped by ``shaper`` as a read of Spanner
    would be. A column a row lacks is NULL."""
    if not rows:
        return iter(())
    columns, key_names = _layout(table, rows)
    token = snapshot_token(table)
    if key_range is not None:
        rows = _KeyOrder(columns, key_names).within(rows, key_range)
        token = range_token(table, key_range)
    names = [c.name for c in columns]
    convs = encoders(columns)
    wire = (encode_values({n: {**v, **k}.get(n) for n in names}, convs) for k, v in rows)
    return snapshot_records(table, read_timestamp_ns, columns, wire, shaper, token=token)
