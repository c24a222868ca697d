"""The spool of WriteTables: open files (staged rows of a key) and cut files waiting for
their upload, held in memory up to a high watermark and spilled to a local directory past
it, and the uploader thread that writes cut files to storage in the order they were cut.

Accounting (bytes): ``memory`` is the Arrow/JSON bytes of open files' unspilled rows plus
the encoded bytes of cut files held in memory; ``disk`` is what the spill directory holds.
:class:`Uploader` keeps both, under one lock with the queue, so the driver thread and the
upload thread see one picture.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from cdcflow.errors import SinkError, SinkIOError
from cdcflow.transforms._tablebuild import rfc3339
from cdcflow.transforms._tablerows import Schema

__all__ = ["storage_errors"]

Key = tuple[str, str]  # (table, date partition directory)

_STORAGE_ERRORS: tuple[type[BaseException], ...] = ()


def storage_errors(*more: type[BaseException]) -> tuple[type[BaseException], ...]:
    """What a storage call can raise when the storage, not the data, fails: ``OSError`` (what
    fsspec maps most failures to), and the errors its object-store clients let through
    untranslated (botocore's, for a refused connection, missing credentials or a timeout;
    aiohttp's), those of the clients installed; and ``more``."""
    global _STORAGE_ERRORS
    if not _STORAGE_ERRORS:
        found: list[type[BaseException]] = [OSError]
        with contextlib.suppress(ImportError):
            from botocore.exceptions import BotoCoreError, ClientError

            found += [BotoCoreError, ClientError]
        with contextlib.suppress(ImportError):
            from aiohttp import ClientError as HTTPClientError

            found.append(HTTPClientError)
        _STORAGE_ERRORS = tuple(found)
    return (*_STORAGE_ERRORS, *more)


@attrs.define
class Cut:
    """A closed file waiting for its upload: its bytes, or a local file in the spill dir."""

    key: Key
    name: str  # the final name under the key's directory
    first: int
    last: int
    batch_id: int  # the commit that cut it
    data: bytes | None
    local: str | None
    size: int


@attrs.define
class Usage:
    """Bytes held by all open files together (kept by each file as it changes, so the
    sink reads its spool's size without visiting every open file)."""

    memory: int = 0
    disk: int = 0


#: A file cut before it spilled goes to its upload as bytes up to this size, through its
#: local file above it.
INLINE_CUT = 8 << 20


class OpenFile:
    """A key's open file: whole batches ``first..last`` of schema ``schema``.

    Rows arrive as RecordBatches of ``arrow`` (parquet, csv) or JSON-line blocks (jsonl:
    ``arrow`` is None). Parquet keeps the RecordBatches in memory until :meth:`spill`
    writes them to ``local`` as a row group; its size is estimated from an encoding ratio
    (encoded / Arrow bytes). CSV and JSON lines are encoded as they arrive (a CSV file holds
    ``arrow`` flattened: a struct column's fields are columns ``parent.child``, after one
    header line), so their size is exact; :meth:`spill` appends the text to ``local``.
    """

    def __init__(self, key: Key, schema: Schema, arrow: pa.Schema | None,
                 local: Callable[[], str], first: int, opened: float,
                 parquet: Mapping[str, Any] | None = None, *, csv: bool = False,
                 usage: Usage | None = None) -> None:
        self.key, self.schema, self.arrow = key, schema, arrow
        self._local, self._path = local, ""  # the spill file, named at the first spill
        self.usage = Usage() if usage is None else usage  # shared by the sink's open files
        self.parquet = dict(parquet or {})  # options of pyarrow's parquet writers
        self.csv = csv
        self.text = arrow is None or csv  # rows held as encoded text
        self.first = self.last = first
        self.opened = opened  # the driver's monotonic clock
        self.chunks: list[Any] = []
        self.memory = 0  # bytes of chunks
        self.disk = 0  # bytes in `local`
        self.spilled_raw = 0  # chunk bytes that became `disk` (the encoding ratio)
        self.header = b""
        if csv:
            assert arrow is not None
            sink = pa.BufferOutputStream()
            pacsv.write_csv(pa.Table.from_batches([], schema=arrow).flatten(), sink)
            self.header = sink.getvalue().to_pybytes()
        self._writer: pq.ParquetWriter | None = None

    def append(self, chunk: pa.RecordBatch | bytes, nbytes: int, batch_id: int) -> None:
        """Add rows made by :func:`encode` for this file's format."""
        self.chunks.append(chunk)
        self.memory += nbytes
        self.usage.memory += nbytes
        self.last = batch_id

    def size(self, ratio: float) -> int:
        """The file's size if cut now: exact for text; for parquet, rows still in memory
        count at the encoding ratio of what was spilled, else at ``ratio``."""
        if self.text:  # a spilled file holds its header
            return (self.disk or len(self.header)) + self.memory
        if self.spilled_raw:
            ratio = self.disk / self.spilled_raw
        return self.disk + int(self.memory * ratio)

    def ratio(self, sample: int = 2 << 20) -> float:
        """Parquet: encoded / in-memory bytes of the rows so far, measured by encoding the
        latest chunks (about ``sample`` bytes of them) once, to calibrate :meth:`size`."""
        if not self.chunks:
            return self.disk / self.spilled_raw if self.spilled_raw else 1.0
        chunks, raw = [], 0
        for chunk in reversed(self.chunks):
            chunks.append(chunk)
            raw += chunk.nbytes
            if raw >= sample:
                break
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_batches(chunks[::-1], schema=self._meta()), sink,
                       **self.parquet)
        encoded: int = sink.tell()
        return max(0.01, encoded / max(raw, 1))

    def spill(self) -> int:
        """Write the rows in memory to the local file; return the bytes freed."""
        if not self.chunks:
            return 0
        freed = self.memory
        if self.text:
            with open(self.local, "ab") as f:
                if not self.disk:
                    f.write(self.header)
                f.write(b"".join(self.chunks))
        else:
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.local, self._meta(), **self.parquet)
            self._writer.write_table(self._table())
        self.chunks, self.memory = [], 0
        self.spilled_raw += freed
        disk = os.path.getsize(self.local)
        self.usage.memory -= freed
        self.usage.disk += disk - self.disk
        self.disk = disk
        return freed

    @property
    def local(self) -> str:
        """The local file the rows spill to (its directory is made when first asked)."""
        if not self._path:
            self._path = self._local()
        return self._path

    def _leave(self) -> None:
        """The file leaves the open files (cut or discarded): its bytes leave the usage."""
        self.usage.memory -= self.memory
        self.usage.disk -= self.disk
        self.memory = self.disk = 0

    def _meta(self) -> pa.Schema:
        assert self.arrow is not None
        return self.arrow.with_metadata({b"cdcflow.schema_version":
                                         str(self.schema.version).encode()})

    def _table(self) -> pa.Table:
        return pa.Table.from_batches(self.chunks, schema=self._meta())

    def finish(self, name: str, batch_id: int) -> Cut:
        """Close the file: its bytes if it never spilled and is small, else the completed
        local file (joined or encoded in memory, a large file would be held twice, and its
        bytes then wait for the upload outside the spool's count)."""
        if self._writer is None and self.disk == 0 and self.memory <= INLINE_CUT:
            if self.text:
                data = self.header + b"".join(self.chunks)
            else:
                sink = pa.BufferOutputStream()
                pq.write_table(self._table(), sink, **self.parquet)
                data = sink.getvalue().to_pybytes()
            self._leave()
            self.chunks = []
            return Cut(self.key, name, self.first, self.last, batch_id, data, None, len(data))
        self.spill()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        size = os.path.getsize(self.local)
        self._leave()
        return Cut(self.key, name, self.first, self.last, batch_id, None, self.local, size)

    def discard(self) -> None:
        self._leave()
        self.chunks = []
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self._path:
            with contextlib.suppress(OSError):
                os.remove(self._path)





