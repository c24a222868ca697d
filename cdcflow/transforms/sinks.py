"""Built-in sinks: Collect (tests), Print, and WriteFiles (exactly-once JSONL or Parquet files,
defined in :mod:`cdcflow.transforms.files`).

Every sink here commits idempotently per batch id, so a replayed batch does not repeat
output: together with the engine's deterministic replay they give exactly-once results.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import IO, Any, Generic, Literal, TypeVar

import orjson

from cdcflow.errors import PipelineDefinitionError
from cdcflow.serialize import to_json_value
from cdcflow.transforms.base import Sink, SinkContext, SinkWriter, WriterContext
from cdcflow.transforms.files import WriteFiles, WrittenFile

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
    ``format="repr"`` prints ``repr(element)``. Writers buffer the lines of their task, as
    text, until it ends (the lines travel to the driver in the commit message): like
    Collect, meant for output a terminal can show, not for a large backlog.
    """

    def __init__(self, format: Literal["json", "repr"] = "json") -> None:
        if format not in ("json", "repr"):
            msg = f"Print(format={format!r}): use 'json' or 'repr'"
            raise PipelineDefinitionError(msg)
        self.format = format
        self._batches = _OncePerBatch()
        self._closed = False
        self._stop: Callable[[str], None] | None = None

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

    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, list[str]]:
        return _BufferWriter(_json_text if self.format == "json" else repr)

    def commit(self, batch_id: int, messages: Sequence[list[str]]) -> None:
        if not self._batches.claim(batch_id) or self._closed:
            return
        out: IO[str] = sys.stdout  # looked up now, so redirected output is honoured
        try:
            for message in messages:
                for line in message:
                    print(line, file=out)
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
