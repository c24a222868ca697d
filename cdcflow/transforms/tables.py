"""WriteTables: change data landed per table in object storage (any fsspec URL), in files
near a target size, exactly once.

Layout under ``url``::

    <table>/_schema/v<k>.json                                 columns, types, keys, checksum
    <table>/[date=YYYY-MM-DD/[hour=HH/]]part-<first>-<last>-<k>.<parquet|jsonl>
    _cdcflow/durable.json                                     {"durable_batch": D, ...}

A *key* is one (table, date partition) directory. Each key has at most one open file,
staged on local disk; a file holds **whole batches** of its key, ``first..last``, and
``k`` is the schema version its rows follow (``v<k>.json`` is written before any file of
version ``k``).

Why this is exactly-once (the two-stage ack of ``cdcflow.engine.durability``):

1. ``commit(b)`` stages batch ``b``'s rows in the open file of each key it touches. A key's
   file is cut (written out) at a batch boundary when it reaches ``file_size``, when
   ``flush_interval`` has passed since it was opened, before its table's schema changes, or
   at ``flush()``. A cut is one PUT of the final name (locally: a temporary name, then an
   atomic rename): an object store has no atomic rename, but a PUT is atomic, so the final
   name is either absent or whole.
2. The names are deterministic and say which batches a key has made durable: the largest
   ``last`` among a key's files. After a crash the engine replays the batches above the
   sink's durable mark; the sink reads each key's largest ``last`` from the listing and
   skips, for that key, every replayed batch at or below it (its rows are in a file
   already), and stages the others. Files of a key are contiguous in batch order, so a
   replay neither repeats nor drops a row, whatever the cut points of the replay (which
   may differ: ``flush_interval`` is wall-clock time).
3. ``durable_batch()`` is ``B`` only when every key's open file holds batches above ``B``
   (the minimum over open files of ``first - 1``; with nothing open, the last batch
   staged). After a cut it is also written to ``_cdcflow/durable.json`` (after the data),
   so a restart finds a lower bound of it in the output itself.

A schema change (a record with a column the table's current schema lacks, or another type)
cuts every open file of the table, writes ``v<k+1>.json`` (the columns so far plus the new
ones), then stages the batch in new files. Records with fewer columns (a DELETE's keys, an
UPDATE's changed columns) fit the current schema; the missing columns are null.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs
import fsspec
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from cdcflow.durations import parse_duration
from cdcflow.errors import PipelineDefinitionError, SinkError, SinkIOError
from cdcflow.model import DataChangeRecord, Timestamp
from cdcflow.transforms._tablerows import (
    Column,
    RowStyle,
    Schema,
    arrow_table,
    columns_of,
    json_value,
    jsonl_row,
    rows_of,
)
from cdcflow.transforms.base import Sink, SinkContext, SinkWriter, WriterContext

__all__ = ["WriteTables", "parse_size"]

_PART = re.compile(r"part-(\d+)-(\d+)-(\d+)\.(parquet|jsonl)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes for ``"64MiB"``, ``"500KB"``, ``"1GiB"`` or an int."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if m is None:
        msg = f"not a size: {text!r}; write e.g. 64MiB, 500KB or 1GiB"
        raise PipelineDefinitionError(msg)
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


@attrs.frozen
class _Group:
    """Rows of one (table, partition directory) from one task, and their columns."""

    table: str
    directory: str
    columns: tuple[Column, ...]
    rows: list[dict[str, Any]]


@attrs.frozen
class TaskRows:
    """A writer's commit message: its rows inline, or the path of a local spool file."""

    groups: tuple[_Group, ...] = ()
    spool: str | None = None

    def load(self) -> tuple[_Group, ...]:
        if self.spool is None:
            return self.groups
        groups: list[_Group] = []
        try:
            with open(self.spool, "rb") as f:
                while True:
                    try:
                        groups.extend(pickle.load(f))
                    except EOFError:
                        break
        except OSError as exc:
            msg = (f"WriteTables cannot read the task's spool {self.spool}: {exc}; tasks spool "
                   "to local disk: on a cluster set spool_size=None (rows travel inline)")
            raise SinkError(msg) from exc
        return tuple(groups)


