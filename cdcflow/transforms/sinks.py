"""Built-in sinks: Collect (tests), Print, and WriteFiles (exactly-once JSONL or Parquet files).

Every sink here commits idempotently per batch id, so a replayed batch does not repeat
output: together with the engine's deterministic replay they give exactly-once results.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO, Any, Generic, Literal, TypeVar

import attrs
import orjson

from cdcflow.errors import PipelineDefinitionError, SinkError
from cdcflow.model import Timestamp
from cdcflow.serialize import dumps_line, to_json_dict, to_json_value
from cdcflow.transforms.base import Sink, SinkContext, SinkWriter, WriterContext

__all__ = ["Collect", "Print", "WriteFiles", "WrittenFile"]

E = TypeVar("E")
V = TypeVar("V")


class _BufferWriter(Generic[E, V]):
    """Keeps a task's elements, each converted to ``V``, in memory; ``close`` returns them."""

    def __init__(self, convert: Callable[[E], V]) -> None:
        self._items: list[V] = []
        self._convert = convert

    def write(self, element: E) -> None:
        self._items.append(self._convert(element))

    def close(self) -> list[V]:
        items, self._items = self._items, []
        return items

    def abort(self) -> None:
        self._items = []


class _OncePerBatch:
    """Batch ids already committed in this process, for idempotent driver-side commits."""

    def __init__(self) -> None:
        self._done: set[int] = set()
        self._lock = threading.Lock()

    def claim(self, batch_id: int) -> bool:
        """True the first time ``batch_id`` is seen."""
        with self._lock:
            if batch_id in self._done:
                return False
            self._done.add(batch_id)
            return True


def _same(element: E) -> E:
    return element


class Collect(Sink[E, list[E]]):
    """Gathers every committed element into ``self.items`` on the driver (for tests).

    Writers buffer the elements of their task; ``commit`` appends them to :attr:`items` in
    the order of the batch's messages, once per batch id (a replayed batch is ignored). The
    items are visible on the driver after each batch commit. Only the driver's instance
    holds them: pickled copies (in tasks) start empty.
    """

    def __init__(self) -> None:
        self.items: list[E] = []
        self._batches = _OncePerBatch()

    def __getstate__(self) -> dict[str, Any]:
        # tasks only need the writer factory; the driver's items stay on the driver
        state = self.__dict__.copy()
        state["items"] = []
        state["_batches"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._batches = _OncePerBatch()

    def open_writer(self, ctx: WriterContext) -> SinkWriter[E, list[E]]:
        return _BufferWriter(_same)

    def commit(self, batch_id: int, messages: Sequence[list[E]]) -> None:
        if not self._batches.claim(batch_id):
            return
        for message in messages:
            self.items.extend(message)


def _json_text(element: Any) -> str:
    return orjson.dumps(to_json_value(element)).decode()


class Print(Sink[Any, list[str]]):
    """Prints committed elements on the driver: once, in order, only for committed batches.

    ``format="json"`` prints one JSON document per element (see :mod:`cdcflow.serialize`);
    ``format="repr"`` prints ``repr(element)``. Writers buffer the lines of their task.
    """

    def __init__(self, format: Literal["json", "repr"] = "json") -> None:
        if format not in ("json", "repr"):
            msg = f"Print(format={format!r}): use 'json' or 'repr'"
            raise PipelineDefinitionError(msg)
        self.format = format
        self._batches = _OncePerBatch()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_batches"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._batches = _OncePerBatch()

    def describe_params(self) -> str:
        return f"format={self.format}"

    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, list[str]]:
        return _BufferWriter(_json_text if self.format == "json" else repr)

    def commit(self, batch_id: int, messages: Sequence[list[str]]) -> None:
        if not self._batches.claim(batch_id):
            return
        out: IO[str] = sys.stdout  # looked up now, so redirected output is honoured
        for message in messages:
            for line in message:
                print(line, file=out)
        out.flush()


@attrs.frozen
class WrittenFile:
    """The commit message of a WriteFiles writer: one file written under a temporary name."""

    temp: str
    final: str
    count: int


