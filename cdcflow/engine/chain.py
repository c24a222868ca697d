"""The fused chain: one task's copy of the transforms after ReadPartition, and its writers.

Nothing is shuffled: a task pushes each DataChangeRecord through every ParDo downstream of
ReadPartition (linear or branching) and hands the results to sink writers, opened on first
use. With ``max_inflight > 1`` on ReadPartition the ParDos of several records run
concurrently on a pool while sink writers still receive elements in record order: an
:class:`~cdcflow.inflight.InflightTracker` releases only the contiguously completed prefix.
User functions and sink writes run under the pipeline's
:class:`~cdcflow.policy.ErrorPolicy`; a skipped element goes to the dead-letter sink as a
:class:`~cdcflow.policy.FailedElement`.
"""

from __future__ import annotations

import functools
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

from cdcflow.engine.program import TaskProgram
from cdcflow.engine.runner import Task
from cdcflow.errors import PipelineStopped, SinkIOError
from cdcflow.inflight import Barrier, InflightTracker
from cdcflow.model import DataChangeRecord
from cdcflow.policy import FailedElement, Retry, Stop
from cdcflow.transforms.base import ParDo, Sink, SinkWriter, WriterContext

__all__ = ["Chain", "approx_size"]

_log = logging.getLogger("cdcflow.task")


class _Skipped:
    """An element the error policy skipped, with the last error as text."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class _Failure:
    """An exception raised in the pool, delivered in record order."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


Delivery = tuple[str, Any]  # (sink label, element)


class _Evaluated:
    """One record's trip through the ParDos: what reaches sinks, and per-step counts."""

    __slots__ = ("counts", "deliveries")

    def __init__(self, deliveries: list[Delivery], counts: dict[str, int]) -> None:
        self.deliveries = deliveries
        self.counts = counts


