from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cdcflow as cf
from cdcflow.engine.lifecycle import (
    all_finished,
    count_states,
    fold,
    gc_candidates,
    low_watermark,
    plan_batch,
    ready_partitions,
)
from cdcflow.engine.runner import ChildSeen, Task, TaskResult
from cdcflow.engine.snapshot import snapshot_partitions
from cdcflow.engine.task import TaskProgram, run_task
from cdcflow.errors import RunnerContractError
from cdcflow.keyrange import KeyRange, range_token
from cdcflow.metadata.memory import MemoryStore
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    MAX_NS,
    DataChangeRecord,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
    Slice,
    is_snapshot_token,
    snapshot_table,
    snapshot_token,
)
from cdcflow.testing import ScriptedChangeStream

C, R, F = PartitionState.CREATED, PartitionState.RUNNING, PartitionState.FINISHED


def part(
    token: str,
    state: PartitionState,
    start: int = 0,
    watermark: int | None = None,
    parents: tuple[str, ...] = (),
    end: int = MAX_NS,
    finished_at: int | None = None,
) -> PartitionMetadata:
    return PartitionMetadata(
        token=token,
        parent_tokens=parents,
        start=start,
        end=end,
        watermark=start if watermark is None else watermark,
        state=state,
        finished_at=finished_at,
    )


def test_ready_needs_every_parent_finished() -> None:
    parts = [
        part("a", F, 0, 10),
        part("b", R, 0, 7),
        part("m", C, 10, parents=("a", "b")),
        part("s", C, 10, parents=("a",)),
        part("early", C, 7, parents=("gone",)),  # a missing parent at or below the low mark
        part("late", C, 9, parents=("unknown",)),  # a missing parent may still come: b is at 7
    ]
    assert [p.token for p in ready_partitions(parts)] == ["early", "s"]


def test_low_watermark_counts_created_with_their_start() -> None:
    assert low_watermark([part("a", F, 0, 50), part("b", R, 0, 30), part("c", C, 20)]) == 20
    assert low_watermark([part("a", F, 0, 50), part("b", F, 0, 40)]) == 50
    assert low_watermark([]) == 0


def test_plan_batch_end_never_ahead_of_clock_and_bounded_by_span() -> None:
    parts = [part("a", R, 0, 100), part("b", R, 0, 180)]
    plan, transitions = plan_batch(parts, now_ns=1_000, max_span_ns=50, batch_id=7)
    assert plan.batch_id == 7 and plan.end == 150
    assert plan.slices == (Slice("a", 100, 150),)  # b is already past T
    assert transitions == {}
    plan, _ = plan_batch(parts, now_ns=120, max_span_ns=50, batch_id=8)
    assert plan.end == 120 and plan.slices == (Slice("a", 100, 120),)


def test_plan_batch_starts_ready_partitions_and_stops_at_partition_end() -> None:
    parts = [
        part("root", F, 0, 10),
        part("x", C, 10, parents=("root",), end=25),
        part("y", C, 10, parents=("root",), end=25),
        part("later", C, 40, parents=("root",)),
    ]
    plan, transitions = plan_batch(parts, now_ns=1_000, max_span_ns=100, batch_id=1)
    assert plan.end == 110
    assert plan.slices == (Slice("x", 10, 25), Slice("y", 10, 25), Slice("later", 40, 110))
    assert transitions == {"x": R, "y": R, "later": R}


def test_plan_batch_keeps_partitions_that_start_after_t_created() -> None:
    parts = [part("a", R, 0, 0), part("b", C, 500)]
    plan, transitions = plan_batch(parts, now_ns=1_000, max_span_ns=100, batch_id=1)
    assert plan.slices == (Slice("a", 0, 100),)
    assert transitions == {}


