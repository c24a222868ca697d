"""The engine's view of a pipeline's partitions, and which idle partitions can wait.

Cost proportional to activity. A run owns its pipeline (the lease fences every other
writer out), so after one read at start the engine keeps the partitions in memory and
applies to them exactly what it writes to the store: per batch there is no store read,
and the store writes hold only the partitions the batch planned or read.

An idle partition (its last slices held no data change record) need not be queried every
batch. :class:`IdleSchedule` reads it again after a delay that doubles with each idle
slice, up to ``max_delay`` seconds; any data resets it. Each delay is shortened by a
random part of up to half of it, so partitions that went idle together (ten thousand of
them, started by one batch) spread their reads over the batches instead of all coming due
in one. A partition that is not read keeps its watermark, so the pipeline's resolved
(low) watermark lags the clock by at most ``max_delay`` plus one batch more than it would
otherwise. A restarted run takes the partitions an earlier run read near the clock as idle
at that cap, each due at a random time within it (:meth:`IdleSchedule.resume`), rather
than reading them all in its first batches. An idle partition does not bound a batch's end
either: the batch reads at most ``max_batch_span`` past the other partitions' low
watermark, so a span shorter than the wait never holds busy partitions back, and an idle
partition, once due, reads from its watermark to the batch end (at most its wait plus the
span of changes).

Only IMMUTABLE_KEY_RANGE streams skip idle partitions: there a key lives in one partition
at a time and moves only to its children, which wait for their parents, so reading one
partition later never reorders a key's changes. In MUTABLE_KEY_RANGE streams keys move
between live partitions, and so do they in the emulator's streams (its partition churn
moves keys between partitions that are not parent and child:
``StreamInfo.keys_follow_lineage``); there per-key order relies on every partition being
read up to the same batch end, so every partition is read.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

import attrs

from cdcflow.engine.lifecycle import BatchOutcome
from cdcflow.engine.resume import capped
from cdcflow.engine.runner import TaskResult
from cdcflow.metadata import _rules
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import PartitionMetadata, PartitionState

__all__ = ["IdleSchedule", "PartitionView"]

_NS = 1_000_000_000


class PartitionView:
    """The stored partitions of ``pipeline``, read once and then kept in step with what the
    engine writes (:meth:`planned`, :meth:`committed`, :meth:`deleted`).

    With ``end`` (an end_at moved earlier on stored progress, :mod:`cdcflow.engine.resume`)
    no partition ends after it: a stored partition's end is lowered to it as it is read,
    and the children of such a partition inherit it."""

    def __init__(self, store: MetadataStore, pipeline: str, end: int | None = None) -> None:
        self._pipeline = pipeline
        self._parts = {p.token: p for p in capped(store.partitions(pipeline), end)}

    def __len__(self) -> int:
        return len(self._parts)

    def get(self, token: str) -> PartitionMetadata | None:
        return self._parts.get(token)

    def snapshot(self) -> list[PartitionMetadata]:
        """The partitions now (a new list; the records themselves are immutable)."""
        return list(self._parts.values())

    def mapping(self) -> Mapping[str, PartitionMetadata]:
        return self._parts

    def planned(self, transitions: Mapping[str, PartitionState], now_ns: int) -> None:
        """Apply the state transitions written with a plan (as the store stamps them)."""
        for token, state in transitions.items():
            self._parts[token] = self._moved(self._parts[token], state, now_ns)

    def committed(self, outcome: BatchOutcome, now_ns: int) -> None:
        """Apply a committed batch: watermarks, finished partitions, new children."""
        self._apply(self._parts, outcome, now_ns)

    def projected(self, outcome: BatchOutcome, now_ns: int) -> list[PartitionMetadata]:
        """The partitions as they will be once ``outcome`` is committed (what
        :meth:`committed` would make of them), without changing the view: the next batch
        can be planned from it while this one commits (:mod:`cdcflow.engine.batch`)."""
        parts = dict(self._parts)
        self._apply(parts, outcome, now_ns)
        return list(parts.values())

    def _apply(
        self, parts: dict[str, PartitionMetadata], outcome: BatchOutcome, now_ns: int
    ) -> None:
        for u in outcome.updates:
            p = attrs.evolve(parts[u.token], watermark=u.watermark)
            parts[u.token] = self._moved(p, PartitionState.FINISHED, now_ns) if u.finished else p
        for child in outcome.children:
            parts.setdefault(child.token, child)

    def _moved(
        self, p: PartitionMetadata, state: PartitionState, now_ns: int
    ) -> PartitionMetadata:
        # The stores' own rule, so the view stamps states exactly as they do.
        return _rules.transition(self._pipeline, p, state, now_ns)

    def deleted(self, tokens: Iterable[str]) -> None:
        for token in tokens:
            self._parts.pop(token, None)


class IdleSchedule:
    """Which partitions can skip this batch (see the module docstring).

    ``base_delay`` is the wait after the first idle slice, doubling per idle slice up to
    ``max_delay`` (seconds), less a random part of up to ``jitter`` of it (0 for exact
    waits). ``max_delay == 0`` reads every partition every batch.
    """

    def __init__(self, base_delay: float, max_delay: float, jitter: float = 0.5,
                 rng: random.Random | None = None) -> None:
        self.base_ns = max(1, int(base_delay * _NS))
        self.max_ns = int(max_delay * _NS)
        self.jitter = jitter
        self._rng = rng or random.Random()
        self._streak: dict[str, int] = {}
        self._due: dict[str, int] = {}

    def waiting(self, partitions: Sequence[PartitionMetadata], now_ns: int) -> set[str]:
        """Tokens of RUNNING partitions not due for a read at ``now_ns``."""
        if self.max_ns <= 0:
            return set()
        due = self._due
        return {
            p.token for p in partitions
            if p.state == PartitionState.RUNNING and due.get(p.token, 0) > now_ns
        }

    def quiet(self, partitions: Sequence[PartitionMetadata]) -> set[str]:
        """Tokens of RUNNING partitions whose last slice held no data, near the clock (the
        ones :meth:`waiting` may hold back, due or not): they do not bound a batch's end
        (:func:`~cdcflow.engine.lifecycle.plan_batch`)."""
        if self.max_ns <= 0:
            return set()
        streak = self._streak
        return {
            p.token for p in partitions
            if p.state == PartitionState.RUNNING and streak.get(p.token, 0) > 0
        }

    def resume(self, partitions: Sequence[PartitionMetadata], now_ns: int) -> None:
        """A run's start: a RUNNING partition this schedule has not seen yet whose watermark
        is within ``max_delay`` of the clock (read near the clock by an earlier run) is
        taken as idle at the cap, due at a random time before its watermark plus
        ``max_delay``. A restart does not know which partitions were idle; reading all of
        them in its first batches (each then due again one base delay later, then two...)
        cost several batches as slow as the partitions are many. The lag bound holds: none
        waits past its watermark plus ``max_delay``; any data read resets it."""
        if self.max_ns <= 0:
            return
        streak = (self.max_ns // self.base_ns).bit_length() + 1  # its next wait: the cap
        due, streaks, random_ = self._due, self._streak, self._rng.random
        for p in partitions:
            if (p.state == PartitionState.RUNNING and p.token not in due
                    and now_ns - p.watermark <= self.max_ns):
                streaks[p.token] = streak
                wait = min(self.max_ns, p.watermark + self.max_ns - now_ns)
                due[p.token] = now_ns + int(wait * random_())

    def read(self, results: Sequence[TaskResult], now_ns: int, planned_ns: int | None = None
             ) -> None:
        """Note what each read partition held: data resets it, an idle slice that reached
        near the clock doubles its wait (catching up on the past is never idle; a finished
        partition is forgotten). "Near the clock" is judged at ``planned_ns``, when the
        batch was planned (default ``now_ns``): a batch that took long to read is not
        catching up for that (else a slow batch of many idle partitions would keep every
        one of them read, and its successors as slow)."""
        if self.max_ns <= 0:
            return
        planned = now_ns if planned_ns is None else planned_ns
        for r in results:
            if r.ended:
                self._streak.pop(r.token, None)
                self._due.pop(r.token, None)
            elif r.records or planned - r.position > self.max_ns:
                self._streak[r.token] = 0
                self._due[r.token] = 0
            else:
                streak = self._streak.get(r.token, 0) + 1
                self._streak[r.token] = streak
                delay = min(self.max_ns, self.base_ns << min(streak - 1, 40))
                if self.jitter > 0:
                    delay -= int(delay * self.jitter * self._rng.random())
                self._due[r.token] = now_ns + delay
