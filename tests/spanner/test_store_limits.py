"""The Spanner store under its mutation budget, on the emulator.

Operations too large for one transaction run as several, each within the budget (counted
here from the mutations the transactions really carried), with the same outcome as one
transaction; a crash or a takeover between the transactions of a batch's commit leaves the
batch pending, and the replay completes it. A small injected budget makes the split paths
run with a few partitions; one test runs thousands at the default budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from google.api_core.exceptions import PermissionDenied

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import FencedError, StoreError
from cdcflow.model import (
    MAX_NS,
    BatchPlan,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
    Slice,
)
from cdcflow.spanner._store_limits import DEFAULT_MUTATION_BUDGET, MUTATION_LIMIT
from cdcflow.spanner.store import SpannerStore

pytestmark = pytest.mark.emulator

RUNNING = PartitionState.RUNNING
FINISHED = PartitionState.FINISHED
BUDGET = 100  # 5 inserts, 6 updates or 33 deletes per transaction
TTL = 60 * 10**9


def part(token: str, start: int = 10, **kw: Any) -> PartitionMetadata:
    fields: dict[str, Any] = {"parent_tokens": (), "end": MAX_NS, "state": "CREATED", **kw}
    return PartitionMetadata(token=token, start=start, watermark=start, **fields)


def cells(mutations: list[Any], partition_table: str) -> int:
    """Mutations by Spanner's rule: a cell per column written and row; a delete, one per key
    or range; plus, in the partition table, a cell per column of each index entry an insert
    adds (2 indexes x 4) or an update of State moves (removed and added: 2 x 4), and one
    per index entry a keyed delete removes."""
    total = 0
    for m in mutations:
        kind = type(m).pb(m).WhichOneof("operation")
        op = getattr(m, kind)
        ours = op.table == partition_table
        if kind == "delete":
            keys = len(op.key_set.keys)
            total += keys + len(op.key_set.ranges) + (2 * keys if ours else 0)
            continue
        rows = len(op.values)
        total += rows * len(op.columns)
        if ours and (kind == "insert" or "State" in op.columns):
            total += rows * 8
    return total


class Recorder:
    """Stands in for the store's ``Database.run_in_transaction``: records the mutations of
    every committed transaction (``costs``), can run ``before[n]`` ahead of the n-th call
    (1-based) and make the n-th call fail with ``fail[n]`` before it reaches Spanner."""

    def __init__(self, store: SpannerStore) -> None:
        self.table = store.table
        self.db = store._database()
        self.real = self.db.run_in_transaction
        self.calls = 0
        self.costs: list[int] = []
        self.before: dict[int, Callable[[], None]] = {}
        self.fail: dict[int, Exception] = {}
        self.db.run_in_transaction = self

    def __call__(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls in self.before:
            self.before[self.calls]()
        if self.calls in self.fail:
            raise self.fail[self.calls]
        sent: list[Any] = []

        def recorded(txn: Any, *a: Any, **kw: Any) -> Any:
            result = func(txn, *a, **kw)
            sent[:] = list(txn._mutations)
            return result

        result = self.real(recorded, *args, **kwargs)
        self.costs.append(cells(sent, self.table))
        return result

    def take(self) -> list[int]:
        """The costs recorded since the last take."""
        costs, self.costs = self.costs, []
        return costs


@pytest.fixture
def opened() -> Iterator[Callable[..., SpannerStore]]:
    stores: list[SpannerStore] = []

    def _open(database: str, **kw: Any) -> SpannerStore:
        stores.append(SpannerStore(database, retry=RetryPolicy(initial=0.001, maximum=0.01),
                                   **kw))
        return stores[-1]

    yield _open
    for s in stores:
        s.close()


def _drive(store: SpannerStore, n: int, fence: int | None = None) -> bool:
    """Batch 1 over n partitions: all start RUNNING, all finish, each reports a child."""
    tokens = [f"t{i:05}" for i in range(n)]
    store.insert_partitions("p", [part(t) for t in tokens])
    plan = BatchPlan(1, 500, tuple(Slice(t, 10, 500) for t in tokens), planned_at=1)
    store.write_plan("p", plan, dict.fromkeys(tokens, RUNNING), fence=fence)
    return store.commit_batch(
        "p", 1, [PartitionUpdate(t, 500, finished=True) for t in tokens],
        [part(f"c{t}", 500, parent_tokens=(t,)) for t in tokens], records=n, fence=fence,
    )


def _state(store: SpannerStore) -> list[tuple[Any, ...]]:
    """What a batch's commit decides, without the times Spanner stamps."""
    rows = [(p.token, p.parent_tokens, p.state, p.watermark, p.finished_at is not None)
            for p in store.partitions("p")]
    log = [(b.batch_id, b.committed_at is not None, b.records) for b in store.batches("p")]
    return [*rows, *log]