_FORMATS = ("jsonl", "parquet")


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class WriteFiles(Sink[Any, WrittenFile]):
    """Writes each batch to files under ``path``, exactly once per batch.

    Every task writes one file per (batch id, partition token), named
    ``<prefix>-<batch id, 10 digits>-<sha1 of the token, 16 hex>.<format>``. The file is
    first written under a hidden temporary name unique to the task attempt and renamed on
    the driver when the batch commits, so a replayed batch rewrites the same files with the
    same content and readers never see partial files (names starting with ``.`` or ``_``
    are ignored by Spark, pyarrow and pandas dataset readers). Tasks that wrote nothing
    produce no file.

    After each commit ``_watermark.json`` holds the pipeline's low watermark
    (``{"low_watermark": RFC 3339, "ns": int}``): every record with a commit timestamp below
    it is in the committed files.

    ``format="jsonl"``: one JSON object per line; elements are records, attrs or dataclass
    instances, or dicts (see :mod:`cdcflow.serialize`). ``format="parquet"``: elements become
    rows the same way; nested values (dicts, lists, mods) are stored as JSON text and
    timestamps as RFC 3339 text; a column must keep one type within a file. A parquet
    writer keeps its task's rows in memory until the task ends.

    A relative ``path`` resolves against the pipeline file's directory. On a cluster,
    ``path`` must be on a filesystem shared by the driver and every executor.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        format: Literal["jsonl", "parquet"] = "jsonl",
        prefix: str = "part",
        fsync: bool = True,
    ) -> None:
        path = os.fspath(path)
        if not path:
            msg = "WriteFiles needs a directory path, e.g. WriteFiles('out/orders')"
            raise PipelineDefinitionError(msg)
        if format not in _FORMATS:
            msg = f"WriteFiles(format={format!r}): use one of {', '.join(_FORMATS)}"
            raise PipelineDefinitionError(msg)
        if not prefix or prefix.startswith((".", "_")) or os.sep in prefix or "/" in prefix:
            msg = (
                f"WriteFiles(prefix={prefix!r}): use a plain file name prefix such as 'part' "
                "(no path separators, not starting with '.' or '_')"
            )
            raise PipelineDefinitionError(msg)
        self.path = path
        self.format = format
        self.prefix = prefix
        self.fsync = fsync
        expanded = os.path.expanduser(path)
        # absolute paths need no setup; relative ones are resolved by setup() on the driver
        self.directory: str | None = os.path.abspath(expanded) if os.path.isabs(expanded) else None
        self._last_watermark: int | None = None

    def describe_params(self) -> str:
        return f"{self.path} ({self.format})"

    def setup(self, ctx: SinkContext) -> None:
        expanded = os.path.expanduser(self.path)
        self.directory = os.path.abspath(os.path.join(ctx.base_dir, expanded))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            msg = f"WriteFiles cannot create {self.directory}: {exc}; choose a writable path"
            raise SinkError(msg) from exc

    def _dir(self) -> str:
        if self.directory is None:
            msg = (
                f"WriteFiles({self.path!r}) was not set up: the runner must call setup() "
                "before tasks run (or pass an absolute path)"
            )
            raise SinkError(msg)
        return self.directory

    def final_name(self, batch_id: int, partition_token: str) -> str:
        """The committed file name for a batch and partition (stable across replays)."""
        return f"{self.prefix}-{batch_id:010d}-{_digest(partition_token)}.{self.format}"

    def _temp_pattern(self, batch_id: int) -> str:
        name = f".{self.prefix}-{batch_id:010d}-"
        return os.path.join(glob.escape(self._dir()), glob.escape(name) + "*.tmp")

    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, WrittenFile]:
        directory = self._dir()
        final = self.final_name(ctx.batch_id, ctx.partition_token)
        stem = final.rsplit(".", 1)[0]
        temp = os.path.join(directory, f".{stem}-{_digest(ctx.attempt)}.tmp")
        final_path = os.path.join(directory, final)
        if self.format == "parquet":
            return _ParquetWriter(temp, final_path, self.fsync)
        return _JsonlWriter(temp, final_path, self.fsync)

    def commit(self, batch_id: int, messages: Sequence[WrittenFile]) -> None:
        """Rename every temporary file to its final name; idempotent for ``batch_id``.

        A message whose temporary file is gone while the final file exists was committed
        before. Leftover temporary files of the batch (failed attempts) are deleted.
        """
        directory = self._dir()
        for message in messages:
            try:
                os.replace(message.temp, message.final)
            except FileNotFoundError:
                if not os.path.exists(message.final):
                    msg = (
                        f"batch {batch_id}: neither {message.temp} nor {message.final} exists; "
                        "the path must be shared by the driver and every executor (the batch "
                        "will be replayed)"
                    )
                    raise SinkError(msg) from None
        for stray in glob.glob(self._temp_pattern(batch_id)):
            with contextlib.suppress(FileNotFoundError):
                os.remove(stray)
        if self.fsync:
            _fsync_dir(directory)

    def abort(self, batch_id: int, messages: Sequence[WrittenFile]) -> None:
        """Delete the batch's temporary files; committed files are left alone."""
        temps = {m.temp for m in messages}
        temps.update(glob.glob(self._temp_pattern(batch_id)))
        for temp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)

    def on_watermark(self, watermark_ns: int) -> None:
        """Atomically write ``_watermark.json``; a smaller value than the last is ignored."""
        if self._last_watermark is not None and watermark_ns <= self._last_watermark:
            return
        directory = self._dir()
        body = orjson.dumps(
            {"low_watermark": Timestamp.from_ns(watermark_ns).rfc3339(), "ns": watermark_ns}
        )
        target = os.path.join(directory, "_watermark.json")
        temp = os.path.join(directory, f"._watermark.json.{os.getpid()}.tmp")
        _write_file(temp, body, self.fsync)
        os.replace(temp, target)
        self._last_watermark = watermark_ns