class Chain:
    """One task's copy of the transforms downstream of ReadPartition, and its writers."""

    def __init__(self, program: TaskProgram, task: Task) -> None:
        self._program = program
        self._task = task
        self._nodes: dict[str, ParDo[Any, Any] | Sink[Any, Any]] = pickle.loads(program.chain)
        self._succ = program.successors
        self._policy = program.policy
        self._attempt = uuid.uuid4().hex  # unique per execution: retries write elsewhere
        self._writers: dict[str, SinkWriter[Any, Any]] = {}
        self._set_up: list[ParDo[Any, Any]] = []
        self._started = False
        self._skipped = 0
        self._retries = 0
        self._counts: dict[str, int] = {}  # touched on the reader thread only
        self._count_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: InflightTracker | None = None
        self._released: list[tuple[int, Any]] = []
        self._release_lock = threading.Lock()
        if program.max_inflight > 1:
            self._inflight = InflightTracker(program.max_inflight, program.max_inflight_bytes)

    # -- feeding records ---------------------------------------------------------------------

    def push(self, record: DataChangeRecord, position: int, size: int) -> None:
        self._start()
        if self._inflight is None:
            self._deliver(record, self._evaluate(record))
            return
        assert self._pool is not None
        seq = self._inflight.begin(position, size)
        future = self._pool.submit(self._evaluate, record)
        future.add_done_callback(lambda f: self._completed(seq, record, f))
        self._flush()

    def barrier(self, position: int) -> None:
        if self._inflight is None:
            return
        with self._release_lock:
            self._released.extend(self._inflight.barrier(position))
        self._flush()

    def _completed(
        self, seq: int, record: DataChangeRecord, future: Future[_Evaluated]
    ) -> None:
        error = CancelledError() if future.cancelled() else future.exception()
        result: Any = _Failure(error) if error is not None else (record, future.result())
        assert self._inflight is not None
        # complete() and the append happen under one lock so released runs stay in order
        with self._release_lock:
            self._released.extend(self._inflight.complete(seq, result))

    def _flush(self) -> None:
        with self._release_lock:
            released, self._released = self._released, []
        for _, result in released:
            if isinstance(result, Barrier):
                continue
            if isinstance(result, _Failure):
                raise result.error
            record, evaluated = result
            self._deliver(record, evaluated)

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        # DoFn.setup runs once per task, before the first element, on this thread.
        for node in self._nodes.values():
            if isinstance(node, ParDo):
                node.fn.setup()
                self._set_up.append(node)
        if self._inflight is not None:
            self._pool = ThreadPoolExecutor(
                self._inflight.max_inflight, thread_name_prefix="cdcflow-inflight"
            )

    # -- running transforms -----------------------------------------------------------------

    def _evaluate(self, record: DataChangeRecord) -> _Evaluated:
        """Run every ParDo on ``record``; the sink deliveries in chain order, and how many
        elements each ParDo took and gave (counted here, merged on the reader thread)."""
        out: list[Delivery] = []
        counts: dict[str, int] = {}

        def visit(label: str, element: Any) -> None:
            node = self._nodes[label]
            if isinstance(node, Sink):
                out.append((label, element))
                return
            key_in = f"elements_in/{label}"
            counts[key_in] = counts.get(key_in, 0) + 1
            call = functools.partial(_process, node, element)
            outputs = self._guarded(label, record, element, call)
            if isinstance(outputs, _Skipped):
                if self._program.dead_letter_label is not None:
                    out.append((self._program.dead_letter_label,
                                self._failed(label, record, element, outputs)))
                return
            key_out = f"elements_out/{label}"
            counts[key_out] = counts.get(key_out, 0) + len(outputs)
            for value in outputs:
                for nxt in self._succ[label]:
                    visit(nxt, value)

        for label in self._succ[self._program.read_label]:
            visit(label, record)
        return _Evaluated(out, counts)

    def _deliver(self, record: DataChangeRecord, evaluated: _Evaluated) -> None:
        dead = self._program.dead_letter_label
        counts = self._counts
        for key, n in evaluated.counts.items():
            counts[key] = counts.get(key, 0) + n
        wanted = self._task.sinks
        for label, element in evaluated.deliveries:
            if wanted is not None and label not in wanted:
                continue  # a replay for other sinks: this one has the batch already
            writer = self._writer(label)
            key = f"sink_writes/{label}"
            counts[key] = counts.get(key, 0) + 1
            if label == dead:
                writer.write(element)  # a failing dead-letter sink fails the task
                counts["dead_lettered"] = counts.get("dead_lettered", 0) + 1
                continue
            done = self._guarded(label, record, element, functools.partial(writer.write, element))
            if isinstance(done, _Skipped) and dead is not None and (
                wanted is None or dead in wanted
            ):
                self._writer(dead).write(self._failed(label, record, element, done))
                counts["dead_lettered"] = counts.get("dead_lettered", 0) + 1

    def _guarded(
        self, label: str, record: DataChangeRecord, element: Any, call: Callable[[], Any]
    ) -> Any:
        """``call()`` under the error policy: its value, or _Skipped when skipped."""
        failed = 0
        while True:
            try:
                return call()
            except SinkIOError:
                raise  # the sink's storage failed, not the element: the batch is retried
            except PipelineStopped:
                raise  # already decided further down (a sink with a policy of its own)
            except Exception as exc:
                failed += 1
                decision = self._policy.decide(exc, element, record.partition_token, failed)
                if isinstance(decision, Retry):
                    time.sleep(decision.after)
                    with self._count_lock:
                        self._retries += 1
                    continue
                where = (
                    f"{label!r} failed on a change of partition {record.partition_token} "
                    f"committed at {record.commit_timestamp} after {failed} attempt(s): "
                    f"{type(exc).__name__}: {exc}"
                )
                if isinstance(decision, Stop):
                    msg = (
                        f"{where}. Nothing past this record was committed; fix the cause and "
                        "run again to resume, or skip such elements with "
                        "ErrorPolicy(then='skip')"
                    )
                    raise PipelineStopped(msg) from exc
                _log.warning("skipped an element: %s", where)
                with self._count_lock:
                    self._skipped += 1
                return _Skipped(f"{type(exc).__name__}: {exc}")

    def _failed(
        self, label: str, record: DataChangeRecord, element: Any, skipped: _Skipped
    ) -> FailedElement:
        return FailedElement(
            label=label,
            error=skipped.error,
            partition_token=record.partition_token,
            commit_timestamp=record.commit_timestamp,
            element=element,
        )

    def _writer(self, label: str) -> SinkWriter[Any, Any]:
        writer = self._writers.get(label)
        if writer is None:
            sink = self._nodes[label]
            assert isinstance(sink, Sink)
            sl = self._task.slice
            writer = sink.open_writer(WriterContext(
                pipeline=self._program.pipeline, sink_label=label, batch_id=self._task.batch_id,
                partition_token=sl.token, slice_start=sl.start, slice_end=sl.end,
                attempt=self._attempt,
            ))
            self._writers[label] = writer
        return writer

    # -- ending -----------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Drain in-flight work, tear down, close writers; the sink commit messages."""
        if self._inflight is not None:
            self._inflight.drain()
            self._flush()
        self._shutdown()
        teardown, self._set_up = self._set_up, []
        for node in teardown:
            node.fn.teardown()
        messages: dict[str, Any] = {}
        for label in list(self._writers):
            messages[label] = self._writers.pop(label).close()
        return messages

    def abort(self) -> None:
        self._shutdown()
        for node in self._set_up:
            try:
                node.fn.teardown()
            except Exception:
                _log.exception("teardown of a DoFn failed while aborting a task")
        self._set_up = []
        for writer in self._writers.values():
            try:
                writer.abort()
            except Exception:
                _log.exception("aborting a sink writer failed")
        self._writers.clear()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def counters(self) -> dict[str, int]:
        """What this task did: ``skipped``, ``retries``, ``dead_lettered`` elements, and per
        step ``elements_in/<label>``, ``elements_out/<label>``, ``sink_writes/<label>``."""
        return {**self._counts, "skipped": self._skipped, "retries": self._retries}


def _process(node: ParDo[Any, Any] | Sink[Any, Any], element: Any) -> list[Any]:
    assert isinstance(node, ParDo)
    produced = node.fn.process(element)
    return [] if produced is None else list(produced)


def approx_size(record: DataChangeRecord) -> int:
    """A cheap estimate of a record's memory in bytes (for the in-flight byte quota)."""
    n = 256
    for mod in record.mods:
        for values in (mod.keys, mod.new_values, mod.old_values):
            for key, value in values.items():
                n += 48 + len(key) + (len(value) if isinstance(value, str | bytes) else 16)
    return n