def test_a_large_batch_takes_several_transactions_each_within_the_budget(
    database: str, opened: Callable[..., SpannerStore]
) -> None:
    reference = opened(database, table="Reference")
    assert _drive(reference, 12)
    store = opened(database, mutation_budget=BUDGET)
    recorder = Recorder(store)
    store.insert_partitions("p", [part(f"t{i:05}") for i in range(12)])
    inserts = recorder.take()
    assert len(inserts) == 3 and max(inserts) <= BUDGET  # 5 + 5 + 2 rows of 20 cells
    assert _drive(store, 12)  # its inserts find every token present
    steps = recorder.take()
    assert len(steps) > 6 and max(steps) <= BUDGET
    assert _state(store) == _state(reference)
    assert store.delete_partitions("p", [f"ct{i:05}" for i in range(12)] + ["gone"]) == 12
    deletes = recorder.take()
    assert len(deletes) == 1 and max(deletes) <= BUDGET  # 13 keys x 3
    assert not store.commit_batch("p", 1, [PartitionUpdate("t00000", 500)], [])


def test_a_crash_between_the_transactions_of_a_commit_is_repaired_by_the_replay(
    database: str, opened: Callable[..., SpannerStore]
) -> None:
    reference = opened(database, table="Reference")
    assert _drive(reference, 12)
    store = opened(database, mutation_budget=BUDGET)
    recorder = Recorder(store)
    # Calls 1-3 insert, 4-6 plan, 7-11 commit (6 + 6 updates, 4 + 4 + 4 children): the
    # process dies before the commit's second step.
    recorder.fail[8] = PermissionDenied("the process died here")
    with pytest.raises(StoreError, match="committing the batch failed"):
        _drive(store, 12)
    # The batch is pending; what the first steps wrote is what the replay writes again.
    pending = store.pending_plan("p")
    assert pending is not None and pending.batch_id == 1
    assert store.batches("p")[0].committed_at is None
    moved = [p for p in store.partitions("p") if p.token.startswith("t")]
    assert {p.watermark for p in moved} == {10, 500}  # some advanced, none beyond 500
    assert {p.state for p in moved if p.watermark == 500} == {FINISHED}
    # The replay reads the same slices, so it reports the same progress.
    tokens = [f"t{i:05}" for i in range(12)]
    assert store.commit_batch(
        "p", 1, [PartitionUpdate(t, 500, finished=True) for t in tokens],
        [part(f"c{t}", 500, parent_tokens=(t,)) for t in tokens], records=12,
    )
    assert _state(store) == _state(reference)
    assert not store.commit_batch("p", 1, [], [])


def test_a_takeover_between_the_transactions_of_a_commit_fences_the_old_run(
    database: str, opened: Callable[..., SpannerStore]
) -> None:
    store = opened(database, mutation_budget=BUDGET)
    other = opened(database)
    old = store.acquire_lease("p", "host-a:1", "run-1", TTL)
    recorder = Recorder(store)
    new: list[Any] = []
    # Calls 1-3 insert, 4-6 plan, 7-11 commit: the takeover lands after the commit's first
    # step.
    recorder.before[8] = lambda: new.append(
        other.acquire_lease("p", "host-b:2", "run-2", TTL, replace=old.token))
    with pytest.raises(FencedError, match="host-b:2"):
        _drive(store, 12, fence=old.token)
    assert store.batches("p")[0].committed_at is None  # still pending for the new owner
    tokens = [f"t{i:05}" for i in range(12)]
    assert other.commit_batch("p", 1, [PartitionUpdate(t, 500, finished=True) for t in tokens],
                              [], fence=new[0].token)
    assert {p.state for p in other.partitions("p")} == {FINISHED}


