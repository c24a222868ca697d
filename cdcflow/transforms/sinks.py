"""Built-in sinks: Collect (tests), Print, and WriteFiles (exactly-once JSONL or Parquet files,
defined in :mod:`cdcflow.transforms.files`).

Every sink here commits idempotently per batch id, so a replayed batch does not repeat
output: together with the engine's deterministic replay they give exactly-once results.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any, Generic, Literal, TypeVar

import attrs

from cdcflow.errors import PipelineDefinitionError
from cdcflow.serialize import json_dumps, to_json_value
from cdcflow.transforms._fileio import local_prefix, sweep
from cdcflow.transforms.base import Sink, SinkContext, SinkWriter, WriterContext
from cdcflow.transforms.files import WriteFiles, WrittenFile

__all__ = ["PRINT_MEMORY", "Collect", "Print", "PrintedLines", "WriteFiles", "WrittenFile"]

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
    """Batch ids already committed in this process, for idempotent driver-side commits: by
    the sink's label too, since labelled copies of one sink (``"a" >> out`` and ``"b" >>
    out`` on two branches) share it, and each commits every batch."""

    def __init__(self) -> None:
        self._done: set[tuple[str | None, int]] = set()
        self._lock = threading.Lock()

    def claim(self, batch_id: int, label: str | None) -> bool:
        """True the first time ``batch_id`` is seen under ``label``."""
        with self._lock:
            if (label, batch_id) in self._done:
                return False
            self._done.add((label, batch_id))
            return True

    def highest(self) -> int:
        """The highest batch id claimed, or 0: a run with a new store (batch ids from 1
        again) plans its batches above it, so they are not taken for replays."""
        with self._lock:
            return max((batch for _, batch in self._done), default=0)


def _same(element: E) -> E:
    return element


class Collect(Sink[E, list[E]]):
    """Gathers every committed element into ``self.items`` on the driver (for tests).

    Writers buffer the elements of their task; ``commit`` appends them to :attr:`items` in
    the order of the batch's messages, once per batch id (a replayed batch is ignored). The
    items are visible on the driver after each batch commit. Only the driver's instance
    holds them: pickled copies (in tasks) start empty.

    Collect is for tests and small runs: it is the sink that keeps a task's whole output in
    memory until the task ends (the process's byte quota stops counting an element once a
    writer has taken it), so its memory is not bounded by ``max_inflight_bytes``.
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

    def last_committed_batch(self) -> int:
        return self._batches.highest()

    def commit(self, batch_id: int, messages: Sequence[list[E]]) -> None:
        if not self._batches.claim(batch_id, self.label):
            return
        for message in messages:
            self.items.extend(message)


def _json_text(element: Any) -> str:
    return json_dumps(to_json_value(element)).decode()


#: Bytes of text a Print writer holds in memory before it spills its lines to local disk.
PRINT_MEMORY = 1 << 20
_PRINT_PREFIX = "cdcflow-print-"


@attrs.frozen
class PrintedLines:
    """A Print writer's commit message: its task's lines, the earlier ones in a local
    spool file (pickled chunks of lines) when it spilled, the rest inline."""

    lines: tuple[str, ...] = ()
    spool: str | None = None

    def all(self) -> Iterator[str]:
        if self.spool is not None:
            with open(self.spool, "rb") as f:
                while True:
                    try:
                        yield from pickle.load(f)
                    except EOFError:
                        break
        yield from self.lines

    def discard(self) -> None:
        if self.spool is not None:
            with contextlib.suppress(OSError):  # gone already: a commit took it
                os.remove(self.spool)


class _LineWriter:
    """A task's lines: in memory up to :data:`PRINT_MEMORY` bytes, then appended to a local
    spool file when ``spill`` (the task runs on the driver's machine, which reads it)."""

    def __init__(self, convert: Callable[[Any], str], spill: bool, prefix: str) -> None:
        self._convert, self._spill, self._prefix = convert, spill, prefix
        self._lines: list[str] = []
        self._bytes = 0
        self._path: str | None = None

    def write(self, element: Any) -> None:
        line = self._convert(element)
        self._lines.append(line)
        self._bytes += len(line) + 1
        if self._spill and self._bytes > PRINT_MEMORY:
            if self._path is None:
                fd, self._path = tempfile.mkstemp(prefix=self._prefix, suffix=".spool")
                os.close(fd)
            with open(self._path, "ab") as f:
                pickle.dump(self._lines, f, protocol=pickle.HIGHEST_PROTOCOL)
            self._lines, self._bytes = [], 0

    def close(self) -> PrintedLines:
        message = PrintedLines(tuple(self._lines), self._path)
        self._lines, self._path = [], None
        return message

    def abort(self) -> None:
        PrintedLines(spool=self._path).discard()
        self._lines, self._path = [], None


class Print(Sink[Any, PrintedLines]):
    """Prints committed elements on the driver: once, in order, only for committed batches.

    ``format="json"`` prints one JSON document per element (see :mod:`cdcflow.serialize`);
    ``format="repr"`` prints ``repr(element)``. Writers keep the lines of their task as
    text until it ends (the lines travel to the driver in the commit message); past
    :data:`PRINT_MEMORY` bytes a writer on the driver's machine spills them to a local file
    the commit reads (a cluster's executors keep them in memory). Meant for output a
    terminal or a pipe reads.
    """

    def __init__(self, format: Literal["json", "repr"] = "json") -> None:
        if format not in ("json", "repr"):
            msg = f"Print(format={format!r}): use 'json' or 'repr'"
            raise PipelineDefinitionError(msg)
        self.format = format
        self._batches = _OncePerBatch()
        self._closed = False
        self._stop: Callable[[str], None] | None = None
        self._driver_host: str | None = None  # where setup ran: tasks there may spill
        self._driver_pid: int | None = None  # whose process reads (and sweeps) the spills

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_batches"] = None
        state["_stop"] = None  # the driver's callback never travels into tasks
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._batches = _OncePerBatch()

    def describe_params(self) -> str:
        return f"format={self.format}"

    def setup(self, ctx: SinkContext) -> None:
        self._stop = ctx.request_stop
        self._driver_host = socket.gethostname()
        self._driver_pid = os.getpid()
        sweep(None, prefix=_PRINT_PREFIX)  # what killed runs left

    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, PrintedLines]:
        local = self._driver_host is None or socket.gethostname() == self._driver_host
        return _LineWriter(_json_text if self.format == "json" else repr, local,
                           local_prefix(self._driver_pid, _PRINT_PREFIX))

    def abort(self, batch_id: int, messages: Sequence[PrintedLines]) -> None:
        for message in messages:
            message.discard()

    def last_committed_batch(self) -> int:
        return self._batches.highest()

    def commit(self, batch_id: int, messages: Sequence[PrintedLines]) -> None:
        if not self._batches.claim(batch_id, self.label) or self._closed:
            self.abort(batch_id, messages)
            return
        out: IO[str] = sys.stdout  # looked up now, so redirected output is honoured
        try:
            for message in messages:
                for line in message.all():
                    print(line, file=out)
                message.discard()
            out.flush()
        except BrokenPipeError:
            # The reader went away (`cdcflow run ... | head`): it read what it wanted. The
            # batch commits and the run ends after it, instead of failing and printing the
            # batch again next time. Later writes to stdout go nowhere, quietly.
            self._closed = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, out.fileno())
            os.close(devnull)
            if self._stop is not None:
                self._stop("output closed")
            self.abort(batch_id, messages)  # the lines not printed: their spool files