def test_an_idle_partition_that_waits_does_not_hold_the_batch_end_back() -> None:
    # "b" is idle and not due for a read; its watermark is further behind the clock than
    # the span. The batch end follows the partitions read, so "a" is read up to the clock
    # (bounding T by b's watermark would leave "a" nothing to read until b is due).
    parts = [part("root", F, 0, 10), part("a", R, 10, 990), part("b", R, 10, 700)]
    plan, _ = plan_batch(parts, 1_000, 50, 1, waiting={"b"}, quiet={"b"})
    assert plan.end == 1_000 and plan.slices == (Slice("a", 990, 1_000),)
    # Once due, b reads from its watermark to the batch end (its slice is longer than the
    # span: it held no data, and may hold at most its idle wait's worth).
    plan, _ = plan_batch(parts, 1_000, 50, 2, quiet={"b"})
    assert plan.end == 1_000
    assert plan.slices == (Slice("a", 990, 1_000), Slice("b", 700, 1_000))
    # Every partition quiet: they read up to the clock; every one waiting: nothing to plan.
    plan, _ = plan_batch(parts, 1_000, 50, 3, quiet={"a", "b"})
    assert plan.slices == (Slice("a", 990, 1_000), Slice("b", 700, 1_000))
    plan, transitions = plan_batch(parts, 1_000, 50, 4, waiting={"a", "b"}, quiet={"a", "b"})
    assert plan.slices == () and transitions == {}
    # A partition that is not quiet bounds T as before: b lags with data to read.
    plan, _ = plan_batch(parts, 1_000, 50, 5)
    assert plan.end == 750 and plan.slices == (Slice("b", 700, 750),)


def test_plan_batch_is_empty_before_the_clock_reaches_the_watermark() -> None:
    plan, transitions = plan_batch([part("a", R, 0, 500)], 400, 100, 1)
    assert plan.slices == () and transitions == {}


def test_gc_only_after_children_started_and_ttl() -> None:
    parts = [
        part("a", F, 0, 10, finished_at=100),
        part("b", F, 0, 10, finished_at=100),
        part("m", C, 10, parents=("a", "b")),
        part("c", F, 0, 10, finished_at=100),
        part("c1", R, 10, parents=("c",)),
        part("leaf", F, 0, 10, finished_at=100),  # no children: kept
        part("young", F, 0, 10, finished_at=190),
        part("y1", R, 10, parents=("young",)),
    ]
    assert gc_candidates(parts, now_ns=200, ttl_ns=50) == ["c"]
    assert gc_candidates(parts, now_ns=200, ttl_ns=0) == ["c", "young"]


# -- the scheduling rules over random split/merge histories ---------------------------------


@st.composite
def histories(draw: st.DrawFn) -> tuple[ScriptedChangeStream, int]:
    stream = ScriptedChangeStream("S", partitions=draw(st.integers(1, 3)), buckets=32)
    alive = stream.partitions_at(0)
    at = 0
    for i in range(draw(st.integers(0, 12))):
        at += draw(st.integers(1, 40))
        splittable = [t for t in alive if len(stream._parts[t].buckets) >= 2]
        if len(alive) >= 2 and (not splittable or draw(st.booleans())):
            chosen = draw(st.lists(st.sampled_from(alive), min_size=2, max_size=3, unique=True))
            stream.merge(chosen, at=at, into=f"m{i}")
        else:
            stream.split(draw(st.sampled_from(splittable)), at=at, into=[f"s{i}a", f"s{i}b"])
        alive = stream.partitions_at(at)
    for k in range(20):
        stream.write("T", k, "INSERT", {"v": k}, at=draw(st.integers(0, at + 50)))
    return stream, at + 60


def _run(stream: ScriptedChangeStream, end: int, span: int, ttl: int | None) -> None:
    """Drive the real task, the lifecycle and the memory store the way the engine does,
    checking the scheduling invariants after every batch."""
    pipeline = cf.Pipeline("h")
    (pipeline | cf.DetectPartitions(stream="S", start_at=0, client=stream)
     | cf.ReadPartition() | cf.Collect())
    program = TaskProgram.from_pipeline(pipeline)
    store = MemoryStore()
    root = part(INITIAL_PARTITION_TOKEN, C, 0, end=end)
    store.insert_partitions("h", [root])
    reads: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    delivered: list[DataChangeRecord] = []
    last_low = low_watermark([root])
    for batch in range(1, 10_000):
        parts = store.partitions("h")
        if all_finished(parts):
            break
        plan, transitions = plan_batch(parts, end + 100, span, batch)
        assert plan.end <= end + 100
        assert plan.slices, "a plan must advance while partitions are not finished"
        store.write_plan("h", plan, transitions)
        stored = {p.token: p for p in parts}
        results: list[TaskResult] = []
        for sl in plan.slices:
            p = stored[sl.token]
            if sl.start == p.start:
                reads[sl.token] = reads.get(sl.token, 0) + 1
                for parent in p.parent_tokens:  # never before all parents finished
                    assert parent not in stored or stored[parent].state == F
                    assert finished_at.get(parent, -1) < batch
            result = run_task(program, Task("h", batch, sl))
            delivered += result.sink_messages.get("Collect") or []
            results.append(result)
        outcome = fold(stored, results, now_ns=batch)
        for u in outcome.updates:
            assert u.watermark >= stored[u.token].watermark
            if u.finished:
                finished_at[u.token] = batch
        store.commit_batch("h", batch, list(outcome.updates), list(outcome.children))
        parts = store.partitions("h")
        low = low_watermark(parts)
        assert low >= last_low, "the low watermark never moves backwards"
        last_low = low
        if ttl is not None:
            expired = gc_candidates(parts, batch, ttl)
            if expired:
                store.delete_partitions("h", expired)
    assert all_finished(store.partitions("h"))
    # every partition was read from its start exactly once (one reader per partition)
    assert all(n == 1 for n in reads.values())
    order = stream.expected_records(0, end)
    assert sorted(delivered, key=order.index) == order and len(delivered) == len(order)