def test_a_split_plan_validates_every_transition_before_writing_any(
    database: str, opened: Callable[..., SpannerStore]
) -> None:
    store = opened(database, mutation_budget=BUDGET)
    tokens = [f"t{i:05}" for i in range(12)]
    store.insert_partitions("p", [part(t) for t in tokens])
    plan = BatchPlan(1, 500, tuple(Slice(t, 10, 500) for t in tokens), planned_at=1)
    with pytest.raises(StoreError, match="has no partition 'zz'"):
        store.write_plan("p", plan, {**dict.fromkeys(tokens, RUNNING), "zz": RUNNING})
    assert {p.state for p in store.partitions("p")} == {PartitionState.CREATED}
    assert store.pending_plan("p") is None
    recorder = Recorder(store)
    store.write_plan("p", plan, dict.fromkeys(tokens, RUNNING))
    costs = recorder.take()
    assert len(costs) == 3 and max(costs) <= BUDGET  # 5 + 5 transitions, then 2 and the log
    assert store.pending_plan("p") == plan
    assert {p.state for p in store.partitions("p")} == {RUNNING}
    store.write_plan("p", plan, dict.fromkeys(tokens, RUNNING))  # pending already: no change
    assert len(recorder.take()) == 1


def test_an_interrupted_reset_is_refused_until_it_is_run_again(
    database: str, opened: Callable[..., SpannerStore]
) -> None:
    store = opened(database, mutation_budget=BUDGET)  # 29 partitions per step
    lease = store.acquire_lease("p", "host-a:1", "run-1", TTL)
    store.set_source("p", "{}")
    assert _drive(store, 40)  # 80 partitions, batch 1 committed
    recorder = Recorder(store)
    recorder.fail[2] = PermissionDenied("the process died here")
    with pytest.raises(StoreError, match="resetting the pipeline failed"):
        store.reset("p")
    for refused in (
        lambda: store.partitions("p"),
        lambda: store.insert_partitions("p", [part("x")]),
        lambda: store.write_plan("p", BatchPlan(2, 600, (), 1), {}),
    ):
        with pytest.raises(StoreError, match=r"reset was interrupted .* --reset again"):
            refused()
    assert store.last_batch_id("p") == 1 and store.pending_plan("p") is None
    recorder.take()
    store.reset("p")  # goes on where it stopped: 80 - 29 partitions left
    costs = recorder.take()
    assert len(costs) == 2 and max(costs) <= BUDGET
    assert store.partitions("p") == [] and store.source("p") is None
    assert store.last_batch_id("p") == 1 and store.lease("p") == lease
    assert store.pipelines() == ["p"]


def test_thousands_of_partitions_stay_under_the_limit_at_the_default_budget(
    database: str, opened: Callable[..., SpannerStore]
) -> None:
    store = opened(database)
    recorder = Recorder(store)
    began = time.monotonic()
    assert _drive(store, 3000)
    costs = recorder.take()
    # 3000 inserts (60,000) take 2 transactions, 3000 transitions (45,000) 2, the commit's
    # 3000 updates and 3000 children (105,000) 3: each of them would exceed the budget.
    assert len(costs) == 7 and max(costs) <= DEFAULT_MUTATION_BUDGET < MUTATION_LIMIT
    rows = store.partitions("p")
    assert len(rows) == 6000
    assert sum(p.state == FINISHED and p.watermark == 500 for p in rows) == 3000
    assert store.batches("p")[0].records == 3000
    # Garbage collection of the finished parents: 9,000 mutations, one transaction.
    assert store.delete_partitions("p", [f"t{i:05}" for i in range(3000)]) == 3000
    assert recorder.take() == [9000]
    assert len(store.partitions("p")) == 3000
    # About 20 s on the emulator, whose commits slow down with their size (a range delete of
    # 6,000 rows takes it longer than the call deadline, so reset is left to the test above).
    assert time.monotonic() - began < 90
