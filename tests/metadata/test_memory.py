"""MemoryStore specifics: named instances, privacy of anonymous ones, threads, log size."""

from __future__ import annotations

import threading
import uuid

from cdcflow.errors import PlanConflictError
from cdcflow.metadata import MemoryStore, open_store
from cdcflow.model import MAX_NS, BatchPlan, PartitionMetadata, PartitionState

P = "orders"


def part(token: str) -> PartitionMetadata:
    return PartitionMetadata(token, (), 0, MAX_NS, 0, PartitionState.CREATED)


def test_a_named_store_is_shared_within_the_process() -> None:
    url = f"memory://shared-{uuid.uuid4().hex}"
    a = open_store(url)
    a.insert_partitions(P, [part("x")])
    a.close()
    b = open_store(url)
    assert b is a
    assert [p.token for p in b.partitions(P)] == ["x"]
    assert b.url == url


def test_an_anonymous_store_is_private() -> None:
    a, b = open_store("memory://"), open_store("memory://")
    a.insert_partitions(P, [part("x")])
    assert b.partitions(P) == []
    assert a.url == "memory://"


def test_concurrent_planners_get_one_plan_through() -> None:
    store = MemoryStore()
    results: list[str] = []
    barrier = threading.Barrier(8)

    def plan(n: int) -> None:
        barrier.wait()
        try:
            store.write_plan(P, BatchPlan(1 + n, 100, ()), {})
            results.append("planned")
        except PlanConflictError:
            results.append("conflict")

    threads = [threading.Thread(target=plan, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["conflict"] * 7 + ["planned"]
    assert len(store.batches(P)) == 1


def test_the_batch_log_keeps_the_newest_entries() -> None:
    store = MemoryStore(batch_log_size=3)
    for i in range(1, 7):
        store.write_plan(P, BatchPlan(i, i * 10, ()), {})
        if i < 6:
            store.commit_batch(P, i, [], [])
    assert [b.batch_id for b in store.batches(P)] == [6, 5, 4]
    assert store.last_batch_id(P) == 6


def test_a_clock_can_be_injected() -> None:
    store = MemoryStore(clock=lambda: 123)
    store.insert_partitions(P, [part("x")])
    store.write_plan(P, BatchPlan(1, 10, ()), {"x": PartitionState.RUNNING})
    store.commit_batch(P, 1, [], [])
    (row,) = store.partitions(P)
    assert row.scheduled_at == row.running_at == 123
    (log,) = store.batches(P)
    assert log.planned_at == log.committed_at == 123
