"""SpannerStore specifics on the emulator: URLs, schema (both dialects, the upgrade of the
previous version's tables, the TTL column), init, concurrency, nanoseconds.

The MetadataStore contract itself runs against this store in tests/metadata (both
dialects); retries are in test_store_retries.py, the mutation budget in
test_store_limits.py.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from cdcflow.engine.lifecycle import gc_candidates
from cdcflow.errors import (
    FencedError,
    PlanConflictError,
    StoreError,
    StoreNotFoundError,
    StoreSetupError,
    StoreURLError,
)
from cdcflow.keyrange import MAX_BOUND_CHARS, KeyRange, range_token, token_range
from cdcflow.metadata import open_store
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    MAX_NS,
    BatchPlan,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
    Slice,
    snapshot_token,
)
from cdcflow.spanner._store_schema import (
    BATCH_COLUMNS,
    PARTITION_COLUMNS,
    to_spanner,
)
from cdcflow.spanner.emulator import Emulator, emulator_client
from cdcflow.spanner.store import DEFAULT_TABLE, SpannerStore, init_store, parse_spanner_url

PATH = "projects/p-1/instances/inst-1/databases/db_1"


def part(token: str, start: int, **kw: Any) -> PartitionMetadata:
    fields: dict[str, Any] = {"parent_tokens": (), "end": MAX_NS, "state": "CREATED", **kw}
    return PartitionMetadata(token=token, start=start, watermark=start, **fields)


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
        ("spanner://projects/P/instances/inst-1/databases/db_1", "lower-case letters"),
        ("spanner://projects/pp/instances/i/databases/meta",
         r"the instance id 'i' is not one Spanner takes; .*an instance 2-64 characters"),
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


@pytest.mark.parametrize("budget", [10, 80_001])
def test_a_mutation_budget_outside_spanners_limit_is_refused(budget: int) -> None:
    with pytest.raises(ValueError, match=r"between \d+ and Spanner's limit 80000"):
        SpannerStore(PATH, mutation_budget=budget)


# --- on the emulator ------------------------------------------------------------------

def _sql(store: SpannerStore, sql: str) -> list[list[Any]]:
    with store._database().snapshot() as snap:
        return [list(row) for row in snap.execute_sql(sql)]


@pytest.mark.emulator
def test_init_creates_beam_compatible_tables_and_is_idempotent(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    url = f"spanner://{database}?table=Meta"
    assert init_store(url) == (
        "created Meta, Meta_ByStateWatermark, Meta_ByCreatedAtStart, Meta_Batches, "
        f"Meta_Pipelines, Meta_StepState in {database}"
    )
    assert init_store(url) == (
        f"Meta, Meta_Batches, Meta_Pipelines and Meta_StepState already exist in {database}")

    store = stores(url)
    assert store.dialect == "GOOGLE_STANDARD_SQL"
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
        ["GcAfter", "TIMESTAMP", "YES"],
    ]
    commit_ts = _sql(store, "SELECT table_name, column_name FROM information_schema."
                            "column_options WHERE option_name = 'allow_commit_timestamp' AND "
                            "option_value = 'TRUE' ORDER BY table_name, column_name")
    assert commit_ts == [["Meta", "CreatedAt"], ["Meta", "FinishedAt"], ["Meta", "GcAfter"],
                         ["Meta", "RunningAt"], ["Meta", "ScheduledAt"],
                         ["Meta_Batches", "CommittedAt"]]
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
    assert ttl == [["Meta", "OLDER_THAN(GcAfter, INTERVAL 1 DAY)"], ["Meta_Batches", None],
                   ["Meta_Pipelines", None], ["Meta_StepState", None]]


@pytest.mark.emulator
def test_a_postgresql_database_gets_the_same_tables_in_its_dialect(
    spanner_emulator: Emulator, name: str, stores: Callable[[str], SpannerStore]
) -> None:
    spanner_emulator.create_database(name, dialect="POSTGRESQL")
    database = spanner_emulator.database_path(name)
    url = f"spanner://{database}?table=Meta"
    assert init_store(url).startswith("created Meta, Meta_ByStateWatermark, ")
    store = stores(url)
    assert store.dialect == "POSTGRESQL"
    columns = _sql(store, "SELECT column_name, spanner_type, is_nullable FROM "
                          "information_schema.columns WHERE table_name = 'Meta' "
                          "ORDER BY ordinal_position")
    assert columns == [
        ["PipelineName", "character varying", "NO"],
        ["PartitionToken", "character varying", "NO"],
        ["ParentTokens", "character varying[]", "NO"],
        ["StartTimestamp", "timestamp with time zone", "NO"],
        ["EndTimestamp", "timestamp with time zone", "NO"],
        ["HeartbeatMillis", "bigint", "NO"],
        ["State", "character varying", "NO"],
        ["Watermark", "timestamp with time zone", "NO"],
        ["CreatedAt", "spanner.commit_timestamp", "NO"],
        ["ScheduledAt", "spanner.commit_timestamp", "YES"],
        ["RunningAt", "spanner.commit_timestamp", "YES"],
        ["FinishedAt", "spanner.commit_timestamp", "YES"],
        ["GcAfter", "spanner.commit_timestamp", "YES"],
    ]
    ttl = _sql(store, "SELECT table_name, row_deletion_policy_expression FROM "
                      "information_schema.tables WHERE table_schema = 'public' "
                      "ORDER BY table_name")
    # The emulator writes the interval as it likes ('24 HOURS'); the column is what counts.
    assert [name for name, _ in ttl] == ["Meta", "Meta_Batches", "Meta_Pipelines",
                                         "Meta_StepState"]
    assert ttl[0][1].endswith('ON "GcAfter"') and all(t[1] is None for t in ttl[1:])
    # Positions keep their nanoseconds in timestamptz too.
    start = 1_714_564_800_123_456_789
    store.insert_partitions("p", [part("a", start)])
    assert store.partitions("p")[0].start == start


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
    assert tables == [[DEFAULT_TABLE], [f"{DEFAULT_TABLE}_Batches"],
                      [f"{DEFAULT_TABLE}_Pipelines"], [f"{DEFAULT_TABLE}_StepState"],
                      ["Other"], ["Other_Batches"], ["Other_Pipelines"], ["Other_StepState"]]


# The tables of the previous version: no pipelines table, no GcAfter, and a row deletion
# policy that dropped every FINISHED partition a day after it finished.
_PREVIOUS_SCHEMA = [
    """CREATE TABLE Meta (
  PipelineName STRING(MAX) NOT NULL,
  PartitionToken STRING(MAX) NOT NULL,
  ParentTokens ARRAY<STRING(MAX)> NOT NULL,
  StartTimestamp TIMESTAMP NOT NULL,
  EndTimestamp TIMESTAMP NOT NULL,
  HeartbeatMillis INT64 NOT NULL,
  State STRING(MAX) NOT NULL,
  Watermark TIMESTAMP NOT NULL,
  CreatedAt TIMESTAMP NOT NULL OPTIONS (allow_commit_timestamp=true),
  ScheduledAt TIMESTAMP OPTIONS (allow_commit_timestamp=true),
  RunningAt TIMESTAMP OPTIONS (allow_commit_timestamp=true),
  FinishedAt TIMESTAMP OPTIONS (allow_commit_timestamp=true),
) PRIMARY KEY (PipelineName, PartitionToken),
  ROW DELETION POLICY (OLDER_THAN(FinishedAt, INTERVAL 1 DAY))""",
    "CREATE INDEX Meta_ByStateWatermark ON Meta (State, Watermark)",
    "CREATE INDEX Meta_ByCreatedAtStart ON Meta (CreatedAt, StartTimestamp)",
    """CREATE TABLE Meta_Batches (
  PipelineName STRING(MAX) NOT NULL,
  BatchId INT64 NOT NULL,
  EndTimestamp TIMESTAMP NOT NULL,
  SliceTokens ARRAY<STRING(MAX)> NOT NULL,
  SliceStarts ARRAY<TIMESTAMP> NOT NULL,
  SliceEnds ARRAY<TIMESTAMP> NOT NULL,
  SliceCount INT64 NOT NULL,
  PlannedAt TIMESTAMP NOT NULL,
  CommittedAt TIMESTAMP OPTIONS (allow_commit_timestamp=true),
  Records INT64 NOT NULL,
) PRIMARY KEY (PipelineName, BatchId)""",
]


@pytest.mark.emulator
def test_the_tables_of_the_previous_version_are_upgraded_in_place(
    spanner_emulator: Emulator, name: str, stores: Callable[[str], SpannerStore]
) -> None:
    from google.cloud.spanner import COMMIT_TIMESTAMP

    old = spanner_emulator.create_database(name, _PREVIOUS_SCHEMA)
    # A pipeline the previous version ran: a finished leaf and two committed batches.
    with old.batch() as batch:
        batch.insert("Meta", PARTITION_COLUMNS, [(
            "p", "leaf", [], to_spanner(10), to_spanner(100), 1000, "FINISHED",
            to_spanner(100), COMMIT_TIMESTAMP, COMMIT_TIMESTAMP, COMMIT_TIMESTAMP,
            COMMIT_TIMESTAMP,
        )])
        batch.insert("Meta_Batches", BATCH_COLUMNS, [
            ("p", batch_id, to_spanner(100), [], [], [], 0, to_spanner(1), COMMIT_TIMESTAMP, 0)
            for batch_id in (1, 2)
        ])
    database = spanner_emulator.database_path(name)
    url = f"spanner://{database}?table=Meta"
    assert init_store(url) == (
        f"created Meta_Pipelines, Meta_StepState, Meta.GcAfter, Meta's row deletion policy on "
        f"GcAfter, Meta_Batches.Stats in {database}"
    )
    assert init_store(url) == (
        f"Meta, Meta_Batches, Meta_Pipelines and Meta_StepState already exist in {database}")
    store = stores(url)
    ttl = _sql(store, "SELECT table_name, row_deletion_policy_expression FROM "
                      "information_schema.tables WHERE table_schema = '' ORDER BY table_name")
    assert ttl == [["Meta", "OLDER_THAN(GcAfter, INTERVAL 1 DAY)"], ["Meta_Batches", None],
                   ["Meta_Pipelines", None], ["Meta_StepState", None]]
    # The old rows read as before, and the ownership part works on them.
    (leaf,) = store.partitions("p")
    assert (leaf.token, leaf.state, leaf.watermark) == ("leaf", "FINISHED", 100)
    assert store.last_batch_id("p") == 2 and store.pipelines() == ["p"]
    lease = store.acquire_lease("p", "host:1", "run-1", 60 * 10**9)
    store.reset("p")
    assert store.last_batch_id("p") == 2 and store.lease("p") == lease
    store.insert_partitions("p", [part("a", 5)])
    store.write_plan("p", BatchPlan(3, 50, (Slice("a", 5, 50),), planned_at=1),
                     {"a": PartitionState.RUNNING}, fence=lease.token)
    assert store.commit_batch("p", 3, [PartitionUpdate("a", 50)], [], fence=lease.token,
                              stats={"skipped": 2})
    assert [b.stats for b in store.batches("p")] == [{"skipped": 2}]  # the reset forgot 1, 2
    # A store that opens the upgraded database changes nothing more.
    assert stores(url).ensure_schema() == []


@pytest.mark.emulator
def test_no_store_operation_marks_a_row_for_the_ttl(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    # A bounded pipeline run to its end as the engine drives it: the root reports two
    # children, which read to the end; garbage collection removes what gc_candidates names.
    # Beam's policy (FinishedAt + 1 day) would then remove the leaves too, and a later run
    # would find an empty store and start over; the policy on GcAfter cannot.
    store = stores(f"spanner://{database}")
    lease = store.acquire_lease("p", "host:1", "run-1", 60 * 10**9)
    store.set_source("p", '{"stream": "S"}')
    root = part(INITIAL_PARTITION_TOKEN, 10, end=100)
    store.insert_partitions("p", [root])
    store.write_plan("p", BatchPlan(1, 50, (Slice(root.token, 10, 50),), planned_at=1),
                     {root.token: PartitionState.RUNNING}, fence=lease.token)
    store.commit_batch("p", 1, [PartitionUpdate(root.token, 10, finished=True)],
                       [part("a", 10, end=100, parent_tokens=(root.token,)),
                        part("b", 10, end=100, parent_tokens=(root.token,))],
                       fence=lease.token)
    store.write_plan("p", BatchPlan(2, 100, (Slice("a", 10, 100), Slice("b", 10, 100)), 2),
                     {"a": PartitionState.RUNNING, "b": PartitionState.RUNNING},
                     fence=lease.token)
    store.commit_batch("p", 2, [PartitionUpdate("a", 100, finished=True),
                                PartitionUpdate("b", 100, finished=True)], [],
                       fence=lease.token)
    expired = gc_candidates(store.partitions("p"), time.time_ns() + 10**12, 0)
    assert expired == [root.token]
    assert store.delete_partitions("p", expired) == 1
    store.renew_lease("p", lease, 60 * 10**9)
    store.release_lease("p", lease)
    store.reset("other")

    leaves = store.partitions("p")
    assert [(p.token, p.state) for p in leaves] == [("a", "FINISHED"), ("b", "FINISHED")]
    assert all(p.finished_at is not None for p in leaves)
    assert _sql(store, f"SELECT COUNT(*) FROM {DEFAULT_TABLE} WHERE GcAfter IS NOT NULL") == [[0]]
    policy = _sql(store, "SELECT row_deletion_policy_expression FROM information_schema.tables "
                         f"WHERE table_name = '{DEFAULT_TABLE}'")
    assert policy == [["OLDER_THAN(GcAfter, INTERVAL 1 DAY)"]]


@pytest.mark.emulator
def test_a_foreign_table_of_the_same_name_is_refused(
    spanner_emulator: Emulator, name: str, stores: Callable[[str], SpannerStore]
) -> None:
    spanner_emulator.create_database(
        name, ["CREATE TABLE Orders (Id INT64 NOT NULL) PRIMARY KEY (Id)"]
    )
    store = stores(f"spanner://{spanner_emulator.database_path(name)}?table=Orders")
    with pytest.raises(StoreError, match=r"not a cdcflow metadata table .*\?table=NAME") as info:
        store.partitions("p")
    assert isinstance(info.value, StoreSetupError)  # a configuration to fix: exit 2


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


def test_the_longest_snapshot_range_tokens_are_stored_planned_and_committed(
    database: str, stores: Callable[[str], SpannerStore]
) -> None:
    """A key range's bounds live in its token (cdcflow.keyrange): at their longest they
    must fit the store's key (PartitionToken is part of the primary key and the indexes'
    entries, and Spanner allows a key 8 KiB)."""
    store = stores(f"spanner://{database}")
    longest = "\u00e9" * (MAX_BOUND_CHARS // 6 - 2)  # 6 characters each as JSON text
    bound = (longest,)
    assert len(KeyRange(1, bound, bound).bounds_text()) > 2 * MAX_BOUND_CHARS - 30
    table = snapshot_token("Orders")
    tokens = [range_token("Orders", KeyRange(i, bound if i else None, bound)) for i in (0, 1)]
    store.insert_partitions("p", [part(table, 9, state="RUNNING", end=10)])
    store.write_plan("p", BatchPlan(1, 10, (Slice(table, 9, 10),), planned_at=1), {})
    assert store.commit_batch("p", 1, [PartitionUpdate(table, 10, True)], [
        part(t, 9, parent_tokens=(table,), end=10) for t in tokens])
    store.write_plan("p", BatchPlan(2, 10, tuple(Slice(t, 9, 10) for t in tokens),
                                    planned_at=2), {t: PartitionState.RUNNING for t in tokens})
    assert store.commit_batch("p", 2, [PartitionUpdate(t, 10, True) for t in tokens], [])
    rows = {p.token: p for p in store.partitions("p")}
    assert {t: rows[t].state for t in tokens} == dict.fromkeys(tokens, PartitionState.FINISHED)
    assert [token_range(t) for t in tokens] == [KeyRange(0, None, bound), KeyRange(1, bound, bound)]


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
def test_durable_marks_move_forward_and_keep_the_batches_a_sink_lacks(database: str) -> None:
    store = SpannerStore(database, batch_log_size=2)
    try:
        lease = store.acquire_lease("p", "host:1", "run-1", 60 * 10**9)
        store.insert_partitions("p", [part("a", 0)])
        assert store.durable_marks("p") == {}
        for batch_id in range(1, 6):
            store.write_plan("p", BatchPlan(batch_id, batch_id * 10, (), 1), {},
                             fence=lease.token)
            store.commit_batch("p", batch_id, [PartitionUpdate("a", batch_id * 10)], [],
                               fence=lease.token, durable={"files": 2, "other": batch_id})
        assert store.durable_marks("p") == {"files": 2, "other": 5}
        # The log keeps two entries, and every batch above the smallest mark.
        assert [b.batch_id for b in store.batches("p")] == [5, 4, 3]
        assert store.logged_plan("p", 3) == BatchPlan(3, 30, (), 1)
        assert store.logged_plan("p", 2) is None
        store.mark_durable("p", {"files": 1}, fence=lease.token)  # never back
        store.mark_durable("p", {"files": 5, "new": 4}, fence=lease.token)
        assert store.durable_marks("p") == {"files": 5, "new": 4, "other": 5}
        with pytest.raises(FencedError):
            store.mark_durable("p", {"files": 9}, fence=lease.token + 1)
        store.reset("p")
        assert store.durable_marks("p") == {} and store.lease("p") == lease
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


def _ddl(spanner_emulator: Emulator, name: str) -> list[str]:
    db = spanner_emulator.client().instance("test-instance").database(name)
    db.reload()
    return list(db.ddl_statements)


def _refused(url: str, error: type[StoreError], says: str) -> None:
    """A store opened with create=False refuses its first operation with ``error``."""
    store = open_store(url, create=False)
    try:
        with pytest.raises(error, match=says):
            store.pipelines()
    finally:
        store.close()


@pytest.mark.emulator
def test_a_store_opened_without_create_creates_nothing_on_the_emulator(
    spanner_emulator: Emulator, name: str
) -> None:
    # What `cdcflow status` opens: a URL naming another database, a mistyped table prefix,
    # an unknown instance or database is reported; the emulator's usual creation is not
    # done either.
    client = spanner_emulator.client()
    instance = f"nowhere-{uuid.uuid4().hex[:8]}"
    _refused(f"spanner://{spanner_emulator.database_path(name, instance)}", StoreNotFoundError,
             f"the Spanner instance projects/{spanner_emulator.project}/instances/{instance} "
             r"does not exist \(nothing was created\); check the URL")
    assert not client.instance(instance).exists()
    spanner_emulator.create_instance()
    database = spanner_emulator.database_path(name)
    _refused(f"spanner://{database}", StoreNotFoundError,
             f"the Spanner database {database} does not exist .*`cdcflow metadata init ")
    assert not client.instance("test-instance").database(name).exists()

    spanner_emulator.create_database(  # an application's database
        name, ["CREATE TABLE Orders (Id INT64 NOT NULL) PRIMARY KEY (Id)"])
    before = _ddl(spanner_emulator, name)
    for url, table in ((f"spanner://{database}", DEFAULT_TABLE),
                       (f"spanner://{database}?table=Typo", "Typo")):
        _refused(url, StoreNotFoundError,
                 rf"holds no cdcflow metadata \(no table {table}\): check the URL and its "
                 r"table= prefix, or run a pipeline \(or `cdcflow metadata init spanner://")
    assert _ddl(spanner_emulator, name) == before

    init_store(f"spanner://{database}?table=Meta")  # a store there: it opens and reads
    store = open_store(f"spanner://{database}?table=Meta", create=False)
    try:
        assert store.pipelines() == [] and store.partitions("p") == []
    finally:
        store.close()


@pytest.mark.emulator
def test_a_store_opened_without_create_does_not_upgrade_an_earlier_version(
    spanner_emulator: Emulator, name: str
) -> None:
    spanner_emulator.create_database(name, _PREVIOUS_SCHEMA)
    before = _ddl(spanner_emulator, name)
    _refused(f"spanner://{spanner_emulator.database_path(name)}?table=Meta", StoreSetupError,
             r"holds cdcflow metadata of an earlier version, or in part \(it lacks "
             r"Meta_Pipelines, .*Meta_Batches.Stats\): complete it with `cdcflow metadata init")
    assert _ddl(spanner_emulator, name) == before


@pytest.mark.emulator
def test_a_store_made_on_the_emulator_says_what_it_created(
    spanner_emulator: Emulator, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """On the emulator a run makes a missing instance and database for its store; a URL
    with a mistyped instance so gave a new, empty store without a word. A new instance is a
    warning, a new database in an existing one a note."""
    instance = f"typo-{uuid.uuid4().hex[:8]}"
    with caplog.at_level(logging.INFO, logger="cdcflow"):
        init_store(f"spanner://{spanner_emulator.database_path(name, instance)}")
    (made,) = [r for r in caplog.records if "did not exist on the emulator" in r.getMessage()]
    assert made.levelno == logging.WARNING
    assert f"created its instance '{instance}' and database '{name}'" in made.getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cdcflow"):
        init_store(f"spanner://{spanner_emulator.database_path(name + '2', instance)}")
    (made,) = [r for r in caplog.records if "did not exist on the emulator" in r.getMessage()]
    assert made.levelno == logging.INFO
    assert f"created its database '{name}2'" in made.getMessage()
