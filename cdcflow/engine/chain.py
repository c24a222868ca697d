"""The fused chain: one task's copy of the transforms after ReadPartition, and its writers.

Nothing is shuffled: a task pushes each DataChangeRecord through every ParDo downstream of
ReadPartition (linear or branching) and hands the results to sink writers, opened on first
use. With ``max_inflight > 1`` on ReadPartition the ParDos of several records run
concurrently on a pool while sink writers still receive elements in record order: an
:class:`~cdcflow.inflight.InflightTracker` releases only the contiguously completed prefix.

Memory: every record is charged to the process's byte quota
(:func:`cdcflow.engine.quota.process_quota`) before it enters the chain and given back once
every sink writer has taken its outputs, so reading blocks (in :meth:`Chain._wait_for_quota`)
while the tasks of the process hold the quota, whatever ``max_inflight`` is.
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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import cloudpickle
import orjson

from cdcflow.engine.listener import note_task_done
from cdcflow.engine.program import TaskProgram
from cdcflow.engine.quota import ByteQuota, process_quota, quota_limit
from cdcflow.engine.runner import ChildSeen, Task, TaskResult
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
        self._steps = frozenset(program.step_labels)
        self._ends = self._steps | {
            label for label, node in self._nodes.items() if isinstance(node, Sink)
        }
        self._step_inputs: dict[str, list[Any]] = {}
        self._policy = program.policy
        self._attempt = uuid.uuid4().hex  # unique per execution: retries write elsewhere
        self._writers: dict[str, SinkWriter[Any, Any]] = {}
        self._set_up: list[ParDo[Any, Any]] = []
        self._started = False
        self._skipped = 0
        self._retries = 0
        self._counts: dict[str, int] = {}  # touched on the reader thread only
        # made once per step: they serve every element
        self._counter_keys = {
            label: (f"elements_in/{label}", f"elements_out/{label}", f"sink_writes/{label}")
            for label in self._nodes
        }
        self._processes: dict[str, Callable[[Any], Sequence[Any]]] = {
            label: functools.partial(_process, node)
            for label, node in self._nodes.items() if isinstance(node, ParDo)
        }
        self._count_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: InflightTracker | None = None
        self._released: list[tuple[int, Any]] = []
        self._release_lock = threading.Lock()
        self._quota: ByteQuota = process_quota(quota_limit(program.max_inflight_bytes))
        self._held = 0  # bytes of this chain's records charged to the quota, not yet returned
        self._peak_held = 0
        if program.max_inflight > 1:
            self._inflight = InflightTracker(program.max_inflight, self._quota.limit)

    # -- feeding records ---------------------------------------------------------------------

    def push(self, record: DataChangeRecord, position: int, size: int) -> None:
        """Run ``record`` (``size`` bytes, :func:`approx_size`) through the chain; blocks
        while the process's byte quota is used up."""
        self._start()
        self._wait_for_quota(size)
        if self._inflight is None:
            # on this thread: the steps count straight into the chain's counters
            self._deliver(record, self._evaluate(record, self._counts))
            self._give_back(size)
            return
        assert self._pool is not None
        seq = self._inflight.begin(position, size)  # blocks while max_inflight are in flight
        future = self._pool.submit(self._evaluate, record)
        future.add_done_callback(lambda f: self._completed(seq, record, size, f))
        self._flush()

    def push_element(self, element: Any) -> None:
        """Push a BatchStep's output through a driver-side chain (one built from
        :meth:`TaskProgram.for_step`), on this thread."""
        self._start()
        self._deliver(element, self._evaluate(element))

    def _wait_for_quota(self, size: int) -> None:
        """Charge ``size`` bytes to the process's quota: the one place reading blocks on
        memory. While it waits, this chain delivers its own completed records (giving
        their bytes back), so tasks holding bytes never wait on each other forever."""
        counts = self._counts
        if not self._quota.try_acquire(size):  # room at once: the usual case, untimed
            began = time.perf_counter()
            while not self._quota.acquire(size, until=self._has_released):
                self._flush()
            waited = time.perf_counter() - began
            if waited > 0.001:  # admitted at once takes microseconds: this one waited
                counts["quota_waits"] = counts.get("quota_waits", 0) + 1
                counts["quota_wait_us"] = counts.get("quota_wait_us", 0) + int(waited * 1e6)
        held = self._held = self._held + size
        if held > self._peak_held:
            self._peak_held = counts["inflight_bytes_peak"] = held

    def _has_released(self) -> bool:
        return bool(self._released)  # read without the lock: a stale answer only delays

    def _give_back(self, size: int) -> None:
        self._held -= size
        self._quota.release(size)

    def _give_back_all(self) -> None:
        held, self._held = self._held, 0
        if held:
            self._quota.release(held)

    def barrier(self, position: int) -> None:
        if self._inflight is None:
            return
        with self._release_lock:
            self._released.extend(self._inflight.barrier(position))
        self._flush()

    def _completed(
        self, seq: int, record: DataChangeRecord, size: int, future: Future[_Evaluated]
    ) -> None:
        error = CancelledError() if future.cancelled() else future.exception()
        result: Any = (
            _Failure(error) if error is not None else (record, future.result(), size)
        )
        assert self._inflight is not None
        # complete() and the append happen under one lock so released runs stay in order
        with self._release_lock:
            self._released.extend(self._inflight.complete(seq, result))
        self._quota.notify()  # the reader may be waiting for the quota: deliver these first

    def _flush(self) -> None:
        with self._release_lock:
            released, self._released = self._released, []
        for _, result in released:
            if isinstance(result, Barrier):
                continue
            if isinstance(result, _Failure):
                raise result.error
            record, evaluated, size = result
            self._deliver(record, evaluated)
            self._give_back(size)

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

    def _evaluate(
        self, record: DataChangeRecord, counts: dict[str, int] | None = None
    ) -> _Evaluated:
        """Run every ParDo on ``record``; the sink deliveries in chain order, and how many
        elements each ParDo took and gave: counted in ``counts`` (the chain's own, on the
        reader thread), else in a dict of their own (merged on the reader thread)."""
        out: list[Delivery] = []
        if counts is None:
            counts = {}

        def visit(label: str, element: Any) -> None:
            if label in self._ends:  # a sink, or a step the engine folds on the driver
                out.append((label, element))
                return
            key_in, key_out, _ = self._counter_keys[label]
            counts[key_in] = counts.get(key_in, 0) + 1
            outputs = self._guarded(label, record, element, self._processes[label], element)
            if isinstance(outputs, _Skipped):
                if self._program.dead_letter_label is not None:
                    out.append((self._program.dead_letter_label,
                                self._failed(label, record, element, outputs)))
                return
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
        if evaluated.counts is not counts:
            for key, n in evaluated.counts.items():
                counts[key] = counts.get(key, 0) + n
        wanted = self._task.sinks
        for label, element in evaluated.deliveries:
            if label in self._steps:
                # A replay for staging sinks never needs a step: the engine refuses staging
                # sinks downstream of one.
                if wanted is None:
                    self._step_inputs.setdefault(label, []).append(element)
                continue
            if wanted is not None and label not in wanted:
                continue  # a replay for other sinks: this one has the batch already
            writer = self._writers.get(label) or self._writer(label)
            key = self._counter_keys[label][2]
            counts[key] = counts.get(key, 0) + 1
            if label == dead:
                writer.write(element)  # a failing dead-letter sink fails the task
                counts["dead_lettered"] = counts.get("dead_lettered", 0) + 1
                continue
            done = self._guarded(label, record, element, writer.write, element)
            if isinstance(done, _Skipped) and dead is not None and (
                wanted is None or dead in wanted
            ):
                self._writer(dead).write(self._failed(label, record, element, done))
                counts["dead_lettered"] = counts.get("dead_lettered", 0) + 1

    def _guarded(
        self, label: str, record: DataChangeRecord, element: Any, call: Callable[[Any], Any],
        argument: Any,
    ) -> Any:
        """``call(argument)`` under the error policy: its value, or _Skipped when skipped."""
        failed = 0
        while True:
            try:
                return call(argument)
            except SinkIOError:
                raise  # the sink's storage failed, not the element: the batch is retried
            except PipelineStopped:
                raise  # already decided further down (a sink with a policy of its own)
            except Exception as exc:
                failed += 1
                token, at = _origin(record)
                decision = self._policy.decide(exc, element, token, failed)
                if isinstance(decision, Retry):
                    time.sleep(decision.after)
                    with self._count_lock:
                        self._retries += 1
                    continue
                where = (
                    f"{label!r} failed on a change of partition {token} "
                    f"committed at {at} after {failed} attempt(s): "
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
        token, at = _origin(record)
        return FailedElement(
            label=label, error=skipped.error, partition_token=token, commit_timestamp=at,
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
        self._give_back_all()
        teardown, self._set_up = self._set_up, []
        for node in teardown:
            node.fn.teardown()
        messages: dict[str, Any] = {}
        for label in list(self._writers):
            messages[label] = self._writers.pop(label).close()
        return messages

    def abort(self) -> None:
        self._shutdown()
        self._give_back_all()
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

    def step_inputs(self) -> dict[str, bytes]:
        """The elements that reached each BatchStep, in record order, pickled (for
        ``TaskResult.step_inputs``)."""
        return {label: cloudpickle.dumps(elements)
                for label, elements in self._step_inputs.items()}

    def counters(self) -> dict[str, int]:
        """What this task did: ``skipped``, ``retries``, ``dead_lettered`` elements, per
        step ``elements_in/<label>``, ``elements_out/<label>``, ``sink_writes/<label>``,
        ``inflight_bytes_peak`` (the most bytes this task held of the process's byte quota),
        ``quota_waits`` / ``quota_wait_us`` (reads that waited for room in the quota, and
        how long in all)."""
        return {**self._counts, "skipped": self._skipped, "retries": self._retries}

    def result(
        self, messages: Mapping[str, Any], *, position: int, ended: bool, records: int,
        size: int, children: tuple[ChildSeen, ...] = (),
        counters: Mapping[str, int] | None = None, commit_times: tuple[int, ...] = (),
    ) -> TaskResult:
        """The task's result once :meth:`finish` gave ``messages``: what it read, its
        counters (with ``counters`` added: the reader's own), the elements that reached
        BatchSteps. Also notes that the task's read is done (stuck-partition detection)."""
        task = self._task
        note_task_done(task.pipeline, task.batch_id, task.slice.token)
        counts = self.counters()
        counts.update(counters or {})
        return TaskResult(
            token=task.slice.token, position=position, ended=ended, children=children,
            sink_messages=dict(messages), records=records, bytes=size, counters=counts,
            commit_times=commit_times, step_inputs=self.step_inputs(),
        )


def _origin(record: Any) -> tuple[str, Any]:
    """The partition and commit timestamp an element came from. On a driver-side chain the
    "record" is a BatchStep's output: no partition (its token reads "" unless the output
    names one), and its commit timestamp when it has one."""
    return getattr(record, "partition_token", ""), getattr(record, "commit_timestamp", None)


def _process(node: ParDo[Any, Any] | Sink[Any, Any], element: Any) -> Sequence[Any]:
    assert isinstance(node, ParDo)
    produced = node.fn.process(element)
    if type(produced) is tuple or type(produced) is list:  # Map's, Filter's: as they are
        return produced
    return [] if produced is None else list(produced)


def approx_size(record: DataChangeRecord) -> int:
    """An estimate of a record's memory in bytes, for the byte quota: 256 for the record,
    plus the payload of its mods' keys and values (their JSON text, as orjson writes it in
    C: strings in UTF-8, JSON values and arrays whole; a bytes value's length; a value JSON
    cannot hold, such as a Timestamp or a Decimal, 4 bytes) and :data:`_PER_VALUE` for
    each key and each value around it. Linear in the record's values."""
    extra = 0

    def other(value: Any) -> Any:  # what orjson cannot write: counted here, written as null
        nonlocal extra
        if isinstance(value, bytes | bytearray | memoryview):
            extra += len(value)
        elif isinstance(value, Mapping):
            return dict(value)
        elif isinstance(value, set | frozenset):
            return list(value)
        return None

    values = [(m.keys, m.new_values, m.old_values) for m in record.mods]
    try:
        body = len(orjson.dumps(values, default=other))
    except (TypeError, orjson.JSONEncodeError):  # a key that is not a str, a huge int
        n = 256
        for mod in record.mods:
            for part in (mod.keys, mod.new_values, mod.old_values):
                n += _dict_size(part)
        return n
    entries = sum(len(k) + len(n) + len(o) for k, n, o in values)
    return 256 + body + extra + 2 * _PER_VALUE * entries


#: What a key or value costs besides its payload (the object header and its reference).
_PER_VALUE = 48


def _dict_size(values: Mapping[str, Any]) -> int:
    # The hot path of approx_size (every key and value of every record): str keys and
    # str / number / None values are measured inline, anything else by _value_size; the
    # sum is the same as _value_size's over every key and value.
    n = 2 * _PER_VALUE * len(values)
    for key, value in values.items():
        if type(key) is str:
            n += len(key) if key.isascii() else len(key.encode())
        else:
            n += _value_size(key) - _PER_VALUE
        kind = type(value)
        if kind is str:
            n += len(value) if value.isascii() else len(value.encode())
        elif value is not None and kind is not int and kind is not float and kind is not bool:
            n += _value_size(value) - _PER_VALUE
    return n


def _value_size(value: Any) -> int:
    if isinstance(value, str):
        # isascii() is O(1) in CPython; only non-ASCII text pays for an encode
        return _PER_VALUE + (len(value) if value.isascii() else len(value.encode()))
    if isinstance(value, bytes | bytearray):
        return _PER_VALUE + len(value)
    if isinstance(value, dict):
        return _PER_VALUE + _dict_size(value)
    if isinstance(value, list | tuple):
        return _PER_VALUE + sum(_value_size(v) for v in value)
    return _PER_VALUE  # numbers, booleans, None, dates, timestamps, Decimals