@settings(max_examples=60, deadline=None)
@given(histories(), st.integers(1, 70), st.sampled_from([None, 0, 3]))
def test_random_histories_read_each_partition_once_after_its_parents(
    history: tuple[ScriptedChangeStream, int], span: int, ttl: int | None
) -> None:
    stream, end = history
    _run(stream, end, span, ttl)


# -- fold: what the tasks read becomes the store's changes -----------------------------------


def _result(token: str, position: int, ended: bool = False, *children: ChildSeen,
            records: int = 0) -> TaskResult:
    return TaskResult(token, position, ended, children=children, records=records)


def test_fold_advances_and_finishes_at_the_reported_positions() -> None:
    stored = {"a": part("a", R, 0, 5, end=100), "b": part("b", R, 0, 5, end=20)}
    out = fold(stored, [_result("a", 10, records=3), _result("b", 20, records=1)], now_ns=7)
    # b reached its own end without an ending record: finished all the same
    assert out.updates == (PartitionUpdate("a", 10, False), PartitionUpdate("b", 20, True))
    assert out.children == () and out.records == 4 and (out.splits, out.merges) == (0, 0)


def test_fold_makes_children_once_with_the_reporters_end() -> None:
    stored = {
        "p": part("p", R, 0, end=50), "q": part("q", R, 0, end=50),
        "old": part("old", C, 9, parents=("p",)),
    }
    split = _result("p", 9, True, ChildSeen("a", ("p",), 9), ChildSeen("old", ("p",), 9))
    merge_from_p = _result("q", 9, True, ChildSeen("m", ("p", "q"), 9))
    merge_from_q = _result("p", 9, True, ChildSeen("m", ("p", "q"), 9))
    out = fold(stored, [split, merge_from_p, merge_from_q], now_ns=11)
    assert [c.token for c in out.children] == ["a", "m"]  # "old" is stored already
    a, m = out.children
    assert (a.parent_tokens, a.start, a.end, a.watermark, a.state, a.created_at) == (
        ("p",), 9, 50, 9, C, 11
    )
    assert m.parent_tokens == ("p", "q")
    assert (out.splits, out.merges) == (1, 1)


def test_fold_children_without_parents_belong_to_the_reporter() -> None:
    stored = {INITIAL_PARTITION_TOKEN: part(INITIAL_PARTITION_TOKEN, R, 0, end=MAX_NS)}
    out = fold(stored, [_result(INITIAL_PARTITION_TOKEN, 0, True, ChildSeen("x", (), 0),
                                ChildSeen("y", (), 0))], now_ns=1)
    assert [c.parent_tokens for c in out.children] == [(INITIAL_PARTITION_TOKEN,)] * 2
    assert out.splits == 0  # the root's children are the stream's partitions, not a split


def test_fold_child_starting_at_the_end_is_born_finished() -> None:
    stored = {"p": part("p", R, 0, end=10)}
    out = fold(stored, [_result("p", 10, True, ChildSeen("c", ("p",), 10))], now_ns=3)
    (c,) = out.children
    assert c.state == F and c.finished_at == 3 and c.watermark == 10


def test_fold_refuses_a_result_for_an_unknown_partition() -> None:
    with pytest.raises(RunnerContractError, match="does not hold"):
        fold({}, [_result("ghost", 1)], now_ns=0)


def test_count_states_and_all_finished() -> None:
    parts = [part("a", F, finished_at=1), part("b", R)]
    assert count_states(parts) == {"CREATED": 0, "SCHEDULED": 0, "RUNNING": 1, "FINISHED": 1}
    assert not all_finished(parts) and not all_finished([])
    assert all_finished([part("a", F, finished_at=1)])


