"""The fused chain: one task's copy of the transforms after ReadPartition, and its writers.

Nothing is shuffled: a task pushes each DataChangeRecord through every ParDo downstream of
ReadPartition (linear or branching) and hands the results to sink writers, opened on first
use. With ``max_inflight > 1`` on ReadPartition the ParDos of several records run
concurrently on a pool while sink writers still receive elements in record order: an
:class:`~cdcflow.inflight.InflightTracker` releases only the contiguously completed prefix.

One line: a chain that is ReadPartition -> ParDo ... -> one sink, without ``max_inflight``
or bundles (the usual pipeline), runs fused: each record goes down the line and into the
sink's writer in one call, without the general path's delivery list, and a Map's function
(``DoFn.as_function``) is called directly. Outputs, writes, counts and error handling are
the general path's.

Bundles: when a DoFn of the chain has ``bundle_size > 1`` the chain holds consecutive
records (charged to the quota) and runs them as one bundle, node by node, so that each
bundling DoFn's ``process_bundle`` sees every element the bundle's records gave it; each
record's deliveries are then put back in the order a record-at-a-time run gives them. A
bundle ends at the largest ``bundle_size`` records, at a quarter of the quota's bytes, at
a barrier (a heartbeat), when the quota runs short (so a held bundle never blocks reading)
and at the end of the task. Under ``max_inflight > 1`` a bundle is one item of the pool.

Memory: every record is charged to the process's byte quota
(:func:`cdcflow.engine.quota.process_quota`) before it enters the chain and given back once
every sink writer has taken its outputs, so reading blocks (in :meth:`Chain._wait_for_quota`)
while the tasks of the process hold the quota, whatever ``max_inflight`` is. Bytes go back
in lots (a 64th of the quota, at most 1 MiB: the quota's lock once a lot, not once a
record); a read that waits gives its chain's lot back first.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import cloudpickle

from cdcflow.engine._chain_parts import (
    Delivery,
    Evaluated,
    Failure,
    Item,
    Line,
    LineStep,
    Path,
    Skipped,
    shape_of,
)
from cdcflow.engine.guard import guard_for, stopping_for
from cdcflow.engine.listener import note_task_done, note_task_held_back
from cdcflow.engine.program import TaskProgram
from cdcflow.engine.quota import ByteQuota, process_quota, quota_limit
from cdcflow.engine.runner import ChildSeen, Task, TaskResult
from cdcflow.errors import (
    BatchInterrupted,
    FencedError,
    LeaseExpiredError,
    PipelineDefinitionError,
    PipelineStopped,
    SinkIOError,
    UserInputError,
    WriterFailed,
    WriterStopped,
    describe,
    log_failure,
    user_code,
)
from cdcflow.inflight import Barrier, InflightTracker
from cdcflow.model import DataChangeRecord
from cdcflow.policy import FailedElement, Retry, Stop
from cdcflow.transforms.base import ParDo, Sink, SinkWriter, WriterContext

__all__ = ["Chain"]

_log = logging.getLogger("cdcflow.task")
_MAX_LOT = 1 << 20  # the most bytes a chain holds for others to take once its sinks took them


class Chain:
    """One task's copy of the transforms downstream of ReadPartition, and its writers.

    The copy (its DoFns unpickled, their functions) is made when the first element comes
    (or a sink's writer opens): a task that reads no change, an idle partition's, makes
    none. What the chain is like (:class:`Shape`) is known from the program."""

    def __init__(self, program: TaskProgram, task: Task) -> None:
        self._program = program
        self._task = task
        shape = shape_of(program)
        self._nodes: dict[str, ParDo[Any, Any] | Sink[Any, Any]] = {}  # see _load
        self._processes: dict[str, Callable[[Any], Sequence[Any]]] = {}
        self._loaded = False
        self._succ = program.successors
        self._steps = shape.steps
        self._ends = shape.ends
        self._counter_keys = shape.counter_keys
        self._step_inputs: dict[str, list[Any]] = {}
        self._policy = program.policy
        self._attempt: str | None = None  # unique per execution: retries write elsewhere
        self._writers: dict[str, SinkWriter[Any, Any]] = {}
        self._set_up: list[tuple[str, ParDo[Any, Any]]] = []  # (label, step)
        self._started = False
        self._skipped = 0
        self._retries = 0
        self._bundle_retries = 0  # bundles whose process_bundle raised
        self._counts: dict[str, int] = {}  # touched on the reader thread only
        self._count_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: InflightTracker | None = None
        self._released: list[tuple[int, Any]] = []
        self._release_lock = threading.Lock()
        self._quota: ByteQuota = process_quota(quota_limit(program.max_inflight_bytes))
        self._held = 0  # bytes this chain charged to the quota, not yet returned
        self._owed = 0  # of those, bytes whose elements every sink has taken (given back soon)
        self._credit = 0  # of those, bytes taken ahead for records not read yet
        # taken and given back in lots of at most this many bytes: one lock a lot, not one
        # a record
        self._owed_lot = max(1, min(self._quota.limit // 64, _MAX_LOT))
        self._peak_held = 0
        if program.max_inflight > 1:
            self._inflight = InflightTracker(program.max_inflight, self._quota.limit)
        self._bundle_size = shape.bundle_size
        self._bundle: list[tuple[DataChangeRecord, int, int]] = []  # (record, position, size)
        self._bundle_bytes = 0
        self._order = shape.order
        # a chain that is one line of ParDos into one sink runs fused (see _push_line); its
        # steps are made with the copy (_start)
        self._line_labels = (
            shape.line(program, task.sinks)
            if self._inflight is None and self._bundle_size == 1 else None
        )
        self._line: Line | None = None
        #: ``push(record, position, size)``: run ``record`` (``size`` bytes,
        #: :func:`approx_size`) through the chain; blocks while the process's byte quota
        #: is used up. Chosen once: the fused path for one line, else the general one.
        self.push: Callable[[DataChangeRecord, int, int], None] = (
            self._push if self._line_labels is None else self._push_line
        )

    def _load(self) -> None:
        """Make this task's copy of the transforms (once)."""
        if self._loaded:
            return
        self._loaded = True
        self._nodes = nodes = pickle.loads(self._program.chain)
        self._processes = {
            label: functools.partial(_process, node.fn.process)
            for label, node in nodes.items() if isinstance(node, ParDo)
        }
        if self._line_labels is not None:
            steps, sink = self._line_labels
            line_steps = []
            for label in steps:
                node = nodes[label]
                assert isinstance(node, ParDo)
                line_steps.append(LineStep(label, node.fn, self._processes[label]))
            self._line = Line(tuple(line_steps), sink, self._counter_keys[sink][2])

    # -- feeding records ---------------------------------------------------------------------

    def _push(self, record: DataChangeRecord, position: int, size: int) -> None:
        """:attr:`push` of a chain that is not one line (or runs records concurrently, or
        in bundles)."""
        if not self._started:
            self._start()
        self._wait_for_quota(size)
        if self._bundle_size > 1:
            self._bundle.append((record, position, size))
            self._bundle_bytes += size
            if (len(self._bundle) >= self._bundle_size
                    or self._bundle_bytes >= self._quota.limit // 4):
                self._run_bundle()
            return
        if self._inflight is None:
            # on this thread: the steps count straight into the chain's counters
            self._deliver(record, self._evaluate(record, self._counts))
            self._give_back(size)
            return
        self._submit([(record, position, size)], lambda: [self._evaluate(record)])

    def _run_bundle(self) -> None:
        """Run the held bundle (if any) through the chain, or hand it to the pool."""
        bundle, self._bundle, self._bundle_bytes = self._bundle, [], 0
        if not bundle:
            return
        records = [record for record, _, _ in bundle]
        if self._inflight is None:
            for (record, _, size), evaluated in zip(
                bundle, self._evaluate_bundle(records), strict=True
            ):
                self._deliver(record, evaluated)
                self._give_back(size)
            return
        self._submit(bundle, lambda: self._evaluate_bundle(records))

    def _submit(
        self, items: list[tuple[DataChangeRecord, int, int]],
        evaluate: Callable[[], list[Evaluated]],
    ) -> None:
        """Run ``evaluate`` (the evaluation of ``items``' records) on the pool as one
        in-flight item at the last record's position."""
        assert self._pool is not None and self._inflight is not None
        size = sum(n for _, _, n in items)
        seq = self._inflight.begin(items[-1][1], size)  # blocks while max_inflight in flight
        future = self._pool.submit(evaluate)
        future.add_done_callback(lambda f: self._completed(seq, items, f))
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
        credit = self._credit
        if size <= credit:  # taken ahead, in the last lot: the usual case
            self._credit = credit - size
        else:
            self._charge(size)
        # what the sinks took, and the credit, are held for the quota only, not in the chain
        held = self._held - self._owed - self._credit
        if held > self._peak_held:
            self._peak_held = self._counts["inflight_bytes_peak"] = held

    def _charge(self, size: int) -> None:
        """Take ``size`` bytes from the quota, with a lot of credit for the next records
        when there is room at once; else exactly ``size``, waiting for them."""
        quota = self._quota
        if self._credit:  # too little for this record: given back first
            quota.release(self._credit)
            self._held -= self._credit
            self._credit = 0
        lot = self._owed_lot
        if size < lot and quota.try_acquire(lot):
            self._held += lot
            self._credit = lot - size
            return
        if not quota.try_acquire(size):  # room at once: untimed
            began = time.perf_counter()
            self._held_back("room in the byte quota (the sinks have not taken earlier elements)")
            try:
                while not quota.acquire(size, until=self._must_give_back):
                    self._run_bundle()  # a held bundle would hold its bytes while this waits
                    self._flush()
                    self._give_back_owed()
            finally:
                self._held_back(None)
            waited = time.perf_counter() - began
            if waited > 0.001:  # admitted at once takes microseconds: this one waited
                counts = self._counts
                counts["quota_waits"] = counts.get("quota_waits", 0) + 1
                counts["quota_wait_us"] = counts.get("quota_wait_us", 0) + int(waited * 1e6)
        self._held += size

    def _held_back(self, by: str | None) -> None:
        """Say what this task waits for (None: its read again), for the stuck watch."""
        task = self._task
        note_task_held_back(task.pipeline, task.batch_id, task.slice.token, by)

    def _must_give_back(self) -> bool:
        # Read without the lock: a stale answer only delays.
        return bool(self._released) or bool(self._bundle) or self._owed > 0

    def _give_back(self, size: int) -> None:
        """Every sink has taken the outputs of a record of ``size`` bytes: its bytes go
        back to the quota, in lots (a waiting read of this chain gives them back first)."""
        owed = self._owed = self._owed + size
        if owed >= self._owed_lot:
            self._give_back_owed()

    def _give_back_owed(self) -> None:
        owed, self._owed = self._owed, 0
        if owed:
            self._held -= owed
            self._quota.release(owed)

    def _give_back_all(self) -> None:
        self._owed = self._credit = 0
        held, self._held = self._held, 0
        if held:
            self._quota.release(held)

    def barrier(self, position: int) -> None:
        self._run_bundle()  # the tracker takes positions in order: the bundle's come first
        if self._inflight is None:
            return
        with self._release_lock:
            self._released.extend(self._inflight.barrier(position))
        self._flush()

    def _completed(
        self, seq: int, items: list[tuple[DataChangeRecord, int, int]],
        future: Future[list[Evaluated]],
    ) -> None:
        error = CancelledError() if future.cancelled() else future.exception()
        result: Any = Failure(error) if error is not None else [
            (record, evaluated, size)
            for (record, _, size), evaluated in zip(items, future.result(), strict=True)
        ]
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
            if isinstance(result, Failure):
                raise result.error
            for record, evaluated, size in result:
                self._deliver(record, evaluated)
                self._give_back(size)

    def _start(self) -> None:
        if self._started:
            return
        self._started = True
        self._load()
        # DoFn.setup runs once per task, before the first element, on this thread.
        for label, node in self._nodes.items():
            if isinstance(node, ParDo):
                with user_code(f"in setup() of step {label!r}"):
                    node.fn.setup()
                self._set_up.append((label, node))
        if self._line is not None:  # a DoFn may make its function in setup
            for step in self._line.steps:
                step.function = step.fn.as_function()
        if self._inflight is not None:
            self._pool = ThreadPoolExecutor(
                self._inflight.max_inflight, thread_name_prefix="cdcflow-inflight"
            )

    # -- running transforms -----------------------------------------------------------------

    def _evaluate(
        self, record: DataChangeRecord, counts: dict[str, int] | None = None
    ) -> Evaluated:
        """Run every ParDo on ``record``; the sink deliveries in chain order, and how many
        elements each ParDo took and gave: counted in ``counts`` (the chain's own, on the
        reader thread), else in a dict of their own (merged on the reader thread)."""
        out: list[Delivery] = []
        if counts is None:
            counts = {}
        visit = self._visit
        for label in self._succ[self._program.read_label]:
            visit(label, record, record, counts, out)
        return Evaluated(out, counts)

    def _visit(
        self, label: str, element: Any, record: DataChangeRecord, counts: dict[str, int],
        out: list[Delivery],
    ) -> None:
        """:meth:`_evaluate` of ``element`` from step ``label`` on (a method, not a closure
        made per record: this runs for every element)."""
        if label in self._ends:  # a sink, or a step the engine folds on the driver
            out.append((label, element))
            return
        key_in, key_out, _ = self._counter_keys[label]
        counts[key_in] = counts.get(key_in, 0) + 1
        process = self._processes[label]
        try:  # _guarded, inline: its first attempt is the usual case
            outputs = process(element)
        except Exception as exc:
            outputs = self._failing(label, record, element, process, element, exc)
        if isinstance(outputs, Skipped):
            if self._program.dead_letter_label is not None:
                out.append((self._program.dead_letter_label,
                            self._failed(label, record, element, outputs)))
            return
        counts[key_out] = counts.get(key_out, 0) + len(outputs)
        successors = self._succ[label]
        for value in outputs:
            for nxt in successors:
                self._visit(nxt, value, record, counts, out)

    # -- one line: the fused path -----------------------------------------------------------

    def _push_line(self, record: DataChangeRecord, position: int, size: int) -> None:
        """:attr:`push` for a chain that is one line: :meth:`_evaluate` and
        :meth:`_deliver` in one, with the same outputs, writes, counts, error handling and
        order of calls (depth first), without a delivery list. A step with a plain function
        (``DoFn.as_function``: Map's) is called directly while one element goes down the
        line."""
        if not self._started:
            self._start()
        self._wait_for_quota(size)
        line = self._line
        assert line is not None
        element: Any = record
        for at, step in enumerate(line.steps):
            function = step.function
            if function is None:
                self._line_visit(record, line, at, element, None)
                break
            try:
                element = function(element)
            except Exception as exc:
                self._line_visit(record, line, at, element, exc)
                break
            step.taken += 1
            step.given += 1
        else:
            self._line_write(record, line, element)
        # _give_back, inline
        owed = self._owed = self._owed + size
        if owed >= self._owed_lot:
            self._give_back_owed()

    def _line_visit(
        self, record: DataChangeRecord, line: Line, at: int, element: Any,
        failed: Exception | None,
    ) -> None:
        """``element`` down the line from step ``at`` on, each output to the end before the
        next (as :meth:`_visit`); ``failed``: what step ``at`` raised on it already."""
        steps = line.steps
        if at == len(steps):
            self._line_write(record, line, element)
            return
        step = steps[at]
        step.taken += 1
        if failed is None:
            try:
                outputs = step.normalized(element)
            except Exception as exc:
                failed = exc
        if failed is not None:
            decided = self._failing(step.label, record, element, step.normalized, element,
                                    failed)
            if isinstance(decided, Skipped):
                step.skipped += 1
                if self._program.dead_letter_label is not None:
                    self._write_dead(self._failed(step.label, record, element, decided))
                return
            outputs = decided
        step.given += len(outputs)
        for value in outputs:
            self._line_visit(record, line, at + 1, value, None)

    def _line_write(self, record: DataChangeRecord, line: Line, element: Any) -> None:
        writer = line.writer or self._line_writer(line)
        line.writes += 1
        try:  # _guarded, inline: its first attempt is the usual case
            writer.write(element)
        except Exception as exc:
            self._write_failed(line.sink, record, element, writer, exc)

    def _line_writer(self, line: Line) -> SinkWriter[Any, Any]:
        writer = line.writer = self._writer(line.sink)
        return writer

    def _write_failed(
        self, label: str, record: DataChangeRecord, element: Any, writer: SinkWriter[Any, Any],
        exc: Exception,
    ) -> None:
        """A sink's ``write(element)`` raised ``exc``: what the error policy decides."""
        done = self._failing(label, record, element, writer.write, element, exc)
        if isinstance(done, Skipped) and self._program.dead_letter_label is not None:
            self._write_dead(self._failed(label, record, element, done))

    def _write_dead(self, failed: FailedElement) -> None:
        """Write ``failed`` to the dead-letter sink (unless this task replays other sinks);
        a failing dead-letter sink fails the task."""
        dead = self._program.dead_letter_label
        wanted = self._task.sinks
        if dead is None or (wanted is not None and dead not in wanted):
            return
        self._writer(dead).write(failed)
        counts = self._counts
        for key in (self._counter_keys[dead][2], "dead_lettered"):
            counts[key] = counts.get(key, 0) + 1

    def _evaluate_bundle(self, records: list[DataChangeRecord]) -> list[Evaluated]:
        """:meth:`_evaluate` of each of ``records``, run node by node so that a bundling
        DoFn gets all of its elements from the bundle at once. Each record's deliveries
        come out in the order :meth:`_evaluate` gives: sorted by their paths, which is the
        depth-first order of the record's trip."""
        out: list[list[tuple[Path, Delivery]]] = [[] for _ in records]
        counts: list[dict[str, int]] = [{} for _ in records]
        waiting: dict[str, list[Item]] = {}

        def route(source: str, index: int, path: Path, element: Any) -> None:
            for s, nxt in enumerate(self._succ[source]):
                waiting.setdefault(nxt, []).append((index, (*path, s), element))

        for index, record in enumerate(records):
            route(self._program.read_label, index, (), record)
        for label in self._order:
            items = waiting.pop(label, None)
            if not items:
                continue
            node = self._nodes.get(label)
            if label in self._steps or isinstance(node, Sink):
                for index, path, element in items:
                    out[index].append((path, (label, element)))
                continue
            assert isinstance(node, ParDo)
            for (index, path, element), outputs in zip(
                items, self._run_pardo(label, node, items, records), strict=True
            ):
                n = counts[index]
                n[f"elements_in/{label}"] = n.get(f"elements_in/{label}", 0) + 1
                if isinstance(outputs, Skipped):
                    if self._program.dead_letter_label is not None:
                        failed = self._failed(label, records[index], element, outputs)
                        out[index].append((path, (self._program.dead_letter_label, failed)))
                    continue
                n[f"elements_out/{label}"] = n.get(f"elements_out/{label}", 0) + len(outputs)
                for j, value in enumerate(outputs):
                    route(label, index, (*path, j), value)
        return [
            Evaluated([d for _, d in sorted(o, key=lambda pd: pd[0])], c)
            for o, c in zip(out, counts, strict=True)
        ]

    def _run_pardo(
        self, label: str, node: ParDo[Any, Any], items: list[Item],
        records: list[DataChangeRecord],
    ) -> list[list[Any] | Skipped]:
        """The outputs of ``node`` for each item: through ``process_bundle`` in chunks of
        its ``bundle_size``, or (for a DoFn of 1, and for a chunk whose ``process_bundle``
        raised) element by element under the error policy."""
        fn = node.fn
        results: list[list[Any] | Skipped] = []
        step = max(1, fn.bundle_size)
        for at in range(0, len(items), step):
            chunk = items[at:at + step]
            if step > 1:
                try:
                    produced = fn.process_bundle([element for _, _, element in chunk])
                    if len(produced) != len(chunk):
                        msg = (
                            f"{type(fn).__name__}.process_bundle returned {len(produced)} "
                            f"outputs for {len(chunk)} elements; return one iterable per "
                            "element"
                        )
                        raise ValueError(msg)
                    results.extend([] if o is None else list(o) for o in produced)
                    continue
                except (SinkIOError, PipelineStopped):
                    raise
                except Exception as exc:  # each element again, under the error policy
                    _log.info("%r: a bundle of %d failed (%s: %s); processing its elements "
                              "one by one", label, len(chunk), type(exc).__name__, exc)
                    with self._count_lock:
                        self._bundle_retries += 1
            for index, _, element in chunk:
                results.append(self._guarded(label, records[index], element,
                                             self._processes[label], element))
        return results

    def _deliver(self, record: DataChangeRecord, evaluated: Evaluated) -> None:
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
            if label == dead:
                self._write_dead(element)
                continue
            writer = self._writers.get(label) or self._writer(label)
            key = self._counter_keys[label][2]
            counts[key] = counts.get(key, 0) + 1
            try:  # _guarded, inline: its first attempt is the usual case
                writer.write(element)
            except Exception as exc:
                self._write_failed(label, record, element, writer, exc)

    def _guarded(
        self, label: str, record: DataChangeRecord, element: Any, call: Callable[[Any], Any],
        argument: Any,
    ) -> Any:
        """``call(argument)`` under the error policy: its value, or Skipped when skipped."""
        try:
            return call(argument)  # the usual case, without the policy's loop
        except Exception as exc:
            return self._failing(label, record, element, call, argument, exc)

    def _failing(
        self, label: str, record: DataChangeRecord, element: Any, call: Callable[[Any], Any],
        argument: Any, first: Exception,
    ) -> Any:
        """:meth:`_guarded` once ``call(argument)`` raised ``first``: what the error policy
        decides, attempt after attempt."""
        exc, failed = first, 0
        while True:
            if isinstance(exc, SinkIOError | PipelineStopped | WriterFailed | WriterStopped
                          | BatchInterrupted | FencedError | LeaseExpiredError
                          | UserInputError):
                # the sink's storage failed, not the element (the batch is retried), or it
                # was decided further down (a sink with a policy of its own), or the writer
                # failed as a whole or gave the batch up on a stop (the next run replays
                # it), or the run may no longer act (its guard: engine.guard), or the
                # pipeline or its configuration is wrong (LookupRows naming a column the
                # table lacks): no retry or skip of an element mends that
                raise exc
            failed += 1
            token, at = _origin(record)
            decision = self._policy.decide(exc, element, token, failed)
            if isinstance(decision, Retry):
                time.sleep(decision.after)
                with self._count_lock:
                    self._retries += 1
                try:
                    return call(argument)
                except Exception as again:
                    exc = again
                    continue
            where = (
                f"{label!r} failed on a change of partition {token} "
                f"committed at {at} after {failed} attempt(s): {describe(exc)}"
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
            return Skipped(describe(exc))

    def _failed(
        self, label: str, record: DataChangeRecord, element: Any, skipped: Skipped
    ) -> FailedElement:
        token, at = _origin(record)
        return FailedElement(
            label=label, error=skipped.error, partition_token=token, commit_timestamp=at,
            element=element,
        )

    def _writer(self, label: str) -> SinkWriter[Any, Any]:
        writer = self._writers.get(label)
        if writer is None:
            self._load()
            sink = self._nodes[label]
            assert isinstance(sink, Sink)
            sl = self._task.slice
            with user_code(f"in open_writer() of sink {label!r}"):
                writer = self._open_writer(label, sink, sl)
            if not isinstance(writer, SinkWriter):
                msg = (f"sink {label!r}: open_writer() returned {type(writer).__name__}, not "
                       "a SinkWriter (an object with write(element), close() and abort()); "
                       "fix the sink")
                raise PipelineDefinitionError(msg)
            self._writers[label] = writer
        return writer

    def _open_writer(self, label: str, sink: Sink[Any, Any], sl: Any) -> SinkWriter[Any, Any]:
        return sink.open_writer(WriterContext(
            pipeline=self._program.pipeline, sink_label=label, batch_id=self._task.batch_id,
            partition_token=sl.token, slice_start=sl.start, slice_end=sl.end,
            attempt=self._attempt_id(), guard=guard_for(self._program.pipeline),
            error_policy=self._policy,
            dead_letter=self._program.dead_letter_label is not None,
            hold=self._quota.take, let_go=self._quota.release,
            stopping=stopping_for(self._program.pipeline),
            holding_back=lambda waiting: self._held_back(
                f"sink {label!r} to take its elements" if waiting else None),
        ))

    def _attempt_id(self) -> str:
        if self._attempt is None:
            self._attempt = uuid.uuid4().hex
        return self._attempt

    # -- ending -----------------------------------------------------------------------------

    def finish(self) -> dict[str, Any]:
        """Drain in-flight work, tear down, close writers; the sink commit messages."""
        self._run_bundle()
        if self._inflight is not None:
            self._inflight.drain()
            self._flush()
        self._shutdown()
        self._give_back_all()
        teardown, self._set_up = self._set_up, []
        for label, node in teardown:
            with user_code(f"in teardown() of step {label!r}"):
                node.fn.teardown()
        messages: dict[str, Any] = {}
        dead = self._program.dead_letter_label
        # the dead-letter sink closes last: a writer that skips elements itself (Consume)
        # hands them over as it closes
        for label in sorted(self._writers, key=lambda label: label == dead):
            writer = self._writers.pop(label)
            with user_code(f"in close() of the writer of sink {label!r}"):
                messages[label] = writer.close()
            # a writer with an error policy of its own (Consume) counts what it did
            counted = getattr(writer, "policy_counters", None)
            if counted is not None:
                counts = counted()
                self._skipped += int(counts.get("skipped", 0))
                self._retries += int(counts.get("retries", 0))
            skipped = getattr(writer, "dead_letters", None)
            if skipped is not None and label != dead:
                self._dead_letter(label, skipped())
        if dead is not None and dead in self._writers:
            with user_code(f"in close() of the writer of sink {dead!r}"):
                messages[dead] = self._writers.pop(dead).close()
        return messages

    def _dead_letter(self, label: str, skipped: list[tuple[Any, str]]) -> None:
        """Write the elements a sink's writer skipped to the dead-letter sink."""
        dead = self._program.dead_letter_label
        wanted = self._task.sinks
        if not skipped or dead is None or (wanted is not None and dead not in wanted):
            return
        for element, error in skipped:
            token, at = _origin(element)
            self._write_dead(FailedElement(
                label=label, error=error, partition_token=token or self._task.slice.token,
                commit_timestamp=at, element=element,
            ))

    def abort(self) -> None:
        self._bundle, self._bundle_bytes = [], 0  # its bytes are in _held: given back below
        self._shutdown()
        self._give_back_all()
        for _, node in self._set_up:
            try:
                node.fn.teardown()
            except Exception as exc:
                log_failure(_log, "teardown() of a DoFn failed while aborting a task", exc=exc)
        self._set_up = []
        for writer in self._writers.values():
            try:
                writer.abort()
            except Exception as exc:
                log_failure(_log, "abort() of a sink writer failed", exc=exc)
        self._writers.clear()

    def _shutdown(self) -> None:
        if self._line is not None:
            self._line.writer = None  # its writer closes or aborts next
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
        ``inflight_bytes_peak`` (the most bytes this task held of the process's byte quota;
        a batch takes the largest over its tasks), ``inflight_bytes_limit`` (that quota),
        ``quota_waits`` / ``quota_wait_us`` (reads that waited for room in the quota, and
        how long in all), ``bundle_retries`` (bundles whose ``process_bundle`` raised and
        whose elements were then processed one by one)."""
        counts = {**self._counts, "skipped": self._skipped, "retries": self._retries,
                  "inflight_bytes_limit": self._quota.limit}
        line = self._line
        if line is not None:  # the fused path counts apart
            for step in line.steps:
                # as the general path counts: out once an element was not skipped, even 0
                if step.taken:
                    key = f"elements_in/{step.label}"
                    counts[key] = counts.get(key, 0) + step.taken
                if step.taken > step.skipped:
                    key = f"elements_out/{step.label}"
                    counts[key] = counts.get(key, 0) + step.given
            if line.writes:
                counts[line.sink_key] = counts.get(line.sink_key, 0) + line.writes
        if self._bundle_retries:
            counts["bundle_retries"] = self._bundle_retries
        return counts

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


def _process(process: Callable[[Any], Any], element: Any) -> Sequence[Any]:
    """What a DoFn's ``process`` gave for ``element``, as a sequence."""
    produced = process(element)
    if type(produced) is tuple or type(produced) is list:  # Map's, Filter's: as they are
        return produced
    if produced is None:
        return []
    if not isinstance(produced, str | bytes | dict):  # iterable, yet one value by mistake
        try:
            return list(produced)  # a generator, the usual case: no ABC check on its way
        except TypeError:
            if isinstance(produced, Iterable):
                raise  # raised while iterating: the DoFn's own error
    owner = getattr(process, "__self__", None)
    msg = (f"{type(owner).__name__ if owner is not None else 'a DoFn'}.process() returned "
           f"a value of type {type(produced).__name__}; it must return an iterable of "
           "outputs (a list, or yield them), or None for none")
    raise TypeError(msg)
