"""The micro-batch engine: plan -> execute -> commit, the same for every runner.

Each batch follows the commit protocol of the design contract (§4), numbered the same way
in the code below:

1. plan: a pending plan in the store (a batch planned by an earlier run that did not
   commit) is replayed as it is; otherwise :func:`~cdcflow.engine.lifecycle.plan_batch`
   schedules ready partitions and chooses the batch end ``T`` (never ahead of the clock,
   at most a span after the low watermark: ``max_batch_span``, paced, see
   :mod:`cdcflow.engine.pacing`), and the plan is written to the store before any sink
   commits the batch (write-ahead): once its tasks have returned (for a batch read ahead
   while the previous one committed, pipelined batches, see :mod:`cdcflow.engine.batch`:
   once the previous batch has committed, too);
2. execute: the runner runs one task per slice (:mod:`cdcflow.engine.task`);
3. commit: (a) every sink commits the batch (idempotent per batch id); (b) the store
   commits all progress of the batch in one transaction — watermarks, finished
   partitions, children, as :func:`~cdcflow.engine.lifecycle.fold` derives them from what
   the tasks read; (c) every sink learns the new low watermark; (d) finished partitions
   whose children have all started are garbage collected after ``gc_ttl``.

A crash at any point leaves either a pending plan, which the next run replays with the
same slices (a sink may have committed it), or a committed batch, or a batch whose plan
was not written (its tasks were reading): no sink had it, nothing commits the
attempt-specific output its tasks staged, and the next run plans it afresh, with half the
span after a crash (:mod:`cdcflow.engine.pacing`), so a batch that takes longer to read
than runs live does not hold the pipeline back for ever. With deterministic reads and
idempotent sink commits the output is exactly once. Steps 2 and 3 live in
:mod:`cdcflow.engine.batch`.
"""

from __future__ import annotations

import json
import logging
import math
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
from cdcflow.durations import is_relative_time
from cdcflow.engine.batch import Batches
from cdcflow.engine.durability import StagedSinks
from cdcflow.engine.guard import RunGuard, guarding
from cdcflow.engine.lifecycle import (
    all_finished,
    count_states,
    low_watermark,
    plan_batch,
)
from cdcflow.engine.listener import EngineListener, RunSummary
from cdcflow.engine.options import RunOptions
from cdcflow.engine.ownership import Ownership, held_by_a_live_run
from cdcflow.engine.pacing import STEP_BATCH_BYTES, Pacer
from cdcflow.engine.partitions import IdleSchedule, PartitionView
from cdcflow.engine.quota import quota_limit
from cdcflow.engine.resume import resume_source, source_of_record, stored_source
from cdcflow.engine.runner import Runner
from cdcflow.engine.signals import (
    abandon_on_signal,
    defer,
    deferred_signals,
    handling,
    settle_deferred,
)
from cdcflow.engine.snapshot import snapshot_partitions
from cdcflow.engine.steps import BatchSteps
from cdcflow.engine.task import TaskProgram, make_client
from cdcflow.errors import (
    BatchAbandoned,
    CdcflowError,
    FencedError,
    LeaseHeldError,
    LostProgressError,
    PipelineDefinitionError,
    PluginError,
    SinkIOError,
    StoreError,
    log_failure,
    user_code,
)
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    BatchPlan,
    PartitionMetadata,
    PartitionState,
    Timestamp,
)
from cdcflow.plugins import is_own
from cdcflow.processes import settled_heap
from cdcflow.transforms.base import Sink, SinkContext

__all__ = ["Engine", "RunOptions"]