class _Writer:
    """Turns a task's records into rows; spools them to a local file past ``spool_size``."""

    def __init__(self, style: RowStyle, partition_by: str, spool_size: int | None) -> None:
        self.style: RowStyle = style
        self.partition_by = partition_by
        self.spool_size = spool_size
        self.groups: dict[tuple[str, str], tuple[dict[str, Column], list[dict[str, Any]]]] = {}
        self.bytes = 0
        self.spool: str | None = None

    def write(self, element: DataChangeRecord) -> None:
        if not isinstance(element, DataChangeRecord):
            msg = (f"WriteTables takes DataChangeRecords, got {type(element).__name__}; "
                   "put it right after ReadPartition (or a Filter)")
            raise SinkError(msg)
        key = (element.table_name, _directory(element.commit_timestamp, self.partition_by))
        cols, rows = self.groups.setdefault(key, ({}, []))
        for c in columns_of(element):
            cols[c.name] = c
        new = rows_of(element, self.style)
        rows.extend(new)
        self.bytes += sum(64 + 16 * len(r) for r in new)
        if self.spool_size is not None and self.bytes >= self.spool_size:
            self._spill()

    def _batch(self) -> list[_Group]:
        out = [_Group(t, d, tuple(cols.values()), rows)
               for (t, d), (cols, rows) in self.groups.items() if rows]
        self.groups, self.bytes = {}, 0
        return out

    def _spill(self) -> None:
        if self.spool is None:
            fd, self.spool = tempfile.mkstemp(prefix="cdcflow-tables-", suffix=".spool")
            os.close(fd)
        with open(self.spool, "ab") as f:
            pickle.dump(self._batch(), f, protocol=pickle.HIGHEST_PROTOCOL)

    def close(self) -> TaskRows | None:
        if self.spool is not None:
            self._spill()
            return TaskRows(spool=self.spool)
        groups = self._batch()
        return TaskRows(groups=tuple(groups)) if groups else None

    def abort(self) -> None:
        self.groups = {}
        if self.spool is not None:
            with contextlib.suppress(OSError):
                os.remove(self.spool)


def _directory(ts: Timestamp, partition_by: str) -> str:
    if partition_by == "day":
        return f"date={ts:%Y-%m-%d}"
    if partition_by == "hour":
        return f"date={ts:%Y-%m-%d}/hour={ts:%H}"
    return ""


class _Open:
    """A key's open file, staged on local disk (bounded memory): parquet row groups are
    written to a local file as pending rows pass ``row_group`` bytes."""

    def __init__(self, path: str, schema: Schema, arrow: pa.Schema, fmt: str, style: RowStyle,
                 first: int, row_group: int) -> None:
        self.path, self.schema, self.arrow, self.format = path, schema, arrow, fmt
        self.style: RowStyle = style
        self.first = self.last = first
        self.opened = time.monotonic()
        self.row_group = row_group
        self.pending: list[pa.Table] = []
        self.pending_bytes = 0
        self.raw_written = 0
        self.parquet: pq.ParquetWriter | None = None

    def append(self, rows: list[dict[str, Any]], batch_id: int) -> None:
        self.last = batch_id
        if self.format == "jsonl":
            with open(self.path, "ab") as f:
                for row in rows:
                    f.write(orjson.dumps(jsonl_row(row, self.schema, self.style),
                                         default=json_value, option=orjson.OPT_APPEND_NEWLINE))
            return
        table = arrow_table(rows, self.arrow)
        self.pending.append(table)
        self.pending_bytes += table.nbytes
        if self.pending_bytes >= self.row_group:
            self._write_row_group()

    def _write_row_group(self) -> None:
        if not self.pending:
            return
        if self.parquet is None:
            meta = {b"cdcflow.schema_version": str(self.schema.version).encode()}
            self.parquet = pq.ParquetWriter(self.path, self.arrow.with_metadata(meta))
        self.parquet.write_table(pa.concat_tables(self.pending))
        self.raw_written += self.pending_bytes
        self.pending, self.pending_bytes = [], 0

    def size(self) -> int:
        """The file's size if cut now (pending parquet rows estimated at the ratio so far)."""
        on_disk = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        ratio = on_disk / self.raw_written if self.raw_written else 0.5
        return on_disk + int(self.pending_bytes * ratio)

    def finish(self) -> str:
        """Close the local file and return its path."""
        if self.format == "parquet":
            self._write_row_group()
            if self.parquet is not None:
                self.parquet.close()
        return self.path