def test_fold_announced_partitions_wait_for_nobody() -> None:
    stored = {
        INITIAL_PARTITION_TOKEN: part(INITIAL_PARTITION_TOKEN, R, 0, end=MAX_NS),
        "a": part("a", R, 0, end=MAX_NS),
    }
    from_root = _result(INITIAL_PARTITION_TOKEN, 0, True, ChildSeen("a2", (), 0, announced=True))
    from_a = _result("a", 10, False, ChildSeen("c", (), 5, announced=True),
                     ChildSeen("d", (), 5, announced=True))
    out = fold(stored, [from_root, from_a], now_ns=1)
    kids = {c.token: c for c in out.children}
    assert kids["a2"].parent_tokens == (INITIAL_PARTITION_TOKEN,)
    assert kids["c"].parent_tokens == kids["d"].parent_tokens == ()  # "a" goes on reading
    assert out.updates[1] == PartitionUpdate("a", 10, False)
    assert out.splits == 0  # announcing partitions is not a split
    ready = ready_partitions([*stored.values(), *out.children])
    assert {"c", "d"} <= {p.token for p in ready}


def test_gc_deletes_childless_partitions_that_others_read_past() -> None:
    parts = [
        part("ended", F, 0, 9, finished_at=100),  # ended mid-stream, no children
        part("far", R, 0, 50),
    ]
    assert gc_candidates(parts, now_ns=200, ttl_ns=10) == ["ended"]
    at_end = [part("x", F, 0, 50, finished_at=100), part("y", F, 0, 50, finished_at=100)]
    assert gc_candidates(at_end, now_ns=200, ttl_ns=10) == []  # how far the pipeline got


# -- snapshot partitions: the root waits for them -------------------------------------------

SNAP_START = 1_000


def _snapshot_parts(*states: PartitionState) -> list[PartitionMetadata]:
    """Snapshot partitions of tables t0, t1, ... in these states and the root that waits."""
    snaps = [
        part(snapshot_token(f"t{i}"), state, SNAP_START - 1,
             SNAP_START if state == F else SNAP_START - 1, end=SNAP_START,
             finished_at=5 if state == F else None)
        for i, state in enumerate(states)
    ]
    root = part(INITIAL_PARTITION_TOKEN, C, SNAP_START, parents=tuple(p.token for p in snaps))
    return [*snaps, root]


def test_snapshot_partitions_run_first_in_one_slice_and_the_root_waits() -> None:
    parts = _snapshot_parts(C, C)
    assert [p.token for p in ready_partitions(parts)] == ["snapshot/t0", "snapshot/t1"]
    assert low_watermark(parts) == SNAP_START - 1
    plan, moves = plan_batch(parts, now_ns=50_000, max_span_ns=10_000, batch_id=1)
    assert plan.slices == (
        Slice("snapshot/t0", SNAP_START - 1, SNAP_START),
        Slice("snapshot/t1", SNAP_START - 1, SNAP_START),
    )
    assert moves == {"snapshot/t0": R, "snapshot/t1": R}  # the root stays CREATED
    stored = {p.token: attrs.evolve(p, state=moves.get(p.token, p.state)) for p in parts}
    outcome = fold(stored, [_result("snapshot/t0", SNAP_START, True),
                            _result("snapshot/t1", SNAP_START, True)], now_ns=60_000)
    assert outcome.updates == (
        PartitionUpdate("snapshot/t0", SNAP_START, True),
        PartitionUpdate("snapshot/t1", SNAP_START, True),
    )
    assert outcome.children == () and outcome.splits == 0


def test_the_root_starts_only_when_every_snapshot_partition_finished() -> None:
    one_left = _snapshot_parts(F, R)
    assert ready_partitions(one_left) == []
    plan, moves = plan_batch(one_left, now_ns=50_000, max_span_ns=10_000, batch_id=2)
    assert [s.token for s in plan.slices] == ["snapshot/t1"] and moves == {}
    assert low_watermark(one_left) == SNAP_START - 1  # t1's rows are not committed yet

    done = _snapshot_parts(F, F)
    assert low_watermark(done) == SNAP_START  # every row before start is delivered
    plan, moves = plan_batch(done, now_ns=50_000, max_span_ns=10_000, batch_id=3)
    assert plan.slices == (Slice(INITIAL_PARTITION_TOKEN, SNAP_START, SNAP_START + 10_000),)
    assert moves == {INITIAL_PARTITION_TOKEN: R}


