"""The partition lifecycle, as pure functions (no I/O, no clock): the one place that decides.

Everything here takes the stored partitions of one pipeline (and, for :func:`fold`, what the
tasks of a batch read) and returns what to do; the engine (:mod:`cdcflow.engine.loop`) reads
the store, calls these, and writes back. ``cdcflow status`` and the property tests use the
same functions, so there is one meaning of "ready", "finished", "low watermark" and "garbage".

- :func:`plan_batch`: which partitions read which slice next (CREATED -> RUNNING).
- :func:`fold`: the tasks' reports -> partition updates (RUNNING -> FINISHED) and new children.
- :func:`low_watermark`: the resolved timestamp of the pipeline.
- :func:`gc_candidates`: finished partitions that may be deleted.

Invariants these functions rely on and keep:

- A child partition is scheduled only when every parent is FINISHED. With one reader per
  partition this keeps every key's changes in commit-timestamp order across splits and
  merges. Garbage collection deletes a FINISHED partition only after all of its children
  have started, so a parent missing for a CREATED child is one not discovered yet (see
  :func:`ready_partitions`).
- Snapshot partitions (``snapshot/<table>`` and the key ranges a large table is split
  into, ``snapshot/<table>/<n>/...``; see :mod:`cdcflow.engine.snapshot`) are read in one
  slice of 1 ns each. A table's partition has no parents, and its ranges are its children
  (inserted once, like a split's). No other partition is ready while any snapshot
  partition is unfinished (:func:`ready_partitions`), so the stream starts after every
  snapshot row committed, ranges included, although the root lists only the tables'
  partitions as parents. At most ``max_snapshot_slices`` snapshot partitions are read per
  batch (:func:`plan_batch`), which bounds what a crash during the snapshot reads again.
- The batch end ``T`` is never ahead of the clock and at most ``max_span_ns`` after the
  low watermark, so one lagging partition bounds how far the others run ahead.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence

import attrs

from cdcflow.engine.runner import TaskResult
from cdcflow.errors import RunnerContractError
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    BatchPlan,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
    Slice,
    is_snapshot_token,
)

__all__ = [
    "BatchOutcome",
    "all_finished",
    "children_of",
    "count_states",
    "fold",
    "gc_candidates",
    "low_watermark",
    "plan_batch",
    "ready_partitions",
]

_FINISHED = PartitionState.FINISHED
_CREATED = PartitionState.CREATED


def ready_partitions(partitions: Sequence[PartitionMetadata]) -> list[PartitionMetadata]:
    """CREATED partitions whose parents have all FINISHED, in (start, token) order.

    A parent missing from ``partitions`` is either garbage collected (it finished) or not
    inserted yet: a merge child can be reported by one parent while another parent has
    not even been discovered, because its own ancestor lags behind. The two cases are
    told apart by the low watermark: an undiscovered parent has an unfinished ancestor
    whose watermark is below the child's start, so a child with a missing parent is ready
    only once no unfinished partition is below its start.

    Snapshot first: while any snapshot partition is unfinished, only snapshot partitions
    are ready. Every snapshot row (commit timestamp ``start - 1 ns``) is then committed
    before the first change is read, whichever partition (a table, a key range of it)
    holds it.
    """
    state = {p.token: p.state for p in partitions}
    low = low_watermark(partitions)
    snapshotting = any(is_snapshot_token(p.token) and p.state != _FINISHED for p in partitions)
    ready = []
    for p in partitions:
        if p.state != _CREATED or (snapshotting and not is_snapshot_token(p.token)):
            continue
        if all(
            state[parent] == _FINISHED if parent in state else low >= p.start
            for parent in p.parent_tokens
        ):
            ready.append(p)
    return sorted(ready, key=lambda p: (p.start, p.token))


def low_watermark(partitions: Iterable[PartitionMetadata]) -> int:
    """The pipeline's low watermark: every record below it has been delivered and committed.

    The minimum watermark over partitions that are not FINISHED (a CREATED partition's
    watermark is its start). When every partition is FINISHED it is the largest finish
    position (the end of what was read); with no partitions at all it is 0.
    """
    active: list[int] = []
    finished: list[int] = []
    for p in partitions:
        (finished if p.state == _FINISHED else active).append(p.watermark)
    if active:
        return min(active)
    return max(finished, default=0)


def plan_batch(
    partitions: Sequence[PartitionMetadata],
    now_ns: int,
    max_span_ns: int,
    batch_id: int,
    waiting: Collection[str] = frozenset(),
    max_snapshot_slices: int | None = None,
    quiet: Collection[str] = frozenset(),
) -> tuple[BatchPlan, dict[str, PartitionState]]:
    """Plan batch ``batch_id``: its slices, and the state transitions to write with it.

    The batch end is ``T = min(now_ns, low_watermark + max_span_ns)``. Every active
    partition (RUNNING or SCHEDULED, plus CREATED partitions that are ready) gets the
    slice ``[watermark, min(T, end))`` when that is non-empty. A ready partition moves to
    RUNNING only when it gets a slice; one that starts after ``T`` stays CREATED, so "its
    children have started" keeps meaning that a reader began on them. A partition whose
    watermark has reached its end without finishing (its end was moved earlier,
    :mod:`cdcflow.engine.resume`) moves to FINISHED with the plan. A plan with no slices
    and no transitions means nothing can advance before the clock passes the low
    watermark; the engine waits instead of writing it.

    Partitions in ``waiting`` (idle ones the engine reads less often) get no slice this
    batch; a ready CREATED partition always starts. Partitions in ``quiet`` (idle ones:
    their last slice held no data; ``waiting`` is among them) do not bound ``T``: the low
    watermark it is taken from is the other partitions' (``T = now_ns`` when every
    unfinished partition is quiet), so a span shorter than the idle wait never holds busy
    partitions back, and a quiet partition reads from its watermark to ``T`` when due. At
    most ``max_snapshot_slices`` snapshot partitions get a slice (None: all), the first in
    (start, token) order; the others keep their state for a later batch.

    Slices are ordered by (start, token) so a plan is deterministic.
    """
    if max_span_ns <= 0:
        msg = f"max_span_ns must be positive, got {max_span_ns}; use e.g. 10 s = 10_000_000_000"
        raise ValueError(msg)
    if max_snapshot_slices is not None and max_snapshot_slices < 1:
        msg = f"max_snapshot_slices must be 1 or more (or None), got {max_snapshot_slices}"
        raise ValueError(msg)
    bounding = [p for p in partitions if p.token not in quiet] if quiet else partitions
    if quiet and all(p.state == _FINISHED for p in bounding):
        batch_end = now_ns  # every partition that may still read is quiet
    else:
        batch_end = min(now_ns, low_watermark(bounding) + max_span_ns)
    ready = {p.token for p in ready_partitions(partitions)}
    slices: list[Slice] = []
    transitions: dict[str, PartitionState] = {}
    snapshot_room = len(partitions) if max_snapshot_slices is None else max_snapshot_slices
    for p in sorted(partitions, key=lambda p: (p.start, p.token)):
        starts_now = p.token in ready
        if not starts_now and p.state not in (PartitionState.RUNNING, PartitionState.SCHEDULED):
            continue
        if not starts_now and p.token in waiting:
            continue
        if p.watermark >= p.end:
            # Its end was moved before what it read (engine.resume): it is done, unread
            transitions[p.token] = PartitionState.FINISHED
            continue
        end = min(batch_end, p.end)
        if p.watermark >= end:
            continue
        if is_snapshot_token(p.token):
            if snapshot_room <= 0:
                continue
            snapshot_room -= 1
        slices.append(Slice(p.token, p.watermark, end))
        if p.state != PartitionState.RUNNING:
            transitions[p.token] = PartitionState.RUNNING
    return BatchPlan(batch_id=batch_id, end=batch_end, slices=tuple(slices)), transitions


def children_of(partitions: Iterable[PartitionMetadata]) -> dict[str, list[PartitionMetadata]]:
    """Map each parent token to its stored children (a merge child is under every parent)."""
    out: dict[str, list[PartitionMetadata]] = {}
    for p in partitions:
        for parent in p.parent_tokens:
            out.setdefault(parent, []).append(p)
    return out


def gc_candidates(
    partitions: Sequence[PartitionMetadata],
    now_ns: int,
    ttl_ns: int,
    children: Mapping[str, Sequence[PartitionMetadata]] | None = None,
) -> list[str]:
    """Tokens of FINISHED partitions that can be deleted, sorted.

    A partition qualifies when it finished more than ``ttl_ns`` before ``now_ns`` and
    either every one of its stored children has started (is not CREATED), or it has no
    children and another partition has read further (a MUTABLE_KEY_RANGE partition that
    ended mid-stream). The partitions that read furthest and have no children are kept:
    they are the record of how far the pipeline got (its end, once it is reached), so a
    store never becomes empty again (an empty store means "first run").
    """
    kids = children_of(partitions) if children is None else children
    furthest = max((p.watermark for p in partitions), default=0)
    out: list[str] = []
    for p in partitions:
        if p.state != _FINISHED or p.finished_at is None or now_ns - p.finished_at <= ttl_ns:
            continue
        mine = kids.get(p.token, [])
        if mine:
            if all(c.state != _CREATED for c in mine):
                out.append(p.token)
        elif p.watermark < furthest:
            out.append(p.token)
    return sorted(out)


@attrs.frozen
class BatchOutcome:
    """What a batch changes in the store, from its tasks' reports (see :func:`fold`).

    ``updates``: every read partition's new watermark and whether it finished;
    ``children``: partitions discovered by the batch, each once, ready to insert;
    ``splits`` / ``merges``: parents that reported two or more children / children with two
    or more parents; ``records``: data change records read.
    """

    updates: tuple[PartitionUpdate, ...]
    children: tuple[PartitionMetadata, ...]
    splits: int = 0
    merges: int = 0
    records: int = 0


def fold(
    stored: Mapping[str, PartitionMetadata],
    results: Sequence[TaskResult],
    now_ns: int,
) -> BatchOutcome:
    """Turn what the tasks of one batch read into the store's changes.

    A partition finishes when its task read the record that ends it (a child partitions
    record, or MUTABLE_KEY_RANGE's partition end record) or when it reached its own end.
    Its watermark becomes the position it read to: the slice end, or the ending record's
    position, where its children start. A child is reported once even when several parents
    (a merge) or several tasks report it, and only if the store does not hold it yet; it
    inherits the end of the partition that reported it, and one that starts at or after
    that end has nothing to read and is born FINISHED. Children of the root partition are
    the stream's first partitions, not a split.

    A partition *announced* by a MUTABLE_KEY_RANGE partition start record outside the root
    has no parents: the announcing partition goes on reading, so waiting for it to finish
    would stall both (its start caps the batch end). It is ready at once. Per-key order
    across its key ranges' move-ins and move-outs holds because every batch reads every
    partition up to the same batch end: a key's records before a move are delivered in the
    same or an earlier batch than its records after it, never a later one.
    """
    updates: list[PartitionUpdate] = []
    children: dict[str, PartitionMetadata] = {}
    splits = merges = 0
    for r in results:
        parent = stored.get(r.token)
        if parent is None:
            msg = (
                f"a task reported partition {r.token!r}, which the store does not hold; "
                "results must come from the batch planned on these partitions"
            )
            raise RunnerContractError(msg)
        finished = r.ended or r.position >= parent.end
        updates.append(PartitionUpdate(r.token, r.position, finished))
        if sum(not c.announced for c in r.children) >= 2 and not (
            r.token == INITIAL_PARTITION_TOKEN or is_snapshot_token(r.token)
        ):  # the root's children and a table's key ranges are not a split of the stream
            splits += 1
        for seen in r.children:
            if seen.token in stored or seen.token in children:
                continue
            parents = seen.parent_tokens or (r.token,)
            if seen.announced and r.token != INITIAL_PARTITION_TOKEN:
                parents = ()
            child = PartitionMetadata(
                token=seen.token, parent_tokens=parents,
                start=seen.start, end=parent.end, watermark=seen.start,
                state=PartitionState.CREATED, heartbeat_millis=parent.heartbeat_millis,
                created_at=now_ns,
            )
            if child.start >= child.end:
                child = attrs.evolve(
                    child, state=PartitionState.FINISHED, finished_at=now_ns
                )
            children[child.token] = child
            if len(child.parent_tokens) >= 2:
                merges += 1
    return BatchOutcome(
        updates=tuple(updates), children=tuple(children.values()), splits=splits,
        merges=merges, records=sum(r.records for r in results),
    )


def all_finished(partitions: Sequence[PartitionMetadata]) -> bool:
    """True when the pipeline has partitions and every one is FINISHED (its end reached)."""
    return bool(partitions) and all(p.state == _FINISHED for p in partitions)


def count_states(partitions: Iterable[PartitionMetadata]) -> dict[str, int]:
    """State name -> number of partitions, for every state (zeros included)."""
    counts = Counter(p.state.value for p in partitions)
    return {state.value: counts.get(state.value, 0) for state in PartitionState}
