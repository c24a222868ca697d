"""Stuck partitions: a partition that is not FINISHED and whose watermark has not moved.

:class:`StuckDetector` is the decision, without a clock or a thread of its own: it is fed
the stored partitions with the engine's clock (``observe``, after every committed batch)
and asked again between batches (``check``). A partition is *stuck* when it is not
FINISHED and its watermark has not advanced for ``stuck_after`` seconds of the engine's
clock, counted from the later of "when its current watermark was first seen" and "when
the clock passed that watermark" (a partition cannot read ahead of the clock, so one that
starts in the future is not stuck while it waits). Each episode is reported once: a
WARNING log line naming the token, its watermark and how long it has not moved when it
starts, an INFO line when the partition moves again (or finishes, or is gone).

:class:`StuckWatch` is the listener that feeds a detector during a run and checks it on a
timer thread, so a partition is reported even while a batch hangs or the engine waits (no
commit means no ``on_partitions``). Its thread runs between :meth:`StuckWatch.start` and
:meth:`StuckWatch.stop` (a context manager does both).

Two kinds of partitions are never stuck, whatever their watermark does: a CREATED partition
that waits (for parents that are not all FINISHED: a merge's child behind a lagging parent;
or, for a stream partition, for the snapshot: the root waits for every snapshot partition,
the key ranges its tables split into included; it is watched once they finish), and a
snapshot partition (``snapshot/<table>`` or a key range of it), read in one slice whose end
it reaches only once its rows are read, however long that takes; the query deadline bounds
that read.

Batches commit all of their slices or none, so a read that hangs holds back the stored
watermark of every partition of its batch. The watch names only the partitions whose read
is still running: a partition whose task of the batch in flight has finished (see
:func:`cdcflow.engine.listener.tasks_done`) is waiting for the commit, not stuck; one whose
task waits for a sink to take its elements, or for room in the byte quota (see
:func:`cdcflow.engine.listener.tasks_held_back`), is reported as held back by that. Where
tasks run in other processes (Spark executors) the driver cannot see that, and every
partition of the hung batch is reported, with the batch that is in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from types import TracebackType

import attrs

from cdcflow.engine.listener import (
    BatchStats,
    EngineListener,
    RunSummary,
    tasks_done,
    tasks_held_back,
)
from cdcflow.errors import log_failure
from cdcflow.model import (
    BatchPlan,
    PartitionMetadata,
    PartitionState,
    Timestamp,
    is_snapshot_token,
)

__all__ = ["StuckDetector", "StuckPartition", "StuckWatch", "default_stuck_after"]

_NS = 1_000_000_000
_MIN_DEFAULT_S = 30.0
_HEARTBEATS = 10
_MAX_CHECK_INTERVAL_S = 1.0

_log = logging.getLogger("cdcflow.stuck")


def default_stuck_after(
    heartbeat_millis: int, batch_interval: float = 0.0, idle_read_interval: float = 0.0
) -> float:
    """Seconds without progress after which a partition counts as stuck, when the run does
    not say: 10 heartbeat intervals, at least 30 s, at least 3 batch intervals (an idle
    pipeline advances once per batch) and at least twice the idle read interval (an idle
    partition is read that rarely)."""
    return max(_MIN_DEFAULT_S, _HEARTBEATS * heartbeat_millis / 1000, 3 * batch_interval,
               2 * idle_read_interval)


@attrs.frozen
class StuckPartition:
    """A partition that has not advanced: its watermark has stayed at ``watermark`` since
    ``since`` (engine clock, ns); :meth:`seconds` is how long that is at ``now_ns``."""

    token: str
    state: PartitionState
    watermark: int
    since: int

    def seconds(self, now_ns: int) -> float:
        return max(0, now_ns - self.since) / _NS


@attrs.define
class _Track:
    watermark: int
    seen_at: int  # engine clock when this watermark was first seen
    state: PartitionState
    heartbeat_millis: int

    @property
    def since(self) -> int:
        # Progress is possible only once the clock has passed the watermark.
        return max(self.seen_at, self.watermark)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


class StuckDetector:
    """Decides which partitions are stuck; safe to call from several threads.

    ``stuck_after``: seconds without progress (None: :func:`default_stuck_after` of each
    partition's heartbeat and ``batch_interval``). ``pipeline`` names the pipeline in log
    lines. Time is whatever ``now_ns`` the caller passes: the engine's clock.
    """

    def __init__(
        self,
        stuck_after: float | None = None,
        *,
        pipeline: str = "",
        batch_interval: float = 0.0,
        idle_read_interval: float = 0.0,
        log: logging.Logger | None = None,
    ) -> None:
        if stuck_after is not None and stuck_after <= 0:
            msg = f"stuck_after must be more than 0 seconds, got {stuck_after}"
            raise ValueError(msg)
        self.stuck_after = stuck_after
        self.pipeline = pipeline
        self.batch_interval = batch_interval
        self.idle_read_interval = idle_read_interval
        self.log = log or _log
        self._lock = threading.Lock()
        self._tracks: dict[str, _Track] = {}
        self._stuck: dict[str, StuckPartition] = {}

    def threshold(self, heartbeat_millis: int) -> float:
        """Seconds without progress after which a partition with this heartbeat is stuck."""
        if self.stuck_after is not None:
            return self.stuck_after
        return default_stuck_after(heartbeat_millis, self.batch_interval,
                                   self.idle_read_interval)

    def observe(
        self, partitions: Iterable[PartitionMetadata], now_ns: int, note: str = ""
    ) -> list[StuckPartition]:
        """Take the stored partitions at ``now_ns``; return the ones newly found stuck.

        A partition whose watermark moved, that FINISHED, or that is no longer stored ends
        its episode (logged at INFO), and so does one that waits (see the module
        docstring). ``partitions`` is read, not kept.
        """
        parts = list(partitions)
        unfinished = {p.token for p in parts if p.state != PartitionState.FINISHED}
        snapshotting = any(is_snapshot_token(t) for t in unfinished)
        with self._lock:
            seen: set[str] = set()
            for p in parts:
                if p.state == PartitionState.FINISHED or is_snapshot_token(p.token):
                    continue
                if p.state == PartitionState.CREATED and (
                    snapshotting or unfinished.intersection(p.parent_tokens)
                ):
                    continue  # waits: for the snapshot, or its parents (one no longer stored
                    # finished)
                seen.add(p.token)
                track = self._tracks.get(p.token)
                if track is None or p.watermark != track.watermark:
                    self._tracks[p.token] = _Track(p.watermark, now_ns, p.state, p.heartbeat_millis)
                    if track is not None:
                        self._clear(p.token, now_ns, f"advanced to {_stamp(p.watermark)}")
                else:
                    track.state = p.state
            for token in [t for t in self._tracks if t not in seen]:
                del self._tracks[token]
                self._clear(token, now_ns, "finished")
            return self._evaluate(now_ns, note)

    def seed(self, positions: Iterable[tuple[str, int]], now_ns: int) -> None:
        """Start watching partitions not observed yet, at these (token, watermark) positions:
        the slices of a batch planned before any commit (a run whose first batch hangs has
        no stored partitions to observe). Their heartbeat is taken as the largest known. A
        partition watched since it was CREATED is RUNNING once a batch reads it."""
        with self._lock:
            heartbeat = max((t.heartbeat_millis for t in self._tracks.values()), default=1000)
            for token, watermark in positions:
                track = self._tracks.get(token)
                if track is not None and track.state == PartitionState.CREATED:
                    track.state = PartitionState.RUNNING
                if track is None and not is_snapshot_token(token):
                    self._tracks[token] = _Track(
                        watermark, now_ns, PartitionState.RUNNING, heartbeat
                    )

    def check(
        self, now_ns: int, note: str = "", waiting: Collection[str] = (),
        notes: Mapping[str, str] | None = None,
    ) -> list[StuckPartition]:
        """Look again at the partitions last observed, at ``now_ns``; return the ones newly
        found stuck. ``note`` is added to their log lines (e.g. the batch in flight), or a
        partition's own in ``notes`` (e.g. what its read is held back by).

        ``waiting``: tokens whose read of the batch in flight is done; their progress waits
        for the batch's commit, so they are not stuck (an episode of theirs ends)."""
        with self._lock:
            for token in waiting:
                track = self._tracks.get(token)
                if track is not None:
                    track.seen_at = max(track.seen_at, now_ns)
                    self._clear(token, now_ns, "its read is done, its batch commits it")
            return self._evaluate(now_ns, note, notes)

    def stuck(self) -> list[StuckPartition]:
        """The partitions stuck now, longest first."""
        with self._lock:
            return sorted(self._stuck.values(), key=lambda s: (s.since, s.token))

    def _evaluate(self, now_ns: int, note: str, notes: Mapping[str, str] | None = None
                  ) -> list[StuckPartition]:
        found: list[StuckPartition] = []
        for token, track in self._tracks.items():
            if token in self._stuck:
                continue
            threshold_ns = int(self.threshold(track.heartbeat_millis) * _NS)
            if now_ns - track.since < threshold_ns:
                continue
            stuck = StuckPartition(token, track.state, track.watermark, track.since)
            self._stuck[token] = stuck
            found.append(stuck)
            self.log.warning(
                "%spartition %s (%s) has not advanced for %s: its watermark is still %s%s",
                self._prefix(), token, track.state.value.lower(),
                _duration(stuck.seconds(now_ns)), _stamp(track.watermark),
                f"; {said}" if (said := (notes or {}).get(token, note)) else "",
            )
        return found

    def _clear(self, token: str, now_ns: int, how: str) -> None:
        stuck = self._stuck.pop(token, None)
        if stuck is not None:
            self.log.info(
                "%spartition %s is moving again (%s) after %s without progress",
                self._prefix(), token, how, _duration(stuck.seconds(now_ns)),
            )

    def _prefix(self) -> str:
        return f"pipeline {self.pipeline}: " if self.pipeline else ""


def _stamp(ns: int) -> str:
    return Timestamp.from_ns(ns).rfc3339()


class StuckWatch(EngineListener):
    """Feeds ``detector`` from the engine and checks it every ``interval`` seconds.

    ``clock`` must be the engine's clock (ns since the epoch; the engine's default is
    ``time.time_ns``). ``interval`` defaults to a fifth of the detector's ``stuck_after``,
    at most 1 s. The checking thread runs from :meth:`start` to :meth:`stop`; the engine
    does not call either (``run_pipeline`` does, around the run, so the thread also ends
    when a run fails).
    """

    def __init__(
        self,
        detector: StuckDetector,
        *,
        clock: Callable[[], int] = time.time_ns,
        interval: float | None = None,
    ) -> None:
        self.detector = detector
        self._clock = clock
        if interval is None:
            after = detector.stuck_after
            interval = _MAX_CHECK_INTERVAL_S if after is None else min(
                _MAX_CHECK_INTERVAL_S, max(0.01, after / 5)
            )
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._flight_lock = threading.Lock()
        self._in_flight: tuple[int, float] | None = None  # (batch id, monotonic start)
        self._pipeline = detector.pipeline

    # -- the engine's side ------------------------------------------------------------------

    def on_start(self, pipeline: str, runner: str, store_url: str) -> None:
        self._pipeline = pipeline

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        with self._flight_lock:
            self._in_flight = (plan.batch_id, time.monotonic())
        self.detector.seed(((s.token, s.start) for s in plan.slices), self._clock())

    def on_partitions(self, partitions: Sequence[PartitionMetadata], now_ns: int) -> None:
        self.detector.observe(partitions, now_ns)

    def on_batch(self, stats: BatchStats) -> None:
        with self._flight_lock:
            self._in_flight = None

    def on_batches_done(self, summary: RunSummary) -> None:
        # No partition moves from here on (the final flush): none is stuck.
        self._stop.set()

    # -- the timer --------------------------------------------------------------------------

    def check(self) -> list[StuckPartition]:
        """One check now (what the thread does every ``interval``)."""
        with self._flight_lock:
            flight = self._in_flight
        note = ""
        done: frozenset[str] = frozenset()
        notes: dict[str, str] = {}
        if flight is not None:
            batch_id, began = flight
            note = f"batch {batch_id} has been running for {_duration(time.monotonic() - began)}"
            done = tasks_done(self._pipeline, batch_id)
            notes = {token: f"{note}, and its read is held back, not hung: its task waits for "
                            f"{by}"
                     for token, by in tasks_held_back(self._pipeline, batch_id).items()}
            if done:
                note += f", waiting for this read ({len(done)} other reads of it are done)"
        return self.detector.check(self._clock(), note, done, notes)

    def start(self) -> StuckWatch:
        """Start the checking thread (once)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._run, name="cdcflow-stuck-watch", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the checking thread and wait for it (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.check()
            except Exception as exc:  # a broken check must not end the run it observes
                log_failure(_log, "checking for stuck partitions failed", exc=exc)

    def __enter__(self) -> StuckWatch:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
