"""GoogleSQL data change records from their wire fields: what both GoogleSQL decoders share.

A GoogleSQL change stream sends a data change record as a STRUCT of thirteen fields; the
decoders (:mod:`cdcflow.spanner.decode` reads protobuf ``Value`` trees,
:mod:`cdcflow.spanner.flat` serialized messages) pull out the fields and hand them to
:class:`DataBuilder`, which makes the record:

* the table name and mod type are looked at first: a record the shaper's filter does not
  want is never decoded further and becomes a HeartbeatRecord at its commit timestamp, once
  per position in a row (the records of a transaction share it), so a reader still advances
  past it;
* its column types are decoded once per table and distinct list, keyed by the list's
  serialized bytes, into the shaper's :class:`~cdcflow.spanner.shape.TablePlan`;
* its mods arrive as JSON texts, three per mod (keys, new values, old values; ``""`` for a
  NULL, an empty map for the model), parsed with orjson and typed by the plan: without a
  filter the parsed dicts are converted in place (no second dict per mod).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal
from typing import Any

import attrs
import orjson

from cdcflow.compiled import speedups
from cdcflow.model import (
    ChangeRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    JsonString,
    Mod,
    ModType,
    Timestamp,
)
from cdcflow.spanner import values
from cdcflow.spanner.shape import RecordShaper, TablePlan
from cdcflow.spanner.values import parse_timestamp

__all__ = [
    "CHILD_LAYOUT",
    "CHILD_PARTITIONS_LAYOUT",
    "COLUMN_LAYOUT",
    "DATA_LAYOUT",
    "ENTRY_BYTES",
    "HEARTBEAT_LAYOUT",
    "MOD_LAYOUT",
    "RECORD_BYTES",
    "TOP_LAYOUT",
    "DataBuilder",
    "compiled_decoder",
]

_loads = orjson.loads

#: A record's size beyond its mods, and what a key or a value costs besides its payload
#: (its object and its reference, twice: key and value): cdcflow.engine.chain's measure.
RECORD_BYTES = 256
ENTRY_BYTES = 2 * 48

# The documented field order of the GoogleSQL ChangeRecord STRUCTs.
TOP_LAYOUT = ("data_change_record", "heartbeat_record", "child_partitions_record")
DATA_LAYOUT = (
    "commit_timestamp", "record_sequence", "server_transaction_id",
    "is_last_record_in_transaction_in_partition", "table_name", "column_types", "mods",
    "mod_type", "value_capture_type", "number_of_records_in_transaction",
    "number_of_partitions_in_transaction", "transaction_tag", "is_system_transaction",
)
COLUMN_LAYOUT = ("name", "type", "is_primary_key", "ordinal_position")
MOD_LAYOUT = ("keys", "new_values", "old_values")
HEARTBEAT_LAYOUT = ("timestamp",)
CHILD_PARTITIONS_LAYOUT = ("start_timestamp", "record_sequence", "child_partitions")
CHILD_LAYOUT = ("token", "parent_partition_tokens")


def _compiled() -> Any:
    """The compiled decoder (:func:`cdcflow.compiled.speedups`), configured; or None."""
    module = speedups()
    if module is None:
        return None
    module.configure(
        _loads, parse_timestamp, values._numeric, values._json, Decimal, JsonString,
        Mod, tuple(f.name for f in attrs.fields(Mod)),
        DataChangeRecord, tuple(f.name for f in attrs.fields(DataChangeRecord)),
        Timestamp, ("_nanosecond", "_ns", "_text"), RECORD_BYTES, ENTRY_BYTES,
    )
    return module


_SPEEDUPS = _compiled()


def compiled_decoder() -> bool:
    """Whether GoogleSQL records are decoded by the compiled decoder (else in Python)."""
    return _SPEEDUPS is not None


class DataBuilder:
    """Makes DataChangeRecords shaped by ``shaper``; one per decoder (it remembers the last
    stand-in heartbeat, so a run of dropped records gives one)."""

    __slots__ = ("_last_stand_in", "_plain", "shaper")

    def __init__(self, shaper: RecordShaper) -> None:
        self.shaper = shaper
        # Without a filter a plan keeps every column and checks nothing: mods are the
        # parsed JSON dicts converted in place.
        self._plain = shaper.filter is None
        self._last_stand_in: tuple[str, str] | None = None

    def plan(
        self, table: str, columns: bytes, parse: Callable[[bytes], Iterable[ColumnType]]
    ) -> TablePlan:
        """The plan of ``table`` with the column types ``columns`` (the serialized
        ``ListValue``); ``parse(columns)`` gives the ColumnTypes when the plan is new."""
        key = ("columns", table, columns)
        shaper = self.shaper
        plan = shaper.cached(key)
        if plan is None:
            plan = shaper.plan(key, table, parse(columns))
        return plan

    def stand_in(self, token: str, commit_timestamp: str) -> HeartbeatRecord | None:
        """A dropped record's position as a heartbeat, once per position in a row."""
        key = (token, commit_timestamp)
        if key == self._last_stand_in:
            return None
        self._last_stand_in = key
        return HeartbeatRecord(token, parse_timestamp(commit_timestamp))

    def merged(
        self, token: str, strings: Sequence[str], bools: Sequence[bool],
        lists: Sequence[bytes], parse_columns: Callable[[bytes], Iterable[ColumnType]],
        sizes: dict[int, int] | None = None,
    ) -> list[ChangeRecord] | None:
        """The records of a merged run of data change records (9 strings, 2 bools and 2
        serialized lists per record, in :data:`DATA_LAYOUT` order) made by the compiled
        decoder: what :meth:`run` makes of them, with ``sizes`` likewise. None when it
        does not apply: not built, a filter, a shape it declines, or a value it cannot
        type (:meth:`run` then decodes the run, and raises what is wrong)."""
        compiled = _SPEEDUPS
        if compiled is None or not self._plain:
            return None

        def planner(table: str, columns: bytes) -> tuple[tuple[ColumnType, ...], Any]:
            plan = self.shaper.cached(("columns", table, columns)) or self.plan(
                table, columns, parse_columns
            )
            return plan.columns, plan.converters

        try:
            records: list[ChangeRecord] | None = compiled.decode(
                token, list(strings), list(bools), list(lists), planner, sizes
            )
        except Exception:
            return None
        return records

    def mods(
        self, plan: TablePlan, texts: Sequence[str], mod_type: str, capture: str
    ) -> list[Mod]:
        """The shaped mods of ``texts`` (keys, new values, old values of each mod, in turn)."""
        loads = _loads
        it = iter(texts)
        if not self._plain:
            check = self.shaper.checks_unchanged(mod_type, capture)
            shape = plan.mod
            out = []
            for k, n, o in zip(it, it, it, strict=True):
                mod = shape(loads(k) if k else {}, loads(n) if n else {},
                            loads(o) if o else {}, check)
                if mod is not None:
                    out.append(mod)
            return out
        return _plain_mods(plan, texts)[0]

    def run(
        self, token: str, records: Iterable[tuple[Any, Any, Any]],
        mod_texts: Callable[[bytes], Sequence[str]],
        parse_columns: Callable[[bytes], Iterable[ColumnType]],
        sizes: dict[int, int] | None = None,
    ) -> list[ChangeRecord]:
        """The records (and stand-ins) of a run of data change records, each given as
        ``((commit_timestamp, record_sequence, transaction_id, table, mod_type, capture,
        records_in_transaction, partitions_in_transaction, transaction_tag),
        (is_last, is_system_transaction), (columns, mods))`` with the column types and mods
        lists serialized (``mod_texts(mods)`` gives their JSON texts, ``parse_columns`` the
        column types): what :meth:`plan`, :meth:`mods` and :meth:`record` make of each, in
        one loop (the hot path of every GoogleSQL read). Without a filter, ``sizes`` (if
        given) gets each record's size by ``id()``: :data:`RECORD_BYTES`, the serialized
        mods' bytes (their JSON texts) and :data:`ENTRY_BYTES` per key and value of its
        mods; the measure of ``cdcflow.sizes.approx_size``, read off the wire."""
        if not self._plain:
            out: list[ChangeRecord] = []
            wants = self.shaper.wants
            for (ts, seq, txn, table, mod_type, capture, n_rec, n_part, tag), (
                last, system
            ), (columns, mods) in records:
                if wants(table, mod_type):
                    plan = self.plan(table, columns, parse_columns)
                    record = self.record(
                        token, ts, seq, txn, last, table, plan,
                        self.mods(plan, mod_texts(mods), mod_type, capture), mod_type,
                        capture, n_rec, n_part, tag, system,
                    )
                else:
                    record = self.stand_in(token, ts)
                if record is not None:
                    out.append(record)
            return out
        # No filter: every record is kept whole, its mods converted in the parsed dicts.
        plain_mods = _plain_mods
        cached = self.shaper.cached
        made: list[ChangeRecord] = []
        append = made.append
        previous: tuple[str, bytes, TablePlan] | None = None
        for (ts, seq, txn, table, mod_type, capture, n_rec, n_part, tag), (last, system), (
            columns, mods
        ) in records:
            # A run of one table's records usually repeats its columns: compare the bytes
            if previous is not None and previous[1] == columns and previous[0] == table:
                plan = previous[2]
            else:
                plan = cached(("columns", table, columns)) or self.plan(
                    table, columns, parse_columns
                )
                previous = (table, columns, plan)
            shaped, entries = plain_mods(plan, mod_texts(mods))
            record = DataChangeRecord(
                token, parse_timestamp(ts), seq, txn, last, table, plan.columns, shaped,
                mod_type, capture, int(n_rec), int(n_part), tag, system,
            )
            append(record)
            if sizes is not None:
                sizes[id(record)] = RECORD_BYTES + len(mods) + ENTRY_BYTES * entries
        return made

    def record(
        self, token: str, commit_timestamp: str, record_sequence: str, transaction_id: str,
        is_last: bool, table: str, plan: TablePlan, mods: list[Mod], mod_type: ModType,
        capture: str, records_in_transaction: str, partitions_in_transaction: str,
        transaction_tag: str, is_system_transaction: bool,
    ) -> DataChangeRecord | HeartbeatRecord | None:
        """The record (wire texts for timestamps and counts), or its stand-in when the
        filter left it no mod (see :meth:`stand_in`)."""
        if not mods and not self._plain:
            return self.stand_in(token, commit_timestamp)
        return DataChangeRecord(
            token, parse_timestamp(commit_timestamp), record_sequence, transaction_id,
            is_last, table, plan.columns, mods, mod_type, capture,
            int(records_in_transaction), int(partitions_in_transaction), transaction_tag,
            is_system_transaction,
        )


def _plain_mods(plan: TablePlan, texts: Sequence[str]) -> tuple[list[Mod], int]:
    """The mods of ``texts`` (keys, new values, old values of each mod, in turn) with no
    filter: every mod kept, its values converted in the parsed dicts; and how many keys and
    values they hold (for the record's size)."""
    loads = _loads
    convert = plan.in_place
    mods = []
    entries = 0
    it = iter(texts)
    for k, n, o in zip(it, it, it, strict=True):
        kd = loads(k) if k else {}
        nd = loads(n) if n else {}
        od = loads(o) if o else {}
        entries += len(kd) + len(nd) + len(od)
        if convert is not None:
            try:
                convert(kd)
                if nd:
                    convert(nd)
                if od:
                    convert(od)
            except Exception:
                # plan.mod raises the DecodeError naming the column; should it not, the
                # converter's own error stands
                plan.mod(loads(k or "{}"), loads(n or "{}"), loads(o or "{}"))
                raise
        mods.append(Mod(kd, nd, od))
    return mods, entries
