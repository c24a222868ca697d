"""Typed values and pushed-down filters: what every decoder does to a data change record.

A :class:`RecordShaper` holds a reader's options (``typed``, a
:class:`~cdcflow.stream.RecordFilter`) and, per table and distinct ``column_types``, a
:class:`TablePlan` built once: the columns kept and a converter per column (see
:mod:`cdcflow.spanner.values`), so a value costs one dict lookup and one call. Decoders
ask :meth:`RecordShaper.wants` with the table name and mod type before they decode the
rest of a record, and turn a record that keeps no mod into a HeartbeatRecord at its commit
timestamp (see :meth:`RecordShaper.dropped`), so readers still advance past it.

The GoogleSQL, PostgreSQL and protobuf decoders, the stock-row path and
:class:`~cdcflow.testing.ScriptedChangeStream` all shape through this module.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import attrs
import orjson

from cdcflow.errors import DecodeError
from cdcflow.model import ColumnType, DataChangeRecord, HeartbeatRecord, Mod, Timestamp
from cdcflow.spanner.values import (
    converter_in_place,
    decode_values,
    decoder_for,
    decoders,
    type_code,
)
from cdcflow.stream import RecordFilter

__all__ = ["RecordShaper", "TablePlan", "default_shaper"]

_PLAN_LIMIT = 4096
_MISSING = object()
RawMod = tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any]]


def _unchanged(new: Mapping[str, Any], old: Mapping[str, Any]) -> bool:
    return all(new.get(name, _MISSING) == value for name, value in old.items())


class TablePlan:
    """How mods of one table with one ``column_types`` list become :class:`Mod` objects.

    ``columns`` are the column types a record carries (pruned to the kept columns);
    ``names`` the names of all columns the server listed, in its order (protobuf mods
    refer to columns by that index); ``in_place`` converts a dict of wire values (fresh
    from a JSON parser) in place, as :meth:`mod` converts values, or is None when nothing
    needs converting (see :func:`~cdcflow.spanner.values.converter_in_place`).
    """

    __slots__ = ("_converters", "_keep", "_table", "columns", "in_place", "names")

    def __init__(
        self, table: str, columns: tuple[ColumnType, ...], keep: frozenset[str] | None,
        typed: bool,
    ) -> None:
        self._table = table
        self.names = tuple(c.name for c in columns)
        if keep is not None:
            keep = keep | {c.name for c in columns if c.is_primary_key}
            columns = tuple(c for c in columns if c.name in keep)
        self._keep = keep
        self.columns = columns
        self._converters = decoders(columns) if typed else {}
        self.in_place = converter_in_place(self._converters)

    @property
    def converters(self) -> Mapping[str, Any]:
        """Column name -> converter from the wire form, for the kept columns that need one
        (empty for wire values)."""
        return self._converters

    def mod(
        self, keys: Mapping[str, Any], new: Mapping[str, Any], old: Mapping[str, Any],
        check_unchanged: bool = False,
    ) -> Mod | None:
        """The shaped mod of these wire values, or None when ``check_unchanged`` and no
        kept column changed. ``keys`` is never pruned."""
        keep = self._keep
        if keep is not None:
            new = {k: v for k, v in new.items() if k in keep}
            old = {k: v for k, v in old.items() if k in keep}
        if check_unchanged and _unchanged(new, old):
            return None
        convs = self._converters
        if not convs:
            return Mod(keys, new, old)
        try:
            return Mod(
                decode_values(keys, convs), decode_values(new, convs) if new else new,
                decode_values(old, convs) if old else old,
            )
        except Exception as exc:  # a value that does not have its column's wire form
            raise self._error(keys, new, old) from exc

    def _error(self, *parts: Mapping[str, Any]) -> DecodeError:
        types = {c.name: c.type for c in self.columns}
        for values in parts:
            for name, value in values.items():
                convert = decoder_for(types.get(name))
                if value is None or convert is None:
                    continue
                try:
                    convert(value)
                except Exception as exc:
                    msg = (
                        f"column {name!r} of {self._table!r} ({type_code(types[name])}) has "
                        f"the value {value!r:.60} that is not its wire form ({exc}); read "
                        "with typed=False for wire values, and report this"
                    )
                    return DecodeError(msg)
        return DecodeError(f"cannot type the values of a {self._table!r} mod; use typed=False")


class RecordShaper:
    """A reader's options and its cache of :class:`TablePlan` (thread-safe: a plan built
    twice by racing threads is the same plan)."""

    def __init__(self, typed: bool = True, filter: RecordFilter | None = None) -> None:
        self.typed = typed
        self.filter = filter
        self._plans: dict[Hashable, TablePlan] = {}

    def __repr__(self) -> str:
        where = f", filter={self.filter.describe()!r}" if self.filter is not None else ""
        return f"RecordShaper(typed={self.typed}{where})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (RecordShaper, (self.typed, self.filter))  # plans are rebuilt where it lands

    def wants(self, table: str, mod_type: str) -> bool:
        """Whether records of ``table`` with ``mod_type`` are decoded at all."""
        return self.filter is None or self.filter.wants(table, mod_type)

    def checks_unchanged(self, mod_type: str, value_capture_type: str) -> bool:
        return self.filter is not None and self.filter.checks_unchanged(
            mod_type, value_capture_type
        )

    def cached(self, key: Hashable) -> TablePlan | None:
        """The plan built for ``key`` (a decoder's identity of table + column types)."""
        return self._plans.get(key)

    def plan(self, key: Hashable, table: str, columns: Iterable[ColumnType]) -> TablePlan:
        """Build, cache and return the plan of ``table`` with these (unpruned) columns."""
        keep = self.filter.kept_columns(table) if self.filter is not None else None
        plan = TablePlan(table, tuple(columns), keep, self.typed)
        if len(self._plans) >= _PLAN_LIMIT:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def mods(
        self, plan: TablePlan, raw: Iterable[RawMod], mod_type: str, value_capture_type: str
    ) -> list[Mod]:
        """The shaped mods of a record (those the filter keeps)."""
        check = self.checks_unchanged(mod_type, value_capture_type)
        out = []
        for keys, new, old in raw:
            mod = plan.mod(keys, new, old, check)
            if mod is not None:
                out.append(mod)
        return out

    def dropped(self, mods: list[Mod]) -> bool:
        """Whether a record left with ``mods`` is dropped (only a filter drops records)."""
        return not mods and self.filter is not None

    def shape(self, record: DataChangeRecord) -> DataChangeRecord | HeartbeatRecord:
        """A record whose mods hold wire values, shaped; a HeartbeatRecord at its commit
        timestamp when the filter keeps nothing of it."""
        if not self.wants(record.table_name, record.mod_type):
            return _stand_in(record.partition_token, record.commit_timestamp)
        key = _columns_key(record.table_name, record.column_types)
        plan = self.cached(key) or self.plan(key, record.table_name, record.column_types)
        mods = self.mods(
            plan, ((m.keys, m.new_values, m.old_values) for m in record.mods),
            record.mod_type, record.value_capture_type,
        )
        if self.dropped(mods):
            return _stand_in(record.partition_token, record.commit_timestamp)
        return attrs.evolve(record, column_types=plan.columns, mods=mods)


def _stand_in(token: str, commit_timestamp: Timestamp) -> HeartbeatRecord:
    return HeartbeatRecord(token, commit_timestamp)


def _columns_key(table: str, columns: Iterable[ColumnType]) -> Hashable:
    return ("record", table, tuple(
        (c.name, orjson.dumps(c.type, option=orjson.OPT_SORT_KEYS), c.is_primary_key,
         c.ordinal_position)
        for c in columns
    ))


#: The default options: typed values, no filter.
default_shaper = RecordShaper()
