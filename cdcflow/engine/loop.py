"""The micro-batch engine: plan -> execute -> commit, the same for every runner.

Each batch follows the commit protocol of the design contract (§4), numbered the same way
in the code below:

1. plan: a pending plan in the store (a batch planned by an earlier run that did not
   commit) is replayed as it is; otherwise :func:`~cdcflow.engine.lifecycle.plan_batch`
   schedules ready partitions and chooses the batch end ``T`` (never ahead of the clock,
   at most ``max_batch_span`` after the low watermark), and the plan is written to the
   store before any task runs (write-ahead);
2. execute: the runner runs one task per slice (:mod:`cdcflow.engine.task`);
3. commit: (a) every sink commits the batch (idempotent per batch id); (b) the store
   commits all progress of the batch in one transaction — watermarks, finished
   partitions, children, as :func:`~cdcflow.engine.lifecycle.fold` derives them from what
   the tasks read; (c) every sink learns the new low watermark; (d) finished partitions
   whose children have all started are garbage collected after ``gc_ttl``.

A crash at any point leaves either a pending plan, which the next run replays with the
same slices, or a committed batch: with deterministic reads and idempotent sink commits
the output is exactly once.
"""

from __future__ import annotations

import json
import logging
import math
import pickle
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import Any

import attrs
import cloudpickle

from cdcflow.backoff import RetryPolicy
from cdcflow.dag import Dag
from cdcflow.engine.durability import StagedSinks
from cdcflow.engine.lifecycle import (
    all_finished,
    count_states,
    fold,
    gc_candidates,
    low_watermark,
    plan_batch,
)
from cdcflow.engine.listener import BatchStats, EngineListener, RunSummary
from cdcflow.engine.ownership import Ownership
from cdcflow.engine.partitions import IdleSchedule, PartitionView
from cdcflow.engine.runner import Runner, Task, TaskResult
from cdcflow.engine.task import TaskProgram, make_client
from cdcflow.errors import (
    FencedError,
    PipelineDefinitionError,
    PipelineStopped,
    RunnerContractError,
    TransientError,
)
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    BatchPlan,
    PartitionMetadata,
    PartitionState,
    Timestamp,
)
from cdcflow.transforms.base import Sink, SinkContext

__all__ = ["Engine", "RunOptions"]

_log = logging.getLogger("cdcflow.engine")
_NS = 1_000_000_000
_TICK = 0.05  # seconds between checks for a stop request while waiting


