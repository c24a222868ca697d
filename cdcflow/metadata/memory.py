"""MemoryStore: the in-process MetadataStore, for tests and short-lived runs.

``memory://`` gives a private store; ``memory://NAME`` gives the process-wide store of that
name, so two opens of the same URL share state (and "reopening" after close sees it again).
Stored values are frozen attrs records holding tuples, so they are shared, never copied.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import attrs

from cdcflow.metadata import _rules
from cdcflow.model import (
    BatchPlan,
    BatchRecord,
    Lease,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
)

__all__ = ["MemoryStore"]

_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_named: dict[str, MemoryStore] = {}
_named_lock = threading.Lock()


@attrs.define
class _Batch:
    plan: BatchPlan
    committed_at: int | None = None
    records: int = 0
    stats: Mapping[str, float] = attrs.field(factory=dict)


@attrs.define
class _Pipeline:
    partitions: dict[str, PartitionMetadata] = attrs.field(factory=dict)
    batches: dict[int, _Batch] = attrs.field(factory=dict)  # increasing batch ids
    lease: Lease | None = None
    floor: int = 0  # the largest batch id before the last reset
    source: str | None = None
    durable: dict[str, int] = attrs.field(factory=dict)  # sink label -> durable batch
    step_state: bytes | None = None  # the BatchSteps' state as of the last commit

    def empty(self) -> bool:
        return not (
            self.partitions or self.batches or self.lease or self.floor or self.source
            or self.durable or self.step_state is not None
        )

    def pending(self) -> _Batch | None:
        last = self.last()
        return last if last is not None and last.committed_at is None else None

    def last(self) -> _Batch | None:
        # Batch ids only grow, so the newest entry is the last inserted.
        return self.batches[next(reversed(self.batches))] if self.batches else None


class MemoryStore:
    """A thread-safe MetadataStore held in this process; see the protocol for the contract."""

    def __init__(
        self,
        name: str | None = None,
        *,
        clock: Callable[[], int] = time.time_ns,
        batch_log_size: int = _rules.DEFAULT_BATCH_LOG_SIZE,
    ) -> None:
        self._name = name
        self._clock = clock
        self._batch_log_size = _rules.check_log_size(batch_log_size)
        self._lock = threading.RLock()
        self._pipelines: dict[str, _Pipeline] = {}

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        """``memory://`` -> a new private store; ``memory://NAME`` -> the shared store NAME."""
        if not url.startswith("memory://"):
            raise _rules.url_error(url, "a memory store URL starts with memory://")
        name = url[len("memory://"):]
        if not name:
            return cls()
        if not _NAME.match(name):
            raise _rules.url_error(url, "a memory store name uses only letters, digits, . _ -")
        with _named_lock:
            store = _named.get(name)
            if store is None:
                store = _named[name] = cls(name)
            return store

    @property
    def url(self) -> str:
        return f"memory://{self._name or ''}"

    def _get(self, pipeline: str) -> _Pipeline:
        state = self._pipelines.get(pipeline)
        if state is None:
            state = self._pipelines[pipeline] = _Pipeline()
        return state

    def _drop_if_empty(self, pipeline: str) -> None:
        state = self._pipelines.get(pipeline)
        if state is not None and state.empty():
            del self._pipelines[pipeline]

    def partitions(self, pipeline: str) -> list[PartitionMetadata]:
        with self._lock:
            state = self._pipelines.get(pipeline)
            rows = list(state.partitions.values()) if state else []
        return sorted(rows, key=lambda p: (p.start, p.token))

    def insert_partitions(self, pipeline: str, partitions: Sequence[PartitionMetadata]) -> int:
        with self._lock:
            stored = self._get(pipeline).partitions
            inserted = 0
            for p in partitions:
                if p.token not in stored:
                    stored[p.token] = p
                    inserted += 1
            self._drop_if_empty(pipeline)
            return inserted

    def pending_plan(self, pipeline: str) -> BatchPlan | None:
        with self._lock:
            state = self._pipelines.get(pipeline)
            pending = state.pending() if state else None
            return pending.plan if pending else None

    def last_batch_id(self, pipeline: str) -> int:
        with self._lock:
            state = self._pipelines.get(pipeline)
            return self._last_id(state)

    @staticmethod
    def _last_id(state: _Pipeline | None) -> int:
        if state is None:
            return 0
        last = state.last()
        return max(state.floor, last.plan.batch_id if last else 0)

    def write_plan(
        self,
        pipeline: str,
        plan: BatchPlan,
        transitions: Mapping[str, PartitionState],
        *,
        fence: int | None = None,
    ) -> None:
        with self._lock:
            state = self._pipelines.get(pipeline) or _Pipeline()
            _rules.check_fence(pipeline, state.lease, fence)
            pending = state.pending()
            if _rules.is_pending(plan, pending.plan if pending else None):
                return
            _rules.check_new_plan(
                pipeline, plan, self._last_id(state), pending.plan.batch_id if pending else None
            )
            now = self._clock()
            # Compute every change first so a refused transition changes nothing.
            changed: dict[str, PartitionMetadata] = {}
            for token, new_state in transitions.items():
                current = changed.get(token) or state.partitions.get(token)
                if current is None:
                    raise _rules.unknown_partition(pipeline, token)
                changed[token] = _rules.transition(pipeline, current, new_state, now)
            state.partitions.update(changed)
            if not plan.planned_at:
                plan = attrs.evolve(plan, planned_at=now)
            state.batches[plan.batch_id] = _Batch(plan)
            self._prune(state)
            self._pipelines[pipeline] = state

    def commit_batch(
        self,
        pipeline: str,
        batch_id: int,
        updates: Sequence[PartitionUpdate],
        children: Sequence[PartitionMetadata],
        records: int = 0,
        *,
        fence: int | None = None,
        durable: Mapping[str, int] | None = None,
        state: bytes | None = None,
        stats: Mapping[str, float] | None = None,
    ) -> bool:
        with self._lock:
            rec = self._pipelines.get(pipeline)
            _rules.check_fence(pipeline, rec.lease if rec else None, fence)
            batch = rec.batches.get(batch_id) if rec else None
            if rec is None or batch is None:
                raise _rules.not_planned(pipeline, batch_id)
            if batch.committed_at is not None:
                return False
            now = self._clock()
            changed: dict[str, PartitionMetadata] = {}
            for u in updates:
                current = changed.get(u.token) or rec.partitions.get(u.token)
                if current is None:
                    raise _rules.unknown_partition(pipeline, u.token)
                if u.watermark < current.watermark:
                    raise _rules.regression(pipeline, u.token, current.watermark, u.watermark)
                current = attrs.evolve(current, watermark=u.watermark)
                if u.finished:
                    current = _rules.transition(pipeline, current, PartitionState.FINISHED, now)
                changed[u.token] = current
            rec.partitions.update(changed)
            for child in children:
                rec.partitions.setdefault(child.token, child)
            batch.committed_at = now
            batch.records = records
            batch.stats = _rules.batch_stats(stats)
            _rules.raise_marks(rec.durable, durable or {})
            if state is not None:
                rec.step_state = bytes(state)
            return True

    def _prune(self, state: _Pipeline) -> None:
        excess = len(state.batches) - self._batch_log_size
        keep_above = min(state.durable.values(), default=None)
        for batch_id in list(state.batches)[: max(excess, 0)]:
            if keep_above is not None and batch_id > keep_above:
                break  # a sink has not made it durable: recovery may replay it
            if state.batches[batch_id].committed_at is not None:
                del state.batches[batch_id]

    def delete_partitions(self, pipeline: str, tokens: Sequence[str]) -> int:
        with self._lock:
            state = self._pipelines.get(pipeline)
            if state is None:
                return 0
            deleted = sum(state.partitions.pop(t, None) is not None for t in set(tokens))
            self._drop_if_empty(pipeline)
            return deleted

    def batches(self, pipeline: str, limit: int = 20) -> list[BatchRecord]:
        with self._lock:
            state = self._pipelines.get(pipeline)
            if state is None:
                return []
            newest = list(reversed(state.batches.values()))[: max(limit, 0)]
            return [
                BatchRecord(
                    batch_id=b.plan.batch_id, end=b.plan.end, planned_at=b.plan.planned_at,
                    committed_at=b.committed_at, slices=len(b.plan.slices), records=b.records,
                    stats=b.stats,
                )
                for b in newest
            ]

    def pipelines(self) -> list[str]:
        with self._lock:
            return sorted(self._pipelines)

    def reset(self, pipeline: str) -> None:
        with self._lock:
            state = self._pipelines.get(pipeline)
            if state is None:
                return
            kept = _Pipeline(lease=state.lease, floor=self._last_id(state))
            self._pipelines[pipeline] = kept
            self._drop_if_empty(pipeline)

    # -- ownership and the source definition ------------------------------------------------

    def lease(self, pipeline: str) -> Lease | None:
        with self._lock:
            state = self._pipelines.get(pipeline)
            return state.lease if state else None

    def acquire_lease(
        self, pipeline: str, owner: str, run_id: str, ttl_ns: int, *, replace: int | None = None
    ) -> Lease:
        with self._lock:
            state = self._get(pipeline)
            lease = _rules.new_lease(
                pipeline, state.lease, owner, run_id, ttl_ns, self._clock(), replace
            )
            state.lease = lease
            return lease

    def renew_lease(self, pipeline: str, lease: Lease, ttl_ns: int) -> Lease:
        with self._lock:
            state = self._pipelines.get(pipeline)
            current = state.lease if state else None
            renewed = _rules.renewed(pipeline, current, lease, ttl_ns, self._clock())
            assert state is not None
            state.lease = renewed
            return renewed

    def release_lease(self, pipeline: str, lease: Lease) -> None:
        with self._lock:
            state = self._pipelines.get(pipeline)
            if state is not None and state.lease is not None and state.lease.token == lease.token:
                state.lease = attrs.evolve(state.lease, expires_at=0)

    def durable_marks(self, pipeline: str) -> dict[str, int]:
        with self._lock:
            state = self._pipelines.get(pipeline)
            return dict(state.durable) if state else {}

    def mark_durable(
        self, pipeline: str, marks: Mapping[str, int], *, fence: int | None = None
    ) -> None:
        with self._lock:
            state = self._get(pipeline)
            _rules.check_fence(pipeline, state.lease, fence)
            _rules.raise_marks(state.durable, marks)

    def step_state(self, pipeline: str) -> bytes | None:
        with self._lock:
            state = self._pipelines.get(pipeline)
            return state.step_state if state else None

    def logged_plan(self, pipeline: str, batch_id: int) -> BatchPlan | None:
        with self._lock:
            state = self._pipelines.get(pipeline)
            batch = state.batches.get(batch_id) if state else None
            return batch.plan if batch else None

    def source(self, pipeline: str) -> str | None:
        with self._lock:
            state = self._pipelines.get(pipeline)
            return state.source if state else None

    def set_source(self, pipeline: str, source: str) -> None:
        with self._lock:
            self._get(pipeline).source = source

    def close(self) -> None:
        """Nothing to release; a named store keeps its state for the next open."""
