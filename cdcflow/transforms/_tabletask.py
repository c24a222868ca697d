"""The task side of WriteTables: a writer groups a task's records by (table, date
directory, column list) and builds each group column-wise at close (``_tablebuild``,
``_tablejsonl``); its commit message carries the groups, or the path of a local spool file
(past ``spool_size`` bytes of records) and the groups' heads (their metadata, without rows),
so the driver decides a batch's schema from the heads and then stages the rows a spooled
chunk at a time.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from cdcflow.errors import SinkError, SinkIOError
from cdcflow.model import DataChangeRecord, Timestamp
from cdcflow.sizes import payload_size
from cdcflow.transforms._fileio import local_prefix
from cdcflow.transforms._tablebuild import Mods, record_batch
from cdcflow.transforms._tablejsonl import jsonl_lines
from cdcflow.transforms._tablerows import Column, Format, RowStyle, Schema, Unit, columns_of

__all__ = ["TaskRows", "Writer"]



@attrs.frozen
class Group:
    """Rows of one (table, partition directory, column list) from one task: a RecordBatch
    of the group's own columns (parquet, csv) or JSON lines (jsonl)."""

    table: str
    directory: str
    columns: tuple[Column, ...]
    rows: int
    data: Any  # pa.RecordBatch | bytes
    #: the earliest commit timestamp (ns) of the group's records
    first_ns: int = 0
    #: the latest commit timestamp (ns) of a record that carries every column the stream
    #: tracks (see ``_tablebuild.full_ops``), None without one: only such a record shows a
    #: dropped column
    full_ns: int | None = None
    #: the bytes of ``data`` (Arrow's count, or the JSON lines' length)
    nbytes: int = 0

    def head(self) -> Group:
        """The group without its rows (what the driver needs before it stages them)."""
        return attrs.evolve(self, data=None)


@attrs.frozen
class TaskRows:
    """A writer's commit message: its rows inline (``groups``), or the path of a local spool
    file and the heads of the groups in it (``heads``: each group without its rows)."""

    groups: tuple[Group, ...] = ()
    spool: str | None = None
    heads: tuple[Group, ...] = ()

    def described(self) -> tuple[Group, ...]:
        """The groups, with or without their rows: enough to plan a commit."""
        return self.groups if self.spool is None else self.heads

    def chunks(self) -> Iterator[list[Group]]:
        """The groups with their rows, a spooled chunk (about ``spool_size`` bytes of
        records) at a time, so a batch larger than memory is never loaded whole."""
        if self.spool is None:
            yield list(self.groups)
            return
        try:
            f = open(self.spool, "rb")  # noqa: SIM115 (closed below; yields between reads)
        except OSError as exc:
            raise self._unreadable(exc) from exc
        with f:
            while True:
                try:
                    chunk: list[Group] = pickle.load(f)
                except EOFError:
                    return
                except OSError as exc:
                    raise self._unreadable(exc) from exc
                yield chunk

    def _unreadable(self, exc: OSError) -> SinkError:
        return SinkError(f"WriteTables cannot read the task's spool {self.spool}: {exc}; tasks "
                         "spool to local disk: on a cluster set spool_size=None (rows travel "
                         "inline)")


