"""LookupRows' pure part: keys, rows, and rolling rows forward through a task's records.

No I/O here. :func:`keys_to_read` says which rows a run of records needs from a read at its
first commit timestamp; :func:`roll_forward` turns that read and the records' own values
into each record's full rows; :func:`looked_up` puts rows into a record.

Why rolling forward is exact (see LookupRows and README "Full rows"). The records of one
partition come in commit-timestamp order, and while a partition lives it holds every change
of its keys. So for a run of consecutive records of one task, a read at the first record's
commit timestamp ``t0`` gives each key's row as of ``t0``, every later change of that key
up to its last record in the run is a record of the run, and applying each mod's new
values in order gives the row right after each record. The read is *at* ``t0``, not
before it: a bundle may start in the middle of a commit timestamp (the records of one
transaction split across two bundles), and a read at ``t0`` includes all of it; a mod
applied to a row that already holds its own transaction's values gives the same row (new
values are the values after the transaction), so the keys first changed at ``t0`` are
right too. This holds only if every write to the columns read is a record of the run: the
caller checks that (the stream tracks the columns, excludes no transaction or UPDATE, and
nothing upstream filters records). Whatever the records cannot settle — an UPDATE of a row
the read did not find, a value the emulator reports as the commit-timestamp placeholder —
is left to a read at that record's own commit timestamp.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import attrs

from cdcflow.errors import ChangeStreamError, ConfigurationError
from cdcflow.model import ColumnType, DataChangeRecord, Mod, Timestamp

__all__ = [
    "Key",
    "Row",
    "TableColumns",
    "key_tuple",
    "keys_to_read",
    "looked_up",
    "roll_forward",
    "unhashable",
    "wire_value",
]

Key = tuple[Any, ...]  # a primary key in key-column order, wire form, hashable
Row = Mapping[str, Any]  # a row's values by column name

#: What a commit-timestamp column holds in a mod when the emulator reports the placeholder
#: of ``spanner.commit_timestamp()`` instead of the commit timestamp (a read gives the real
#: value): the largest timestamp, in wire form and typed.
_PLACEHOLDER_TEXT = "9999-12-31T23:59:59"
_PLACEHOLDER_NS = Timestamp.parse("9999-12-31T23:59:59Z").ns


@attrs.frozen
class TableColumns:
    """A table's columns in table order, its primary key columns in key order, and its
    generated columns (change streams do not report their values)."""

    columns: tuple[str, ...]
    key: tuple[str, ...]
    generated: frozenset[str] = frozenset()

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

    def ordinals(self) -> dict[str, int]:
        return {c: i + 1 for i, c in enumerate(self.columns)}


def wire_value(value: Any) -> Any:
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
        return [wire_value(v) for v in value]
    msg = f"a key value of type {type(value).__name__} ({value!r}) cannot be looked up"
    raise TypeError(msg)


def key_tuple(keys: Mapping[str, Any], key_columns: Sequence[str]) -> Key:
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
    return tuple(_hashable(wire_value(keys[c])) for c in key_columns)


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def unhashable(value: Any) -> Any:
    """A key value back in the form a ``KeySet`` takes (arrays as lists)."""
    return list(value) if isinstance(value, tuple) else value


def looked_up(
    record: DataChangeRecord,
    table: TableColumns,
    selected: Sequence[str],
    rows: Mapping[Key, Row],
    types: Mapping[str, Any],
) -> DataChangeRecord:
    """``record`` with every non-DELETE mod's ``new_values`` replaced by the non-key
    ``selected`` columns of its row in ``rows`` (keyed by :func:`key_tuple`).

    DELETE records pass unchanged; keys and old values stay as they are. The column types
    describe the key and the selected columns (``types``: each column's decoded JSON type;
    ordinal positions are the columns' positions in the table). Raises ChangeStreamError
    when a row is missing (the database is not the stream's)."""
    if record.mod_type == "DELETE":
        return record
    values = [c for c in selected if c not in table.key]
    mods = []
    for mod in record.mods:
        row = rows.get(key_tuple(mod.keys, table.key))
        if row is None:
            msg = (
                f"row {dict(mod.keys)} of {record.table_name!r} not found at its commit "
                f"timestamp {record.commit_timestamp.rfc3339()}: is LookupRows(database=...) "
                "the database the change stream belongs to?"
            )
            raise ChangeStreamError(msg)
        mods.append(Mod(keys=mod.keys, new_values={c: row[c] for c in values},
                        old_values=mod.old_values))
    ordinals = table.ordinals()
    column_types = tuple(
        ColumnType(c, types[c], c in table.key, ordinals[c]) for c in selected
    )
    return attrs.evolve(record, mods=tuple(mods), column_types=column_types)


# -- rolling forward ------------------------------------------------------------------------


class _Unknown:
    """A row the records alone cannot give (read it at the record's commit timestamp)."""


_UNKNOWN = _Unknown()


def _is_placeholder(value: Any) -> bool:
    if isinstance(value, str):
        return value.startswith(_PLACEHOLDER_TEXT)
    return isinstance(value, Timestamp) and value.ns == _PLACEHOLDER_NS


def _written(mod: Mod, columns: Sequence[str]) -> tuple[dict[str, Any], bool] | None:
    """The values ``mod`` wrote to ``columns`` and whether it wrote all of them; None when
    one of them is a placeholder (its real value is known only to a read)."""
    written = {c: mod.new_values[c] for c in columns if c in mod.new_values}
    if any(_is_placeholder(v) for v in written.values()):
        return None
    return written, len(written) == len(columns)


def keys_to_read(records: Sequence[DataChangeRecord], key_columns: Sequence[str],
                 value_columns: Sequence[str]) -> list[Key]:
    """The keys whose row before (or at) the first record's commit timestamp
    :func:`roll_forward` needs: those whose first mod in ``records`` is an INSERT or
    UPDATE that does not write every one of ``value_columns``. In first-seen order."""
    seen: set[Key] = set()
    needed: list[Key] = []
    for record in records:
        for mod in record.mods:
            key = key_tuple(mod.keys, key_columns)
            if key in seen:
                continue
            seen.add(key)
            if record.mod_type == "DELETE":
                continue
            written = _written(mod, value_columns)
            if written is None or not written[1]:
                needed.append(key)
    return needed


def roll_forward(
    records: Sequence[DataChangeRecord],
    key_columns: Sequence[str],
    value_columns: Sequence[str],
    base: Mapping[Key, Row],
) -> list[dict[Key, Row] | None]:
    """Each record's rows (``value_columns`` by key) right after it, from ``base`` (the
    rows of :func:`keys_to_read` as of the first record's commit timestamp; a key it
    lacks had no row) and the records' new values, applied in order (see the module
    docstring for when this is exact).

    ``records``: consecutive records of one table from one partition, in the order read.
    The result has one entry per record: {} for a DELETE (its rows are gone), None for a
    record with a row that cannot be derived (an UPDATE of a row that did not exist, a
    placeholder value); such a row stays unknown until a mod writes every column again.
    """
    state: dict[Key, Row | _Unknown | None] = {}
    out: list[dict[Key, Row] | None] = []
    for record in records:
        rows: dict[Key, Row] | None = {}
        for mod in record.mods:
            key = key_tuple(mod.keys, key_columns)
            if record.mod_type == "DELETE":
                state[key] = None
                continue
            before = state[key] if key in state else base.get(key)
            written = _written(mod, value_columns)
            row: Row | _Unknown
            if written is None:
                row = _UNKNOWN
            elif written[1]:
                row = written[0]
            elif isinstance(before, Mapping):
                row = {**before, **written[0]}
            else:  # no row before an UPDATE, or one already unknown
                row = _UNKNOWN
            state[key] = row
            if isinstance(row, _Unknown):
                rows = None
            elif rows is not None:
                rows[key] = row
        out.append(rows)
    return out