def test_finished_snapshot_partitions_are_collected_once_the_root_started() -> None:
    waiting = _snapshot_parts(F, F)
    assert gc_candidates(waiting, now_ns=1_000_000, ttl_ns=0) == []  # the root is CREATED
    started = [
        attrs.evolve(p, state=R) if p.token == INITIAL_PARTITION_TOKEN else p for p in waiting
    ]
    assert gc_candidates(started, now_ns=1_000_000, ttl_ns=0) == ["snapshot/t0", "snapshot/t1"]
    assert gc_candidates(started, now_ns=1_000_000, ttl_ns=10**9) == []  # TTL not passed
    # Collected parents do not hold the root back: missing parents count as finished once
    # nothing unfinished lies below its start.
    assert ready_partitions(
        [attrs.evolve(p, state=C) for p in started if p.token == INITIAL_PARTITION_TOKEN]
    ) != []


# -- a snapshot split into key ranges ---------------------------------------------------------


def _range_parts(*range_states: PartitionState) -> list[PartitionMetadata]:
    """Table t0 split into ranges in these states (t0 FINISHED), table t1 FINISHED, and the
    root, whose parents are the tables only."""
    table, other, root = _snapshot_parts(F, F)
    ranges = [
        part(range_token("t0", KeyRange(i, None if i == 0 else (str(i),),
                                        None if i == len(range_states) - 1 else (str(i + 1),))),
             state, SNAP_START - 1, SNAP_START if state == F else SNAP_START - 1,
             parents=(table.token,), end=SNAP_START, finished_at=5 if state == F else None)
        for i, state in enumerate(range_states)
    ]
    return [table, other, *ranges, root]


def test_the_root_waits_for_key_ranges_it_does_not_list_as_parents() -> None:
    parts = _range_parts(F, C, C, C)
    ready = [p.token for p in ready_partitions(parts)]
    assert len(ready) == 3 and all(snapshot_table(t) == "t0" for t in ready)
    assert low_watermark(parts) == SNAP_START - 1
    plan, moves = plan_batch(parts, 50_000, 10_000, 2, max_snapshot_slices=2)
    assert [s.token for s in plan.slices] == ready[:2]  # at most two snapshot partitions
    assert all(s.end - s.start == 1 for s in plan.slices) and set(moves) == set(ready[:2])
    # One range still running: nothing else is ready, the low watermark stays put.
    assert ready_partitions(_range_parts(F, F, F, R)) == []
    assert low_watermark(_range_parts(F, F, F, R)) == SNAP_START - 1
    done = _range_parts(F, F, F, F)
    assert [p.token for p in ready_partitions(done)] == [INITIAL_PARTITION_TOKEN]
    assert low_watermark(done) == SNAP_START
    with pytest.raises(ValueError, match="max_snapshot_slices"):
        plan_batch(parts, 50_000, 10_000, 2, max_snapshot_slices=0)


def test_fold_inserts_a_table_s_ranges_once_as_its_children() -> None:
    parts = {p.token: p for p in _snapshot_parts(R, C)}
    t0 = snapshot_token("t0")
    kids = [ChildSeen(range_token("t0", KeyRange(i)), (t0,), SNAP_START - 1) for i in range(3)]
    out = fold(parts, [_result(t0, SNAP_START, True, *kids)], now_ns=9)
    assert out.updates == (PartitionUpdate(t0, SNAP_START, True),)
    assert [(c.token, c.parent_tokens, c.start, c.end, c.state) for c in out.children] == [
        (k.token, (t0,), SNAP_START - 1, SNAP_START, C) for k in kids]
    assert out.splits == 0  # a table's ranges are not a split of the stream


@st.composite
def snapshot_histories(draw: st.DrawFn) -> tuple[ScriptedChangeStream, int, int]:
    sizes = draw(st.lists(st.integers(0, 30), min_size=1, max_size=3))
    stream = ScriptedChangeStream("S", partitions=2, buckets=8, snapshot_rows={
        f"t{i}": [(k, {"v": k}) for k in range(n)] for i, n in enumerate(sizes)})
    start = draw(st.integers(10, 40))
    if draw(st.booleans()):
        stream.split("p0", at=start + draw(st.integers(0, 20)), into=["a", "b"])
    for _ in range(draw(st.integers(0, 25))):
        table = f"t{draw(st.integers(0, len(sizes) - 1))}"
        kind = draw(st.sampled_from(["INSERT", "UPDATE", "DELETE"]))
        stream.write(table, draw(st.integers(0, 40)), kind,
                     {} if kind == "DELETE" else {"v": -1}, at=draw(st.integers(0, start + 40)))
    return stream, start, start + 50


