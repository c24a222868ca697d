"""Rules every store applies the same way: state transitions, plan checks, error messages.

Kept apart from the stores so the memory, SQLite and Spanner stores cannot drift apart on
what the MetadataStore contract means.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import attrs

from cdcflow.errors import (
    FencedError,
    LeaseHeldError,
    PlanConflictError,
    StoreError,
    StoreURLError,
    WatermarkRegressionError,
)
from cdcflow.model import (
    BATCH_STATS,
    BatchPlan,
    Lease,
    PartitionMetadata,
    PartitionState,
    Timestamp,
)

__all__ = [
    "DEFAULT_BATCH_LOG_SIZE",
    "URL_FORMS",
    "batch_stats",
    "check_fence",
    "check_log_size",
    "check_new_plan",
    "held_message",
    "is_pending",
    "new_lease",
    "not_planned",
    "parse_stats",
    "raise_marks",
    "regression",
    "renewed",
    "stats_text",
    "transition",
    "unknown_partition",
    "url_error",
]

#: Entries kept per pipeline in the batch log; the oldest (always committed) are pruned when a
#: batch is planned, so a long-running pipeline's log stays small.
DEFAULT_BATCH_LOG_SIZE = 10_000

URL_FORMS = (
    "memory:// (private to this store object), memory://NAME (shared within the process), "
    "sqlite:///relative/path.db, sqlite:////absolute/path.db, "
    "spanner://projects/P/instances/I/databases/D[?table=NAME]"
)

_ORDER = {
    PartitionState.CREATED: 0,
    PartitionState.SCHEDULED: 1,
    PartitionState.RUNNING: 2,
    PartitionState.FINISHED: 3,
}


def check_log_size(size: int) -> int:
    if size < 1:
        msg = f"batch_log_size must be at least 1 (the pending batch), got {size}"
        raise ValueError(msg)
    return size


def url_error(url: str, why: str) -> StoreURLError:
    return StoreURLError(f"bad metadata store URL {url!r}: {why}; valid forms: {URL_FORMS}")


def transition(
    pipeline: str, partition: PartitionMetadata, state: PartitionState, now: int
) -> PartitionMetadata:
    """``partition`` moved to ``state``, with the timestamps of the states it reaches set.

    Moving to the current state changes nothing. A jump (CREATED -> RUNNING) also sets the
    skipped state's timestamp. Moving backwards raises StoreError: states only go forward.
    """
    state = PartitionState(state)
    if state == partition.state:
        return partition
    if _ORDER[state] < _ORDER[partition.state]:
        msg = (
            f"pipeline {pipeline!r}: partition {partition.token!r} cannot go from "
            f"{partition.state} back to {state}; states only move forward "
            "(CREATED -> SCHEDULED -> RUNNING -> FINISHED); use reset to start over"
        )
        raise StoreError(msg)
    level = _ORDER[state]
    return attrs.evolve(
        partition,
        state=state,
        scheduled_at=partition.scheduled_at if partition.scheduled_at is not None or level < 1
        else now,
        running_at=partition.running_at if partition.running_at is not None or level < 2
        else now,
        finished_at=partition.finished_at if partition.finished_at is not None or level < 3
        else now,
    )


def check_new_plan(pipeline: str, plan: BatchPlan, last_id: int, pending_id: int | None) -> None:
    """Raise PlanConflictError unless ``plan`` may be logged next."""
    if pending_id is not None:
        msg = (
            f"pipeline {pipeline!r}: batch {pending_id} is still pending; commit or replay it "
            f"before planning batch {plan.batch_id} (is another run of this pipeline active?)"
        )
        raise PlanConflictError(msg)
    if plan.batch_id <= last_id:
        msg = (
            f"pipeline {pipeline!r}: batch id {plan.batch_id} is not greater than the last "
            f"logged batch id {last_id}; plan batch {last_id + 1} next"
        )
        raise PlanConflictError(msg)


def is_pending(plan: BatchPlan, pending: BatchPlan | None) -> bool:
    """True if ``plan`` is the pending plan already: ``write_plan`` was called again after
    an answer that got lost (the first call did commit). The store must then succeed and
    change nothing. Plans compare whole, ``planned_at`` included, so a plan without one
    (which the store stamps) never matches and a second planner still gets
    PlanConflictError."""
    return pending is not None and plan.planned_at != 0 and plan == pending


def not_planned(pipeline: str, batch_id: int) -> StoreError:
    return StoreError(
        f"pipeline {pipeline!r}: batch {batch_id} was never planned; "
        "call write_plan before commit_batch"
    )


def unknown_partition(pipeline: str, token: str) -> StoreError:
    return StoreError(
        f"pipeline {pipeline!r} has no partition {token!r}; insert it first "
        "(insert_partitions, or as a child in commit_batch)"
    )


def regression(pipeline: str, token: str, stored: int, new: int) -> WatermarkRegressionError:
    return WatermarkRegressionError(
        f"pipeline {pipeline!r}: partition {token!r} watermark would move back from {stored} "
        f"to {new} ns; watermarks never go backwards, so commit progress at or after {stored}"
    )


def _ago(ns: int, now_ns: int) -> str:
    seconds = max(0.0, (now_ns - ns) / 1e9)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def held_message(pipeline: str, lease: Lease, now_ns: int) -> str:
    """One line naming the live owner of ``pipeline`` and how to take over."""
    left = max(0.0, (lease.expires_at - now_ns) / 1e9)
    return (
        f"pipeline {pipeline!r} is being run by {lease.owner} (run {lease.run_id}, since "
        f"{Timestamp.from_ns(lease.acquired_at).rfc3339()[:19]}Z, last heartbeat "
        f"{_ago(lease.renewed_at, now_ns)}); stop that run first, or, if it is gone, run again "
        f"once its lease expires in {left:.0f}s, or take over now with --takeover "
        "(takeover=True)"
    )


def new_lease(
    pipeline: str, current: Lease | None, owner: str, run_id: str, ttl_ns: int, now_ns: int,
    replace: int | None, floor: int = 0,
) -> Lease:
    """The lease ``acquire_lease`` stores, or LeaseHeldError (see the protocol)."""
    if ttl_ns <= 0:
        msg = f"a lease needs a positive ttl, got {ttl_ns} ns"
        raise ValueError(msg)
    if (
        current is not None and current.alive(now_ns) and current.run_id != run_id
        and current.token != replace
    ):
        raise LeaseHeldError(held_message(pipeline, current, now_ns))
    token = max(current.token if current is not None else 0, floor) + 1
    return Lease(owner, run_id, token, now_ns, now_ns, now_ns + ttl_ns)


def renewed(pipeline: str, current: Lease | None, lease: Lease, ttl_ns: int, now_ns: int) -> Lease:
    """``lease`` extended by ``ttl_ns``, or FencedError when it is no longer current."""
    check_fence(pipeline, current, lease.token)
    assert current is not None
    return attrs.evolve(current, renewed_at=now_ns, expires_at=now_ns + ttl_ns)


def check_fence(pipeline: str, current: Lease | None, fence: int | None) -> None:
    """Raise FencedError unless ``fence`` is None or the current lease's token."""
    if fence is None or (current is not None and current.token == fence):
        return
    holder = "nobody" if current is None else f"{current.owner} (run {current.run_id})"
    msg = (
        f"pipeline {pipeline!r}: this run's lease (token {fence}) is no longer current; "
        f"{holder} holds the pipeline now, so this run stops without writing anything"
    )
    raise FencedError(msg)


def raise_marks(stored: dict[str, int], marks: Mapping[str, int]) -> None:
    """Merge durable marks into ``stored``: a mark only moves forward."""
    for label, batch_id in marks.items():
        if batch_id > stored.get(label, -1):
            stored[label] = batch_id


def batch_stats(stats: Mapping[str, float] | None) -> dict[str, float]:
    """The batch statistics a store keeps: the names of BATCH_STATS, as floats."""
    if not stats:
        return {}
    return {name: float(stats[name]) for name in BATCH_STATS if name in stats}


def stats_text(stats: Mapping[str, float] | None) -> str | None:
    """Batch statistics as the JSON text a store's column holds (None for none)."""
    kept = batch_stats(stats)
    return json.dumps(kept, sort_keys=True) if kept else None


def parse_stats(text: str | None) -> dict[str, float]:
    """Batch statistics from a store's column; an unreadable value reads as none (they
    are for people, nothing depends on them)."""
    if not text:
        return {}
    try:
        loaded = json.loads(text)
    except ValueError:
        return {}
    return batch_stats(loaded) if isinstance(loaded, dict) else {}