class Writer:
    """Groups a task's records by (table, directory, column list) and builds each group
    column-wise at close (or when ``spool_size`` is passed, into a local spool file).

    A group's column list is recognised by identity first (the decoder shares one tuple
    among a table's records with the same columns), then by equality: no per-record
    schema work. ``write`` is on the hot path: a record like the one before it (same
    column list object, same table, no date directories) is one append."""

    def __init__(self, style: RowStyle, fmt: Format, partition_by: str,
                 spool_size: int | None, spool_prefix: str | None = None,
                 unit: Unit = "ns") -> None:
        self.style: RowStyle = style
        self.format: Format = fmt
        self.unit: Unit = unit
        self.partition_by = partition_by
        self._undivided = partition_by == "none"
        self.spool_size = spool_size
        self.spool_prefix = spool_prefix or local_prefix()  # names the driver's process
        # (table, directory) -> [(column_types, records)]
        self.groups: dict[tuple[str, str], list[tuple[Any, list[DataChangeRecord]]]] = {}
        self.dirs: dict[tuple[int, int, int, int], str] = {}
        self.spool: str | None = None
        self.heads: list[Group] = []  # of the groups spooled
        # the fast path: the last record's column list and table, and its group's records
        self._types: Any = None
        self._table: Any = None
        self._records: list[DataChangeRecord] = []
        self._key: tuple[str, str] = ("", "")
        self._bytes = 0  # of the records held (payload_size), counted with a spool_size

    def write(self, element: DataChangeRecord) -> None:
        try:
            same = (element.column_types is self._types and element.table_name == self._table
                    and self._undivided)
        except AttributeError:  # not a DataChangeRecord: _add says so
            same = False
        if same:
            self._records.append(element)
        else:
            self._add(element)
        if self.spool_size is not None:  # every record: sizes vary (a 200 KB blob)
            self._bytes += payload_size(element)
            if self._bytes >= self.spool_size:
                self._spill()

    def _add(self, element: DataChangeRecord) -> None:
        if not isinstance(element, DataChangeRecord):
            msg = (f"WriteTables takes DataChangeRecords, got {type(element).__name__}; "
                   "put it right after ReadPartition (or a Filter)")
            raise SinkError(msg)
        directory = ("" if self.partition_by == "none"
                     else self._directory(element.commit_timestamp))
        key = (element.table_name, directory)
        types = element.column_types
        if not (types is self._types and key == self._key):
            groups = self.groups.setdefault(key, [])
            records = next((recs for have, recs in groups if have is types or have == types),
                           None)
            if records is None:
                records = []
                groups.append((types, records))
            self._records, self._key = records, key
        self._types, self._table = types, element.table_name
        self._records.append(element)

    def _directory(self, ts: Timestamp) -> str:
        hour = (ts.year, ts.month, ts.day, ts.hour)
        found = self.dirs.get(hour)
        if found is None:
            found = self.dirs[hour] = _directory(ts, self.partition_by)
        return found

    def _batch(self) -> list[Group]:
        out = []
        for (table, directory), groups in self.groups.items():
            for _, records in groups:
                columns = columns_of(records[0])
                schema = Schema(table, 0, columns)
                mods = Mods(records, self.style)
                if self.format == "jsonl":
                    data: Any = jsonl_lines(mods, schema, self.style)
                else:
                    data = record_batch(mods, schema, self.style, self.format, self.unit)
                first, full = mods.bounds()
                nbytes = len(data) if isinstance(data, bytes) else data.nbytes
                out.append(Group(table, directory, columns, len(mods), data, first, full,
                                 nbytes))
        self.groups = {}
        self._types = self._table = None
        self._records, self._key = [], ("", "")
        self._bytes = 0
        return out

    def _spill(self) -> None:
        if self.spool is None:
            try:
                fd, self.spool = tempfile.mkstemp(prefix=self.spool_prefix, suffix=".spool")
            except OSError as exc:
                msg = (f"WriteTables cannot spool a task's rows to {tempfile.gettempdir()}: "
                       f"{exc.strerror or exc}; set TMPDIR to a directory with room, or "
                       "spool_size=None to send rows in the commit message")
                raise SinkIOError(msg) from exc
            os.close(fd)
        groups = self._batch()
        try:
            with open(self.spool, "ab") as f:
                pickle.dump(groups, f, protocol=pickle.HIGHEST_PROTOCOL)
        except OSError as exc:
            msg = (f"WriteTables cannot spool a task's rows to {self.spool}: "
                   f"{exc.strerror or exc}; free space there (or set TMPDIR to a directory "
                   "with room), or set spool_size=None to send rows in the commit message")
            raise SinkIOError(msg) from exc
        self.heads.extend(g.head() for g in groups)

    def close(self) -> TaskRows | None:
        if self.spool is not None:
            self._spill()
            return TaskRows(spool=self.spool, heads=tuple(self.heads))
        groups = self._batch()
        return TaskRows(groups=tuple(groups)) if groups else None

    def abort(self) -> None:
        self.groups = {}
        self._types = self._table = None
        self._records = []
        self.heads = []
        if self.spool is not None:
            with contextlib.suppress(OSError):
                os.remove(self.spool)


def next_version(table: str, current: Schema | None,
                 groups: Sequence[Group]) -> Schema | None:
    """The table's next schema version if a batch's ``groups`` need one (None if they fit
    ``current``): a column the current version lacks (or has with another type), or a
    column dropped (a row carrying every tracked column lacks it, that row is newer than
    the version's ``since``, and no row of the batch carries it)."""
    # Rows with every column first, so a version lists its columns in table order; a
    # column retyped within the batch takes its newest type (of the group whose records
    # begin latest): the batch's earlier rows are cast to it when staged.
    groups = sorted(groups, key=lambda g: (g.full_ns is None, -len(g.columns)))
    merged: dict[str, Column] = {}
    newest: dict[str, int] = {}
    for g in groups:
        for c in g.columns:
            if c.name not in merged or g.first_ns > newest[c.name]:
                merged[c.name] = c  # a new key keeps its place in the dict
                newest[c.name] = g.first_ns
    columns = tuple(merged.values())
    if current is None:
        return Schema(table, 1, columns, min(g.first_ns for g in groups))
    changed = [g for g in groups if not current.fits(g.columns)]
    dropped: set[str] = set()
    for g in groups:
        if g.full_ns is not None and g.full_ns > current.since:
            names = {c.name for c in g.columns}
            lacks = {c.name for c in current.columns
                     if not c.primary_key and c.name not in names}
            if lacks:
                dropped |= lacks
                changed.append(g)
    dropped -= set(merged)
    if not dropped and current.fits(columns):
        return None
    return current.evolve(columns, dropped, min(g.first_ns for g in changed))


def _directory(ts: Timestamp, partition_by: str) -> str:
    if partition_by == "day":
        return f"date={ts:%Y-%m-%d}"
    if partition_by == "hour":
        return f"date={ts:%Y-%m-%d}/hour={ts:%H}"
    return ""