def _run_snapshot(stream: ScriptedChangeStream, start: int, end: int, rows_per_task: int,
                  cap: int, span: int, crashes: frozenset[int]) -> None:
    """Drive real snapshot and stream tasks, the lifecycle and the memory store as the
    engine does (batches in ``crashes`` run twice: the first attempt is lost), checking
    after every batch that everything below the low watermark was delivered."""
    pipeline = cf.Pipeline("h")
    (pipeline
     | cf.DetectPartitions(stream="S", start_at=start, end_at=end - 1, client=stream,
                           snapshot=True, snapshot_rows_per_task=rows_per_task,
                           snapshot_tasks_per_batch=cap)
     | cf.ReadPartition() | cf.Collect())
    program = TaskProgram.from_pipeline(pipeline)
    store = MemoryStore()
    snaps = snapshot_partitions(program, start, 0, lambda source: stream)
    store.insert_partitions("h", [*snaps, part(INITIAL_PARTITION_TOKEN, C, start, end=end,
                                               parents=tuple(p.token for p in snaps))])
    snapshot_rows = Counter(
        (t, row["id"]) for t in stream.tables() for row in stream.rows_at(t, start - 1))
    changes = stream.expected_records(start, end)
    delivered: list[DataChangeRecord] = []
    reads: Counter[str] = Counter()
    last_low = low_watermark(store.partitions("h"))
    for batch in range(1, 1_000):
        parts = store.partitions("h")
        if all_finished(parts):
            break
        plan, transitions = plan_batch(parts, end + 100, span, batch, max_snapshot_slices=cap)
        assert plan.slices, "a plan must advance while partitions are not finished"
        snapshot_slices = [s for s in plan.slices if is_snapshot_token(s.token)]
        assert len(snapshot_slices) <= cap
        if any(is_snapshot_token(p.token) and p.state != F for p in parts):
            assert snapshot_slices == list(plan.slices), "the stream began during the snapshot"
        store.write_plan("h", plan, transitions)
        stored = {p.token: p for p in parts}
        for _ in range(2 if batch in crashes else 1):  # a lost first attempt: run it again
            results = [run_task(program, Task("h", batch, sl)) for sl in plan.slices]
        for sl, result in zip(plan.slices, results, strict=True):
            reads[sl.token] += sl.start == stored[sl.token].start  # read from its start
            delivered += result.sink_messages.get("Collect") or []
        outcome = fold(stored, results, now_ns=batch)
        store.commit_batch("h", batch, list(outcome.updates), list(outcome.children))
        low = low_watermark(store.partitions("h"))
        assert low >= last_low
        last_low = low
        # every record below the low watermark was delivered: the snapshot's rows ...
        if low > start - 1:
            assert Counter((r.table_name, int(m.keys["id"])) for r in delivered
                           if r.is_snapshot for m in r.mods) == snapshot_rows
        # ... and the changes
        below = [r for r in changes if r.commit_timestamp.ns < low]
        assert Counter(map(_record_id, below)) <= Counter(map(_record_id, delivered))
    assert all_finished(store.partitions("h"))
    assert all(n == 1 for n in reads.values()), "a partition was read from its start twice"
    got = [r for r in delivered if not r.is_snapshot]
    assert sorted(map(_record_id, got)) == sorted(map(_record_id, changes))
    assert max(Counter((r.table_name, m.keys["id"]) for r in delivered if r.is_snapshot
                       for m in r.mods).values(), default=1) == 1


def _record_id(r: DataChangeRecord) -> tuple[int, str, str, str]:
    return r.commit_timestamp.ns, r.server_transaction_id, r.partition_token, r.record_sequence


@settings(max_examples=60, deadline=None)
@given(snapshot_histories(), st.integers(1, 12), st.integers(1, 4), st.integers(1, 30),
       st.frozensets(st.integers(1, 6), max_size=2))
def test_random_snapshots_split_read_every_row_once_before_the_stream(
    history: tuple[ScriptedChangeStream, int, int], rows_per_task: int, cap: int, span: int,
    crashes: frozenset[int],
) -> None:
    stream, start, end = history
    _run_snapshot(stream, start, end, rows_per_task, cap, span, crashes)