def encode(data: pa.RecordBatch | bytes, csv: bool) -> tuple[pa.RecordBatch | bytes, int]:
    """Rows as an open file holds them, and their bytes: a RecordBatch as it is (parquet),
    encoded as CSV lines (csv), JSON lines as they are (jsonl)."""
    if csv:
        assert isinstance(data, pa.RecordBatch)
        data = _csv_lines(data)
    return data, len(data) if isinstance(data, bytes) else data.nbytes


def _csv_lines(batch: pa.RecordBatch) -> bytes:
    """CSV lines (no header) of ``batch`` flattened; timestamps as RFC 3339 text with nine
    fractional digits and ``Z`` (formatted here: Arrow's own cast of a zoned timestamp to
    text is several times slower); decimals with all their digits and no exponent (Arrow's
    cast writes 1E-9)."""
    table = pa.Table.from_batches([batch]).flatten()
    for i, field in enumerate(table.schema):
        if pa.types.is_timestamp(field.type):
            table = table.set_column(i, field.name, rfc3339(table.column(i).combine_chunks()))
        elif pa.types.is_decimal(field.type):
            texts = [None if v is None else format(v, "f") for v in table.column(i).to_pylist()]
            table = table.set_column(i, field.name, pa.array(texts, pa.string()))
    sink = pa.BufferOutputStream()
    pacsv.write_csv(table, sink, pacsv.WriteOptions(include_header=False,
                                                    quoting_style="needed"))
    lines: bytes = sink.getvalue().to_pybytes()
    return lines