def _write_file(path: str, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


class _JsonlWriter:
    """Streams JSONL lines into the temporary file, opened on the first element."""

    def __init__(self, temp: str, final: str, fsync: bool) -> None:
        self._temp = temp
        self._final = final
        self._fsync = fsync
        self._file: IO[bytes] | None = None
        self._count = 0

    def write(self, element: Any) -> None:
        line = dumps_line(element)
        if self._file is None:
            os.makedirs(os.path.dirname(self._temp), exist_ok=True)
            self._file = open(self._temp, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._file.write(line)
        self._count += 1

    def close(self) -> WrittenFile | None:
        if self._file is None:
            return None
        f, self._file = self._file, None
        try:
            if self._fsync:
                f.flush()
                os.fsync(f.fileno())
        finally:
            f.close()
        return WrittenFile(self._temp, self._final, self._count)

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._temp)


def _parquet_row(element: Any) -> dict[str, Any]:
    row = to_json_dict(element)
    for key, value in row.items():
        if isinstance(value, dict | list):
            row[key] = orjson.dumps(value).decode()
    return row


class _ParquetWriter:
    """Collects rows and writes one Parquet file at close (one schema per file)."""

    def __init__(self, temp: str, final: str, fsync: bool) -> None:
        self._temp = temp
        self._final = final
        self._fsync = fsync
        self._rows: list[dict[str, Any]] = []

    def write(self, element: Any) -> None:
        self._rows.append(_parquet_row(element))

    def close(self) -> WrittenFile | None:
        if not self._rows:
            return None
        import pyarrow as pa  # only parquet output needs pyarrow
        import pyarrow.parquet as pq

        rows, self._rows = self._rows, []
        # column-wise, so every row's keys count (from_pylist infers from the first row)
        names = list(dict.fromkeys(key for row in rows for key in row))
        try:
            table = pa.table({name: [row.get(name) for row in rows] for name in names})
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            msg = (
                f"cannot build a Parquet table: {exc}; give every column one type in all "
                "rows (convert it in a Map), or write format='jsonl'"
            )
            raise SinkError(msg) from exc
        os.makedirs(os.path.dirname(self._temp), exist_ok=True)
        pq.write_table(table, self._temp)
        if self._fsync:
            fd = os.open(self._temp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return WrittenFile(self._temp, self._final, len(rows))

    def abort(self) -> None:
        self._rows = []
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._temp)
