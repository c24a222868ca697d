"""The writers of WriteFiles (JSONL, Parquet) and the storage helpers its commit shares.

Two kinds of failure leave a writer differently:

- The element's fault (it cannot be serialized, or a Parquet column would get a second
  type): ``write`` raises :class:`~cdcflow.errors.SinkError` before it changes anything, so
  the pipeline's error policy can retry the element or skip it to the dead-letter sink,
  and the writer goes on with the next element.
- The storage's fault (an ``OSError``: disk full, permission denied, an I/O error): the
  writer raises :class:`~cdcflow.errors.SinkIOError` and is broken from then on: every
  further ``write`` and ``close`` raises it again, so the task fails and the engine
  retries the whole batch. A half-written line can never be committed, whatever the
  caller does with the first error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from typing import IO, Any, NoReturn

import attrs

from cdcflow.errors import SinkError, SinkIOError
from cdcflow.processes import process_alive
from cdcflow.serialize import dumps_line, json_dumps, to_json_dict
from cdcflow.transforms.base import WriterContext

__all__ = [
    "JsonlWriter",
    "ParquetWriter",
    "WrittenFile",
    "fsync_dir",
    "parquet_row",
    "quiet_cut_requests",
    "storage",
    "write_atomic",
]


@attrs.frozen
class WrittenFile:
    """The commit message of a WriteFiles writer: one file written under a temporary name,
    ``count`` elements from the slice [``slice_start``, ``slice_end``) of partition
    ``partition_token`` (the slice is what the batch's manifest records)."""

    temp: str
    final: str
    count: int
    partition_token: str
    slice_start: int
    slice_end: int


def _io_message(action: str, path: str, exc: OSError) -> str:
    reason = f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else str(exc)
    return (
        f"cannot {action} {path}: {reason}; free space, fix permissions or the mount of "
        "that filesystem"
    )


@contextlib.contextmanager
def storage(action: str, path: str) -> Iterator[None]:
    """Raise an ``OSError`` of the block as SinkIOError (``cannot <action> <path>: ...``)."""
    try:
        yield
    except OSError as exc:
        raise SinkIOError(_io_message(action, path, exc)) from exc


def fsync_dir(directory: str) -> None:
    """Make renames in ``directory`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not every filesystem lets a directory be opened
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (22, 95):  # EINVAL, EOPNOTSUPP: the filesystem does not do it
            raise
    finally:
        os.close(fd)


def _write_file(path: str, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def write_atomic(path: str, temp: str, data: bytes, fsync: bool) -> None:
    """Write ``data`` to ``temp`` and rename it to ``path``: readers see the old or the new
    bytes, never a part. Raises SinkIOError on a storage failure (``temp`` is removed)."""
    with storage("write", path):
        try:
            _write_file(temp, data, fsync)
            os.replace(temp, path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(temp)
            raise
        if fsync:
            fsync_dir(os.path.dirname(path))


def create_exclusive(path: str, temp: str, data: bytes, fsync: bool = False) -> bool:
    """Write ``data`` to ``path`` only if no file is there: a hard link of the complete
    ``temp`` (atomic: a reader never sees a part), or an exclusive open where the
    filesystem has no hard links. False if ``path`` existed (nothing written); other
    failures raise SinkIOError."""
    directory = os.path.dirname(path)
    created = True
    with storage("create", path):
        os.makedirs(directory, exist_ok=True)
        try:
            _write_file(temp, data, fsync)
            try:
                os.link(temp, path)  # atomic, and refuses an existing name
            except FileExistsError:
                created = False
            except OSError:  # a filesystem without hard links
                try:
                    with open(path, "xb") as f:
                        f.write(data)
                except FileExistsError:
                    created = False
        finally:
            with contextlib.suppress(OSError):
                os.remove(temp)
        if fsync and created:
            fsync_dir(directory)
    return created


def quiet_cut_requests(fs: Any) -> None:
    """Log at DEBUG, not as tracebacks, what the HTTP client of an asynchronous filesystem
    (fsspec's s3fs, gcsfs, ...) leaves behind when the storage cuts its connections: an
    outage then printed "Task exception was never retrieved" with a traceback for each
    request it cut (``ClientConnectionResetError``), where the sink's own warning names the
    failure and the retries. Any other asyncio error goes to the handler the loop had (its
    default one, unless its owner set another). Once per event loop (fsspec runs one per
    process)."""
    loop = getattr(fs, "loop", None) if getattr(fs, "async_impl", False) else None
    if loop is None:
        return
    previous = loop.get_exception_handler()
    if getattr(previous, "_cdcflow", False):
        return

    def handler(loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message", "").startswith("Task exception was never retrieved") and (
                isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in _HTTP):
            _log.debug("%s: %r", context["message"], exc)
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler._cdcflow = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)


#: The HTTP and storage clients whose cut requests quiet_cut_requests logs at DEBUG.
_HTTP = frozenset({"aiohttp", "aiobotocore", "botocore", "gcsfs", "s3fs", "adlfs"})
_log = logging.getLogger("cdcflow.sinks")


_BUFFER = 256 << 10


class _FileWriter:
    """What both writers share: the target, the commit message, the broken state."""

    def __init__(self, temp: str, final: str, ctx: WriterContext, fsync: bool) -> None:
        self._temp = temp
        self._final = final
        self._slice = (ctx.partition_token, ctx.slice_start, ctx.slice_end)
        self._fsync = fsync
        self._broken: str | None = None

    def _usable(self) -> None:
        if self._broken is not None:
            raise SinkIOError(self._broken)

    @contextlib.contextmanager
    def _storage(self, action: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            self._break(action, exc)

    def _break(self, action: str, exc: OSError) -> NoReturn:
        self._broken = _io_message(action, self._temp, exc)
        raise SinkIOError(self._broken) from exc

    def _create(self) -> IO[bytes]:
        os.makedirs(os.path.dirname(self._temp), exist_ok=True)
        # a write call per 256 KiB of lines, not per 8 KiB (the default buffer)
        return open(self._temp, "wb", buffering=_BUFFER)

    def _message(self, count: int) -> WrittenFile:
        token, start, end = self._slice
        return WrittenFile(self._temp, self._final, count, token, start, end)

    def _remove_temp(self) -> None:
        with contextlib.suppress(OSError):  # abort is best effort; commit/abort sweep later
            os.remove(self._temp)


class JsonlWriter(_FileWriter):
    """Streams JSONL lines into the temporary file, opened on the first element."""

    def __init__(self, temp: str, final: str, ctx: WriterContext, fsync: bool) -> None:
        super().__init__(temp, final, ctx, fsync)
        self._file: IO[bytes] | None = None
        self._count = 0

    def write(self, element: Any) -> None:
        if self._broken is not None:
            raise SinkIOError(self._broken)
        line = dumps_line(element)  # the element's fault raises here, before any byte
        try:  # what _storage does, inline: this runs for every element
            file = self._file
            if file is None:
                file = self._file = self._create()
            file.write(line)
        except OSError as exc:
            self._break("write", exc)
        self._count += 1

    def close(self) -> WrittenFile | None:
        self._usable()
        if self._file is None:
            return None
        f, self._file = self._file, None
        with self._storage("write"):
            try:
                f.flush()
                if self._fsync:
                    os.fsync(f.fileno())
            finally:
                f.close()
        return self._message(self._count)

    def abort(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        self._remove_temp()


def parquet_row(element: Any) -> dict[str, Any]:
    """An element as a Parquet row: JSON values, nested values (dicts, lists) as JSON text."""
    row = to_json_dict(element)
    for key, value in row.items():
        if isinstance(value, dict | list):
            row[key] = json_dumps(value).decode()
    return row


_INT64_MIN, _INT64_END = -(2**63), 2**63
_EXACT_IN_DOUBLE = 2**53  # larger integers do not survive a float64 column (Arrow refuses)


def _kind(name: str, value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int
        return "bool"
    if isinstance(value, int):
        if not _INT64_MIN <= value < _INT64_END:
            msg = (
                f"column {name!r}: {value} does not fit a 64-bit integer; convert it to text "
                "in a Map, or write format='jsonl'"
            )
            raise SinkError(msg)
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    msg = f"column {name!r}: cannot store a {type(value).__name__} in Parquet; map it to text"
    raise SinkError(msg)


_NAMES = {"bool": "boolean", "int": "int64", "float": "double", "str": "string"}


#: Text columns whose values average more characters are not dictionary encoded.
_DICTIONARY_TEXT = 256


class _Columns:
    """A file's rows, column-wise, with one type per column that every row must keep.

    ``add`` checks the row against the types of the rows before it (a few isinstance
    checks per value, no Arrow call) and changes nothing when it raises. Integers and
    floats mix into a double column, as Arrow does, unless an integer is too large for a
    double to hold exactly. A column whose values are all null is typed string when the
    file is written: most values are text here (timestamps, nested values), and a
    null-typed column makes a dataset of this file and a typed one unreadable.

    Rows are held in chunks: :meth:`take` hands over the rows so far as an Arrow record
    batch (a column with no value yet is null-typed there) and keeps the types, so the
    next rows are checked against every row of the file; :meth:`schema` is the file's
    schema, to which :func:`conform` casts every chunk.
    """

    def __init__(self) -> None:
        self.rows = 0  # rows held now (since the last take)
        self.bytes = 0  # their payload: text by its length, other values _VALUE_BYTES each
        # per text column, over the whole file: (values, characters)
        self._text: dict[str, list[int]] = {}
        self._values: dict[str, list[Any]] = {}  # every column of the file, first-seen order
        self._kinds: dict[str, str] = {}
        self._big: set[str] = set()  # int columns holding a value beyond 2**53

    def add(self, row: dict[str, Any]) -> None:
        kinds: dict[str, str] = {}
        big: list[str] = []
        size = _VALUE_BYTES * len(row)
        texts: list[tuple[str, int]] = []
        for name, value in row.items():
            if value is None:
                continue
            kind = _kind(name, value)
            if kind == "str":
                size += len(value)
                texts.append((name, len(value)))
            have = self._kinds.get(name)
            merged = kind if have is None or have == kind else None
            if {have, kind} == {"int", "float"}:
                merged = "float"
            if merged is None:
                assert have is not None
                msg = (
                    f"column {name!r} holds {_NAMES[have]} values in this file, this element "
                    f"has {_NAMES[kind]} {value!r:.40}: give every column one type (convert "
                    "it in a Map), or write format='jsonl'"
                )
                raise SinkError(msg)
            is_big = kind == "int" and abs(value) > _EXACT_IN_DOUBLE
            if merged == "float" and (is_big or name in self._big):
                msg = (
                    f"column {name!r} mixes floats with integers beyond 2**53, which a double "
                    "cannot hold exactly: give the column one type in a Map, or write "
                    "format='jsonl'"
                )
                raise SinkError(msg)
            if merged != have:
                kinds[name] = merged
            if is_big:
                big.append(name)
        # Checked: only now does the row change anything.
        self._kinds.update(kinds)
        self._big.update(big)
        for name, length in texts:
            seen = self._text.setdefault(name, [0, 0])
            seen[0] += 1
            seen[1] += length
        for name, values in self._values.items():
            values.append(row.get(name))
        for name, value in row.items():
            if name not in self._values:
                self._values[name] = [None] * self.rows + [value]
        self.rows += 1
        self.bytes += size

    def take(self) -> Any:
        """The rows held as a pyarrow RecordBatch (typed as far as the file's rows tell,
        null-typed where no row had a value yet); forgets them, keeps the columns."""
        import pyarrow as pa  # only parquet output needs pyarrow

        try:
            batch = pa.record_batch({
                name: pa.array(values, type=_arrow_type(self._kinds.get(name, "null")))
                for name, values in self._values.items()
            })
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            # add() admits only what these conversions accept; this is a bug, said so
            msg = (
                f"cannot build a Parquet table: {exc}; give every column one type in all "
                "rows (convert it in a Map), or write format='jsonl'"
            )
            raise SinkError(msg) from exc
        self._values = {name: [] for name in self._values}
        self.rows = 0
        self.bytes = 0
        return batch

    def short_text(self, longest: int = _DICTIONARY_TEXT) -> list[str]:
        """The columns worth dictionary encoding: all but the text columns whose values
        average more than ``longest`` characters (few repeat, and the encoder would hold
        several copies of a row group trying)."""
        return [name for name in self._values
                if name not in self._text or self._text[name][1] <= longest * self._text[name][0]]

    def schema(self) -> Any:
        """The file's schema: every column in first-seen order, its one type (string for a
        column that never held a value)."""
        import pyarrow as pa

        return pa.schema([(name, _arrow_type(self._kinds.get(name, "str")))
                          for name in self._values])


def _arrow_type(kind: str) -> Any:
    import pyarrow as pa

    factories = {"bool": pa.bool_, "int": pa.int64, "float": pa.float64, "str": pa.string,
                 "null": pa.null}
    return factories[kind]()


def conform(batch: Any, schema: Any) -> Any:
    """``batch`` with every column of ``schema``, in its order and types: a column the batch
    lacks (it first appeared later) is all null; a null-typed column or an int column of a
    file whose column became float is cast (both exact, as add() checked)."""
    import pyarrow as pa

    columns = []
    for field in schema:
        index = batch.schema.get_field_index(field.name)
        if index < 0:
            columns.append(pa.nulls(batch.num_rows, type=field.type))
        else:
            column = batch.column(index)
            columns.append(column if column.type == field.type else column.cast(field.type))
    return pa.record_batch(columns, schema=schema)


#: What a Parquet writer holds in memory, in rows and in payload bytes (text by its
#: length): a chunk that reaches either goes to a spill file on disk.
SPILL_ROWS = 50_000
SPILL_BYTES = 2 << 20
#: What the Parquet writers of one process hold together, in payload bytes: each open
#: writer's chunk spills at its share (at most SPILL_BYTES, at least SPILL_BYTES_LEAST).
#: Arrow's builders take several times the payload, so with a fixed 2 MiB per writer
#: the memory grew with the tasks of a process: 8 tasks at a 32 MiB quota peaked 197 MB
#: over the quota against 163 MB at 4 tasks (1 GB backlog of 64 KiB rows); at a 1 MiB
#: share, 8 tasks peaked at 163 MB too.
SPILL_BYTES_PROCESS = 8 << 20
SPILL_BYTES_LEAST = 256 << 10
#: The open Parquet writers of this process (one dropped unclosed leaves with the garbage
#: collector).
_open_writers: weakref.WeakSet[ParquetWriter] = weakref.WeakSet()
_open_lock = threading.Lock()


def _spill_share() -> int:
    """The payload bytes an open Parquet writer of this process may hold now."""
    share = SPILL_BYTES_PROCESS // max(1, len(_open_writers))
    return max(SPILL_BYTES_LEAST, min(SPILL_BYTES, share))
#: What a value (and its column's slot) costs besides its text, in _Columns.bytes.
_VALUE_BYTES = 16


class ParquetWriter(_FileWriter):
    """Checks each row's column types at ``write``; writes one Parquet file at ``close``.

    A Parquet file has one schema, and a column may first appear (or first hold a value)
    in a later row, so the file is written when the task ends. Until then at most
    :data:`SPILL_ROWS` rows and :data:`SPILL_BYTES` of their payload stay in memory (less
    when more writers are open in the process: :data:`SPILL_BYTES_PROCESS`; the sink's
    memory does not grow with the batch): each full chunk is written to a spill file
    beside the temporary file (Arrow IPC, named ``<temp>.<n>.spill``); ``close`` writes
    the chunks, conformed to the file's schema, as the file's row groups and removes the
    spill files (``abort`` too; a crash leaves them to the batch's commit or abort, which
    sweeps every attempt's leftovers).
    """

    def __init__(self, temp: str, final: str, ctx: WriterContext, fsync: bool) -> None:
        super().__init__(temp, final, ctx, fsync)
        self._columns = _Columns()
        self._spills: list[str] = []
        self._count = 0
        self._spill_rows = SPILL_ROWS
        with _open_lock:
            _open_writers.add(self)

    def write(self, element: Any) -> None:
        self._usable()
        self._columns.add(parquet_row(element))
        self._count += 1
        if self._columns.rows >= self._spill_rows or self._columns.bytes >= _spill_share():
            self._spill()

    def _closed(self) -> None:
        with _open_lock:
            _open_writers.discard(self)

    def _spill(self) -> None:
        import pyarrow as pa

        batch = self._columns.take()
        path = f"{self._temp}.{len(self._spills)}.spill"
        with self._storage("spill to"):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with pa.OSFile(path, "wb") as f, pa.ipc.new_stream(f, batch.schema) as out:
                out.write_batch(batch)
        self._spills.append(path)

    def _chunks(self) -> Iterator[Any]:
        import pyarrow as pa

        for path in self._spills:
            with pa.memory_map(path) as source:
                yield from pa.ipc.open_stream(source)
        if self._columns.rows:
            yield self._columns.take()

    def close(self) -> WrittenFile | None:
        self._usable()
        self._closed()
        if self._count == 0:
            return None
        import pyarrow.parquet as pq

        schema = self._columns.schema()
        with self._storage("write"), self._create() as f:
            with pq.ParquetWriter(f, schema,
                                  use_dictionary=self._columns.short_text()) as out:
                for batch in self._chunks():
                    out.write_batch(conform(batch, schema))
            f.flush()
            if self._fsync:
                os.fsync(f.fileno())
        self._drop_spills()
        self._columns = _Columns()
        return self._message(self._count)

    def _drop_spills(self) -> None:
        for path in self._spills:
            with contextlib.suppress(OSError):  # best effort; commit/abort sweep later
                os.remove(path)
        self._spills = []

    def abort(self) -> None:
        self._closed()
        self._columns = _Columns()
        self._drop_spills()
        self._remove_temp()


#: Local files of WriteTables: ``<PREFIX><pid>-...``, so a run can remove what a run that
#: died left behind (spilled rows, task spool files), which nothing will read again.
PREFIX = "cdcflow-tables-"


def local_prefix(pid: int | None = None, prefix: str = PREFIX) -> str:
    """The start of a local file's name: ``<prefix><pid>-``, ``pid`` the driver's process
    (this one by default) that reads or removes the file, so :func:`sweep` knows whose it
    is; a task in a Spark worker names its spool files after the driver, not itself."""
    return f"{prefix}{os.getpid() if pid is None else pid}-"


def sweep(directory: str | None, prefix: str = PREFIX) -> int:
    """Remove what dead processes of this host left in ``directory`` (the temporary
    directory when None) under names ``<prefix><pid>-...``: spill directories, and task
    spool files (``.spool``), both named after the driver that would read them (see
    :func:`local_prefix`). Returns how many entries it removed."""
    directory = directory or tempfile.gettempdir()
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for entry in entries:
        m = re.match(rf"{re.escape(prefix)}(\d+)-", entry.name)
        if m is None or process_alive(int(m.group(1))):
            continue
        try:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            elif entry.name.endswith(".spool"):
                os.remove(entry.path)
            else:
                continue
        except OSError:
            continue
        removed += 1
    return removed