_log = logging.getLogger("cdcflow.sinks")

#: A storage failure that no retry mends (a missing bucket or directory, a refused
#: permission) stops the uploads once it failed this many tries in a row (about 15 s).
PERMANENT_TRIES = 8
#: While uploads fail, a warning at the first failure and then every this many seconds.
WARN_EVERY = 30.0
#: An upload that has not finished after this many seconds is named in a warning (then
#: every WARN_EVERY seconds while it lasts): a storage that does not answer fails no call.
SLOW_UPLOAD = 15.0


def storage_cause(exc: BaseException) -> BaseException:
    """The storage's own error: what a SinkIOError wraps, else ``exc``."""
    return exc.__cause__ if isinstance(exc, SinkIOError) and exc.__cause__ else exc


def _lasting(exc: BaseException) -> bool:
    """Whether a storage failure (or the one it wraps) is of a kind retries do not mend."""
    return isinstance(storage_cause(exc), FileNotFoundError | PermissionError | NotADirectoryError)


class Uploader:
    """One thread that uploads cut files in FIFO order (so a key's files land in batch
    order: a replay after a crash relies on a key's largest ``last`` in storage, which must
    never pass a file that is missing).

    ``put(cut)`` uploads one file and raises SinkIOError (or one of :func:`storage_errors`)
    on a storage failure: the cut stays at the head of the queue and is retried with
    backoff, and ``error`` says why until it succeeds; a warning names the failure at once
    and every :data:`WARN_EVERY` seconds while it lasts, and an INFO line the recovery; an
    upload that has not finished after :data:`SLOW_UPLOAD` seconds (a storage that does not
    answer: no call fails) is named the same way, by a watch thread. A
    failure no retry mends (a missing bucket, a refused permission) stops the thread after
    :data:`PERMANENT_TRIES` tries in a row, as a SinkError naming ``where``. ``done(cut)``
    runs after each upload, outside the lock (the thread stays busy until it returns); a
    storage failure in it is retried the same way, without uploading the cut again. Any
    other exception stops the thread and is re-raised by :meth:`check` in the driver.
    """

    def __init__(self, put: Callable[[Cut], None], done: Callable[[Cut], None],
                 where: str = "storage") -> None:
        self._put, self._done = put, done
        self.where = where
        self._warned = 0.0  # monotonic time of the last warning about failing uploads
        self.lock = threading.Condition()
        self.queue: collections.deque[Cut] = collections.deque()
        self.memory = 0  # bytes of queued cuts held in memory
        self.disk = 0  # bytes of queued cuts in local files
        self.error: BaseException | None = None  # the last storage failure, while retrying
        self.failures = 0
        # running totals (metrics): files and bytes uploaded, seconds spent, failed tries
        self.uploaded = self.uploaded_bytes = self.errors = 0
        self.upload_seconds = 0.0
        self._fatal: BaseException | None = None
        self._stop = False
        self._active = False  # a cut is being uploaded (or its `done` is running)
        self._began = 0.0  # monotonic time the upload in progress began
        self._thread: threading.Thread | None = None

    def submit(self, cut: Cut) -> None:
        with self.lock:
            self.queue.append(cut)
            if cut.data is not None:
                self.memory += cut.size
            else:
                self.disk += cut.size
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cdcflow-uploads",
                                                daemon=True)
                self._thread.start()
                threading.Thread(target=self._watch, name="cdcflow-uploads-watch",
                                 daemon=True).start()
            self.lock.notify_all()

    def spill(self, directory: str, target: int) -> None:
        """Move queued cuts held in memory to local files (newest first, the last to be
        uploaded) until their memory is at most ``target``."""
        with self.lock:
            for cut in reversed(self.queue):
                if self.memory <= target:
                    return
                if cut.data is None or cut is self.queue[0]:
                    continue  # the head may be uploading right now
                path = os.path.join(directory, f"cut-{cut.first}-{cut.last}-{id(cut)}")
                with open(path, "wb") as f:
                    f.write(cut.data)
                cut.data, cut.local = None, path
                self.memory -= cut.size
                self.disk += cut.size

    def check(self) -> None:
        """Re-raise what stopped the upload thread (not a storage failure: those retry)."""
        if self._fatal is not None:
            raise self._fatal

    def wait(self, until: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait (holding the lock between checks) until ``until()`` or ``timeout``; re-raise
        a fatal error of the thread. Returns ``until()``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while not until():
                self.check()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self.lock.wait(0.5 if left is None else min(left, 0.5))
            self.check()
            return until()

    def _run(self) -> None:
        backoff = 0.05
        while True:
            with self.lock:
                while not self.queue and not self._stop:
                    self.lock.wait()
                if self._stop:
                    return
                cut = self.queue[0]
                self._active = True
                self._began = began = time.monotonic()
            try:
                self._put(cut)
            except storage_errors(SinkIOError) as exc:
                backoff = self._failed(exc, backoff, time.monotonic() - began)
                if self._fatal is not None:
                    return
                continue
            except BaseException as exc:  # handed to the driver by check()
                self._die(exc)
                return
            backoff = 0.05
            with self.lock:
                self.queue.popleft()
                self.uploaded += 1
                self.uploaded_bytes += cut.size
                self.upload_seconds += time.monotonic() - began
                if cut.data is not None:
                    self.memory -= cut.size
                else:
                    self.disk -= cut.size
            while True:
                try:
                    self._done(cut)
                    break
                except storage_errors(SinkIOError) as exc:
                    backoff = self._failed(exc, backoff, 0.0)
                    if self._stop or self._fatal is not None:
                        return
                except BaseException as exc:  # handed to the driver by check()
                    self._die(exc)
                    return
            backoff = 0.05
            with self.lock:
                if self.failures:
                    _log.info("WriteTables: uploads to %s succeed again, after %d failed tries",
                              self.where, self.failures)
                self.error, self.failures = None, 0
                self._active = False
                self.lock.notify_all()

    def _failed(self, exc: BaseException, backoff: float, seconds: float) -> float:
        """Note a storage failure, warn (see the class docstring), wait ``backoff`` (a close
        ends the wait); the next one. Past :data:`PERMANENT_TRIES` tries of a failure no
        retry mends, the thread's fatal error is set instead."""
        with self.lock:
            self.error, self.failures = exc, self.failures + 1
            self.errors += 1
            self.upload_seconds += seconds
            now = time.monotonic()
            cause = storage_cause(exc)
            if self.failures == 1 or now - self._warned >= WARN_EVERY:
                self._warned = now
                _log.warning("WriteTables: uploads to %s fail (%s: %s); retrying (%s so "
                             "far): the files waiting are not durable until they succeed",
                             self.where, type(cause).__name__, cause,
                             "1 failed try" if self.failures == 1
                             else f"{self.failures} failed tries")
            if _lasting(exc) and self.failures >= PERMANENT_TRIES:
                msg = (f"WriteTables: uploads to {self.where} keep failing after "
                       f"{self.failures} tries ({type(cause).__name__}: {cause}): does the "
                       "bucket or directory exist, and may these credentials write there? "
                       "Fix that and run again; the next run writes again what was not "
                       "durable")
                # not caused by the SinkIOError: that one would make the batch look
                # worth retrying (the engine retries transient errors along the chain)
                self._fatal = SinkError(msg)
                self._fatal.__cause__ = cause
            self.lock.notify_all()
            if not self._stop and self._fatal is None:
                self.lock.wait(backoff)
        return min(backoff * 2, 5.0)

    def running_for(self) -> float:
        """Seconds the upload in progress has run (0 when none); call holding ``lock``."""
        return time.monotonic() - self._began if self._active else 0.0

    def _watch(self) -> None:
        """Name an upload that does not finish (see the class docstring)."""
        with self.lock:
            while not self._stop and self._fatal is None:
                self.lock.wait(1.0)
                took, now = self.running_for(), time.monotonic()
                if took >= SLOW_UPLOAD and now - self._warned >= WARN_EVERY and self.queue:
                    self._warned = now
                    _log.warning("WriteTables: the upload of %s to %s has not finished in %.0f s "
                                 "(does the storage answer?); %d file(s) wait: they are not "
                                 "durable until they are uploaded", self.queue[0].name,
                                 self.where, took, len(self.queue))

    def _die(self, exc: BaseException) -> None:
        with self.lock:
            self._fatal = exc
            self.lock.notify_all()

    def busy(self) -> bool:
        """Whether an upload (or what follows it) is running; call holding ``lock``."""
        return self._active

    def close(self) -> None:
        """Stop the thread after the upload in progress (queued cuts are abandoned: they
        are not durable, and a restart replays them)."""
        with self.lock:
            self._stop = True
            self.lock.notify_all()
        if self._thread is not None:
            # an upload hanging on a storage that does not answer is abandoned (it is not
            # durable: the next run writes its rows again)
            self._thread.join(timeout=2)
