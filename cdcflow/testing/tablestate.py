"""The table contents a :class:`~cdcflow.testing.ScriptedChangeStream` implies, and its
snapshot records.

A scripted stream may start with rows (``snapshot_rows=``: the tables' contents at its
origin); its transactions then change them: an INSERT sets a row to its new values (an
INSERT of an existing key replaces the row, like Spanner's insert-or-update), an UPDATE
merges its new values into the row (creating it if missing), a DELETE removes it. A table
as of a timestamp is the initial rows with every transaction committed at or before it
applied, which is what a stale read of Spanner at that timestamp returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from cdcflow.model import ColumnType, DataChangeRecord
from cdcflow.spanner.shape import RecordShaper
from cdcflow.spanner.snapshot import snapshot_records
from cdcflow.spanner.values import encode_values, encoders
from cdcflow.testing.columns import column_types
from cdcflow.testing.transaction import _Txn

__all__ = ["Row", "initial_rows", "rows_at", "snapshot_of"]

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


def snapshot_of(
    table: str, rows: Sequence[Row], read_timestamp_ns: int, shaper: RecordShaper
) -> Iterator[DataChangeRecord]:
    """The snapshot records of ``rows`` (see :func:`cdcflow.spanner.snapshot.
    snapshot_records`): values in the wire form of the column types the values imply,
    shaped by ``shaper`` as a read of Spanner would be. A column a row lacks is NULL."""
    if not rows:
        return iter(())
    types = column_types([(table, k, "INSERT", v, {}) for k, v in rows])[table]
    key_names = list(dict.fromkeys(n for k, _ in rows for n in k))
    names = key_names + [n for n in dict.fromkeys(n for _, v in rows for n in v)
                         if n not in key_names]
    columns = tuple(
        ColumnType(n, types.get(n, {"code": "STRING"}), n in key_names, i)
        for i, n in enumerate(names, 1)
    )
    convs = encoders(columns)
    wire = (encode_values({n: {**v, **k}.get(n) for n in names}, convs) for k, v in rows)
    return snapshot_records(table, read_timestamp_ns, columns, wire, shaper)
