"""The ChangeStreamClient protocol: the seam between the engine and Spanner.

This module imports nothing of google-cloud-spanner. The real implementation lives in
``cdcflow.spanner.client``; ``cdcflow.testing.ScriptedChangeStream`` is its in-memory twin.
:class:`RecordFilter` is what a source pushes down into a client's decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Literal, Protocol, runtime_checkable

import attrs

from cdcflow.errors import PipelineDefinitionError
from cdcflow.keyrange import KeyRange
from cdcflow.model import ChangeRecord, DataChangeRecord

__all__ = [
    "MOD_TYPES",
    "ChangeStreamClient",
    "ChangeStreamQuery",
    "ConfigurableClient",
    "RecordFilter",
    "SnapshotClient",
    "StreamInfo",
    "spelled_as",
]

#: The mod types a data change record can have.
MOD_TYPES = ("INSERT", "UPDATE", "DELETE")
#: Value capture types whose UPDATE mods carry old values (``skip_unchanged`` needs them).
_OLD_VALUE_CAPTURE = frozenset({"OLD_AND_NEW_VALUES", "NEW_ROW_AND_OLD_VALUES"})


@attrs.frozen
class ChangeStreamQuery:
    """Read one partition over positions ``start <= ts < end`` (nanoseconds, half-open).

    ``partition_token`` None is the root query, which returns the stream's first child
    partitions. The change stream function's bounds are inclusive, so a client passes
    ``end_timestamp = end - 1 ns``: consecutive slices neither gap nor overlap.

    ``stopping`` (None: never) tells whether the run was asked to stop: a client may then
    give up a read that is failing or gets nothing (it raises; the run stops and the next
    run reads the slice again) instead of retrying it or waiting out its stall.
    """

    stream: str
    partition_token: str | None
    start: int
    end: int
    heartbeat_millis: int = 1000
    stopping: Callable[[], bool] | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class StreamInfo:
    """What a change stream is. ``keys_follow_lineage``: a key's changes move only from a
    partition to its children (Spanner's IMMUTABLE_KEY_RANGE streams); the Cloud Spanner
    emulator's partition churn moves keys between partitions that are not parent and child
    (seen: a key in one partition, then in a child of that partition's sibling, then in a
    grandchild of the first), so there a partition read later can deliver a key's older
    change after its newer ones."""

    name: str
    partition_mode: Literal["IMMUTABLE_KEY_RANGE", "MUTABLE_KEY_RANGE"] = "IMMUTABLE_KEY_RANGE"
    dialect: Literal["GOOGLE_STANDARD_SQL", "POSTGRESQL"] = "GOOGLE_STANDARD_SQL"
    retention_ns: int | None = None
    keys_follow_lineage: bool = True


def _names(option: str, value: Iterable[str] | None) -> frozenset[str] | None:
    if value is None:
        return None
    if (isinstance(value, str | bytes) or not isinstance(value, Iterable)
            or not all(isinstance(v, str) and v for v in value)):
        msg = f"{option}={value!r}: pass a list of names, e.g. {option}=['Orders']"
        raise PipelineDefinitionError(msg)
    return frozenset(value)


def spelled_as(name: str, known: Collection[str]) -> str:
    """``name`` as ``known`` spells it: itself when known, else the one known name equal to
    it in any case (Spanner's names are case-insensitive; PostgreSQL folds unquoted names
    to lower case), else itself (none, or several)."""
    if name in known:
        return name
    same = [k for k in known if k.lower() == name.lower()]
    return same[0] if len(same) == 1 else name


@attrs.frozen
class RecordFilter:
    """Which data change records and columns a reader keeps; build it with :meth:`build`.

    Applied by the decoder before a record becomes a Python object where the wire shape
    allows it (the table name and mod type are read first). A record none of whose mods
    is kept is not delivered; a client yields a HeartbeatRecord at its commit timestamp
    instead, so the reader's position still advances past it.

    - ``tables``: keep only these tables (None: all); ``exclude_tables``: drop these.
    - ``columns``: per table, keep only these columns in ``new_values``, ``old_values`` and
      ``column_types``; key columns are always kept (``keys`` is never pruned).
    - ``mod_types``: keep only records of these mod types (None: all).
    - ``skip_unchanged``: drop UPDATE mods whose new values equal their old values in every
      column that is kept (compared in the wire form). Only streams whose value capture
      type records old values (OLD_AND_NEW_VALUES, NEW_ROW_AND_OLD_VALUES) can tell; with
      the others every UPDATE is kept. With ``columns``, an UPDATE that changed only
      columns that are not kept counts as unchanged.
    """

    tables: frozenset[str] | None = None
    exclude_tables: frozenset[str] = frozenset()
    columns: tuple[tuple[str, frozenset[str]], ...] = ()
    mod_types: frozenset[str] | None = None
    skip_unchanged: bool = False

    @classmethod
    def build(
        cls,
        *,
        tables: Iterable[str] | None = None,
        exclude_tables: Iterable[str] | None = None,
        columns: Mapping[str, Iterable[str]] | None = None,
        mod_types: Iterable[str] | None = None,
        skip_unchanged: bool = False,
    ) -> RecordFilter | None:
        """The filter for these options, or None when they keep everything.

        Raises PipelineDefinitionError (naming the option) for options that contradict
        each other or are malformed; names are checked against the stream by
        :meth:`check` when a reader starts.
        """
        wanted = _names("tables", tables)
        excluded = _names("exclude_tables", exclude_tables) or frozenset()
        if wanted is not None and excluded:
            msg = "tables=... and exclude_tables=...: use one of them"
            raise PipelineDefinitionError(msg)
        if wanted is not None and not wanted:
            msg = "tables=[]: name at least one table (or leave tables out to read all)"
            raise PipelineDefinitionError(msg)
        kept: list[tuple[str, frozenset[str]]] = []
        if columns is not None and (not isinstance(columns, Mapping)
                                    or not all(isinstance(t, str) and t for t in columns)):
            msg = (f"columns={columns!r}: pass a dict of table names to lists of column "
                   "names, e.g. columns={'Orders': ['Status']}")
            raise PipelineDefinitionError(msg)
        for table, names in sorted((columns or {}).items()):
            cols = _names(f"columns[{table!r}]", names)
            assert cols is not None
            # in any case: names are matched to the stream's so (see resolved)
            if ((wanted is not None and table.lower() not in {t.lower() for t in wanted})
                    or table.lower() in {t.lower() for t in excluded}):
                given = (f"tables={sorted(wanted)!r}" if wanted is not None
                         else f"exclude_tables={sorted(excluded)!r}")
                msg = (f"columns={{{table!r}: ...}}: table {table!r} is not read ({given}): "
                       "name it in both, as the stream spells it")
                raise PipelineDefinitionError(msg)
            kept.append((table, cols))
        types = None
        if mod_types is not None:
            types = _names("mod_types", mod_types)
            assert types is not None
            unknown = sorted(types - set(MOD_TYPES))
            if unknown or not types:
                msg = f"mod_types={sorted(types)!r}: use some of {', '.join(MOD_TYPES)}"
                raise PipelineDefinitionError(msg)
            if types == set(MOD_TYPES):
                types = None
        if wanted is None and not excluded and not kept and types is None and not skip_unchanged:
            return None
        return cls(wanted, excluded, tuple(kept), types, bool(skip_unchanged))

    def wants(self, table: str, mod_type: str) -> bool:
        """Whether records of ``table`` with ``mod_type`` are read at all."""
        if self.tables is not None and table not in self.tables:
            return False
        if table in self.exclude_tables:
            return False
        return self.mod_types is None or mod_type in self.mod_types

    def kept_columns(self, table: str) -> frozenset[str] | None:
        """The non-key columns of ``table`` to keep (None: all)."""
        for name, cols in self.columns:
            if name == table:
                return cols
        return None

    def checks_unchanged(self, mod_type: str, value_capture_type: str) -> bool:
        """Whether mods of such a record are dropped when their values did not change."""
        return (
            self.skip_unchanged and mod_type == "UPDATE"
            and value_capture_type in _OLD_VALUE_CAPTURE
        )

    def names(self) -> dict[str, frozenset[str]]:
        """Every table the filter names, with the columns it names in it."""
        named = {t: frozenset[str]() for t in (self.tables or ())}
        named.update((t, frozenset[str]()) for t in self.exclude_tables)
        named.update(self.columns)
        return named

    def resolved(self, tracked: Mapping[str, Collection[str]]) -> RecordFilter:
        """This filter with each table and column name as the database spells it, where it
        is not spelled so already: the one tracked name equal to it in any case (Spanner's
        names are case-insensitive, and PostgreSQL folds unquoted names to lower case:
        ``tables=["Orders"]`` reads ``orders``). A name matching none or several stays as
        given, for :meth:`check` to name."""

        def table(name: str) -> str:
            return spelled_as(name, tracked)

        columns = tuple(sorted(
            (table(t), frozenset(spelled_as(c, tracked.get(table(t), ())) for c in cols))
            for t, cols in self.columns))
        return attrs.evolve(
            self,
            tables=None if self.tables is None else frozenset(map(table, self.tables)),
            exclude_tables=frozenset(map(table, self.exclude_tables)),
            columns=columns,
        )

    def check(self, stream: str, tracked: Mapping[str, Collection[str]]) -> None:
        """Raise PipelineDefinitionError (one line, listing what exists) unless every table
        and column the filter names is one ``stream`` tracks (``tracked``: table -> its
        columns, keys included)."""
        for table, cols in sorted(self.names().items()):
            if table not in tracked:
                have = ", ".join(sorted(tracked)) or "none"
                msg = (
                    f"change stream {stream!r} does not track table {table!r} (its tables: "
                    f"{have}); fix tables=/exclude_tables=/columns= of the source"
                )
                raise PipelineDefinitionError(msg)
            unknown = sorted(cols - set(tracked[table]))
            if unknown:
                have = ", ".join(sorted(tracked[table])) or "none"
                msg = (
                    f"change stream {stream!r} does not track column {unknown[0]!r} of "
                    f"{table!r} (its columns: {have}); fix columns= of the source"
                )
                raise PipelineDefinitionError(msg)

    def describe(self) -> str:
        """A short text for logs and graphs, e.g. ``tables=Orders mod_types=INSERT``."""
        parts = []
        if self.tables is not None:
            parts.append(f"tables={','.join(sorted(self.tables))}")
        if self.exclude_tables:
            parts.append(f"exclude_tables={','.join(sorted(self.exclude_tables))}")
        for table, cols in self.columns:
            parts.append(f"columns[{table}]={','.join(sorted(cols))}")
        if self.mod_types is not None:
            parts.append(f"mod_types={','.join(t for t in MOD_TYPES if t in self.mod_types)}")
        if self.skip_unchanged:
            parts.append("skip_unchanged")
        return " ".join(parts)


@runtime_checkable
class ChangeStreamClient(Protocol):
    """Reads change-stream partitions.

    Contract of ``read``: yields the partition's records with ``start <= position < end``
    in the order the stream returns them (non-decreasing commit timestamp per partition);
    records of the root query carry ``INITIAL_PARTITION_TOKEN``. Transient errors are
    retried inside with bounded backoff; the iterator raises only when retries are spent
    (:class:`~cdcflow.errors.TransientError`) or on a permanent error.

    Optionally, what ``read`` returns has ``size_of(record) -> int | None``: the size in
    bytes of the record just yielded, measured while decoding it (the Spanner reader's, from
    the JSON it parsed), in the measure of ``cdcflow.sizes.approx_size``, which the
    task uses for the byte quota when a read does not say (None).
    """

    def describe_stream(self, stream: str) -> StreamInfo:
        """Check that the stream exists; raise StreamNotFoundError naming the fix if not."""
        ...

    def read(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]: ...

    def close(self) -> None: ...


@runtime_checkable
class ConfigurableClient(Protocol):
    """A client that takes read options (both cdcflow clients do).

    ``with_options`` returns a client reading the same stream with mod values typed from
    the column types (``typed=True``) or in Spanner's wire form, keeping only what
    ``filter`` wants; its ``describe_stream`` also checks the filter's names against the
    stream (PipelineDefinitionError naming what exists).
    """

    def with_options(
        self, *, typed: bool = True, filter: RecordFilter | None = None
    ) -> ChangeStreamClient: ...


@runtime_checkable
class SnapshotClient(Protocol):
    """A client that also reads tables as of a timestamp: the initial snapshot of a source
    with ``snapshot=`` (both cdcflow clients do). A separate protocol, so that clients
    that only read change streams still satisfy :class:`ChangeStreamClient`.

    ``snapshot_tables(stream)``: the tables ``stream`` tracks, as change records name
    them, sorted.

    ``snapshot_split(stream, table, read_timestamp_ns, rows_per_task)``: ``table``'s
    primary keys as of exactly ``read_timestamp_ns``, read in the table's key order and
    cut into key ranges of about ``rows_per_task`` rows
    (:func:`cdcflow.keyrange.split_ranges`); [] when the table has at most that many rows.

    ``snapshot(stream, table, read_timestamp_ns, key_range=None)``: every row of ``table``
    (of ``key_range`` only, when given: exactly the keys in ``[lo, hi)`` in the table's key
    order) as of exactly ``read_timestamp_ns`` (a stale read: every commit at or before
    it, none after), in DataChangeRecords of mod type INSERT with ``is_snapshot=True``,
    ``commit_timestamp`` the read timestamp, ``server_transaction_id`` ``"snapshot"``,
    ``record_sequence`` the chunk number (zero-padded; a record holds up to a chunk of
    rows), and the columns ``stream`` tracks, typed and filtered with the client's read
    options like change records. A record the filter keeps nothing of is not yielded.
    Partition token of the records: :func:`cdcflow.model.snapshot_token` of the table, or
    :func:`cdcflow.keyrange.range_token` of the range. Transient errors are retried before
    the first row; later ones raise (the engine replays the batch).
    """

    def snapshot_tables(self, stream: str) -> list[str]: ...

    def snapshot_split(
        self, stream: str, table: str, read_timestamp_ns: int, rows_per_task: int
    ) -> list[KeyRange]: ...

    def snapshot(
        self, stream: str, table: str, read_timestamp_ns: int,
        key_range: KeyRange | None = None,
    ) -> Iterator[DataChangeRecord]: ...
