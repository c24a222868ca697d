"""SpannerStore retries: failures injected where the store calls its Database object, and
RPCs bounded by a deadline instead of the stock client's own retries."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from google.api_core.exceptions import (
    Aborted,
    DeadlineExceeded,
    PermissionDenied,
    ServiceUnavailable,
)

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import StoreError
from cdcflow.model import (
    MAX_NS,
    BatchPlan,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
    Slice,
)
from cdcflow.spanner._store_schema import BrokenCall, bound_rpcs, transient
from cdcflow.spanner.emulator import emulator_client
from cdcflow.spanner.store import SpannerStore

PATH = "projects/p-1/instances/inst-1/databases/db_1"


def part(token: str, start: int) -> PartitionMetadata:
    return PartitionMetadata(token=token, parent_tokens=(), start=start, end=MAX_NS,
                             watermark=start, state="CREATED")


class Failing:
    """Stands in for one method of the store's Database: the first ``times`` calls raise
    ``error``, before calling the real method (the request never reached Spanner) or, with
    ``lost``, after it (Spanner applied it, but the answer was lost)."""

    def __init__(self, store: SpannerStore, method: str, *, times: int = 1, lost: bool = False,
                 error: Callable[[], Exception] = lambda: ServiceUnavailable("connection reset")
                 ) -> None:
        self.db = store._database()
        self.real = getattr(self.db, method)
        self.times, self.lost, self.error = times, lost, error
        self.calls = 0
        setattr(self.db, method, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls > self.times:
            return self.real(*args, **kwargs)
        if self.lost:
            self.real(*args, **kwargs)
        raise self.error()


def _fast(**kwargs: Any) -> RetryPolicy:
    return RetryPolicy(initial=0.001, maximum=0.01, **kwargs)


@pytest.fixture
def started(database: str, stores: Callable[[str], SpannerStore]) -> SpannerStore:
    """A store with partition a RUNNING and batch 1 pending (a's slice [10, 100))."""
    store = stores(f"spanner://{database}")
    store.retry = _fast()
    store.insert_partitions("p", [part("a", 10)])
    store.write_plan("p", BatchPlan(1, 100, (Slice("a", 10, 100),), planned_at=1),
                     {"a": PartitionState.RUNNING})
    return store


@pytest.mark.emulator
@pytest.mark.parametrize("lost", [False, True], ids=["refused", "answer-lost"])
def test_a_transient_failure_of_commit_batch_is_retried_and_commits_once(
    started: SpannerStore, lost: bool
) -> None:
    failing = Failing(started, "run_in_transaction", lost=lost)
    committed = started.commit_batch(
        "p", 1, [PartitionUpdate("a", 100)], [part("child", 100)], records=7
    )
    assert failing.calls == 2
    # After a lost answer the retry finds the batch committed by the first attempt.
    assert committed is not lost
    (log,) = started.batches("p")
    assert log.committed_at is not None and log.records == 7
    rows = {p.token: p for p in started.partitions("p")}
    assert sorted(rows) == ["a", "child"] and rows["a"].watermark == 100
    assert not started.commit_batch("p", 1, [PartitionUpdate("a", 100)], [], records=9)
    assert started.batches("p") == [log]


@pytest.mark.emulator
@pytest.mark.parametrize("lost", [False, True], ids=["refused", "answer-lost"])
def test_a_transient_failure_of_write_plan_is_retried_and_plans_once(
    database: str, stores: Callable[[str], SpannerStore], lost: bool
) -> None:
    store = stores(f"spanner://{database}")
    store.retry = _fast()
    store.insert_partitions("p", [part("a", 10)])
    failing = Failing(store, "run_in_transaction", lost=lost)
    planned = BatchPlan(1, 100, (Slice("a", 10, 100),), planned_at=0)  # stamped by the store
    store.write_plan("p", planned, {"a": PartitionState.RUNNING})  # no PlanConflictError
    assert failing.calls == 2
    pending = store.pending_plan("p")
    assert pending is not None and pending.slices == planned.slices and pending.planned_at > 0
    assert [b.batch_id for b in store.batches("p")] == [1]
    (a,) = store.partitions("p")
    assert a.state == PartitionState.RUNNING and a.running_at is not None


@pytest.mark.emulator
def test_reads_are_retried_too(started: SpannerStore) -> None:
    failing = Failing(started, "snapshot", times=2)
    assert [p.token for p in started.partitions("p")] == ["a"]
    assert failing.calls == 3


@pytest.mark.emulator
def test_aborted_transactions_are_retried_and_counted(started: SpannerStore) -> None:
    Failing(started, "run_in_transaction", times=3, error=lambda: Aborted("conflict"))
    assert started.commit_batch("p", 1, [PartitionUpdate("a", 50)], [])
    assert started.aborted_attempts == 3


@pytest.mark.emulator
def test_the_store_gives_up_when_the_policy_does(started: SpannerStore) -> None:
    slept: list[float] = []
    started.retry = RetryPolicy(attempts=3, sleep=slept.append)
    failing = Failing(started, "run_in_transaction", times=99)
    with pytest.raises(StoreError, match=r"the Spanner store .*: committing the batch kept "
                                         r"failing after 3 attempts \(UNAVAILABLE: connection"):
        started.commit_batch("p", 1, [PartitionUpdate("a", 100)], [])
    assert failing.calls == 3 and len(slept) == 2
    assert started.batches("p")[0].committed_at is None
    assert started.aborted_attempts == 0


@pytest.mark.emulator
def test_once_the_run_is_stopping_a_failure_is_not_retried(started: SpannerStore) -> None:
    # A supervisor's SIGTERM during a store outage: the call in progress fails at its next
    # failure instead of retrying up to the policy's deadline (120 s by default).
    stopping = False
    started.set_stopping(lambda: stopping)
    failing = Failing(started, "run_in_transaction", times=3)
    assert started.commit_batch("p", 1, [PartitionUpdate("a", 50)], [])  # retried: not yet
    assert failing.calls == 4
    started.write_plan("p", BatchPlan(2, 200, (Slice("a", 50, 200),), planned_at=2), {})
    failing = Failing(started, "run_in_transaction", times=99)
    stopping = True
    with pytest.raises(StoreError, match="committing the batch kept failing after 1 attempt"):
        started.commit_batch("p", 2, [PartitionUpdate("a", 200)], [])
    assert failing.calls == 1
    started.set_stopping(None)  # the run ended: retried again
    failing.times = failing.calls + 2
    assert started.commit_batch("p", 2, [PartitionUpdate("a", 200)], [])


@pytest.mark.emulator
def test_an_outage_is_logged_at_once_then_every_30s_and_its_end_once(
    started: SpannerStore, caplog: pytest.LogCaptureFixture,
) -> None:
    started.retry = RetryPolicy(attempts=50, initial=0.001, maximum=0.001, deadline=120)
    failing = Failing(started, "run_in_transaction", times=20)
    with caplog.at_level(logging.INFO, logger="cdcflow.spanner"):
        assert started.commit_batch("p", 1, [PartitionUpdate("a", 50)], [])
    assert failing.calls == 21
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # 20 failures within 30 s: one warning
    assert warnings[0].startswith(f"the Spanner store {started.url}: committing the batch "
                                  "failed (UNAVAILABLE: connection reset); retrying (at most "
                                  "50 attempts or 120s)")
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [f"the Spanner store {started.url} answers again"]


@pytest.mark.emulator
def test_a_permanent_error_is_not_retried(started: SpannerStore) -> None:
    failing = Failing(started, "run_in_transaction", times=99,
                      error=lambda: PermissionDenied("caller lacks spanner.databases.write"))
    with pytest.raises(StoreError, match=r": committing the batch failed: .* lacks spanner"):
        started.commit_batch("p", 1, [PartitionUpdate("a", 100)], [])
    assert failing.calls == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_an_unreachable_spanner_fails_after_the_policy_not_the_stock_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Database.exists() alone would retry UNAVAILABLE for up to an hour.
    monkeypatch.delenv("SPANNER_EMULATOR_HOST", raising=False)
    slept: list[float] = []
    store = SpannerStore(PATH, client=emulator_client(f"127.0.0.1:{_closed_port()}"),
                         retry=RetryPolicy(attempts=3, sleep=slept.append), call_timeout=5)
    began = time.monotonic()
    with pytest.raises(StoreError, match=r"the Spanner store .*: connecting kept failing after "
                                         r"3 attempts \(UNAVAILABLE"):
        store.partitions("p")
    assert len(slept) == 2 and time.monotonic() - began < 10


def test_rpcs_of_a_bounded_database_fail_instead_of_retrying_on_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The stock client retries session creation for 30 s, commits for an hour, and restarts
    # streaming reads after UNAVAILABLE forever.
    monkeypatch.delenv("SPANNER_EMULATOR_HOST", raising=False)
    db = emulator_client(f"127.0.0.1:{_closed_port()}").instance("inst-1").database("db_1")
    bound_rpcs(db, 2.0)
    session = f"{PATH}/sessions/s"
    began = time.monotonic()
    with pytest.raises(BrokenCall) as read, db.snapshot() as snap:
        list(snap.execute_sql("SELECT 1"))
    with pytest.raises(BrokenCall) as stream:
        next(iter(db.spanner_api.execute_streaming_sql(request={"session": session,
                                                                "sql": "SELECT 1"})))
    with pytest.raises(BrokenCall) as commit:
        db.spanner_api.commit(request={"session": session,
                                       "single_use_transaction": {"read_write": {}}})
    for failed in (read.value, stream.value, commit.value):
        assert isinstance(failed.error, ServiceUnavailable) and transient(failed)
    assert time.monotonic() - began < 10


@pytest.mark.emulator
def test_a_lease_renewal_or_release_retries_for_at_most_the_lease_retry_deadline(
    started: SpannerStore,
) -> None:
    """A store that does not answer: the run's end does not wait the policy's 120 s for
    the lease's release (it lapses by itself), nor a renewal (the next beat tries again)."""
    from cdcflow.spanner.store import LEASE_RETRY_DEADLINE

    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    started.retry = RetryPolicy(attempts=10_000, initial=1.0, maximum=1.0, deadline=120.0,
                                sleep=sleep, clock=lambda: now[0])
    lease = started.acquire_lease("p", "me", "run-1", 30 * 10**9)
    failing = Failing(started, "run_in_transaction", times=10**6)
    for op in (lambda: started.renew_lease("p", lease, 30 * 10**9),
               lambda: started.release_lease("p", lease)):
        now[0] = 0.0
        with pytest.raises(StoreError, match="lease kept failing"):
            op()
        assert now[0] <= LEASE_RETRY_DEADLINE
    calls = failing.calls
    now[0] = 0.0
    with pytest.raises(StoreError, match="committing the batch kept failing"):
        started.commit_batch("p", 1, [PartitionUpdate("a", 100)], [])
    assert now[0] > 100 and failing.calls - calls > 50  # the policy's own deadline


class _Stalled:
    """One method of the store's Database that does not answer for ``seconds`` (a stalled
    connection: open, silent), then fails as its deadline would."""

    def __init__(self, store: SpannerStore, method: str, seconds: float) -> None:
        self.db = store._database()
        self.seconds = seconds
        setattr(self.db, method, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.seconds)
        raise DeadlineExceeded("stalled")


@pytest.mark.emulator
def test_a_stop_gives_up_a_store_call_that_does_not_answer(started: SpannerStore) -> None:
    """A supervisor's SIGTERM while the store stalls: the call in flight is not waited for
    until its call_timeout (30 s): STOP_PATIENCE after the stop it fails with a StoreError
    (the engine then ends the run as stopped)."""
    from cdcflow.spanner._store_retry import STOP_PATIENCE

    stopping = threading.Event()
    started.set_stopping(stopping.is_set)
    _Stalled(started, "run_in_transaction", seconds=20)
    failed: list[BaseException] = []

    def commit() -> None:
        try:
            started.commit_batch("p", 1, [PartitionUpdate("a", 100)], [])
        except BaseException as exc:
            failed.append(exc)

    worker = threading.Thread(target=commit)
    worker.start()
    time.sleep(0.5)
    stopped = time.monotonic()
    stopping.set()
    worker.join(timeout=10)
    took = time.monotonic() - stopped
    assert not worker.is_alive() and len(failed) == 1
    assert isinstance(failed[0], StoreError)
    assert "did not answer within 2s of the stop request" in str(failed[0])
    assert STOP_PATIENCE <= took < STOP_PATIENCE + 1.5
