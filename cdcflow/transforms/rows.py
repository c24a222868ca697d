"""Rows: change records as one row per mod, in the shapes users already know.

``Rows("flat")`` gives each mod as the table's columns plus ``_op`` (INSERT, UPDATE,
DELETE; SNAPSHOT for a row of the initial snapshot), ``_commit_ts`` (a Timestamp),
``_txn`` (server transaction id), ``_seq`` (record sequence) and ``_table``; a DELETE's
columns are its old values and keys, an UPDATE's the columns it wrote.

``Rows("debezium")`` gives Debezium's envelope: ``before`` and ``after`` (the row, None
where there is none), ``op`` (``c``, ``u``, ``d``; ``r`` for a snapshot row), ``source``
(``table``, ``commit_timestamp``, ``transaction_id``, ``record_sequence``, ``partition``)
and ``ts_ms`` (the commit time in milliseconds).

They are the rows :class:`~cdcflow.transforms.tables.WriteTables` writes (``rows=``), with
the values as the reader decoded them (typed by default; wire strings under
``typed=False``), for any other sink: ``ReadChangeStream(...) | Rows("debezium") |
Consume(publish)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, get_args

from cdcflow.errors import PipelineDefinitionError
from cdcflow.model import DataChangeRecord
from cdcflow.transforms._tablerows import RowStyle, rows_of
from cdcflow.transforms.base import DoFn, ParDo

__all__ = ["Rows"]


class _RowsFn(DoFn[DataChangeRecord, dict[str, Any]]):
    def __init__(self, style: RowStyle) -> None:
        self.style = style

    def process(self, element: DataChangeRecord) -> Iterable[dict[str, Any]]:
        if not isinstance(element, DataChangeRecord):
            msg = (f"Rows takes DataChangeRecords, got {type(element).__name__}; apply it to "
                   "ReadPartition's output (or to a Filter of it)")
            raise TypeError(msg)
        return rows_of(element, self.style, arrow=False)


class Rows(ParDo[DataChangeRecord, dict[str, Any]]):
    """One row per mod, ``style`` "flat" or "debezium" (see the module docstring)."""

    def __init__(self, style: RowStyle = "flat") -> None:
        if style not in get_args(RowStyle):
            msg = f"Rows(style={style!r}): use 'flat' or 'debezium'"
            raise PipelineDefinitionError(msg)
        super().__init__(_RowsFn(style))
        self.style = style

    def default_label(self) -> str:
        return f"Rows({self.style})"

    def describe_params(self) -> str:
        return f"style={self.style}"
