"""The shared rules: what the memory and SQLite stores' refusals say (each names the fix)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cdcflow.errors import PlanConflictError, StoreError, WatermarkRegressionError
from cdcflow.metadata import MemoryStore, MetadataStore, SQLiteStore
from cdcflow.metadata._rules import check_log_size, transition
from cdcflow.model import MAX_NS, BatchPlan, PartitionMetadata, PartitionState, PartitionUpdate

P = "orders"
RUNNING = PartitionState.RUNNING


@pytest.fixture(params=["memory", "sqlite"])
def local_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MetadataStore]:
    store: MetadataStore = (
        MemoryStore() if request.param == "memory" else SQLiteStore(tmp_path / "m.db")
    )
    store.insert_partitions(P, [PartitionMetadata("a", (), 100, MAX_NS, 100, "CREATED")])
    yield store
    store.close()


def test_a_pending_batch_message_says_to_commit_or_replay(local_store: MetadataStore) -> None:
    local_store.write_plan(P, BatchPlan(1, 200, ()), {})
    with pytest.raises(PlanConflictError, match=r"batch 1 is still pending; commit or replay"):
        local_store.write_plan(P, BatchPlan(2, 300, ()), {})


def test_a_stale_batch_id_message_names_the_next_id(local_store: MetadataStore) -> None:
    local_store.write_plan(P, BatchPlan(4, 200, ()), {})
    local_store.commit_batch(P, 4, [], [])
    with pytest.raises(PlanConflictError, match=r"not greater than .* 4; plan batch 5 next"):
        local_store.write_plan(P, BatchPlan(4, 300, ()), {})


def test_an_unknown_partition_message_says_to_insert_it(local_store: MetadataStore) -> None:
    with pytest.raises(StoreError, match=r"no partition 'ghost'; insert it first"):
        local_store.write_plan(P, BatchPlan(1, 200, ()), {"ghost": RUNNING})


def test_a_backward_transition_message_names_the_order(local_store: MetadataStore) -> None:
    local_store.write_plan(P, BatchPlan(1, 200, ()), {"a": RUNNING})
    local_store.commit_batch(P, 1, [], [])
    with pytest.raises(StoreError, match=r"'a' cannot go from RUNNING back to CREATED"):
        local_store.write_plan(P, BatchPlan(2, 300, ()), {"a": PartitionState.CREATED})


def test_a_regression_message_names_both_positions(local_store: MetadataStore) -> None:
    local_store.write_plan(P, BatchPlan(1, 200, ()), {})
    with pytest.raises(WatermarkRegressionError, match=r"from 100 to 99 ns.*at or after 100"):
        local_store.commit_batch(P, 1, [PartitionUpdate("a", 99)], [])


def test_an_unplanned_commit_message_says_to_plan_first(local_store: MetadataStore) -> None:
    with pytest.raises(StoreError, match=r"batch 3 was never planned; call write_plan"):
        local_store.commit_batch(P, 3, [], [])


def test_transition_stamps_only_the_states_reached() -> None:
    p = PartitionMetadata("a", (), 0, MAX_NS, 0, "CREATED", scheduled_at=5)
    finished = transition(P, p, PartitionState.FINISHED, 9)
    assert (finished.scheduled_at, finished.running_at, finished.finished_at) == (5, 9, 9)
    assert transition(P, finished, PartitionState.FINISHED, 20) is finished


def test_the_batch_log_holds_at_least_the_pending_batch() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        check_log_size(0)
    with pytest.raises(ValueError, match="at least 1"):
        MemoryStore(batch_log_size=0)
