from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcflow.engine.lifecycle import gc_candidates, low_watermark, plan_batch, ready_partitions
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    MAX_NS,
    ChildPartitionsRecord,
    DataChangeRecord,
    PartitionMetadata,
    PartitionState,
    Slice,
)
from cdcflow.stream import ChangeStreamQuery
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
    """Drive the scheduling functions like the engine does, checking invariants."""
    parts: dict[str, PartitionMetadata] = {
        INITIAL_PARTITION_TOKEN: part(INITIAL_PARTITION_TOKEN, C, 0, end=end)
    }
    reads: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    delivered: list[DataChangeRecord] = []
    last_low = low_watermark(parts.values())
    for batch in range(1, 10_000):
        if all(p.state == F for p in parts.values()):
            break
        now = batch
        plan, transitions = plan_batch(list(parts.values()), end + 100, span, batch)
        assert plan.end <= end + 100
        assert plan.slices, "a plan must advance while partitions are not finished"
        for token, state in transitions.items():
            parts[token] = attrs.evolve(parts[token], state=state)
        for s in plan.slices:
            p = parts[s.token]
            if s.start == p.start:
                reads[s.token] = reads.get(s.token, 0) + 1
                for parent in p.parent_tokens:  # never before all parents finished
                    assert parent not in parts or parts[parent].state == F
                    assert finished_at.get(parent, -1) < batch
            query = ChangeStreamQuery(
                "S", None if s.token == INITIAL_PARTITION_TOKEN else s.token, s.start, s.end
            )
            watermark, finished = s.end, s.end >= p.end
            for rec in stream.read(query):
                if isinstance(rec, ChildPartitionsRecord):
                    watermark, finished = rec.start_timestamp.ns, True
                    for child in rec.child_partitions:
                        parents = child.parent_partition_tokens or (s.token,)
                        if child.token not in parts:
                            parts[child.token] = part(
                                child.token, C, watermark, parents=parents, end=p.end
                            )
                elif isinstance(rec, DataChangeRecord):
                    delivered.append(rec)
            assert watermark >= p.watermark
            parts[s.token] = attrs.evolve(
                p,
                watermark=watermark,
                state=F if finished else p.state,
                finished_at=now if finished else None,
            )
            if finished:
                finished_at[s.token] = batch
        low = low_watermark(parts.values())
        assert low >= last_low, "the low watermark never moves backwards"
        last_low = low
        if ttl is not None:
            for token in gc_candidates(list(parts.values()), now, ttl):
                del parts[token]
    assert all(p.state == F for p in parts.values())
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
