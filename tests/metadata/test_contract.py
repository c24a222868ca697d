"""The MetadataStore contract, run against every store in conftest.STORE_FACTORIES.

Errors are checked by type here; the wording of the memory and SQLite stores' messages is
checked in test_rules.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcflow.errors import PlanConflictError, StoreError, WatermarkRegressionError
from cdcflow.metadata import MetadataStore
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    MAX_NS,
    BatchPlan,
    BatchRecord,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
    Slice,
)

CREATED = PartitionState.CREATED
SCHEDULED = PartitionState.SCHEDULED
RUNNING = PartitionState.RUNNING
FINISHED = PartitionState.FINISHED
P = "orders"


def part(
    token: str,
    start: int = 100,
    *,
    parents: tuple[str, ...] = (),
    state: PartitionState = CREATED,
    end: int = MAX_NS,
    watermark: int | None = None,
    heartbeat_millis: int = 1000,
) -> PartitionMetadata:
    return PartitionMetadata(
        token=token, parent_tokens=parents, start=start, end=end,
        watermark=start if watermark is None else watermark, state=state,
        heartbeat_millis=heartbeat_millis, created_at=7,
    )


def plan(batch_id: int, end: int = 1000, tokens: tuple[str, ...] = (), start: int = 100
         ) -> BatchPlan:
    return BatchPlan(
        batch_id=batch_id, end=end, slices=tuple(Slice(t, start, end) for t in tokens),
        planned_at=1_000_000 + batch_id,
    )


#: How far a store's own clock may be from the test's. The Spanner store stamps times with
#: Spanner's commit timestamps, from the server's clock: the emulator's runs a fraction of a
#: millisecond ahead of the host's.
SKEW_NS = 100 * 10**6


def stamped(before: int, value: int | None, after: int) -> bool:
    """Whether ``value`` is a time the store took between ``before`` and ``after``."""
    return value is not None and before - SKEW_NS <= value <= after + SKEW_NS


def by_token(store: MetadataStore, pipeline: str = P) -> dict[str, PartitionMetadata]:
    return {p.token: p for p in store.partitions(pipeline)}


def started(store: MetadataStore, tokens: tuple[str, ...] = ("a", "b")) -> None:
    """Partitions a and b RUNNING, batch 1 pending with a slice each."""
    store.insert_partitions(P, [part(t) for t in tokens])
    store.write_plan(P, plan(1, tokens=tokens), dict.fromkeys(tokens, RUNNING))


# --- an empty store -------------------------------------------------------------------


def test_an_empty_store_knows_no_pipeline(store: MetadataStore) -> None:
    assert store.partitions(P) == []
    assert store.pending_plan(P) is None
    assert store.last_batch_id(P) == 0
    assert store.batches(P) == []
    assert store.pipelines() == []
    assert store.delete_partitions(P, ["a"]) == 0
    store.reset(P)  # resetting an unknown pipeline is harmless
    assert store.pipelines() == []


# --- partitions -----------------------------------------------------------------------


def test_partitions_round_trip_every_field(store: MetadataStore) -> None:
    full = PartitionMetadata(
        token="tok-1", parent_tokens=("p1", "p2"), start=1, end=MAX_NS, watermark=MAX_NS - 1,
        state=RUNNING, heartbeat_millis=250, created_at=11, scheduled_at=12, running_at=13,
        finished_at=None,
    )
    root = part(INITIAL_PARTITION_TOKEN, start=0, end=5)
    assert store.insert_partitions(P, [full, root]) == 2
    assert store.partitions(P) == [root, full]


def test_insert_partitions_inserts_only_absent_tokens(store: MetadataStore) -> None:
    assert store.insert_partitions(P, [part("a"), part("b")]) == 2
    # A merge child reported again (with other values) is kept as first stored.
    assert store.insert_partitions(P, [part("a", start=500), part("c")]) == 1
    assert store.insert_partitions(P, [part("d"), part("d", start=900)]) == 1
    assert store.insert_partitions(P, []) == 0
    assert by_token(store)["a"].start == 100
    assert by_token(store)["d"].start == 100
    assert sorted(by_token(store)) == ["a", "b", "c", "d"]


def test_partitions_are_ordered_by_start_then_token(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("z", 5), part("b", 9), part("a", 9), part("m", 1)])
    assert [p.token for p in store.partitions(P)] == ["m", "z", "a", "b"]


def test_delete_partitions_removes_only_the_named_rows(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("a"), part("b"), part("c")])
    store.insert_partitions("other", [part("a")])
    assert store.delete_partitions(P, ["a", "c", "missing", "a"]) == 2
    assert list(by_token(store)) == ["b"]
    assert list(by_token(store, "other")) == ["a"]
    assert store.delete_partitions(P, []) == 0


# --- write_plan -----------------------------------------------------------------------


def test_write_plan_logs_the_plan_as_pending(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("a"), part("b")])
    p1 = BatchPlan(1, 900, (Slice("a", 100, 900), Slice("b", 150, 800)), planned_at=42)
    store.write_plan(P, p1, {})
    assert store.pending_plan(P) == p1
    assert store.last_batch_id(P) == 1
    assert store.batches(P) == [BatchRecord(1, 900, 42, None, 2, 0)]


def test_write_plan_stamps_planned_at_when_the_plan_has_none(store: MetadataStore) -> None:
    before = time.time_ns()
    store.write_plan(P, BatchPlan(1, 900, ()), {})
    after = time.time_ns()
    pending = store.pending_plan(P)
    assert pending is not None
    assert before <= pending.planned_at <= after
    assert store.batches(P)[0].planned_at == pending.planned_at


def test_write_plan_applies_transitions_with_timestamps(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("a"), part("b"), part("c"), part("d")])
    before = time.time_ns()
    store.write_plan(P, plan(1), {"a": SCHEDULED, "b": RUNNING, "c": CREATED})
    after = time.time_ns()
    rows = by_token(store)
    a, b, c, d = rows["a"], rows["b"], rows["c"], rows["d"]
    assert a.state == SCHEDULED and a.scheduled_at is not None and a.running_at is None
    assert stamped(before, a.scheduled_at, after)
    # A jump straight to RUNNING also stamps the state it skipped.
    assert b.state == RUNNING and b.scheduled_at is not None and b.running_at is not None
    assert stamped(before, b.running_at, after)
    assert c == part("c") and d == part("d")

    store.commit_batch(P, 1, [], [])
    store.write_plan(P, plan(2), {"a": RUNNING, "b": RUNNING})
    rows2 = by_token(store)
    assert rows2["a"].state == RUNNING and rows2["a"].scheduled_at == a.scheduled_at
    assert rows2["a"].running_at is not None and rows2["a"].running_at >= a.scheduled_at
    assert rows2["b"] == b  # no change: already RUNNING keeps its timestamps


def test_write_plan_refuses_a_second_pending_plan(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("a")])
    store.write_plan(P, plan(1, tokens=("a",)), {})
    with pytest.raises(PlanConflictError):
        store.write_plan(P, plan(2, tokens=("a",)), {"a": RUNNING})
    assert store.pending_plan(P) == plan(1, tokens=("a",))
    assert store.last_batch_id(P) == 1
    assert by_token(store)["a"].state == CREATED  # the refused plan's transitions not applied


def test_writing_the_pending_plan_again_succeeds_and_changes_nothing(
    store: MetadataStore,
) -> None:
    # What a store's retry does after a write_plan whose answer was lost: the plan is
    # already pending, and the second write must neither fail nor apply anything again.
    store.insert_partitions(P, [part("a"), part("b")])
    p1 = plan(1, tokens=("a", "b"))
    store.write_plan(P, p1, {"a": RUNNING})
    rows, log = by_token(store), store.batches(P)
    store.write_plan(P, p1, {"a": RUNNING})
    store.write_plan(P, p1, {"b": FINISHED})  # even with other transitions: none applies
    assert by_token(store) == rows
    assert store.batches(P) == log
    assert store.pending_plan(P) == p1
    # Any other plan still conflicts, a plan equal but for planned_at too: that is a second
    # planner, not a retry.
    others = [
        plan(1, tokens=("a",)), plan(1, end=999, tokens=("a", "b")), plan(2, tokens=("a", "b")),
        BatchPlan(1, p1.end, p1.slices, planned_at=p1.planned_at + 1),
        BatchPlan(1, p1.end, p1.slices),  # no planned_at: the store would stamp one
    ]
    for other in others:
        with pytest.raises(PlanConflictError):
            store.write_plan(P, other, {})
    assert by_token(store) == rows and store.batches(P) == log
    # Once the batch is committed, the same plan is a stale id.
    assert store.commit_batch(P, 1, [], [])
    with pytest.raises(PlanConflictError):
        store.write_plan(P, p1, {})
    assert store.pending_plan(P) is None


@pytest.mark.parametrize("batch_id", [0, 1, 2])
def test_write_plan_refuses_a_batch_id_not_above_the_last(
    store: MetadataStore, batch_id: int
) -> None:
    store.write_plan(P, plan(1), {})
    store.commit_batch(P, 1, [], [])
    store.write_plan(P, plan(2), {})
    store.commit_batch(P, 2, [], [])
    with pytest.raises(PlanConflictError):
        store.write_plan(P, plan(batch_id), {})
    assert [b.batch_id for b in store.batches(P)] == [2, 1]
    assert store.pending_plan(P) is None


def test_batch_ids_may_skip_numbers(store: MetadataStore) -> None:
    store.write_plan(P, plan(5), {})
    store.commit_batch(P, 5, [], [])
    store.write_plan(P, plan(9), {})
    assert store.last_batch_id(P) == 9


def test_write_plan_refuses_an_unknown_partition_and_changes_nothing(
    store: MetadataStore,
) -> None:
    store.insert_partitions(P, [part("a")])
    with pytest.raises(StoreError):
        store.write_plan(P, plan(1), {"a": RUNNING, "ghost": RUNNING})
    assert store.pending_plan(P) is None
    assert store.last_batch_id(P) == 0
    assert by_token(store)["a"] == part("a")


def test_write_plan_refuses_a_backward_transition_and_changes_nothing(
    store: MetadataStore,
) -> None:
    store.insert_partitions(P, [part("a", state=RUNNING), part("b")])
    with pytest.raises(StoreError):
        store.write_plan(P, plan(1), {"b": SCHEDULED, "a": CREATED})
    assert store.pending_plan(P) is None
    assert by_token(store) == {"a": part("a", state=RUNNING), "b": part("b")}


# --- commit_batch ---------------------------------------------------------------------


def test_commit_batch_applies_progress_and_marks_the_batch_committed(
    store: MetadataStore,
) -> None:
    started(store)
    children = [part("c1", 600, parents=("a",)), part("c2", 600, parents=("a",))]
    before = time.time_ns()
    assert store.commit_batch(
        P, 1, [PartitionUpdate("a", 600, finished=True), PartitionUpdate("b", 1000)], children,
        records=17,
    )
    after = time.time_ns()
    rows = by_token(store)
    assert rows["a"].watermark == 600 and rows["a"].state == FINISHED
    assert stamped(before, rows["a"].finished_at, after)
    assert rows["b"].watermark == 1000 and rows["b"].state == RUNNING
    assert rows["b"].finished_at is None
    assert rows["c1"] == children[0] and rows["c2"] == children[1]
    assert store.pending_plan(P) is None
    (log,) = store.batches(P)
    assert log.batch_id == 1 and log.records == 17 and log.slices == 2
    assert stamped(before, log.committed_at, after)


def test_commit_batch_keeps_the_batch_statistics(store: MetadataStore) -> None:
    started(store)
    stats = {"plan_seconds": 0.012, "execute_seconds": 1.5, "sink_commit_seconds": 0.25,
             "bytes": 4096, "retries": 3, "skipped": 2, "dead_lettered": 1}
    # names the batch log does not keep are dropped
    assert store.commit_batch(P, 1, [PartitionUpdate("a", 700)], [], records=4,
                              stats={**stats, "not a statistic": 5})
    store.write_plan(P, plan(2, tokens=("a",), start=700), {})
    store.commit_batch(P, 2, [PartitionUpdate("a", 800)], [])
    second, first = store.batches(P)
    assert first.stats == stats
    assert second.stats == {} and second.records == 0
    assert not store.commit_batch(P, 1, [], [], stats={"skipped": 9})  # a replay: kept
    assert store.batches(P)[1].stats == stats


def test_commit_batch_accepts_an_unchanged_watermark(store: MetadataStore) -> None:
    started(store)
    assert store.commit_batch(P, 1, [PartitionUpdate("a", 100)], [])
    assert by_token(store)["a"].watermark == 100


def test_commit_batch_refuses_a_smaller_watermark_and_changes_nothing(
    store: MetadataStore,
) -> None:
    started(store)
    store.commit_batch(P, 1, [PartitionUpdate("a", 500), PartitionUpdate("b", 500)], [])
    store.write_plan(P, plan(2, tokens=("a", "b")), {})
    before = by_token(store)
    with pytest.raises(WatermarkRegressionError):
        store.commit_batch(
            P, 2,
            [PartitionUpdate("a", 900, finished=True), PartitionUpdate("b", 499)],
            [part("c", 900, parents=("a",))],
            records=3,
        )
    assert by_token(store) == before
    assert store.pending_plan(P) == plan(2, tokens=("a", "b"))
    assert store.batches(P)[0].committed_at is None
    # The replay with correct progress then commits.
    assert store.commit_batch(P, 2, [PartitionUpdate("b", 900)], [])
    assert by_token(store)["b"].watermark == 900


def test_commit_batch_is_idempotent(store: MetadataStore) -> None:
    started(store)
    assert store.commit_batch(P, 1, [PartitionUpdate("a", 700)], [part("c", 700)], records=4)
    rows, log = by_token(store), store.batches(P)
    # A replay, even one that reports other progress, changes nothing.
    assert not store.commit_batch(
        P, 1, [PartitionUpdate("a", 900, finished=True)], [part("d", 700)], records=9
    )
    assert not store.commit_batch(P, 1, [PartitionUpdate("a", 1)], [])
    assert by_token(store) == rows
    assert store.batches(P) == log


def test_commit_batch_refuses_a_batch_never_planned(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("a")])
    with pytest.raises(StoreError):
        store.commit_batch(P, 1, [PartitionUpdate("a", 200)], [])
    assert by_token(store)["a"] == part("a")
    assert store.batches(P) == []


def test_commit_batch_refuses_an_unknown_partition_and_changes_nothing(
    store: MetadataStore,
) -> None:
    started(store)
    with pytest.raises(StoreError):
        store.commit_batch(P, 1, [PartitionUpdate("a", 300), PartitionUpdate("ghost", 300)], [])
    assert by_token(store)["a"].watermark == 100
    assert store.pending_plan(P) is not None


def test_a_merge_child_reported_by_two_parents_is_stored_once(store: MetadataStore) -> None:
    started(store)
    merged = part("m", 600, parents=("a", "b"))
    store.commit_batch(P, 1, [PartitionUpdate("a", 600, finished=True)], [merged])
    store.write_plan(P, plan(2, tokens=("b",)), {})
    store.commit_batch(
        P, 2, [PartitionUpdate("b", 600, finished=True)], [part("m", 650, parents=("b", "a"))]
    )
    rows = by_token(store)
    assert rows["m"] == merged
    assert [p.token for p in store.partitions(P)].count("m") == 1


def test_a_finished_partition_stays_finished(store: MetadataStore) -> None:
    started(store)
    store.commit_batch(P, 1, [PartitionUpdate("a", 600, finished=True)], [])
    finished_at = by_token(store)["a"].finished_at
    store.write_plan(P, plan(2), {"a": FINISHED})
    store.commit_batch(P, 2, [PartitionUpdate("a", 600), PartitionUpdate("a", 600, True)], [])
    row = by_token(store)["a"]
    assert row.state == FINISHED and row.finished_at == finished_at


# --- the batch log and pipelines ------------------------------------------------------


def test_batches_are_newest_first_and_limited(store: MetadataStore) -> None:
    for i in range(1, 6):
        store.write_plan(P, plan(i, end=i * 100), {})
        if i < 5:
            store.commit_batch(P, i, [], [], records=i)
    log = store.batches(P, limit=3)
    assert [b.batch_id for b in log] == [5, 4, 3]
    assert log[0].committed_at is None and log[0].end == 500
    assert [b.records for b in log[1:]] == [4, 3]
    assert [b.batch_id for b in store.batches(P)] == [5, 4, 3, 2, 1]
    assert store.batches(P, limit=0) == []


def test_pipelines_lists_every_pipeline_with_state(store: MetadataStore) -> None:
    store.insert_partitions("b-parts", [part("a")])
    store.write_plan("a-plans", plan(1), {})
    store.insert_partitions("c-empty", [])
    assert store.pipelines() == ["a-plans", "b-parts"]
    store.reset("b-parts")
    assert store.pipelines() == ["a-plans"]
    store.delete_partitions("a-plans", ["x"])
    assert store.pipelines() == ["a-plans"]


def test_reset_forgets_the_progress_of_one_pipeline(store: MetadataStore) -> None:
    started(store)
    store.insert_partitions("other", [part("a")])
    store.write_plan("other", plan(1), {})
    store.reset(P)
    assert store.partitions(P) == []
    assert store.pending_plan(P) is None
    assert store.batches(P) == []
    # The batch id floor stays (batch ids are never reused), so P is still known.
    assert store.last_batch_id(P) == 1
    assert store.pipelines() == ["orders", "other"]
    assert store.pending_plan("other") == plan(1)
    # The pipeline starts over, at the batch after its last one.
    store.insert_partitions(P, [part("a")])
    store.write_plan(P, plan(2, tokens=("a",)), {"a": RUNNING})
    assert store.pending_plan(P) == plan(2, tokens=("a",))


def test_pipelines_never_see_each_others_rows(store: MetadataStore) -> None:
    started(store)  # pipeline P: a, b RUNNING, batch 1 pending
    store.insert_partitions("q", [part("a", 50), part("z", 50)])
    assert sorted(by_token(store, "q")) == ["a", "z"]
    assert by_token(store, "q")["a"] == part("a", 50)
    # P's pending batch does not block q, and batch ids are per pipeline.
    assert store.pending_plan("q") is None and store.last_batch_id("q") == 0
    store.write_plan("q", plan(1, tokens=("a",)), {"a": SCHEDULED})
    store.commit_batch("q", 1, [PartitionUpdate("a", 80, finished=True)], [part("c", 80)])
    assert by_token(store)["a"].state == RUNNING and by_token(store)["a"].watermark == 100
    assert "c" not in by_token(store)
    assert store.pending_plan(P) == plan(1, tokens=("a", "b"))
    assert store.commit_batch(P, 1, [PartitionUpdate("a", 300)], [])
    assert by_token(store, "q")["a"].watermark == 80
    assert store.delete_partitions("q", ["a"]) == 1
    assert "a" in by_token(store)
    assert store.pipelines() == [P, "q"]


# --- durability -----------------------------------------------------------------------


def test_state_survives_reopening(
    store: MetadataStore, reopen: Callable[[], MetadataStore]
) -> None:
    started(store)
    store.commit_batch(P, 1, [PartitionUpdate("a", 600, True)], [part("c", 600, parents=("a",))],
                       records=5)
    store.write_plan(P, plan(2, tokens=("b", "c")), {"c": RUNNING})
    store.insert_partitions("q", [part("x")])
    rows, log, pending = by_token(store), store.batches(P), store.pending_plan(P)

    again = reopen()
    assert by_token(again) == rows
    assert again.batches(P) == log
    assert again.pending_plan(P) == pending
    assert again.last_batch_id(P) == 2
    assert again.pipelines() == [P, "q"]
    # The reopened store continues where the first one stopped.
    assert again.commit_batch(P, 2, [PartitionUpdate("c", 900)], [])
    assert by_token(reopen())["c"].watermark == 900


# --- property: watermarks never go backwards --------------------------------------------

_TOKENS = ("t0", "t1", "t2")
_update = st.tuples(st.sampled_from(_TOKENS), st.integers(0, 40), st.booleans())


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batches=st.lists(st.lists(_update, max_size=4), max_size=10))
def test_watermarks_never_go_backwards(
    store: MetadataStore, batches: list[list[tuple[str, int, bool]]]
) -> None:
    pipeline = f"prop-{uuid.uuid4().hex}"  # one fresh pipeline per example
    store.insert_partitions(pipeline, [part(t, 10) for t in _TOKENS])
    model = {t: (10, False) for t in _TOKENS}  # token -> (watermark, finished)
    for batch_id, raw in enumerate(batches, start=1):
        store.write_plan(pipeline, plan(batch_id, tokens=_TOKENS), {})
        updates = [PartitionUpdate(t, w, f) for t, w, f in raw]
        after = dict(model)
        ok = True
        for u in updates:
            if u.watermark < after[u.token][0]:
                ok = False
                break
            after[u.token] = (u.watermark, after[u.token][1] or u.finished)
        if ok:
            assert store.commit_batch(pipeline, batch_id, updates, [])
            model = after
        else:
            with pytest.raises(WatermarkRegressionError):
                store.commit_batch(pipeline, batch_id, updates, [])
            assert store.commit_batch(pipeline, batch_id, [], [])  # replay without progress
        rows = by_token(store, pipeline)
        assert {t: (p.watermark, p.state == FINISHED) for t, p in rows.items()} == model
    store.reset(pipeline)
