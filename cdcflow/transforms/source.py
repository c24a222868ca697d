"""The change-stream source of a pipeline: DetectPartitions and ReadPartition (the two
primitives runners execute), and ReadChangeStream, the composite of both."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Literal

from cdcflow.durations import parse_duration, parse_size, parse_time, positive_seconds
from cdcflow.errors import PipelineDefinitionError
from cdcflow.model import MAX_NS, DataChangeRecord, PartitionMetadata
from cdcflow.stream import (
    ChangeStreamClient,
    ConfigurableClient,
    RecordFilter,
    SnapshotClient,
    spelled_as,
)
from cdcflow.transforms.base import PCollection, PrimitiveTransform, PTransform

__all__ = ["DetectPartitions", "ReadChangeStream", "ReadPartition"]

_DATABASE = re.compile(r"^projects/[^/]+/instances/[^/]+/databases/[^/]+$")
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_PRIORITIES = ("LOW", "MEDIUM", "HIGH")

TimeLike = str | datetime | int

#: A table with more rows is read in key ranges of about this many rows, a task each.
DEFAULT_SNAPSHOT_ROWS_PER_TASK = 500_000
#: Most snapshot partitions (tables or key ranges) read in one batch: what a crash during
#: the snapshot reads again at most.
DEFAULT_SNAPSHOT_TASKS_PER_BATCH = 32


class DetectPartitions(PrimitiveTransform[None, PartitionMetadata]):
    """Where partitions come from: a change stream of a Spanner database.

    ``start_at``: ``"now"`` (resolved once, on the first run), ``"-10m"``, RFC 3339 text or
    a datetime. ``end_at`` (inclusive; None reads forever): when every partition has been
    read up to it, the run ends. ``client`` replaces the Spanner reader (tests use
    :class:`cdcflow.testing.ScriptedChangeStream`); it is pickled into every task.

    Values in mods are typed from the records' column types (INT64 -> int, NUMERIC ->
    Decimal, TIMESTAMP -> Timestamp, JSON -> parsed, ...; see
    :mod:`cdcflow.spanner.values`); ``typed=False`` keeps Spanner's wire form (INT64 as
    text, JSON as JSON text, ...).

    Filters, applied while records are decoded (see :class:`~cdcflow.stream.RecordFilter`):
    ``tables`` / ``exclude_tables`` (names as the database spells them), ``columns``
    (``{"Orders": ["Status", "Total"]}``: keep only these columns of that table; keys are
    always kept), ``mod_types`` (e.g. ``["INSERT", "UPDATE"]``) and ``skip_unchanged``
    (drop UPDATE mods whose kept values did not change; needs a stream whose value
    capture type records old values: OLD_AND_NEW_VALUES or NEW_ROW_AND_OLD_VALUES). A
    record nothing of which is kept is not delivered, but its position still counts as
    read. Names the stream does not track stop the run at its start with a one-line error
    that lists the stream's tables or columns.

    ``snapshot``: before streaming, read these tables (``True``: every table the stream
    tracks, less those the filter leaves out) as of ``start - 1 ns`` and emit each row as
    an INSERT with ``is_snapshot=True`` and ``commit_timestamp = start - 1 ns``; the
    changes follow from ``start`` on, after every snapshot row (no gap, no overlap: see
    docs/architecture.md, "Snapshot then stream"). Each table is a partition of the
    pipeline (``snapshot/<table>``); a table of more than ``snapshot_rows_per_task`` rows
    is split into key ranges of about that many rows, each a partition read by a task of
    its own, in parallel, and done ranges are never read again after a crash. At most
    ``snapshot_tasks_per_batch`` snapshot partitions are read per batch: what a crash
    reads again. The filters apply to snapshot rows too. ``data_boost``: read the
    snapshot with Spanner Data Boost (independent compute; needs the
    spanner.databases.useDataBoost permission). ``snapshot`` is part of the stored
    definition: a resumed run that changes it warns (or, with ``--strict``, refuses).
    """

    kind = "Source"

    def __init__(
        self,
        database: str | None = None,
        stream: str = "",
        start_at: TimeLike = "now",
        end_at: TimeLike | None = None,
        *,
        client: ChangeStreamClient | None = None,
        priority: str = "MEDIUM",
        query_timeout: str | float = "10m",
        typed: bool = True,
        tables: Iterable[str] | None = None,
        exclude_tables: Iterable[str] | None = None,
        columns: Mapping[str, Iterable[str]] | None = None,
        mod_types: Iterable[str] | None = None,
        skip_unchanged: bool = False,
        snapshot: bool | Iterable[str] = False,
        data_boost: bool = False,
        snapshot_rows_per_task: int = DEFAULT_SNAPSHOT_ROWS_PER_TASK,
        snapshot_tasks_per_batch: int = DEFAULT_SNAPSHOT_TASKS_PER_BATCH,
    ) -> None:
        for option, count in (("snapshot_rows_per_task", snapshot_rows_per_task),
                              ("snapshot_tasks_per_batch", snapshot_tasks_per_batch)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                msg = f"DetectPartitions({option}={count!r}): use a whole number, 1 or more"
                raise PipelineDefinitionError(msg)
        if client is not None and not isinstance(client, ChangeStreamClient):
            msg = (f"DetectPartitions(client={client!r}): pass a change stream client (a "
                   "cdcflow.testing.ScriptedChangeStream, say), or database= to read Spanner")
            raise PipelineDefinitionError(msg)
        if client is None and (not isinstance(database, str) or not _DATABASE.match(database)):
            msg = (
                f"DetectPartitions(database={database!r}): write the full path "
                "projects/PROJECT/instances/INSTANCE/databases/DATABASE"
            )
            raise PipelineDefinitionError(msg)
        if not isinstance(stream, str) or not _IDENTIFIER.match(stream):
            msg = (
                f"DetectPartitions(stream={stream!r}): a change stream name is an identifier "
                "(letters, digits, '_', not starting with a digit)"
            )
            raise PipelineDefinitionError(msg)
        if not isinstance(priority, str) or priority.upper() not in _PRIORITIES:
            msg = f"DetectPartitions(priority={priority!r}): use one of {', '.join(_PRIORITIES)}"
            raise PipelineDefinitionError(msg)
        for name, value in (("start_at", start_at), ("end_at", end_at)):
            if value is not None:
                try:
                    parse_time(value)
                except ValueError as e:
                    raise PipelineDefinitionError(f"DetectPartitions({name}=...): {e}") from None
        try:
            record_filter = RecordFilter.build(
                tables=tables, exclude_tables=exclude_tables, columns=columns,
                mod_types=mod_types, skip_unchanged=skip_unchanged,
            )
        except PipelineDefinitionError as e:
            raise PipelineDefinitionError(f"DetectPartitions({e})") from None
        self._client_name = type(client).__name__
        if client is not None and (not typed or record_filter is not None):
            if not isinstance(client, ConfigurableClient):
                msg = (
                    f"DetectPartitions(client={self._client_name}): this client takes no read "
                    "options (typed=False, tables=, columns=, mod_types=, skip_unchanged=); "
                    "give it a with_options method, or filter downstream with Filter/Map"
                )
                raise PipelineDefinitionError(msg)
            client = client.with_options(typed=typed, filter=record_filter)
        tables_to_snapshot = _snapshot_tables(snapshot, record_filter)
        if tables_to_snapshot and client is not None and not isinstance(client, SnapshotClient):
            msg = (
                f"DetectPartitions(client={self._client_name}, snapshot=...): this client cannot "
                "read tables; give it snapshot_tables, snapshot_split and snapshot methods "
                "(cdcflow.stream.SnapshotClient), or leave snapshot out"
            )
            raise PipelineDefinitionError(msg)
        self.database = database
        self.stream = stream
        self.start_at = start_at
        self.end_at = end_at
        #: What tasks read with: the given client, with the read options applied.
        self.client = client
        self.priority = priority.upper()
        self.query_timeout = positive_seconds(
            query_timeout, "DetectPartitions(query_timeout=...)", "10m")
        self.typed = bool(typed)
        #: The pushed-down filter (None: every record of every table).
        self.filter = record_filter
        #: Tables to snapshot before streaming: names, True (every tracked table the
        #: filter keeps) or () for none.
        self.snapshot: tuple[str, ...] | Literal[True] = tables_to_snapshot
        self.data_boost = bool(data_boost)
        #: A table with more rows than this is read in key ranges of about this many rows.
        self.snapshot_rows_per_task = snapshot_rows_per_task
        #: Most snapshot partitions (tables or key ranges) one batch reads.
        self.snapshot_tasks_per_batch = snapshot_tasks_per_batch

    def start_ns(self, now_ns: int) -> int:
        """The first position to read, for a pipeline that has no stored state yet."""
        return parse_time(self.start_at, now_ns)

    def end_ns(self, now_ns: int) -> int:
        """The exclusive end position (``end_at`` + 1 ns, since ``end_at`` is inclusive)."""
        return MAX_NS if self.end_at is None else parse_time(self.end_at, now_ns) + 1

    def definition(self) -> dict[str, str | None]:
        """What stored progress depends on: where the stream is and where reading starts
        and ends, as given (``start_at="now"`` stays "now"). A run compares it with the
        definition stored by the run that started the pipeline."""
        where = self.database if self.client is None else f"<{self._client_name}>"
        out = {
            "database": where,
            "stream": self.stream,
            "start_at": _time_text(self.start_at),
            "end_at": None if self.end_at is None else _time_text(self.end_at),
        }
        if self.snapshot:
            # Only when set, so pipelines stored before the option existed read the same.
            out["snapshot"] = "*" if self.snapshot is True else ",".join(self.snapshot)
        return out

    def snapshot_tables(self, tracked: Iterable[str]) -> list[str]:
        """The tables to snapshot, given those the stream tracks (sorted). Raises
        PipelineDefinitionError naming the tracked tables when ``snapshot`` names another."""
        known = set(tracked)
        if self.snapshot is True:
            # the filter's names as the stream spells them (RecordFilter.resolved)
            f = None if self.filter is None else self.filter.resolved(dict.fromkeys(known, ()))
            return sorted(t for t in known if f is None or f.wants(t, "INSERT"))
        if not self.snapshot:
            return []
        names = [spelled_as(t, known) for t in self.snapshot]
        unknown = [t for t in names if t not in known]
        if unknown:
            have = ", ".join(sorted(known)) or "none"
            msg = (
                f"DetectPartitions(snapshot=...): change stream {self.stream!r} does not track "
                f"table {unknown[0]!r} (its tables: {have}); snapshot only tables it tracks"
            )
            raise PipelineDefinitionError(msg)
        return list(dict.fromkeys(names))

    def describe_params(self) -> str:
        where = self.database or self._client_name
        end = f", end_at={self.end_at!s}" if self.end_at is not None else ""
        options = "" if self.typed else " typed=False"
        if self.filter is not None:
            options += f" {self.filter.describe()}"
        if self.snapshot:
            tables = "all" if self.snapshot is True else ",".join(self.snapshot)
            options += f" snapshot={tables}" + (" data_boost" if self.data_boost else "")
            options += f" rows_per_task={self.snapshot_rows_per_task}"
        return f"{where} stream={self.stream} start_at={self.start_at!s}{end}{options}"


class ReadPartition(PrimitiveTransform[PartitionMetadata, DataChangeRecord]):
    """Read every scheduled partition; emit its DataChangeRecords.

    ``heartbeat``: how often an idle partition reports progress. ``max_inflight`` > 1 runs
    the downstream transforms of up to that many records concurrently inside a task; output
    still reaches sinks in record order and progress advances only through the contiguously
    completed prefix; the DoFns then run on several threads at once and must be thread-safe
    (see :class:`~cdcflow.transforms.base.DoFn`). ``max_inflight_bytes`` is the byte quota
    of each process running the pipeline's tasks (the driver, or a Spark executor's Python
    worker), shared by all of its tasks: a record is charged when it is read and given
    back when every sink has taken it, and reading blocks while the quota is used up: a
    number of bytes or size text (``"64MiB"``). None (the default) uses the process's
    default, 256 MiB or the ``CDCFLOW_MAX_INFLIGHT_BYTES`` environment variable (a size
    too).
    """

    kind = "Read"

    def __init__(
        self,
        heartbeat: str | float = "1s",
        *,
        max_inflight: int = 1,
        max_inflight_bytes: int | str | None = None,
    ) -> None:
        try:
            seconds = parse_duration(heartbeat)
        except ValueError as e:
            raise PipelineDefinitionError(f"ReadPartition(heartbeat=...): {e}") from None
        if not 0.001 <= seconds <= 300:
            msg = f"ReadPartition(heartbeat={heartbeat!r}): use a value from 1ms to 300s"
            raise PipelineDefinitionError(msg)
        self.heartbeat_millis = max(1, round(seconds * 1000))
        self.max_inflight = _check_inflight("ReadPartition", max_inflight)
        self.max_inflight_bytes = _check_quota("ReadPartition", max_inflight_bytes)

    def describe_params(self) -> str:
        return f"heartbeat={self.heartbeat_millis}ms max_inflight={self.max_inflight}"


class ReadChangeStream(PTransform[None, DataChangeRecord]):
    """Read a change stream: :class:`DetectPartitions` then :class:`ReadPartition`, in one
    step applied to the pipeline itself::

        pipeline | ReadChangeStream(database, "OrdersStream", start_at="now") | ...

    The arguments are those of the two primitives (see them; typed values and filters
    are DetectPartitions'), checked when the composite is built. Their labels nest under
    the composite's (``ReadChangeStream/DetectPartitions`` and
    ``ReadChangeStream/ReadPartition`` by default), and labels key stored progress: a
    pipeline that switches between this and the two primitives starts over.
    """

    def __init__(
        self,
        database: str | None = None,
        stream: str = "",
        start_at: TimeLike = "now",
        end_at: TimeLike | None = None,
        *,
        heartbeat: str | float = "1s",
        max_inflight: int = 1,
        max_inflight_bytes: int | str | None = None,
        client: ChangeStreamClient | None = None,
        priority: str = "MEDIUM",
        query_timeout: str | float = "10m",
        typed: bool = True,
        tables: Iterable[str] | None = None,
        exclude_tables: Iterable[str] | None = None,
        columns: Mapping[str, Iterable[str]] | None = None,
        mod_types: Iterable[str] | None = None,
        skip_unchanged: bool = False,
        snapshot: bool | Iterable[str] = False,
        data_boost: bool = False,
        snapshot_rows_per_task: int = DEFAULT_SNAPSHOT_ROWS_PER_TASK,
        snapshot_tasks_per_batch: int = DEFAULT_SNAPSHOT_TASKS_PER_BATCH,
    ) -> None:
        self.detect = DetectPartitions(
            database, stream, start_at, end_at,
            client=client, priority=priority, query_timeout=query_timeout, typed=typed,
            tables=tables, exclude_tables=exclude_tables, columns=columns,
            mod_types=mod_types, skip_unchanged=skip_unchanged, snapshot=snapshot,
            data_boost=data_boost, snapshot_rows_per_task=snapshot_rows_per_task,
            snapshot_tasks_per_batch=snapshot_tasks_per_batch,
        )
        self.read = ReadPartition(
            heartbeat, max_inflight=_check_inflight("ReadChangeStream", max_inflight),
            max_inflight_bytes=_check_quota("ReadChangeStream", max_inflight_bytes),
        )

    def expand(self, pcoll: PCollection[None]) -> PCollection[DataChangeRecord]:
        return pcoll | self.detect | self.read


def _check_inflight(owner: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{owner}(max_inflight={value!r}): use a whole number, 1 or more"
        raise PipelineDefinitionError(msg)
    return value


def _check_quota(owner: str, value: object) -> int | None:
    """``max_inflight_bytes``: None, a whole number of bytes or size text ("64MiB"), 1 byte
    or more."""
    if value is None:
        return None
    name = f"{owner}(max_inflight_bytes=...)"
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        msg = f"{name.replace('...', repr(value))}: use 1 byte or more, such as 64MiB"
        raise PipelineDefinitionError(msg)
    if not isinstance(value, int | str) or isinstance(value, bool):
        msg = f"{name.replace('...', repr(value))}: use a size such as 64MiB or 67108864"
        raise PipelineDefinitionError(msg)
    size = parse_size(value, name)
    if size < 1:
        msg = f"{name.replace('...', repr(value))}: use 1 byte or more, such as 64MiB"
        raise PipelineDefinitionError(msg)
    return size


def _snapshot_tables(
    value: bool | Iterable[str], record_filter: RecordFilter | None
) -> tuple[str, ...] | Literal[True]:
    """``snapshot=`` checked: True, or the table names in order without repeats (() for
    none). Names the filter leaves out are refused: their rows would all be dropped."""
    if value is True:
        return True
    if value is False:
        return ()
    if (isinstance(value, str | bytes) or not isinstance(value, Iterable)
            or not all(isinstance(t, str) and t for t in value)):
        msg = (
            f"DetectPartitions(snapshot={value!r}): pass True or a list of table names, "
            "e.g. snapshot=['Singers']"
        )
        raise PipelineDefinitionError(msg)
    names = tuple(dict.fromkeys(value))
    if not names:
        msg = "DetectPartitions(snapshot=[]): name at least one table, or leave snapshot out"
        raise PipelineDefinitionError(msg)
    for table in names:
        if record_filter is not None and (
            (record_filter.tables is not None and table not in record_filter.tables)
            or table in record_filter.exclude_tables
        ):
            msg = (
                f"DetectPartitions(snapshot=[{table!r}, ...]): table {table!r} is not read "
                "(see tables=/exclude_tables=); snapshot only tables the source reads"
            )
            raise PipelineDefinitionError(msg)
    return names


def _time_text(value: TimeLike) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)