_log = logging.getLogger("cdcflow.engine")
_NS = 1_000_000_000
_TICK = 0.05  # seconds between checks for a stop request while waiting


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
            bounded_by=f"the batch's retries (batch_retries={opts.batch_retries})",
        )
        self._owner: Ownership | None = None
        self._sink_floor = 0
        self._empty_sinks: list[str] = []
        self._joining: list[str] = []  # of those, the ones to name as the run goes on
        #: and staging sinks the store has durable through a batch that held data (label ->
        #: batch): their location changed, or their output was removed
        self._emptied: dict[str, int] = {}
        #: where a reset's forgotten progress had read to (its low watermark), if any
        self._reset_from: int | None = None
        self._sink_held = ("", 0)  # the sink whose own output reaches furthest, and where
        self._stop_reason = "interrupted"
        self._signals_seen = 0  # see signalled()

    def _sink_stop(self, reason: str) -> None:
        """A sink ended the run (its consumer went away): stop after this batch commits."""
        _log.info("%s: stopping after the current batch", reason)
        self._stop_reason = reason
        self.request_stop()

    def _lost(self, error: StoreError) -> None:
        """Another run took the pipeline over (its writes are fenced out anyway), or the
        lease could not be renewed for too long: stop."""
        self.request_stop()

    @property
    def _fence(self) -> int:
        assert self._owner is not None
        return self._owner.token

    def _backoff_wait(self, seconds: float) -> None:
        self._stop.wait(seconds)

    def request_stop(self) -> None:
        """Stop after the current batch commits (safe from any thread; a signal handler
        defers it, :func:`cdcflow.engine.signals.defer`: it takes locks).

        A runner whose tasks cannot see the stop (Spark executors) is told, so that it can
        cut a batch short that does not end (its optional ``interrupt()``)."""
        first = not self._stop.is_set()
        self._stop.set()
        interrupt = getattr(self.runner, "interrupt", None)
        if first and interrupt is not None:
            interrupt()

    stop = request_stop

    def signalled(self) -> bool:
        """Count a stop signal (SIGINT, SIGTERM or SIGHUP, whichever handler took it: the
        engine's or its caller's, such as the CLI's Ctrl-C); True when it is not the first
        of the run, which then aborts. Takes no lock: for signal handlers."""
        self._signals_seen += 1
        return self._signals_seen > 1

    # -- the run -----------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Run until the end is reached, a limit passes, or a stop is requested."""
        pipeline, opts = self.pipeline, self.options
        pipeline.validate()
        name = pipeline.name
        if not opts.takeover:
            # A second run of a live pipeline is refused before it sets anything up (a
            # sink's claim, Spark's JVM); the lease decides again when it is taken.
            held = held_by_a_live_run(self.store, name)
            if held is not None:
                raise LeaseHeldError(held)
        first = TaskProgram.from_pipeline(pipeline)
        sinks = self._sinks([first, *BatchSteps(pipeline, first.step_labels).programs.values()])
        # One run per pipeline: every write below carries this run's fencing token, and what
        # reaches no store (a task's side effect, a sink's background upload) checks this.
        guard = RunGuard(name, self._stop.is_set)
        committed: dict[str, int] = {}
        owned: dict[str, int] = {}
        for label, sink in sinks.items():
            with user_code(f"in setup() of sink {label!r}"):
                sink.setup(SinkContext(pipeline=name, sink_label=label, base_dir=opts.base_dir,
                                       request_stop=self._sink_stop, stopping=self._stop.is_set,
                                       guard=guard.check))
        _check_locations(sinks)
        for label, sink in sinks.items():
            # Batch ids go on above any output a sink already holds (a lost or new store
            # must never make a sink reuse a batch id it committed before)...
            with user_code(f"in last_committed_batch() of sink {label!r}"):
                committed[label] = sink.last_committed_batch()
            # ...and the output they know this pipeline committed (see _check_not_lost)
            with user_code(f"in owned_batch() of sink {label!r}"):
                owned[label] = sink.owned_batch()
        self._sink_floor = max(committed.values(), default=0)
        # sinks that write somewhere of their own and hold nothing there (see _first_run);
        # a sink that implements neither method cannot tell, and is not said to hold nothing
        self._empty_sinks = [label for label, s in sinks.items()
                             if s.output_location() is not None and _tells_what_it_holds(s)
                             and committed[label] == 0 and owned[label] == 0]
        self._sink_held = max(owned.items(), key=lambda item: item[1], default=("", 0))
        # Built (and its chain pickled) after setup: tasks need what setup resolved, such as
        # WriteFiles' directory.
        program = TaskProgram.from_pipeline(pipeline)
        quota_limit(program.max_inflight_bytes)  # a bad CDCFLOW_MAX_INFLIGHT_BYTES: exit 2 now
        program_bytes: bytes = cloudpickle.dumps(program)
        steps = BatchSteps(pipeline, program.step_labels)
        steps.check_sinks(sinks)
        idle = IdleSchedule(0.0, 0.0)
        # A store that retries (Spanner's) stops retrying once the run is asked to stop:
        # a stop during an outage ends the run, not the retry policy's deadline.
        stopping_hook = getattr(self.store, "set_stopping", None)
        if stopping_hook is not None:
            stopping_hook(self._stop.is_set)
        try:
            try:
                # The runner starts first: Spark forks its JVM launcher, and a fork after this
                # process has opened gRPC clients (the store's, the stream check's) can kill
                # the child before it execs. A signal waits until it has started (the close
                # below then stops it): one that interrupts Spark's start leaves a JVM behind.
                with deferred_signals("the runner starts"):
                    _open_runner(self.runner, name)
                info = make_client(program.source).describe_stream(program.source.stream)
                if (info.partition_mode == "IMMUTABLE_KEY_RANGE"  # see engine.partitions
                        and info.keys_follow_lineage):
                    idle = IdleSchedule(opts.batch_interval or 0.1, opts.idle_read_interval)
                self._owner = owner = Ownership(self.store, name, opts.lease_ttl, self._lost,
                                                guard)
                owner.acquire(opts.takeover)
                try:
                    staged = StagedSinks(self.store, name, sinks, lambda: self._fence)

                    def make_batches(end_cap: int | None, code: bytes = program_bytes
                                     ) -> Batches:
                        return Batches(
                            name=name, store=self.store, runner=self.runner,
                            listener=self.listener, clock=self._clock,
                            fence=lambda: self._fence, retry=self._batch_retry,
                            # Read once; from here on the view applies what this run writes
                            # (it owns the pipeline), so a batch reads nothing from the store.
                            view=PartitionView(self.store, name, end_cap), idle=idle,
                            steps=steps, staged=staged, sinks=sinks,
                            program_bytes=code,
                            pacer=Pacer.resume(int(opts.max_batch_span * _NS),
                                               opts.max_task_bytes, self.store.batches(name, 4),
                                               STEP_BATCH_BYTES if steps else None,
                                               self._fence, owner.predecessor_crashed),
                            gc_ttl_ns=int(opts.gc_ttl * _NS),
                            snapshot_slices=program.source.snapshot_tasks_per_batch,
                            stopping=self._stop.is_set, guard=guard.check,
                        )

                    if opts.reset:
                        _log.info("pipeline %s: resetting; what its old progress still "
                                  "owes its sinks is delivered first, and a run stopped "
                                  "before the reset is done keeps the old progress (run with "
                                  "--reset again)", name)
                        # what the old progress owes is read from the stream it was made on
                        old = source_of_record(program.source, stored_source(self.store, name))
                        settling = (None if old is None else
                                    cloudpickle.dumps(attrs.evolve(program, source=old)))
                        with guarding(guard):
                            self._settle(make_batches(None, settling or program_bytes), staged)
                        # The store keeps the batch id floor, so batch ids go on from before
                        # the reset and sinks that name output by batch id never reuse one.
                        forgotten = self.store.partitions(name)
                        if forgotten:
                            self._reset_from = low_watermark(forgotten)
                        self.store.reset(name)
                        _log.info("pipeline %s: reset done; the progress of %d partition(s) "
                                  "is forgotten and reading starts over", name, len(forgotten))
                    batches = make_batches(self._first_run(program))
                    try:
                        with guarding(guard):
                            batches.restore_staged()  # may refuse a renamed staging sink
                        self._warn_joining()
                        steps.load(self.store)
                        self.listener.on_start(name, self.runner.name, self.store.url)
                        # what the store holds, for observers (metrics: the partitions and
                        # the lag) before the first batch commits, which may take long
                        if stored := batches.view.snapshot():
                            self.listener.on_partitions(stored, self._clock())
                        with self._signals(), self._time_limit(), settled_heap(), \
                                guarding(guard):
                            summary = self._loop(batches)
                    except KeyboardInterrupt:  # an abort: waits for nothing
                        batches.abandon()
                        raise
                    finally:
                        batches.close()  # waits for a batch read ahead and aborts its output
                    # A graceful end: what is staged becomes durable. A signal while it
                    # waits (a storage that does not answer) gives up: the next run writes
                    # again what is not durable yet, as after a crash.
                    self.listener.on_batches_done(summary)
                    with abandon_on_signal("the staged output was being made durable",
                                            "the next run writes again what is not "
                                            "durable yet"):
                        if self._owner.lost is None:  # else the run that took over does
                            self._final_flush(staged)
                finally:
                    with abandon_on_signal("the lease was being released",
                                            "the lease lapses by itself"):
                        self._owner.release()
                if self._owner.lost is not None:
                    raise self._owner.lost
            except KeyboardInterrupt:  # an abort: the runner waits for no running task
                settle_deferred()  # the signal's warning first
                abandon = getattr(self.runner, "abandon", None)
                if abandon is not None:
                    abandon()
                raise
            finally:
                self.runner.close()
        finally:
            if stopping_hook is not None:
                stopping_hook(None)
            for label, sink in sinks.items():
                try:
                    sink.close()
                except Exception as exc:  # what it committed stays committed
                    log_failure(_log, "close() of sink %r failed; what it committed is kept",
                                label, exc=exc)
        self.listener.on_stop(summary)
        return summary

    def _final_flush(self, staged: StagedSinks) -> None:
        """Make what is staged durable; a run asked to stop does not wait for a storage
        that fails (a sink gives up with SinkIOError) or a store that does (it records the
        durable marks): the next run writes again what is not durable."""
        try:
            staged.flush()
        except (SinkIOError, StoreError) as exc:
            if not self._stop.is_set():
                raise
            _log.warning("stopping without waiting for the staged output to become durable "
                         "(%s); the next run writes it again", exc)

    def _sinks(self, programs: Sequence[TaskProgram]) -> dict[str, Sink[Any, Any]]:
        # The driver's own sink objects (a Collect gathers its items on them).
        sinks: dict[str, Sink[Any, Any]] = {}
        for program in programs:
            for label in program.sink_labels:
                if label not in sinks:
                    sinks[label] = self._sink(program, label)
        return sinks

    def _sink(self, program: TaskProgram, label: str) -> Sink[Any, Any]:
        if label == program.dead_letter_label:
            assert self.pipeline.error_policy.dead_letter is not None
            return self.pipeline.error_policy.dead_letter
        sink = self.pipeline.transform(label)
        assert isinstance(sink, Sink)
        return sink

    def _settle(self, batches: Batches, staged: StagedSinks) -> None:
        """Before a reset, keep what the old progress promised: the committed batches a
        staging sink had not made durable go to it again, then every sink gets the batch an
        earlier run left pending (a crash between the sinks' commits and the store's may
        have left it in some of them; those skip it), in batch order, and staging sinks
        make it all durable. A reset then forgets where reading stood, not output a sink
        still owed. What cannot be delivered (a batch that fails every time: its start
        past the stream's retention, say) is named in a warning, and the reset goes on:
        it is the way out of such a batch."""
        pending = self.store.pending_plan(self.pipeline.name)
        owed: list[tuple[str, Callable[[], object]]] = [
            ("committed batches not yet durable in every sink", batches.restore_staged)]
        if pending is not None:
            owed.append((f"batch {pending.batch_id}, which an earlier run did not commit",
                          lambda: batches.deliver(pending, None)))
        try:
            for what, deliver in owed:
                try:
                    deliver()
                except Exception as exc:
                    _log.warning("before the reset, %s could not be delivered (%s: %s); the "
                                 "reset goes on without it", what, type(exc).__name__,
                                 str(exc).splitlines()[0])
        finally:
            batches.close()
        staged.flush()

    def _first_run(self, program: TaskProgram) -> int | None:
        """Start the pipeline's progress, or check the source it resumes with; returns the
        end every partition is held to (:func:`cdcflow.engine.resume.end_cap`)."""
        name, source = self.pipeline.name, program.source
        definition = source.definition()
        stored_parts = self.store.partitions(name)
        now = self._clock()
        if stored_parts or self.store.pending_plan(name) is not None:
            # known to the pipeline already (read only when there is a sink to ask about)
            staging = self.store.durable_marks(name) if self._empty_sinks else {}
            if self._empty_sinks and self._read_before(name, stored_parts):
                self._joining = [s for s in self._empty_sinks if s not in staging]
            self._emptied = self._emptied_sinks(
                {s: staging[s] for s in self._empty_sinks if staging.get(s, 0) > 0})
            absolute = source.end_at is not None and not is_relative_time(source.end_at)
            return resume_source(self.store, name, definition,
                                 source.end_ns(now) if absolute else None,
                                 strict=self.options.strict, partitions=stored_parts)
        self._check_not_lost()
        start, end = source.start_ns(now), source.end_ns(now)
        if start >= end:
            msg = (
                f"DetectPartitions: end_at ({Timestamp.from_ns(end - 1)}) is before start_at "
                f"({Timestamp.from_ns(start)}); give an end_at at or after start_at"
            )
            raise PipelineDefinitionError(msg)
        # Snapshot then stream: the root waits for one partition per table, its parents,
        # and for the key ranges those split into (lifecycle.ready_partitions: snapshot
        # first), so the stream starts after every snapshot row (cdcflow.engine.snapshot).
        snapshots = snapshot_partitions(program, start, now, make_client)
        root = PartitionMetadata(
            token=INITIAL_PARTITION_TOKEN, parent_tokens=tuple(p.token for p in snapshots),
            start=start, end=end, watermark=start, state=PartitionState.CREATED,
            heartbeat_millis=program.heartbeat_millis, created_at=now,
        )
        self.store.insert_partitions(name, [*snapshots, root])
        self.store.set_source(name, json.dumps(definition, sort_keys=True))
        _log.info("pipeline %s starts reading at %s%s", name, Timestamp.from_ns(start),
                  f" after a snapshot of {len(snapshots)} tables" if snapshots else "")
        if self._reset_from is not None and start > self._reset_from:
            _log.warning(
                "pipeline %s: the reset forgot progress that had read everything up to %s; "
                "this run starts at %s (start_at=%r), so changes committed in between are "
                "not read: to keep them, reset with start_at at or before %s", name,
                Timestamp.from_ns(self._reset_from), Timestamp.from_ns(start), source.start_at,
                Timestamp.from_ns(self._reset_from))
        return None

    def _read_before(self, name: str, partitions: Sequence[PartitionMetadata]) -> bool:
        """Whether the pipeline's stored progress went past its start: a batch committed
        (a watermark moved, or the log says so). A run that stopped before its first batch
        committed left progress that delivered nothing, so a sink joins nothing there."""
        return (any(p.watermark > p.start for p in partitions)
                or any(b.committed_at for b in self.store.batches(name, 2)))

    def _emptied_sinks(self, marks: dict[str, int]) -> dict[str, int]:
        """Of the staging sinks that hold nothing where they write though the store has
        them durable through a batch (``marks``), those through a batch that held data
        by the batch log: a sink the store knows at a batch all of whose batches read
        nothing made them durable without writing anything (a crash before its first
        upload leaves it so). A batch the log no longer holds counts as one with data."""
        if not marks:
            return {}
        name = self.pipeline.name  # the log, newest first, back to batch 1 if it holds it
        read = {b.batch_id: b.records
                for b in self.store.batches(name, max(1, self.store.last_batch_id(name)))}
        return {label: mark for label, mark in marks.items()
                if any(read.get(batch, 1) for batch in range(1, mark + 1))}

    def _warn_joining(self) -> None:
        """Name the sinks that hold nothing of a resuming pipeline's output (see
        :meth:`_first_run`): said once the run goes on, not before a refusal."""
        for label in self._joining:
            _log.warning(
                "sink %r holds no output of pipeline %s, which resumes from stored "
                "progress: if the sink is new to the pipeline, it receives the changes "
                "from here on, not those committed before (to fill it from the start, "
                "run it in a pipeline of its own)", label, self.pipeline.name)
        for label, batch in self._emptied.items():
            _log.warning(
                "sink %r holds no output of pipeline %s where it writes now, though the "
                "store has its output durable through batch %d: if its location changed "
                "(or its output was removed), what it wrote before is not there, and it "
                "receives the changes from here on (to fill it from the start, run it in a "
                "pipeline of its own)", label, self.pipeline.name, batch)

    def _check_not_lost(self) -> None:
        """A pipeline starting afresh in this store, while a sink holds output of batches
        the store never planned, lost its progress (a deleted state file, another store):
        starting over would deliver again all that the sinks hold. Refused, unless the run
        resets (which starts over on purpose) or the store keeps nothing (``memory://``:
        every run starts over, by choice)."""
        label, batch = self._sink_held
        name = self.pipeline.name
        if (self.options.reset or batch <= self.store.last_batch_id(name)
                or self.store.url.startswith("memory:")):
            return
        msg = (
            f"pipeline {name!r} has no progress in the store {self.store.url}, but sink "
            f"{label!r} holds its output up to batch {batch}: the store lost it, or is not "
            "the one the pipeline ran with. To resume, point --metadata at the store that "
            "holds its progress; to start over from start_at, run with --reset once no run "
            "of it is alive on another store (the sink keeps its output and gets the "
            "changes again under new batch ids)"
        )
        raise LostProgressError(msg)

    def _loop(self, run: Batches) -> RunSummary:
        name, opts = self.pipeline.name, self.options
        batches = records = 0
        totals = Counter[str]()
        reason = ""
        view = run.view
        pending: BatchPlan | None = self.store.pending_plan(name)
        next_id = max(self.store.last_batch_id(name), self._sink_floor) + 1

        def may_read_ahead() -> bool:
            # Asked while a batch runs: a stop (or the duration, see _time_limit) ends the
            # run after it.
            return not self._stop.is_set()

        while True:
            limit = opts.max_batches is not None and batches >= opts.max_batches
            if limit or self._stop.is_set():
                # The batch that committed last may have reached the end, or the last batch
                # asked for: then that is why the run ended, whatever else asked it to stop
                # meanwhile (a supervisor that stopped it learns it is complete).
                done = pending is None and run.ahead is None and all_finished(view.snapshot())
                reason = ("end reached" if done else "max batches" if limit else
                          self._stop_reason)
                break
            batch_began = time.monotonic()
            # 1. plan: replay a pending plan as it is; or take up the batch read ahead while
            #    the last one committed; or plan the next batch. A new plan is written to
            #    the store once its tasks have returned, before any sink commits it.
            plan, pending = pending, None
            replay = plan is not None
            unwritten: dict[str, PartitionState] | None = None
            ahead = run.ahead
            if ahead is not None:
                now = ahead.planned_at
                plan, unwritten, parts = run.take_ahead()
            else:
                now = self._clock()
                parts = view.snapshot()
            if plan is None:
                if all_finished(parts):
                    reason = "end reached"
                    break
                waiting = run.idle.waiting(parts, now)
                plan, transitions = plan_batch(parts, now, run.pacer.span_ns, next_id, waiting,
                                               run.snapshot_slices, run.idle.quiet(parts))
                if not plan.slices and not transitions:
                    # Nothing can advance yet: the clock has not passed the low watermark,
                    # or every partition is idle and waiting for its next read. (A plan
                    # with transitions only finishes partitions: it runs as a batch with
                    # no task, so that they finish the way every partition does.)
                    wait = (low_watermark(parts) - now) / _NS
                    self._wait(min(max(wait, 0.01), max(opts.batch_interval, 0.01)))
                    continue
                plan = attrs.evolve(plan, planned_at=now)
                unwritten = transitions  # written once its tasks have returned
            next_id = plan.batch_id + 1
            self.listener.on_planned(plan, replay)
            # Caught up with the clock: a slice was read up to now, so the next batch has
            # little to read until the clock moves on (paced below). A batch whose slices
            # all stop at their partitions' ends (an end_at in the past; partitions that
            # ended) lags: their children, or the end of the run, follow at once.
            caught_up = not replay and any(s.end >= now for s in plan.slices)
            # Read the next batch while this one commits only when it would follow at once
            # anyway: the run lags the clock (no pacing wait), and it is not the last.
            lagging = not replay and not caught_up
            room = opts.max_batches is None or batches + 1 < opts.max_batches
            read_ahead = may_read_ahead if opts.pipelined and lagging and room else None
            try:
                stats = run.execute(plan, replay, parts, batch_began, read_ahead, unwritten)
            except BatchAbandoned as abandoned:
                _log.warning("%s", abandoned)
                reason = self._stop_reason
                break
            except StoreError as exc:
                if not self._store_failed_when_stopping(exc, plan.batch_id):
                    raise
                reason = self._stop_reason
                break
            batches += 1
            records += stats.records
            for key in ("skipped", "retries", "dead_lettered"):
                totals[key] += stats.counters.get(key, 0)
            self.listener.on_batch(stats)
            if caught_up:
                # Pace batches instead of spinning on tiny ones.
                self._wait(batch_began + opts.batch_interval - time.monotonic())
        run.drop_ahead()  # the run ends after the batch that committed last
        parts = view.snapshot()
        return RunSummary(
            pipeline=name, batches=batches, records=records, reason=reason,
            low_watermark=low_watermark(parts), partitions=count_states(parts),
            splits=run.splits, merges=run.merges, skipped=totals["skipped"],
            retried=totals["retries"], dead_lettered=totals["dead_lettered"],
        )

    def _store_failed_when_stopping(self, exc: StoreError, batch_id: int) -> bool:
        """Whether a store failure ends the run as stopped: it came after a stop request
        (the store then tries once, see ``set_stopping``); the next run replays or plans
        the batch again, as after a crash."""
        if not self._stop.is_set():
            return False
        if isinstance(exc, FencedError) and self._owner is not None and self._owner.lost:
            return True  # the lease was lost (said when found): the run ends with that
        _log.warning("the store failed after the stop request (%s); stopping without "
                     "retrying it: the next run takes batch %d up again", exc, batch_id)
        return True

    def _wait(self, seconds: float) -> None:
        """Wait ``seconds``, or less once the run is asked to stop."""
        end = time.monotonic() + seconds
        while not self._stop.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return
            self._stop.wait(min(left, _TICK))

    # -- signals -----------------------------------------------------------------------------

    @contextmanager
    def _time_limit(self) -> Iterator[None]:
        """With a ``duration`` (``--for``): once it passed, the run is asked to stop after
        the current batch, as by a signal, so that a batch failing then (an outage) is
        given up rather than retried on; the run's reason is "duration"."""
        if self.options.duration is None:
            yield
            return

        def passed() -> None:
            if not self._stop.is_set():
                self._stop_reason = "duration"
                self.request_stop()
                # the run ends after the batch in progress, which may take a while: say so
                _log.info("the run's time is up (%gs): stopping after the current batch",
                          self.options.duration)

        if self.options.duration <= 0:
            passed()  # no batch at all, as surely as a stop before the first
        timer = threading.Timer(self.options.duration, passed)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    @contextmanager
    def _signals(self) -> Iterator[None]:
        """Graceful stop on SIGINT/SIGTERM/SIGHUP, unless the caller (the CLI) handles them."""

        def stop(signum: int) -> None:
            if self._stop.is_set():  # the run's time is up, or its caller asked it to stop
                _log.warning("signal %d: the run stops after the current batch already "
                             "(again to abort)", signum)
                return
            _log.warning("signal %d: stopping after the current batch (again to abort)", signum)
            self.request_stop()

        def handler(signum: int, frame: FrameType | None) -> None:
            # takes no lock (see cdcflow.engine.signals): the stop request is deferred
            if self.signalled():  # the second: abort (the next run replays the batch)
                defer(lambda: _log.warning("signal %d again: aborting", signum))
                raise KeyboardInterrupt
            defer(lambda: stop(signum))

        with handling(handler):
            yield


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



def _open_runner(runner: Runner, pipeline: str) -> None:
    """``runner.open(pipeline)``; a plugin runner that fails to open is one line naming it,
    exit 2, as a plugin store that fails to open is (cdcflow's own runners say their own)."""
    if is_own(runner):
        runner.open(pipeline)
        return
    try:
        runner.open(pipeline)
    except CdcflowError:
        raise
    except Exception as exc:
        msg = (f"the runner {runner.name!r} could not open: {type(exc).__name__}: {exc}; "
               "check its settings (--set) and that what it runs on is up")
        raise PluginError(msg) from exc


def _tells_what_it_holds(sink: Sink[Any, Any]) -> bool:
    """Whether ``sink`` says what output it holds: it implements ``last_committed_batch`` or
    ``owned_batch`` (their defaults answer 0, "none, or it cannot tell")."""
    kind = type(sink)
    return (kind.last_committed_batch is not Sink.last_committed_batch
            or kind.owned_batch is not Sink.owned_batch)