class WriteTables(Sink[DataChangeRecord, TaskRows]):
    """Lands DataChangeRecords under ``url`` per table, in files near ``file_size``
    (see the module docstring for the layout and why it is exactly-once).

    ``url``: a local path (relative to the pipeline file), ``memory://...`` or any fsspec
    URL such as ``s3://bucket/prefix``; ``storage_options`` go to fsspec (e.g.
    ``{"client_kwargs": {"endpoint_url": ...}}``). ``format``: ``"parquet"`` (Arrow types
    from the column types) or ``"jsonl"``. ``file_size``: cut a table's file once it
    reaches this size (at a batch boundary, so a file may pass it by one batch's rows).
    ``flush_interval``: cut a file this long after it was opened, whatever its size.
    ``partition_by``: ``"none"``, ``"day"`` or ``"hour"`` of the commit timestamp (UTC).
    ``rows``: ``"flat"`` (the row's columns plus ``_op``, ``_commit_ts``, ``_txn``,
    ``_seq``, ``_table``; a DELETE carries keys and old values) or ``"debezium"``
    (``before``, ``after``, ``op`` c/u/d, ``source``, ``ts_ms``). ``spool_size``: a task
    keeps this many bytes of rows in memory and spools the rest to a local temporary file
    whose path it sends to the driver; ``None`` sends every row in the commit message
    (needed on a cluster whose executors do not share the driver's disk).

    Staging happens on the driver in ``local_dir`` (a temporary directory by default).
    A storage failure raises :class:`~cdcflow.errors.SinkIOError` (the batch is retried).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        format: Literal["parquet", "jsonl"] = "parquet",
        file_size: str | int = "64MiB",
        flush_interval: str | float = "60s",
        partition_by: Literal["none", "day", "hour"] = "none",
        rows: RowStyle = "flat",
        *,
        storage_options: Mapping[str, Any] | None = None,
        spool_size: str | int | None = "16MiB",
        local_dir: str | None = None,
    ) -> None:
        self.url = os.fspath(url)
        if not self.url:
            msg = "WriteTables needs a URL, e.g. WriteTables('s3://bucket/cdc')"
            raise PipelineDefinitionError(msg)
        for name, value, allowed in (("format", format, ("parquet", "jsonl")),
                                     ("partition_by", partition_by, ("none", "day", "hour")),
                                     ("rows", rows, ("flat", "debezium"))):
            if value not in allowed:
                msg = f"WriteTables({name}={value!r}): use one of {', '.join(allowed)}"
                raise PipelineDefinitionError(msg)
        self.format = format
        self.file_size = parse_size(file_size)
        self.flush_interval = parse_duration(flush_interval)
        self.partition_by = partition_by
        self.rows: RowStyle = rows
        self.storage_options = dict(storage_options or {})
        self.spool_size = None if spool_size is None else parse_size(spool_size)
        self.local_dir = local_dir
        self._reset()

    def _reset(self) -> None:
        self._fs: Any = None
        self._root = ""
        self._stage_dir: str | None = None
        self._open: dict[tuple[str, str], _Open] = {}
        self._flushed: dict[tuple[str, str], int] = {}  # a key's largest `last` in storage
        self._schemas: dict[str, Schema] = {}
        self._staged_through = 0
        self._durable: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Tasks need the configuration only; the driver's staging state stays on the driver.
        state = self.__dict__.copy()
        for name in ("_fs", "_open", "_flushed", "_schemas"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fs, self._open, self._flushed, self._schemas = None, {}, {}, {}

    def describe_params(self) -> str:
        return f"{self.url} ({self.format}, {self.rows})"

    # -- tasks -------------------------------------------------------------------------------

    def open_writer(self, ctx: WriterContext) -> SinkWriter[DataChangeRecord, TaskRows]:
        return _Writer(self.rows, self.partition_by, self.spool_size)

    # -- driver ------------------------------------------------------------------------------

    def setup(self, ctx: SinkContext) -> None:
        url = self.url
        if "://" not in url:
            url = os.path.abspath(os.path.join(ctx.base_dir, os.path.expanduser(url)))
        try:
            self._fs, self._root = fsspec.core.url_to_fs(url, **self.storage_options)
            self._fs.makedirs(self._root, exist_ok=True)
        except (OSError, ValueError, ImportError) as exc:
            msg = f"WriteTables cannot open {self.url}: {exc}; check the URL and credentials"
            raise SinkError(msg) from exc
        self._root = self._root.rstrip("/")
        self._stage_dir = tempfile.mkdtemp(prefix="cdcflow-tables-", dir=self.local_dir)

    def _storage(self) -> Any:
        if self._fs is None:
            msg = "WriteTables was not set up: the engine must call setup() before commits"
            raise SinkError(msg)
        return self._fs

    def _path(self, *parts: str) -> str:
        return "/".join([self._root, *[p for p in parts if p]])

    def output_location(self) -> str:
        protocol = self._storage().protocol
        return f"{protocol if isinstance(protocol, str) else protocol[0]}://{self._root}/"

    def _read(self, path: str) -> bytes | None:
        try:
            data: bytes = self._storage().cat_file(path)
            return data
        except FileNotFoundError:
            return None
        except OSError as exc:
            msg = f"WriteTables cannot read {path}: {exc}"
            raise SinkIOError(msg) from exc

    def _put(self, path: str, data: bytes | None = None, local: str | None = None) -> None:
        """One atomic write of ``path``: a PUT on object stores; a temporary name and a
        rename on local disk (where a reader could see a half-written file)."""
        fs = self._storage()
        try:
            target = path
            if "file" in fs.protocol:
                target = path.rsplit("/", 1)[0] + "/." + path.rsplit("/", 1)[1] + ".tmp"
            fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            if local is not None:
                fs.put_file(local, target)
            else:
                fs.pipe_file(target, data)
            if target != path:
                fs.mv(target, path)
        except OSError as exc:
            msg = f"WriteTables cannot write {path}: {exc}; the batch will be retried"
            raise SinkIOError(msg) from exc

    def durable_batch(self) -> int:
        if self._durable is None:
            if self._fs is None:
                return 0  # asked before setup(): whether this sink stages, not where it is
            data = self._read(self._path("_cdcflow", "durable.json"))
            self._durable = int(orjson.loads(data)["durable_batch"]) if data else 0
            self._staged_through = max(self._staged_through, self._durable)
        if not self._open:
            return max(self._durable, self._staged_through)
        return min(o.first for o in self._open.values()) - 1

    def last_committed_batch(self) -> int:
        fs = self._storage()
        try:
            names = fs.find(self._root) if fs.exists(self._root) else []
        except OSError as exc:
            msg = f"WriteTables cannot list {self._root}: {exc}"
            raise SinkIOError(msg) from exc
        lasts = [int(m.group(2)) for n in names if (m := _PART.search(n))]
        return max([self.durable_batch(), *lasts])

    def _key_flushed(self, key: tuple[str, str]) -> int:
        if key not in self._flushed:
            pattern = self._path(key[0], key[1], "part-*")
            try:
                names = self._storage().glob(pattern)
            except OSError as exc:
                msg = f"WriteTables cannot list {pattern}: {exc}"
                raise SinkIOError(msg) from exc
            self._flushed[key] = max(
                (int(m.group(2)) for n in names if (m := _PART.search(n))), default=0)
        return self._flushed[key]

    def _schema(self, table: str) -> Schema | None:
        if table not in self._schemas:
            try:
                names = self._storage().glob(self._path(table, "_schema", "v*.json"))
            except OSError as exc:
                msg = f"WriteTables cannot list {table}'s schemas: {exc}"
                raise SinkIOError(msg) from exc
            versions = sorted(int(m.group(1)) for n in names
                              if (m := re.search(r"v(\d+)\.json$", n)))
            if not versions:
                return None
            data = self._read(self._path(table, "_schema", f"v{versions[-1]}.json"))
            try:
                self._schemas[table] = Schema.parse(data or b"")
            except (KeyError, TypeError, ValueError) as exc:
                msg = (f"WriteTables: {table}/_schema/v{versions[-1]}.json is not a schema "
                       f"this sink wrote ({exc}); restore it or write to another URL")
                raise SinkError(msg) from exc
        return self._schemas[table]

    def commit(self, batch_id: int, messages: Sequence[TaskRows]) -> None:
        """Stage ``batch_id`` (skipped at or below the durable batch, and per key at or below
        the key's last file); cut the files that are due."""
        if batch_id <= self.durable_batch() or batch_id <= self._staged_through:
            return
        self._checkpoint("stage", batch_id)
        by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
        columns: dict[str, dict[str, Column]] = {}
        for message in messages:
            for g in message.load():
                by_key.setdefault((g.table, g.directory), []).extend(g.rows)
                cols = columns.setdefault(g.table, {})
                for c in g.columns:
                    cols[c.name] = c
            if message.spool is not None:
                with contextlib.suppress(OSError):
                    os.remove(message.spool)
        for table, cols in columns.items():
            self._evolve(table, tuple(cols.values()), batch_id)
        for key, rows in by_key.items():
            if batch_id <= self._key_flushed(key):
                continue  # this key's file holding the batch exists: a replay
            self._stage(key, rows, batch_id)
        self._staged_through = batch_id
        due = [k for k, o in self._open.items() if o.size() >= self.file_size
               or time.monotonic() - o.opened >= self.flush_interval]
        self._cut(due, batch_id)

    def _evolve(self, table: str, columns: tuple[Column, ...], batch_id: int) -> None:
        current = self._schema(table)
        if current is not None and current.fits(columns):
            return
        new = (Schema(table, 1, columns) if current is None else current.evolve(columns))
        self._cut([k for k in self._open if k[0] == table], batch_id)
        self._put(self._path(table, "_schema", f"v{new.version}.json"), new.to_json(self.rows))
        self._schemas[table] = new

    def _stage(self, key: tuple[str, str], rows: list[dict[str, Any]], batch_id: int) -> None:
        file = self._open.get(key)
        if file is None:
            schema = self._schemas[key[0]]
            assert self._stage_dir is not None
            local = os.path.join(self._stage_dir, f"{len(os.listdir(self._stage_dir))}.part")
            file = _Open(local, schema, schema.arrow(self.rows), self.format, self.rows,
                         batch_id, max(1 << 20, min(self.file_size // 4, 32 << 20)))
            self._open[key] = file
        file.append(rows, batch_id)

    def _cut(self, keys: Sequence[tuple[str, str]], batch_id: int) -> None:
        """Write out the open files of ``keys``, then record the durable batch."""
        if not keys:
            return
        for key in keys:
            file = self._open[key]
            local = file.finish()
            name = f"part-{file.first}-{file.last}-{file.schema.version}.{self.format}"
            self._put(self._path(key[0], key[1], name), local=local)
            os.remove(local)
            self._flushed[key] = file.last
            del self._open[key]
        self._checkpoint("uploaded", batch_id)
        durable = self.durable_batch()
        doc = {"durable_batch": durable, "at": str(Timestamp.now())}
        self._put(self._path("_cdcflow", "durable.json"), orjson.dumps(doc))
        self._durable = durable
        self._checkpoint("marked", batch_id)

    def flush(self) -> None:
        """Write every open file (the run ends gracefully)."""
        self._cut(list(self._open), self._staged_through)

    def abort(self, batch_id: int, messages: Sequence[TaskRows]) -> None:
        for message in messages:
            if message.spool is not None:
                with contextlib.suppress(OSError):
                    os.remove(message.spool)

    def close(self) -> None:
        for file in self._open.values():
            if file.parquet is not None:
                file.parquet.close()
        if self._stage_dir is not None:
            shutil.rmtree(self._stage_dir, ignore_errors=True)

    def _checkpoint(self, step: str, batch_id: int) -> None:
        """Called at each step of a commit ("stage", "uploaded", "marked"): a seam for crash
        tests; does nothing."""
        return None
