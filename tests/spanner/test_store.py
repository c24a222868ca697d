"""SpannerStore specifics on the emulator: URLs, schema, init, concurrency, nanoseconds,
retries (failures injected where the store calls its Database object).

The MetadataStore contract itself runs against this store in test_contract.py.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from google.api_core.exceptions import Aborted, PermissionDenied, ServiceUnavailable

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import PlanConflictError, StoreError, StoreURLError
from cdcflow.metadata import open_store
from cdcflow.model import (
    MAX_NS,
    BatchPlan,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
    Slice,
)
from cdcflow.spanner._store_schema import BrokenCall, bound_rpcs, transient
from cdcflow.spanner.emulator import Emulator, emulator_client
from cdcflow.spanner.store import DEFAULT_TABLE, SpannerStore, init_store, parse_spanner_url

PATH = "projects/p-1/instances/inst-1/databases/db_1"


def part(token: str, start: int, **kw: Any) -> PartitionMetadata:
    return PartitionMetadata(token=token, parent_tokens=(), start=start, end=MAX_NS,
                             watermark=start, state="CREATED", **kw)


# --- URLs (no emulator) ---------------------------------------------------------------


def test_a_url_names_the_database_and_optionally_the_table() -> None:
    assert parse_spanner_url(f"spanner://{PATH}") == (PATH, DEFAULT_TABLE)
    assert parse_spanner_url(f"spanner://{PATH}?table=Meta_2") == (PATH, "Meta_2")
    store = SpannerStore.from_url(f"spanner://{PATH}?table=Meta_2")
    assert store.url == f"spanner://{PATH}?table=Meta_2"
    assert store.batch_table == "Meta_2_Batches"
    assert SpannerStore.from_url(f"spanner://{PATH}").url == f"spanner://{PATH}"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("spanner://projects/p/instances/i", "projects/PROJECT/instances/INSTANCE/databases"),
        ("spanner://projects/p-1/instances/inst-1/databases/db_1/extra", "databases/DATABASE"),
        ("spanner://projects/P/instances/inst-1/databases/db_1", "lower-case ids"),
        (f"spanner://{PATH}?table=1abc", "not a Spanner identifier"),
        (f"spanner://{PATH}?table=a-b", "not a Spanner identifier"),
        (f"spanner://{PATH}?table=", "not a Spanner identifier"),
        (f"spanner://{PATH}?tabel=X", "unknown option 'tabel=X'"),
        (f"spanner://{PATH}?table", "unknown option 'table'"),
    ],
)
def test_a_malformed_url_raises_with_the_valid_form(url: str, why: str) -> None:
    with pytest.raises(StoreURLError, match=why) as info:
        open_store(url)
    assert "spanner://projects/P/instances/I/databases/D[?table=NAME]" in str(info.value)


# --- on the emulator ------------------------------------------------------------------

@pytest.fixture
def database(spanner_emulator: Emulator) -> str:
    """The path of a database that does not exist yet (the store creates it)."""
    return spanner_emulator.database_path(f"meta-{uuid.uuid4().hex[:20]}")


@pytest.fixture
def stores() -> Iterator[Callable[[str], SpannerStore]]:
    opened: list[SpannerStore] = []

    def _open(url: str) -> SpannerStore:
        opened.append(SpannerStore.from_url(url))
        return opened[-1]

    yield _open
    for s in opened:
        s.close()


def _sql(store: SpannerStore, sql: str) -> list[list[Any]]:
    with store._database().snapshot() as snap:
        return [list(row) for row in snap.execute_sql(sql)]


@pytest.mark.emulator
def test_init_creates_beam_compatible_tables_and_is_idempotent(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    url = f"spanner://{database}?table=Meta"
    assert init_store(url) == (
        f"created Meta, Meta_ByStateWatermark, Meta_ByCreatedAtStart, Meta_Batches in {database}"
    )
    assert init_store(url) == f"Meta and Meta_Batches already exist in {database}"

    store = stores(url)
    columns = _sql(store, "SELECT column_name, spanner_type, is_nullable FROM "
                          "information_schema.columns WHERE table_name = 'Meta' "
                          "ORDER BY ordinal_position")
    assert columns == [
        ["PipelineName", "STRING(MAX)", "NO"],
        ["PartitionToken", "STRING(MAX)", "NO"],
        ["ParentTokens", "ARRAY<STRING(MAX)>", "NO"],
        ["StartTimestamp", "TIMESTAMP", "NO"],
        ["EndTimestamp", "TIMESTAMP", "NO"],
        ["HeartbeatMillis", "INT64", "NO"],
        ["State", "STRING(MAX)", "NO"],
        ["Watermark", "TIMESTAMP", "NO"],
        ["CreatedAt", "TIMESTAMP", "NO"],
        ["ScheduledAt", "TIMESTAMP", "YES"],
        ["RunningAt", "TIMESTAMP", "YES"],
        ["FinishedAt", "TIMESTAMP", "YES"],
    ]
    commit_ts = _sql(store, "SELECT table_name, column_name FROM information_schema."
                            "column_options WHERE option_name = 'allow_commit_timestamp' AND "
                            "option_value = 'TRUE' ORDER BY table_name, column_name")
    assert commit_ts == [["Meta", "CreatedAt"], ["Meta", "FinishedAt"], ["Meta", "RunningAt"],
                         ["Meta", "ScheduledAt"], ["Meta_Batches", "CommittedAt"]]
    indexes = _sql(store, "SELECT index_name, column_name FROM information_schema."
                          "index_columns WHERE table_name = 'Meta' "
                          "ORDER BY index_name, ordinal_position")
    assert indexes == [
        ["Meta_ByCreatedAtStart", "CreatedAt"], ["Meta_ByCreatedAtStart", "StartTimestamp"],
        ["Meta_ByStateWatermark", "State"], ["Meta_ByStateWatermark", "Watermark"],
        ["PRIMARY_KEY", "PipelineName"], ["PRIMARY_KEY", "PartitionToken"],
    ]
    ttl = _sql(store, "SELECT table_name, row_deletion_policy_expression FROM "
                      "information_schema.tables WHERE table_schema = '' ORDER BY table_name")
    assert ttl == [["Meta", "OLDER_THAN(FinishedAt, INTERVAL 1 DAY)"], ["Meta_Batches", None]]


@pytest.mark.emulator
def test_tables_are_created_on_first_use_and_table_names_separate_stores(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    first, second = stores(f"spanner://{database}"), stores(f"spanner://{database}?table=Other")
    assert first.insert_partitions("p", [part("a", 5)]) == 1
    assert second.partitions("p") == []
    assert second.insert_partitions("p", [part("b", 5)]) == 1
    assert [p.token for p in first.partitions("p")] == ["a"]
    tables = _sql(first, "SELECT table_name FROM information_schema.tables "
                         "WHERE table_schema = '' ORDER BY table_name")
    assert tables == [[DEFAULT_TABLE], [f"{DEFAULT_TABLE}_Batches"], ["Other"],
                      ["Other_Batches"]]


@pytest.mark.emulator
def test_a_foreign_table_of_the_same_name_is_refused(
    spanner_emulator: Emulator, stores: Callable[[str], SpannerStore]
) -> None:
    name = f"meta-{uuid.uuid4().hex[:20]}"
    spanner_emulator.create_database(
        name, ["CREATE TABLE Orders (Id INT64 NOT NULL) PRIMARY KEY (Id)"]
    )
    store = stores(f"spanner://{spanner_emulator.database_path(name)}?table=Orders")
    with pytest.raises(StoreError, match=r"not a cdcflow metadata table .*\?table=NAME"):
        store.partitions("p")


@pytest.mark.emulator
def test_positions_keep_nanoseconds_and_max_ns_round_trips(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    store = stores(f"spanner://{database}")
    start = 1_714_564_800_123_456_789
    store.insert_partitions("p", [part("a", start), part("b", start + 1)])
    store.write_plan("p", BatchPlan(1, MAX_NS, (Slice("a", start, MAX_NS),), planned_at=1), {})
    assert store.pending_plan("p") == BatchPlan(1, MAX_NS, (Slice("a", start, MAX_NS),), 1)
    assert store.commit_batch("p", 1, [PartitionUpdate("a", MAX_NS - 1)], [])
    rows = {p.token: p for p in store.partitions("p")}
    assert rows["a"].watermark == MAX_NS - 1 and rows["a"].end == MAX_NS
    assert rows["b"].start == start + 1 and rows["a"].start == start
    assert store.batches("p")[0].end == MAX_NS
    text = "FORMAT_TIMESTAMP('%FT%H:%M:%E9SZ', {}, 'UTC')"
    raw = _sql(store, f"SELECT {text.format('StartTimestamp')}, {text.format('EndTimestamp')} "
                      f"FROM {DEFAULT_TABLE} WHERE PartitionToken = 'a'")
    assert raw == [["2024-05-01T12:00:00.123456789Z", "2262-04-11T23:47:16.854775807Z"]]


@pytest.mark.emulator
def test_caller_times_ahead_of_spanner_are_lowered_to_its_clock(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    store = stores(f"spanner://{database}")
    future = time.time_ns() + 3600 * 10**9
    store.insert_partitions("p", [part("a", 5, created_at=future, scheduled_at=future)])
    (row,) = store.partitions("p")
    assert row.scheduled_at is not None
    assert row.created_at <= time.time_ns() and row.scheduled_at <= time.time_ns()


@pytest.mark.emulator
def test_concurrent_commits_of_one_batch_apply_it_once(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    url = f"spanner://{database}"
    stores(url).insert_partitions("p", [part("a", 10)])
    stores(url).write_plan("p", BatchPlan(1, 100, (Slice("a", 10, 100),), planned_at=1), {})
    # One store object per thread, like two processes, plus two threads sharing one.
    shared = stores(url)
    writers = [stores(url), stores(url), shared, shared]
    results: list[bool | BaseException] = []

    def commit(store: SpannerStore, i: int) -> None:
        try:
            results.append(store.commit_batch(
                "p", 1, [PartitionUpdate("a", 100)], [part(f"child{i}", 100)], records=i))
        except BaseException as e:  # the assertion below shows what went wrong
            results.append(e)

    threads = [threading.Thread(target=commit, args=(s, i)) for i, s in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == [False, False, False, True]
    reader = stores(url)
    (log,) = reader.batches("p")
    assert log.committed_at is not None
    children = [p.token for p in reader.partitions("p") if p.token != "a"]
    assert children == [f"child{log.records}"]  # exactly the winner's progress


@pytest.mark.emulator
def test_concurrent_plans_conflict_cleanly(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    url = f"spanner://{database}"
    stores(url).insert_partitions("p", [part("a", 10)])
    errors: list[BaseException] = []
    done: list[int] = []

    def plan(batch_id: int) -> None:
        try:
            stores(url).write_plan("p", BatchPlan(batch_id, 100, (), planned_at=1), {})
            done.append(batch_id)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=plan, args=(i,)) for i in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == 1 and all(isinstance(e, PlanConflictError) for e in errors)
    assert len(errors) == 2
    pending = stores(url).pending_plan("p")
    assert pending is not None and pending.batch_id == done[0]


@pytest.mark.emulator
def test_pipelines_progress_concurrently_in_one_store(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    url = f"spanner://{database}"
    store = stores(url)
    errors: list[BaseException] = []

    def run(pipeline: str) -> None:
        try:
            own = stores(url)
            own.insert_partitions(pipeline, [part("a", 0)])
            for batch_id in range(1, 6):
                own.write_plan(pipeline, BatchPlan(batch_id, batch_id * 10, (), 1), {})
                assert own.commit_batch(pipeline, batch_id,
                                        [PartitionUpdate("a", batch_id * 10)], [])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(f"p{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.pipelines() == ["p0", "p1", "p2"]
    for name in ("p0", "p1", "p2"):
        assert store.last_batch_id(name) == 5
        assert store.partitions(name)[0].watermark == 50


@pytest.mark.emulator
def test_the_batch_log_keeps_the_newest_entries(database: str) -> None:
    store = SpannerStore(database, batch_log_size=3)
    try:
        for batch_id in range(1, 7):
            store.write_plan("p", BatchPlan(batch_id, batch_id, (), 1), {})
            if batch_id < 6:
                store.commit_batch("p", batch_id, [], [])
        assert [b.batch_id for b in store.batches("p")] == [6, 5, 4]
        assert store.pending_plan("p") == BatchPlan(6, 6, (), 1)
    finally:
        store.close()


@pytest.mark.emulator
def test_a_missing_database_outside_the_emulator_names_the_fix(
    spanner_emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without SPANNER_EMULATOR_HOST the store does not create databases; the client still
    # reaches the emulator through its explicit endpoint.
    monkeypatch.delenv("SPANNER_EMULATOR_HOST")
    spanner_emulator.create_instance()
    path = spanner_emulator.database_path("never-created")
    store = SpannerStore(path, client=emulator_client(spanner_emulator.host))
    with pytest.raises(StoreError, match="does not exist; create it"):
        store.partitions("p")


# --- retries -----------------------------------------------------------------------------


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
