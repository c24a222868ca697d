"""One batch: execute and commit (steps 2 and 3 of the commit protocol), and the read-ahead.

:class:`Batches` runs and commits the batches of one run for the engine
(:mod:`cdcflow.engine.loop`, which plans them and paces the run). Steps, as in the loop's
docstring: 2. the runner runs one task per slice; the BatchSteps fold on the driver;
3a. every sink commits the batch (idempotent per batch id); 3b. the store commits its
progress in one transaction; 3c. every sink learns the new low watermark; 3d. finished
partitions are garbage collected.

When the plan is written. The invariant is: *a batch's plan is in the store before any
sink commits it* (3a), not "before any of its tasks runs": tasks only read and stage
output that is specific to their attempt (a temporary file, a spool, a buffered message)
and that nothing commits without the batch's plan. So a batch's plan is written once its
tasks have returned, before 3a, and a crash while they read leaves no plan: the next run
plans the batch afresh (:mod:`cdcflow.engine.pacing` halves the span after a crash), where
a plan written before the tasks ran would have to be replayed with the same slices
whatever it cost, since a sink might have committed it. A batch that takes longer to read
than a run lives (runs killed every few seconds) would then never commit; planned afresh,
narrower after each crash, it does. Once the plan is written, a crash replays it as it is.

Pipelined batches (``RunOptions.pipelined``). While the run lags the clock, batches run
back to back; then, once batch N's tasks have returned, :meth:`Batches.execute` plans
batch N+1 from the partitions as N will leave them (a projection: the view itself changes
only at N's store commit) and runs N+1's tasks on a thread of its own while N's sinks and
store commit. N+1's plan is written to the store (with the fence) once N has committed and
N+1's tasks have returned, before any sink commits N+1 (the invariant above). So:

- a crash before N+1's plan is written leaves nothing of N+1 committed; the next run plans
  batch N+1 afresh (perhaps with other slices: nothing of the first attempt is used, and
  the sinks sweep its leftovers when they commit or abort the batch id);
- a crash after it is written is the ordinary case of a pending plan: the next run replays
  it, as it is, with the same slices;
- when N's commit fails, or the run stops (a stop request, ``duration``) before N+1 is
  taken up, N+1's tasks are awaited, their output aborted, and N+1 is never planned.

A replayed pending plan, a replay for staging sinks and the batch after a failed attempt
are never overlapped; when the run is caught up with the clock, batches are paced by
``batch_interval`` and nothing is read ahead either (an idle pipeline works as without
pipelining). At most one ``Runner.run_tasks`` call is in flight at any time, from the
engine's thread or from the read-ahead thread.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.engine.durability import StagedSinks
from cdcflow.engine.lifecycle import (
    all_finished,
    count_states,
    fold,
    gc_candidates,
    low_watermark,
    plan_batch,
)
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.pacing import Pacer
from cdcflow.engine.partitions import IdleSchedule, PartitionView
from cdcflow.engine.runner import Runner, Task, TaskResult, add_counters, outcome, settle
from cdcflow.engine.steps import BatchSteps, Folded
from cdcflow.errors import (
    BatchAbandoned,
    CdcflowError,
    FencedError,
    LeaseExpiredError,
    LeaseLapsedError,
    PipelineStopped,
    RunnerContractError,
    SinkError,
    TransientError,
    caused_by,
    log_failure,
    user_code,
)
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import BatchPlan, PartitionMetadata, PartitionState
from cdcflow.plugins import is_own
from cdcflow.transforms.base import Sink

__all__ = ["Batches"]

_log = logging.getLogger("cdcflow.engine")


@attrs.define
class _Ahead:
    """The next batch, planned and reading while the current one commits. ``taken``: it is
    the batch the engine executes now (its tasks' results go to its first attempt)."""

    plan: BatchPlan
    transitions: dict[str, PartitionState]
    future: Future[list[TaskResult]]
    taken: bool = False


class Batches:
    """Executes and commits the batches of one run (see the module docstring).

    ``fence`` returns the run's fencing token for every store write. Call :meth:`close`
    when the run ends (also when it fails): it waits for a batch read ahead and aborts its
    output, then stops the read-ahead thread.
    """

    def __init__(
        self, *, name: str, store: MetadataStore, runner: Runner, listener: EngineListener,
        clock: Callable[[], int], fence: Callable[[], int], retry: RetryPolicy,
        view: PartitionView, idle: IdleSchedule, steps: BatchSteps, staged: StagedSinks,
        sinks: Mapping[str, Sink[Any, Any]], program_bytes: bytes, pacer: Pacer, gc_ttl_ns: int,
        snapshot_slices: int | None = None, stopping: Callable[[], bool] = lambda: False,
        guard: Callable[[], None] = lambda: None,
    ) -> None:
        self.name = name
        self.store = store
        self.runner = runner
        self.listener = listener
        self.view = view
        self.splits = 0
        self.merges = 0
        self._clock = clock
        self._fence = fence
        self._retry = retry
        self._stopping = stopping
        #: Raises when this run may no longer act (:class:`cdcflow.engine.guard.RunGuard`)
        self._guard = guard
        self.idle = idle
        idle.resume(view.snapshot(), clock())  # a restart spreads its idle partitions' reads
        self._steps = steps
        self._staged = staged
        self._sinks = dict(sinks)
        self._program = program_bytes
        #: The span of the batches this run plans (max_batch_span, paced by what tasks read).
        self.pacer = pacer
        #: Most snapshot partitions a batch reads (the source's snapshot_tasks_per_batch).
        self.snapshot_slices = snapshot_slices
        self._gc_ttl_ns = gc_ttl_ns
        self._ahead: _Ahead | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- the read-ahead ----------------------------------------------------------------------

    @property
    def ahead(self) -> BatchPlan | None:
        """The plan of the batch read ahead, if any and not taken yet."""
        return None if self._ahead is None or self._ahead.taken else self._ahead.plan

    def take_ahead(
        self,
    ) -> tuple[BatchPlan, dict[str, PartitionState], list[PartitionMetadata]]:
        """The batch read ahead, to execute next: its plan, the transitions to write with
        it (:meth:`execute` writes the plan once its tasks have returned) and the partitions
        as stored before it. Call once the batch before it has committed (3b-3d)."""
        ahead = self._ahead
        assert ahead is not None and not ahead.taken
        ahead.taken = True
        return ahead.plan, ahead.transitions, self.view.snapshot()

    def drop_ahead(self) -> None:
        """Give up the batch read ahead, if any: wait for its tasks, then abort their output
        in every sink (nothing of it was committed, nor its plan written)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        messages: dict[str, list[Any]] = {}
        settle(ahead.future)  # a signal (an abort) raises here, not below
        try:
            done = ahead.future.result()
        except BaseException as exc:  # nothing of it is used: only its leftovers matter
            _log.debug("batch %d, read ahead, failed (%s: %s); dropped",
                       ahead.plan.batch_id, type(exc).__name__, exc)
        else:
            for r in done:
                for label, message in r.sink_messages.items():
                    if message is not None:
                        messages.setdefault(label, []).append(message)
        _log.debug("batch %d, read ahead, dropped", ahead.plan.batch_id)
        if not self._owned_elsewhere(None):
            _abort(ahead.plan.batch_id, self._sinks, messages)

    def close(self) -> None:
        """Drop a batch read ahead and stop the read-ahead thread."""
        try:
            self.drop_ahead()
        except BaseException:  # an abort while it waited (or it failed): wait no more
            self.abandon()
            raise
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # idle: drop_ahead waited for its last work
            self._pool = None

    def abandon(self) -> None:
        """:meth:`close` for a run that aborts: no wait for the tasks of a batch read ahead
        (one may never return); their output is attempt-specific, and nothing commits it."""
        self._ahead = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _read_ahead(self, plan: BatchPlan, results: Sequence[TaskResult], now: int) -> None:
        """Plan the batch after ``plan`` from the partitions as ``results`` will leave them,
        and start its tasks on the read-ahead thread. Nothing is written and the view does
        not change: an empty plan (nothing can advance) starts nothing."""
        projected = self.view.projected(fold(self.view.mapping(), results, now), now)
        if all_finished(projected):
            return
        waiting = self.idle.waiting(projected, now)
        nxt, transitions = plan_batch(projected, now, self.pacer.span_ns, plan.batch_id + 1,
                                      waiting, self.snapshot_slices, self.idle.quiet(projected))
        if not nxt.slices:
            return
        nxt = attrs.evolve(nxt, planned_at=now)
        tasks = self._tasks(nxt, None)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"cdcflow-ahead-{self.name}")
        future = self._pool.submit(self._run_tasks, nxt, tasks)
        self._ahead = _Ahead(nxt, transitions, future)
        _log.debug("batch %d: reading ahead while batch %d commits", nxt.batch_id,
                   plan.batch_id)

    # -- one batch ---------------------------------------------------------------------------

    def execute(
        self, plan: BatchPlan, replay: bool, parts: Sequence[PartitionMetadata], began: float,
        read_ahead: Callable[[], bool] | None = None,
        transitions: Mapping[str, PartitionState] | None = None,
    ) -> BatchStats:
        """Run and commit ``plan``. ``parts`` are the partitions as stored before the batch
        (their ends and tokens are all the commit needs; only the commit changes them).
        ``transitions``: None when the plan is in the store already (a replay, a batch read
        ahead); else the plan's partition transitions, and the plan is written to the store
        with them once its tasks have returned, before any sink commits it (see the module
        docstring). ``read_ahead``, when given, is asked once the batch's tasks first
        returned whether the next batch may be read while this one commits (see the module
        docstring); None never reads ahead."""
        phases = {"plan": time.monotonic() - began}
        mark = time.monotonic()

        def lap(phase: str) -> None:
            nonlocal mark
            now_s = time.monotonic()
            phases[phase] = now_s - mark
            mark = now_s

        # The tasks of a batch read ahead have run already (or still run): the first
        # attempt takes their results.
        first: Future[list[TaskResult]] | None = None
        if self._ahead is not None and self._ahead.taken:
            assert self._ahead.plan.batch_id == plan.batch_id
            first, self._ahead = self._ahead.future, None

        # 2. execute: one task per slice, on the runner; fold the BatchSteps on the driver;
        # 3a. commit the sinks (idempotent per batch id: a replay commits the same again).
        folded: Folded | None = None

        def fold_steps(done: list[TaskResult]) -> Mapping[str, list[Any]]:
            nonlocal folded
            folded = self._steps.fold(plan, parts, done)
            return folded.messages

        idle_noted = False

        def ready(done: list[TaskResult], first_attempt: bool) -> None:
            # Between the tasks and the sink commits: note idle partitions (once), and start
            # the next batch's tasks (only after a first attempt that went well).
            nonlocal idle_noted
            now = self._clock()
            if not idle_noted:
                self.idle.read(done, now, plan.planned_at or None)
                self.pacer.observe(plan, done)
                idle_noted = True
            if first_attempt and read_ahead is not None and read_ahead():
                self._read_ahead(plan, done, now)

        def write_plan() -> None:
            # Write-ahead: the plan is in the store before any sink commits the batch; a
            # crash while its tasks read leaves nothing of it, and the next run plans again.
            nonlocal transitions
            if transitions is not None:
                self.store.write_plan(self.name, plan, transitions, fence=self._fence())
                self.view.planned(transitions, plan.planned_at)
                transitions = None

        results = self.deliver(plan, None, lambda: lap("execute"),
                               fold_steps if self._steps else None, ready, first, write_plan)
        sinks_committed_at = self._clock()
        lap("sink_commit")
        self.listener.on_sinks_committed(plan.batch_id)

        counters: dict[str, int] = {}
        for r in results:
            add_counters(counters, r.counters)
        if folded is not None:
            add_counters(counters, folded.counters)
        size = sum(r.bytes for r in results)

        # 3b. commit the store: the batch's progress, as the lifecycle reads the results.
        now = self._clock()
        outcome = fold({p.token: p for p in parts}, results, now)
        self.store.commit_batch(
            self.name, plan.batch_id, list(outcome.updates), list(outcome.children),
            outcome.records, fence=self._fence(), durable=self._staged.marks(),
            state=None if folded is None else folded.state,
            stats=_log_stats(phases, size, counters, self.pacer.span_ns, self._fence()),
        )
        if folded is not None:
            self._steps.committed(folded)
        self.splits += outcome.splits
        self.merges += outcome.merges
        view = self.view
        view.committed(outcome, now)
        lap("store_commit")

        # 3c. tell every sink the new low watermark (a resolved timestamp).
        parts = view.snapshot()
        low = low_watermark(parts)
        for sink in self._sinks.values():
            sink.on_watermark(low)
        self.listener.on_partitions(parts, now)
        # 3d. garbage-collect finished partitions whose children have all started.
        expired = gc_candidates(parts, now, self._gc_ttl_ns)
        if expired:
            self.store.delete_partitions(self.name, expired)
            view.deleted(expired)
            gone = set(expired)
            parts = [p for p in parts if p.token not in gone]
        lap("gc")
        return BatchStats(
            batch_id=plan.batch_id, end=plan.end, slices=len(plan.slices),
            records=outcome.records, bytes=size,
            seconds=time.monotonic() - began, low_watermark=low,
            partitions=count_states(parts), new_partitions=len(outcome.children),
            splits=outcome.splits, merges=outcome.merges, replayed=replay, phases=phases,
            counters=dict(counters),
            commit_times=tuple(t for r in results for t in r.commit_times),
            sinks_committed_at=sinks_committed_at, sink_metrics=_sink_metrics(self._sinks),
            next_span_ns=self.pacer.span_ns,
        )

    def deliver(
        self, plan: BatchPlan, only: tuple[str, ...] | None,
        executed: Callable[[], None] = lambda: None,
        fold_steps: Callable[[list[TaskResult]], Mapping[str, list[Any]]] | None = None,
        ready: Callable[[list[TaskResult], bool], None] | None = None,
        first: Future[list[TaskResult]] | None = None,
        write_plan: Callable[[], None] | None = None,
    ) -> list[TaskResult]:
        """Run ``plan``'s tasks and commit their output to the sinks (those in ``only``,
        when given: a replay for sinks that had not made the batch durable).
        ``fold_steps`` folds the BatchSteps after the tasks and returns the driver-side
        writers' commit messages per sink, committed after the tasks' messages. ``ready``
        is called after that, before the sinks commit, with the results and whether this
        is the first attempt. ``first``: the results of the tasks already started (read
        ahead), for the first attempt. ``write_plan``, when given, writes the plan to the
        store if it is not there yet: it is called once the tasks have returned, before
        anything else.

        A transient failure of either (a reader's retries spent, a sink's storage fault)
        drops a batch read ahead meanwhile, aborts the sinks' leftovers and runs both again
        under the batch retry policy; any other failure notes that the batch was not
        committed and propagates."""
        tasks = self._tasks(plan, only)
        targets = self._sinks if only is None else {label: self._sinks[label] for label in only}
        attempts = 0
        failed: BaseException | None = None  # the last attempt's error
        written = write_plan is None  # the plan is in the store

        def attempt() -> list[TaskResult]:
            nonlocal attempts, written
            if failed is not None and self._stopping():
                # Asked to stop (during the backoff, or before a failure: then it is not
                # retried): a supervisor's SIGTERM in an outage ends the run now, not
                # after the retries; the batch is replayed.
                raise BatchAbandoned(plan.batch_id, failed, _next_run(written)) from failed
            attempts += 1
            given: dict[str, list[Any]] = {}  # each sink's messages, once the tasks ran
            try:
                if first is not None and attempts == 1:
                    done = outcome(first)
                else:
                    done = self._run_tasks(plan, tasks)
                given = {label: [r.sink_messages[label] for r in done
                                 if r.sink_messages.get(label) is not None]
                         for label in targets}
                if write_plan is not None:
                    write_plan()
                    written = True
                executed()
                driver = fold_steps(done) if fold_steps is not None else {}
                for label in targets:
                    given[label] += driver.get(label, [])
                if ready is not None:
                    ready(done, attempts == 1)
                for label, sink in targets.items():
                    # A run whose lease ran out (a process paused past it) or was taken
                    # over commits no more sinks: the run that owns the pipeline now may
                    # have committed the batch to them (the store fences only its writes).
                    self._guard()
                    _commit(label, sink, plan.batch_id, given[label])
            except BaseException as exc:
                self.drop_ahead()  # its plan would follow a batch that did not commit
                if not self._owned_elsewhere(exc):
                    _abort(plan.batch_id, targets, given)
                raise
            return done

        def retrying(retry: int, exc: BaseException, delay: float) -> None:
            nonlocal failed
            failed = exc
            _log.warning(
                "batch %d failed (%s: %s); retry %d/%d in %.1fs", plan.batch_id,
                type(exc).__name__, exc, retry, self._retry.retries, delay,
            )
            self.listener.on_batch_retry(plan.batch_id, exc)

        def worth_retrying(exc: BaseException) -> bool:
            return _is_transient(exc) and not self._stopping()

        try:
            return self._retry.call(attempt, retry_if=worth_retrying, on_retry=retrying)
        except (PipelineStopped, BatchAbandoned):
            raise
        except Exception as exc:
            if self._stopping() and _is_transient(exc):
                raise BatchAbandoned(plan.batch_id, exc, _next_run(written)) from exc
            exc.add_note(f"batch {plan.batch_id} was not committed; {_next_run(written)}")
            raise

    def _owned_elsewhere(self, error: BaseException | None) -> bool:
        """Whether another run may own the pipeline now (this run's lease was lost or ran
        out: ``error`` or the run's guard says so). Such a run aborts nothing in the sinks:
        a sink's abort sweeps every attempt's leftovers of the batch id, and the run that
        owns the pipeline may be writing that batch (it sweeps them when it commits)."""
        lost = (FencedError, LeaseLapsedError, LeaseExpiredError)
        if error is not None and caused_by(error, lost):
            return True
        try:
            self._guard()
        except lost:
            return True
        except BaseException:  # an aborted run: it cleans up what it leaves
            pass
        return False

    def restore_staged(self) -> None:
        """Deliver again the committed batches a staging sink had not made durable, and
        make each durable at once (a flush per batch): a run that dies during the replay
        leaves the next one less to replay, so runs that crash in a loop (faster than a
        staging sink cuts its files) still make progress, where the debt of replays would
        otherwise grow with every run."""
        for plan, targets in self._staged.replays():
            _log.info("batch %d again for %s (not durable there before the restart)",
                      plan.batch_id, ", ".join(targets))
            self.deliver(plan, targets)
            self._staged.flush(targets)

    def _tasks(self, plan: BatchPlan, only: tuple[str, ...] | None) -> list[bytes]:
        return [pickle.dumps(Task(self.name, plan.batch_id, s, only)) for s in plan.slices]

    def _run_tasks(self, plan: BatchPlan, tasks: Sequence[bytes]) -> list[TaskResult]:
        """One result per task, in task order; raise RunnerContractError otherwise."""
        if not tasks:
            return []
        if is_own(self.runner):
            raw = self.runner.run_tasks(self._program, tasks)
        else:  # a plugin's failure names the plugin
            with user_code(f"in run_tasks() of runner {self.runner.name!r}"):
                raw = self.runner.run_tasks(self._program, tasks)
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


def _next_run(written: bool) -> str:
    """What the next run does with a batch that did not commit (its plan ``written``)."""
    if written:
        return "its plan stays in the store and the next run replays it"
    return "no sink had it (its plan was not written), and the next run plans it again"


def _sink_metrics(sinks: Mapping[str, Sink[Any, Any]]) -> dict[str, dict[str, float]]:
    """Each sink's ``metrics()`` (a sink whose metrics fail is left out, with a warning:
    numbers for operators never stop a run)."""
    out: dict[str, dict[str, float]] = {}
    for label, sink in sinks.items():
        try:
            numbers = dict(sink.metrics())
        except Exception as e:
            _log.warning("sink %r: metrics() failed (%s: %s)", label, type(e).__name__, e)
            continue
        if numbers:
            out[label] = numbers
    return out


def _commit(label: str, sink: Sink[Any, Any], batch_id: int, messages: list[Any]) -> None:
    """``sink.commit``; what a sink raises that is not cdcflow's becomes a SinkError naming
    the sink (the batch is not committed; the run stops in one line, and the next replays
    it)."""
    try:
        sink.commit(batch_id, messages)
    except CdcflowError:
        raise
    except Exception as exc:
        msg = f"sink {label!r} failed to commit batch {batch_id}: {type(exc).__name__}: {exc}"
        raise SinkError(msg) from exc


def _abort(batch_id: int, sinks: Mapping[str, Sink[Any, Any]],
           given: Mapping[str, list[Any]]) -> None:
    """Let every sink discard what the batch left behind (best effort): the messages its
    tasks gave (``given``; none when they failed), such as WriteTables' spool files."""
    for label, sink in sinks.items():
        try:
            sink.abort(batch_id, given.get(label, []))
        except Exception as exc:
            log_failure(_log, "sink %r failed to abort batch %d", label, batch_id, exc=exc)


def _is_transient(exc: BaseException) -> bool:
    return caused_by(exc, TransientError)


def _log_stats(
    phases: Mapping[str, float], size: int, counters: Mapping[str, int], next_span_ns: int,
    lease_token: int,
) -> dict[str, float]:
    """What the batch log keeps of a batch (``cdcflow.model.BATCH_STATS``): the phases
    before the store commit, bytes read, the error policy's counts, the span the next
    batch is paced to (a restart goes on from it) and the lease token of the run that
    committed it (a restart counts the runs since that committed nothing)."""
    stats = {f"{phase}_seconds": phases[phase] for phase in ("plan", "execute", "sink_commit")
             if phase in phases}
    stats["bytes"] = size
    for name in ("retries", "skipped", "dead_lettered"):
        stats[name] = counters.get(name, 0)
    stats["next_span_ns"] = next_span_ns
    stats["lease_token"] = lease_token
    return stats