def _non_negative(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value < 0:
        msg = f"RunOptions.{attribute.name} must be 0 or more, got {value}"
        raise ValueError(msg)


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value <= 0:
        msg = f"RunOptions.{attribute.name} must be more than 0, got {value}"
        raise ValueError(msg)


@attrs.frozen
class RunOptions:
    """How a run proceeds. Durations are seconds.

    ``batch_interval``: the least time between the starts of batches once the pipeline has
    caught up with the clock (a lagging pipeline runs batches back to back).
    ``max_batch_span``: a batch reads at most this far past the low watermark.
    ``max_batches`` / ``duration``: stop after that many batches / seconds (None: no limit).
    ``reset``: forget the pipeline's stored progress first and start over.
    ``gc_ttl``: delete finished partitions this long after they finished (once their
    children have started). ``base_dir``: relative sink paths resolve against it.
    ``idle_read_interval``: an idle partition (no data in its last slices) is queried less
    often, its wait doubling up to this many seconds; the resolved watermark then lags by
    at most that much more (0: every partition every batch; see
    :mod:`cdcflow.engine.partitions`).
    ``takeover``: take the pipeline over from a run whose lease is still alive (after
    confirming it is gone); ``lease_ttl``: how long this run's lease holds without a
    heartbeat (:mod:`cdcflow.engine.ownership`). ``strict``: refuse to resume stored
    progress made with another source definition (database, stream, start_at, end_at)
    instead of warning.
    ``batch_retries`` / ``retry_backoff``: a batch whose tasks (or sink commits) failed with
    a transient error is run again up to this many times, after a fully jittered wait whose
    cap starts at ``retry_backoff`` and doubles (:class:`cdcflow.backoff.RetryPolicy`).
    """

    batch_interval: float = attrs.field(default=1.0, validator=_non_negative)
    max_batch_span: float = attrs.field(default=10.0, validator=_positive)
    max_batches: int | None = attrs.field(default=None, validator=_positive)
    duration: float | None = attrs.field(default=None, validator=_non_negative)
    reset: bool = False
    gc_ttl: float = attrs.field(default=3600.0, validator=_non_negative)
    base_dir: str = "."
    batch_retries: int = attrs.field(default=3, validator=_non_negative)
    retry_backoff: float = attrs.field(default=1.0, validator=_non_negative)
    takeover: bool = False
    lease_ttl: float = attrs.field(default=30.0, validator=_positive)
    idle_read_interval: float = attrs.field(default=5.0, validator=_non_negative)
    strict: bool = False


class Engine:
    """Runs a pipeline in micro-batches until its end, a limit, or a stop request.

    ``run()`` opens the runner and closes it (and the sinks) when the run ends; the store
    stays open (its owner closes it). :meth:`request_stop` (also on SIGINT/SIGTERM when
    nobody else handles them) ends the run gracefully after the current batch commits.
    ``clock`` returns nanoseconds since the epoch (tests may pass a fake one).
    """

    def __init__(
        self,
        pipeline: Dag,
        store: MetadataStore,
        runner: Runner,
        options: RunOptions | None = None,
        listener: EngineListener | None = None,
        *,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.pipeline = pipeline
        self.store = store
        self.runner = runner
        self.options = options or RunOptions()
        self.listener = listener or EngineListener()
        self._clock = clock
        self._stop = threading.Event()
        opts = self.options
        # A stop request cuts a backoff wait short (the retry then runs, and the run stops
        # after the batch): Ctrl-C is never ignored for the length of a backoff.
        self._batch_retry = RetryPolicy(
            attempts=opts.batch_retries + 1, initial=opts.retry_backoff, maximum=math.inf,
            sleep=self._backoff_wait,
        )
        self._splits = 0
        self._merges = 0
        self._owner: Ownership | None = None
        self._sink_floor = 0
        self._stop_reason = "interrupted"
        self._staged: StagedSinks | None = None
        self._view: PartitionView | None = None
        self._idle = IdleSchedule(0.0, 0.0)

    def _sink_stop(self, reason: str) -> None:
        """A sink ended the run (its consumer went away): stop after this batch commits."""
        _log.info("%s: stopping after the current batch", reason)
        self._stop_reason = reason
        self.request_stop()

    def _lost(self, error: FencedError) -> None:
        """Another run took the pipeline over: stop (its writes are fenced out anyway)."""
        self.request_stop()

    @property
    def _fence(self) -> int:
        assert self._owner is not None
        return self._owner.token

    def _backoff_wait(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def request_stop(self) -> None:
        """Stop after the current batch commits (safe from any thread or signal handler)."""
        self._stop.set()

    stop = request_stop

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Run until the end is reached, a limit passes, or a stop is requested."""
        pipeline, opts = self.pipeline, self.options
        pipeline.validate()
        name = pipeline.name
        sinks = self._sinks(TaskProgram.from_pipeline(pipeline))
        for label, sink in sinks.items():
            sink.setup(SinkContext(pipeline=name, sink_label=label, base_dir=opts.base_dir,
                                   request_stop=self._sink_stop))
        _check_locations(sinks)
        # Batch ids go on above any output a sink already holds (a lost or new store must
        # never make a sink reuse a batch id it committed before).
        self._sink_floor = max((s.last_committed_batch() for s in sinks.values()), default=0)
        # Built (and its chain pickled) after setup: tasks need what setup resolved, such as
        # WriteFiles' directory.
        program = TaskProgram.from_pipeline(pipeline)
        program_bytes: bytes = cloudpickle.dumps(program)
        try:
            # The runner starts first: Spark forks its JVM launcher, and a fork after this
            # process has opened gRPC clients (the store's, the stream check's) can kill the
            # child before it execs.
            self.runner.open(name)
            try:
                info = make_client(program.source).describe_stream(program.source.stream)
                if info.partition_mode == "IMMUTABLE_KEY_RANGE":  # see engine.partitions
                    self._idle = IdleSchedule(opts.batch_interval or 0.1, opts.idle_read_interval)
                # One run per pipeline: every write below carries this run's fencing token.
                self._owner = Ownership(self.store, name, opts.lease_ttl, self._lost)
                self._owner.acquire(opts.takeover)
                try:
                    if opts.reset:
                        # The store keeps the batch id floor, so batch ids go on from before
                        # the reset and sinks that name output by batch id never reuse one.
                        self.store.reset(name)
                    self._first_run(program)
                    self._staged = StagedSinks(self.store, name, sinks, lambda: self._fence)
                    self._restore_staged(program_bytes, sinks)
                    self.listener.on_start(name, self.runner.name, self.store.url)
                    with self._signals():
                        summary = self._loop(program, program_bytes, sinks)
                    self._staged.flush()  # a graceful end: what is staged becomes durable
                finally:
                    self._owner.release()
                if self._owner.lost is not None:
                    raise self._owner.lost
            finally:
                self.runner.close()
        finally:
            for sink in sinks.values():
                try:
                    sink.close()
                except Exception:
                    _log.exception("closing a sink failed")
        self.listener.on_stop(summary)
        return summary

    def _sinks(self, program: TaskProgram) -> dict[str, Sink[Any, Any]]:
        # The driver's own sink objects (a Collect gathers its items on them).
        sinks: dict[str, Sink[Any, Any]] = {}
        for label in program.sink_labels:
            if label == program.dead_letter_label:
                assert self.pipeline.error_policy.dead_letter is not None
                sinks[label] = self.pipeline.error_policy.dead_letter
            else:
                sink = self.pipeline.transform(label)
                assert isinstance(sink, Sink)
                sinks[label] = sink
        return sinks

    def _first_run(self, program: TaskProgram) -> None:
        name = self.pipeline.name
        definition = json.dumps(program.source.definition(), sort_keys=True)
        if self.store.partitions(name) or self.store.pending_plan(name) is not None:
            stored = self.store.source(name)
            if stored is None:  # progress from before sources were stored
                self.store.set_source(name, definition)
            elif stored != definition:
                self._source_changed(json.loads(stored), program.source.definition())
            return
        now = self._clock()
        start, end = program.source.start_ns(now), program.source.end_ns(now)
        if start >= end:
            msg = (
                f"DetectPartitions: end_at ({Timestamp.from_ns(end - 1)}) is before start_at "
                f"({Timestamp.from_ns(start)}); give an end_at at or after start_at"
            )
            raise PipelineDefinitionError(msg)
        root = PartitionMetadata(
            token=INITIAL_PARTITION_TOKEN, parent_tokens=(), start=start, end=end,
            watermark=start, state=PartitionState.CREATED,
            heartbeat_millis=program.heartbeat_millis, created_at=now,
        )
        self.store.insert_partitions(name, [root])
        self.store.set_source(name, definition)
        _log.info("pipeline %s starts reading at %s", name, Timestamp.from_ns(start))

    def _source_changed(self, stored: dict[str, Any], now: dict[str, Any]) -> None:
        changes = ", ".join(
            f"{key} {stored.get(key)!r} -> {now.get(key)!r}"
            for key in sorted(set(stored) | set(now)) if stored.get(key) != now.get(key)
        )
        msg = (
            f"pipeline {self.pipeline.name!r}: its source changed since its stored progress "
            f"began ({changes}); "
        )
        if self.options.strict:
            msg += "run with --reset to start over with the new source, or undo the change"
            raise PipelineDefinitionError(msg)
        _log.warning(
            "%sresuming the stored progress; run with --reset to start over with the new "
            "source (--strict refuses instead)", msg,
        )

    def _loop(
        self, program: TaskProgram, program_bytes: bytes, sinks: dict[str, Sink[Any, Any]]
    ) -> RunSummary:
        name, opts = self.pipeline.name, self.options
        began = time.monotonic()
        deadline = None if opts.duration is None else began + opts.duration
        batches = records = 0
        totals = Counter[str]()
        reason = ""
        # Read once; from here on the view applies what this run writes (it owns the
        # pipeline), so a batch reads nothing from the store.
        view = PartitionView(self.store, name)
        self._view = view
        pending: BatchPlan | None = self.store.pending_plan(name)
        next_id = max(self.store.last_batch_id(name), self._sink_floor) + 1
        while True:
            if self._stop.is_set():
                reason = self._stop_reason
                break
            if opts.max_batches is not None and batches >= opts.max_batches:
                reason = "max batches"
                break
            if deadline is not None and time.monotonic() >= deadline:
                reason = "duration"
                break
            batch_began = time.monotonic()
            # 1. plan: replay a pending plan as it is, or plan the next batch and write it
            #    to the store before any task runs (write-ahead).
            plan, pending = pending, None
            replay = plan is not None
            now = self._clock()
            parts = view.snapshot()
            if plan is None:
                if all_finished(parts):
                    reason = "end reached"
                    break
                span = int(opts.max_batch_span * _NS)
                waiting = self._idle.waiting(parts, now)
                plan, transitions = plan_batch(parts, now, span, next_id, waiting)
                if not plan.slices:
                    # Nothing can advance yet: the clock has not passed the low watermark,
                    # or every partition is idle and waiting for its next read.
                    ahead = (low_watermark(parts) - now) / _NS
                    self._wait(min(max(ahead, 0.01), max(opts.batch_interval, 0.01)), deadline)
                    continue
                plan = attrs.evolve(plan, planned_at=now)
                self.store.write_plan(name, plan, transitions, fence=self._fence)
                view.planned(transitions, now)
            next_id = plan.batch_id + 1
            self.listener.on_planned(plan, replay)
            stats = self._execute(plan, replay, parts, program_bytes, sinks, batch_began)
            batches += 1
            records += stats.records
            for key in ("skipped", "retries", "dead_lettered"):
                totals[key] += stats.counters.get(key, 0)
            self.listener.on_batch(stats)
            if not replay and plan.end >= now:
                # Caught up with the clock: pace batches instead of spinning on tiny ones.
                self._wait(batch_began + opts.batch_interval - time.monotonic(), deadline)
        parts = view.snapshot()
        return RunSummary(
            pipeline=name, batches=batches, records=records, reason=reason,
            low_watermark=low_watermark(parts), partitions=count_states(parts),
            splits=self._splits, merges=self._merges, skipped=totals["skipped"],
            retried=totals["retries"], dead_lettered=totals["dead_lettered"],
        )

    def _wait(self, seconds: float, deadline: float | None) -> None:
        end = time.monotonic() + seconds
        if deadline is not None:
            end = min(end, deadline)
        while not self._stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return
            self._stop.wait(min(left, _TICK))

    # -- one batch ---------------------------------------------------------------------------

    def _execute(
        self,
        plan: BatchPlan,
        replay: bool,
        parts: Sequence[PartitionMetadata],
        program_bytes: bytes,
        sinks: dict[str, Sink[Any, Any]],
        began: float,
    ) -> BatchStats:
        """Run and commit ``plan``. ``parts`` are the partitions as stored before the batch
        (their ends and tokens are all the commit needs; only the commit changes them)."""
        name = self.pipeline.name
        phases = {"plan": time.monotonic() - began}
        mark = time.monotonic()

        def lap(phase: str) -> None:
            nonlocal mark
            now_s = time.monotonic()
            phases[phase] = now_s - mark
            mark = now_s

        # 2. execute: one task per slice, on the runner; then
        # 3a. commit the sinks (idempotent per batch id: a replay commits the same again).
        results = self._deliver(plan, program_bytes, sinks, None, lambda: lap("execute"))
        sinks_committed_at = self._clock()
        lap("sink_commit")
        self.listener.on_sinks_committed(plan.batch_id)

        # 3b. commit the store: the batch's progress, as the lifecycle reads the results.
        now = self._clock()
        outcome = fold({p.token: p for p in parts}, results, now)
        self._idle.read(results, now)
        self.store.commit_batch(
            name, plan.batch_id, list(outcome.updates), list(outcome.children), outcome.records,
            fence=self._fence, durable=self._staged.marks() if self._staged else None,
        )
        self._splits += outcome.splits
        self._merges += outcome.merges
        view = self._view
        assert view is not None
        view.committed(outcome, now)
        lap("store_commit")

        # 3c. tell every sink the new low watermark (a resolved timestamp).
        parts = view.snapshot()
        low = low_watermark(parts)
        for sink in sinks.values():
            sink.on_watermark(low)
        self.listener.on_partitions(parts, now)
        # 3d. garbage-collect finished partitions whose children have all started.
        expired = gc_candidates(parts, now, int(self.options.gc_ttl * _NS))
        if expired:
            self.store.delete_partitions(name, expired)
            view.deleted(expired)
            gone = set(expired)
            parts = [p for p in parts if p.token not in gone]
        lap("gc")
        counters: Counter[str] = Counter()
        for r in results:
            counters.update(r.counters)
        return BatchStats(
            batch_id=plan.batch_id, end=plan.end, slices=len(plan.slices),
            records=outcome.records, bytes=sum(r.bytes for r in results),
            seconds=time.monotonic() - began, low_watermark=low,
            partitions=count_states(parts), new_partitions=len(outcome.children),
            splits=outcome.splits, merges=outcome.merges, replayed=replay, phases=phases,
            counters=dict(counters),
            commit_times=tuple(t for r in results for t in r.commit_times),
            sinks_committed_at=sinks_committed_at,
        )

    def _deliver(
        self, plan: BatchPlan, program_bytes: bytes, sinks: dict[str, Sink[Any, Any]],
        only: tuple[str, ...] | None, executed: Callable[[], None] = lambda: None,
    ) -> list[TaskResult]:
        """Run ``plan``'s tasks and commit their output to ``sinks`` (those in ``only``,
        when given: a replay for sinks that had not made the batch durable).

        A transient failure of either (a reader's retries spent, a sink's storage fault)
        aborts the sinks' leftovers and runs both again under the batch retry policy; any
        other failure notes that the batch was not committed and propagates."""
        name = self.pipeline.name
        tasks = [pickle.dumps(Task(name, plan.batch_id, s, only)) for s in plan.slices]
        targets = sinks if only is None else {label: sinks[label] for label in only}

        def attempt() -> list[TaskResult]:
            try:
                done = self._run_tasks(plan, program_bytes, tasks)
                executed()
                for label, sink in targets.items():
                    messages = [
                        r.sink_messages[label] for r in done
                        if r.sink_messages.get(label) is not None
                    ]
                    sink.commit(plan.batch_id, messages)
            except BaseException:
                _abort(plan.batch_id, targets)
                raise
            return done

        def retrying(retry: int, exc: BaseException, delay: float) -> None:
            _log.warning(
                "batch %d failed (%s: %s); retry %d/%d in %.1fs", plan.batch_id,
                type(exc).__name__, exc, retry, self._batch_retry.retries, delay,
            )

        try:
            return self._batch_retry.call(attempt, retry_if=_is_transient, on_retry=retrying)
        except PipelineStopped:
            raise
        except Exception as exc:
            exc.add_note(
                f"batch {plan.batch_id} was not committed; its plan stays in the store and "
                "the next run replays it"
            )
            raise

    def _restore_staged(self, program_bytes: bytes, sinks: dict[str, Sink[Any, Any]]) -> None:
        """Deliver again the committed batches a staging sink had not made durable."""
        assert self._staged is not None
        for plan, targets in self._staged.replays():
            _log.info("batch %d again for %s (not durable there before the restart)",
                      plan.batch_id, ", ".join(targets))
            self._deliver(plan, program_bytes, sinks, targets)
            self._staged.record()

    def _run_tasks(
        self, plan: BatchPlan, program_bytes: bytes, tasks: Sequence[bytes]
    ) -> list[TaskResult]:
        """One result per task, in task order; raise RunnerContractError otherwise."""
        raw = self.runner.run_tasks(program_bytes, tasks)
        if len(raw) != len(tasks):
            msg = (
                f"runner {self.runner.name!r} returned {len(raw)} results for {len(tasks)} "
                "tasks; a runner must return one result per task, in task order"
            )
            raise RunnerContractError(msg)
        results = [pickle.loads(b) for b in raw]
        for result, s in zip(results, plan.slices, strict=True):
            if not isinstance(result, TaskResult) or result.token != s.token:
                msg = f"runner {self.runner.name!r} returned results out of task order"
                raise RunnerContractError(msg)
        return results

    # -- signals -----------------------------------------------------------------------------

    @contextmanager
    def _signals(self) -> Iterator[None]:
        """Graceful stop on SIGINT/SIGTERM, unless the caller (the CLI) handles them."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum: int, frame: FrameType | None) -> None:
            _log.warning("signal %d: stopping after the current batch", signum)
            self.request_stop()

        previous: dict[signal.Signals, Any] = {}
        for sig, default in ((signal.SIGINT, signal.default_int_handler),
                             (signal.SIGTERM, signal.SIG_DFL)):
            if signal.getsignal(sig) is default:
                previous[sig] = signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


def _abort(batch_id: int, sinks: dict[str, Sink[Any, Any]]) -> None:
    """Let every sink discard what failed tasks of the batch left behind (best effort)."""
    for label, sink in sinks.items():
        try:
            sink.abort(batch_id, [])
        except Exception:
            _log.exception("sink %r failed to abort batch %d", label, batch_id)


def _is_transient(exc: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, TransientError):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def _check_locations(sinks: dict[str, Sink[Any, Any]]) -> None:
    """Two sinks that would write the same output are a definition error (names both)."""
    seen: dict[str, str] = {}
    for label, sink in sinks.items():
        where = sink.output_location()
        if where is None:
            continue
        if where in seen:
            msg = (
                f"sinks {seen[where]!r} and {label!r} would write the same output ({where}); "
                "give one of them another path (or, for WriteFiles, another prefix=)"
            )
            raise PipelineDefinitionError(msg)
        seen[where] = label
