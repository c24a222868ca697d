"""SchemaChanges: a table's schema changes as events, in commit order with its records.

Spanner's change stream has no DDL record, but every DataChangeRecord lists the columns it
carries with their types. ``SchemaChanges`` is a :class:`~cdcflow.transforms.base.BatchStep`
that follows each table's columns through its records and emits a :class:`SchemaChange`
right before the first record of a new shape:

- version 1: the first record of a table;
- ``ADD COLUMN`` (or a new type): a record carries a column the current version lacks, or
  has with another type;
- ``DROP COLUMN``: a record that lists every column the stream tracks (an INSERT; under
  NEW_ROW capture every mod, under OLD_AND_NEW_VALUES also a DELETE) lacks a column, and
  was committed after the first record of the current version.

It is the same rule :class:`~cdcflow.transforms.tables.WriteTables` applies to a batch's
rows (one function, ``_tabletask.next_version``), so both number a table's versions alike.

Order. A partition that splits or merges is read on in the next batch, so a batch can hold
records committed before records of the batch before it. The step therefore holds records
until the low watermark has passed their commit timestamp (as ``GroupTransactions`` does)
and emits them in (commit timestamp, server transaction id, record sequence) order: every
record after the event of version k and before that of version k+1 fits version k, and a
replayed batch emits the same events and records (the held records are the step's state,
stored with each batch commit). Rows of the initial snapshot (all at its read timestamp,
before the stream starts) pass at once.

A version's columns are the columns records have shown: under NEW_VALUES or
OLD_AND_NEW_VALUES capture an UPDATE lists only the keys and the columns it wrote (a DELETE
under NEW_VALUES only the keys), so a table first seen by such a record gets its other
columns, as version 2, at its first INSERT.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs

from cdcflow.model import DataChangeRecord, Timestamp
from cdcflow.transforms._tablebuild import full_ops
from cdcflow.transforms._tablerows import Column, Schema, columns_of, row_op
from cdcflow.transforms._tabletask import Group, next_version
from cdcflow.transforms.base import BatchStep

__all__ = ["Column", "SchemaChange", "SchemaChanges"]


@attrs.frozen
class SchemaChange:
    """Version ``version`` of ``table`` starts with the record that follows this event.

    ``columns`` are the new version's columns in table order (``Column.type`` is the
    change stream's type, e.g. ``{"code": "INT64"}``), ``previous`` the old version's (empty
    for version 1); ``commit_timestamp`` is the first record of the new shape's.
    """

    table: str
    version: int
    commit_timestamp: Timestamp
    columns: tuple[Column, ...]
    previous: tuple[Column, ...] = ()

    @property
    def added(self) -> tuple[str, ...]:
        """Columns of the new version that the previous one lacked."""
        old = {c.name for c in self.previous}
        return tuple(c.name for c in self.columns if c.name not in old)

    @property
    def dropped(self) -> tuple[str, ...]:
        """Columns of the previous version that the new one lacks."""
        new = {c.name for c in self.columns}
        return tuple(c.name for c in self.previous if c.name not in new)

    @property
    def retyped(self) -> tuple[str, ...]:
        """Columns in both versions whose type changed."""
        old = {c.name: c.type for c in self.previous}
        return tuple(c.name for c in self.columns if c.name in old and old[c.name] != c.type)


@attrs.frozen
class _State:
    #: each table's current version
    schemas: Mapping[str, Schema] = attrs.field(factory=dict)
    #: records the low watermark has not passed yet
    held: tuple[DataChangeRecord, ...] = ()


def _order(record: DataChangeRecord) -> tuple[int, str, int, str]:
    seq = record.record_sequence
    return (record.commit_timestamp.ns, record.server_transaction_id,
            int(seq) if seq.isdigit() else -1, seq)


class SchemaChanges(BatchStep[DataChangeRecord, "DataChangeRecord | SchemaChange", _State]):
    """Pass every DataChangeRecord on, in commit order, with a :class:`SchemaChange` before
    the first record of each table's new shape (see the module docstring).

    Apply it to ReadPartition's records (``ReadChangeStream(...) | SchemaChanges()``).
    Records wait until the low watermark passes them, so output lags the batch by up to
    ``max_batch_span`` (plus an idle partition's wait, ``idle_read_interval``).
    """

    def initial_state(self) -> _State:
        return _State()

    def process_batch(
        self, state: _State, elements: Sequence[DataChangeRecord], low_watermark: Timestamp
    ) -> tuple[_State, Iterable[DataChangeRecord | SchemaChange]]:
        schemas = dict(state.schemas)
        out: list[DataChangeRecord | SchemaChange] = []
        held = list(state.held)
        for record in elements:
            if not isinstance(record, DataChangeRecord):
                msg = (f"SchemaChanges takes DataChangeRecords, got {type(record).__name__}; "
                       "apply it to ReadPartition's output (or to a Filter of it)")
                raise TypeError(msg)
            if record.is_snapshot:
                self._follow(schemas, record, out)
            else:
                held.append(record)
        held.sort(key=_order)
        low = low_watermark.ns
        ready = 0
        while ready < len(held) and held[ready].commit_timestamp.ns < low:
            self._follow(schemas, held[ready], out)
            ready += 1
        return _State(schemas, tuple(held[ready:])), out

    @staticmethod
    def _follow(schemas: dict[str, Schema], record: DataChangeRecord,
                out: list[DataChangeRecord | SchemaChange]) -> None:
        table = record.table_name
        current = schemas.get(table)
        at = record.commit_timestamp.ns
        full = row_op(record) in full_ops({record.value_capture_type})
        group = Group(table, "", columns_of(record), 0, None, at, at if full else None)
        new = next_version(table, current, [group])
        if new is not None:
            schemas[table] = new
            out.append(SchemaChange(table, new.version, record.commit_timestamp, new.columns,
                                    current.columns if current is not None else ()))
        out.append(record)

    def describe_params(self) -> str:
        return ""
