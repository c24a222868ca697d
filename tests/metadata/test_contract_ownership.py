"""The ownership part of the MetadataStore contract (lease, fencing token, batch id floor,
source definition), run against every store in conftest.STORE_FACTORIES."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from cdcflow.errors import FencedError, LeaseHeldError, PlanConflictError
from cdcflow.metadata import MetadataStore
from cdcflow.model import BatchPlan, PartitionMetadata, PartitionState, PartitionUpdate, Slice

P = "orders"
S = 1_000_000_000
TTL = 60 * S


def _root() -> PartitionMetadata:
    return PartitionMetadata(token="r", parent_tokens=(), start=100, end=10_000, watermark=100,
                             state=PartitionState.CREATED, created_at=7)


def _plan(batch_id: int, end: int) -> BatchPlan:
    return BatchPlan(batch_id=batch_id, end=end, slices=(Slice("r", 100, end),),
                     planned_at=1_000 + batch_id)


def test_the_first_run_takes_the_lease(store: MetadataStore) -> None:
    assert store.lease(P) is None
    lease = store.acquire_lease(P, "host-a:11", "run-1", TTL)
    assert (lease.owner, lease.run_id, lease.token) == ("host-a:11", "run-1", 1)
    assert lease.acquired_at == lease.renewed_at and lease.expires_at == lease.renewed_at + TTL
    assert store.lease(P) == lease
    assert P in store.pipelines()


def test_a_second_run_is_refused_naming_the_owner(store: MetadataStore) -> None:
    store.acquire_lease(P, "host-a:11", "run-1", TTL)
    # both the command line's way and the API's (pipeline.run(takeover=True))
    with pytest.raises(LeaseHeldError,
                       match=r"host-a:11 \(run run-1.*--takeover \(takeover=True\)"):
        store.acquire_lease(P, "host-b:22", "run-2", TTL)
    assert store.lease(P) is not None and store.lease(P).run_id == "run-1"  # type: ignore[union-attr]


def test_a_takeover_fences_the_old_run_out(store: MetadataStore) -> None:
    old = store.acquire_lease(P, "host-a:11", "run-1", TTL)
    store.insert_partitions(P, [_root()])
    new = store.acquire_lease(P, "host-b:22", "run-2", TTL, replace=old.token)
    assert new.token > old.token
    with pytest.raises(FencedError, match="host-b:22"):
        store.renew_lease(P, old, TTL)
    with pytest.raises(FencedError):
        store.write_plan(P, _plan(1, 500), {"r": PartitionState.RUNNING}, fence=old.token)
    assert store.pending_plan(P) is None and store.last_batch_id(P) == 0  # nothing written
    store.write_plan(P, _plan(1, 500), {"r": PartitionState.RUNNING}, fence=new.token)
    with pytest.raises(FencedError):
        store.commit_batch(P, 1, [PartitionUpdate("r", 500)], [], fence=old.token)
    assert store.pending_plan(P) == _plan(1, 500)  # still pending: the stale commit did nothing
    assert store.commit_batch(P, 1, [PartitionUpdate("r", 500)], [], fence=new.token)
    assert store.partitions(P)[0].watermark == 500


def test_two_runs_racing_to_take_over_cannot_both_win(store: MetadataStore) -> None:
    old = store.acquire_lease(P, "host-a:11", "run-1", TTL)
    store.acquire_lease(P, "host-b:22", "run-2", TTL, replace=old.token)
    with pytest.raises(LeaseHeldError, match="host-b:22"):
        store.acquire_lease(P, "host-c:33", "run-3", TTL, replace=old.token)


def test_an_expired_or_released_lease_is_free(store: MetadataStore) -> None:
    first = store.acquire_lease(P, "host-a:11", "run-1", S // 20)  # 50 ms
    time.sleep(0.2)
    second = store.acquire_lease(P, "host-b:22", "run-2", TTL)
    assert second.token == first.token + 1
    store.release_lease(P, second)
    released = store.lease(P)
    assert released is not None and released.expires_at == 0 and released.token == second.token
    third = store.acquire_lease(P, "host-c:33", "run-3", TTL)
    assert third.token == second.token + 1
    store.release_lease(P, second)  # a stale release changes nothing
    assert store.lease(P) == third


def test_renewal_extends_the_current_lease(store: MetadataStore) -> None:
    lease = store.acquire_lease(P, "host-a:11", "run-1", TTL)
    time.sleep(0.01)
    renewed = store.renew_lease(P, lease, 2 * TTL)
    assert renewed.token == lease.token and renewed.renewed_at > lease.renewed_at
    assert renewed.expires_at == renewed.renewed_at + 2 * TTL
    assert store.lease(P) == renewed


def test_batch_ids_never_go_back_across_a_reset(store: MetadataStore) -> None:
    lease = store.acquire_lease(P, "host-a:11", "run-1", TTL)
    store.insert_partitions(P, [_root()])
    store.set_source(P, '{"stream": "S"}')
    for batch, end in ((1, 200), (2, 300), (3, 400)):
        store.write_plan(P, _plan(batch, end), {"r": PartitionState.RUNNING}, fence=lease.token)
        store.commit_batch(P, batch, [PartitionUpdate("r", end)], [], fence=lease.token)
    store.reset(P)
    assert store.partitions(P) == [] and store.pending_plan(P) is None
    assert store.last_batch_id(P) == 3
    assert store.source(P) is None
    assert store.lease(P) == lease  # the run that reset keeps its lease
    store.insert_partitions(P, [_root()])
    with pytest.raises(PlanConflictError):
        store.write_plan(P, _plan(1, 200), {"r": PartitionState.RUNNING}, fence=lease.token)
    store.write_plan(P, _plan(4, 200), {"r": PartitionState.RUNNING}, fence=lease.token)
    store.reset(P)
    assert store.last_batch_id(P) == 4


def test_ownership_and_the_source_survive_a_reopen(
    store: MetadataStore, reopen: Callable[[], MetadataStore]
) -> None:
    lease = store.acquire_lease(P, "host-a:11", "run-1", TTL)
    store.set_source(P, '{"stream": "S", "start_at": "now"}')
    again = reopen()
    assert again.lease(P) == lease
    assert again.source(P) == '{"stream": "S", "start_at": "now"}'
    assert again.source("other") is None and again.lease("other") is None


def test_durable_marks_only_move_forward_and_keep_their_batches(store: MetadataStore) -> None:
    lease = store.acquire_lease(P, "host-a:11", "run-1", TTL)
    store.insert_partitions(P, [_root()])
    assert store.durable_marks(P) == {}
    for batch, end in ((1, 200), (2, 300), (3, 400)):
        store.write_plan(P, _plan(batch, end), {"r": PartitionState.RUNNING}, fence=lease.token)
        store.commit_batch(P, batch, [PartitionUpdate("r", end)], [], fence=lease.token,
                           durable={"files": 1, "other": batch})
    assert store.durable_marks(P) == {"files": 1, "other": 3}
    store.mark_durable(P, {"files": 0}, fence=lease.token)  # never back
    store.mark_durable(P, {"files": 3}, fence=lease.token)
    assert store.durable_marks(P) == {"files": 3, "other": 3}
    with pytest.raises(FencedError):
        store.mark_durable(P, {"files": 9}, fence=lease.token + 1)
    assert store.logged_plan(P, 2) == _plan(2, 300)
    assert store.logged_plan(P, 99) is None
    store.reset(P)
    assert store.durable_marks(P) == {}
