"""SpannerChangeStreamClient against the Cloud Spanner emulator (and a scripted transport
for failures the emulator cannot produce)."""

from __future__ import annotations

import pickle
import random
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from google.api_core import exceptions as gexc

from cdcflow.errors import (
    ChangeStreamError,
    StreamNotFoundError,
    TransientError,
    UserInputError,
)
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    ChangeRecord,
    ChildPartitionsRecord,
    DataChangeRecord,
    HeartbeatRecord,
    Timestamp,
    record_position,
)
from cdcflow.spanner.client import SpannerChangeStreamClient, cached_client
from cdcflow.spanner.decode import records_from_stock_row
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.retry import RetryPolicy
from cdcflow.spanner.transport import Param
from cdcflow.stream import ChangeStreamClient, ChangeStreamQuery
from cdcflow.testing import ScriptedTransport

pytestmark = pytest.mark.emulator

CAPTURE_TYPES = ["OLD_AND_NEW_VALUES", "NEW_VALUES", "NEW_ROW", "NEW_ROW_AND_OLD_VALUES"]


# --- fixtures -------------------------------------------------------------------------------


def _googlesql_ddl() -> list[str]:
    ddl = ["CREATE TABLE Orders (Id INT64 NOT NULL, Name STRING(MAX), Qty INT64, Doc JSON) "
           "PRIMARY KEY (Id)",
           "CREATE CHANGE STREAM OrdersStream FOR Orders OPTIONS (retention_period = '36h')"]
    for vct in CAPTURE_TYPES:
        ddl += [
            f"CREATE TABLE T_{vct} (Id INT64 NOT NULL, A STRING(MAX), B INT64) PRIMARY KEY (Id)",
            f"CREATE CHANGE STREAM S_{vct} FOR T_{vct} OPTIONS (value_capture_type = '{vct}')",
        ]
    return ddl


@pytest.fixture(scope="module")
def gsql(spanner_emulator: Emulator) -> tuple[Any, str]:
    db = spanner_emulator.create_database("cdc_gsql", _googlesql_ddl())
    return db, spanner_emulator.database_path("cdc_gsql")


@pytest.fixture(scope="module")
def pg(spanner_emulator: Emulator) -> tuple[Any, str]:
    db = spanner_emulator.create_database("cdc_pg", [
        "CREATE TABLE orders (id bigint NOT NULL PRIMARY KEY, name varchar, qty bigint, doc jsonb)",
        "CREATE CHANGE STREAM ordersstream FOR orders",
    ], dialect="POSTGRESQL")
    return db, spanner_emulator.database_path("cdc_pg")


@pytest.fixture
def client_factory(
    spanner_emulator: Emulator,
) -> Iterator[Callable[..., SpannerChangeStreamClient]]:
    made: list[SpannerChangeStreamClient] = []

    def make(database: str, **kwargs: Any) -> SpannerChangeStreamClient:
        kwargs.setdefault("retry", RetryPolicy(sleep=lambda s: None))
        client = SpannerChangeStreamClient(database, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


def _dml(db: Any, *statements: str) -> None:
    """Run statements in one transaction."""
    def work(tx: Any) -> None:
        for sql in statements:
            tx.execute_update(sql)

    db.run_in_transaction(work)


def read_all(
    client: ChangeStreamClient, stream: str, start: int, end: int
) -> tuple[list[DataChangeRecord], dict[str, list[ChangeRecord]]]:
    """Follow the stream from the root partition through every child up to ``end``."""
    by_partition: dict[str, list[ChangeRecord]] = {}
    queue: list[tuple[str | None, int]] = [(None, start)]
    seen: set[str] = set()
    while queue:
        token, begin = queue.pop(0)
        records = list(client.read(ChangeStreamQuery(stream, token, begin, end, 500)))
        by_partition[token or INITIAL_PARTITION_TOKEN] = records
        for r in records:
            if isinstance(r, ChildPartitionsRecord):
                for child in r.child_partitions:
                    if child.token not in seen:
                        seen.add(child.token)
                        queue.append((child.token, r.start_timestamp.ns))
    data = [r for rs in by_partition.values() for r in rs if isinstance(r, DataChangeRecord)]
    data.sort(key=lambda r: (r.commit_timestamp.ns, r.record_sequence))
    return data, by_partition


def _after_commits() -> int:
    """A window end that is past every commit made so far. Under load the emulator assigns
    commit timestamps a few ms ahead of this host's clock, so "now" right after a commit
    can still precede it (real Spanner waits out its clock uncertainty at commit)."""
    time.sleep(0.3)
    return Timestamp.now().ns


def _parent_start(partitions: dict[str, list[ChangeRecord]], token: str) -> int:
    """Where ``token`` starts: the start of the ChildPartitionsRecord that named it."""
    return next(
        r.start_timestamp.ns for rs in partitions.values() for r in rs
        if isinstance(r, ChildPartitionsRecord)
        and any(c.token == token for c in r.child_partitions)
    )


# --- reading --------------------------------------------------------------------------------


@pytest.mark.parametrize("vct", CAPTURE_TYPES)
def test_insert_update_delete_per_value_capture_type(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient], vct: str
) -> None:
    db, path = gsql
    client = client_factory(path)
    start = Timestamp.now().ns
    _dml(db, f"INSERT INTO T_{vct} (Id, A, B) VALUES (1, 'a', 10)")
    _dml(db, f"UPDATE T_{vct} SET A = 'b' WHERE Id = 1")
    _dml(db, f"DELETE FROM T_{vct} WHERE Id = 1")
    data, _ = read_all(client, f"S_{vct}", start, _after_commits())
    assert [r.mod_type for r in data] == ["INSERT", "UPDATE", "DELETE"]
    assert {r.value_capture_type for r in data} == {vct}
    assert all(r.table_name == f"T_{vct}" for r in data)
    insert, update, delete = (r.mods[0] for r in data)
    assert insert.keys == {"Id": 1} and insert.new_values == {"A": "a", "B": 10}
    assert update.new_values["A"] == "b"
    assert delete.new_values == {}
    keeps_old = vct in ("OLD_AND_NEW_VALUES", "NEW_ROW_AND_OLD_VALUES")
    assert (update.old_values.get("A") == "a") is keeps_old
    assert (delete.old_values.get("A") == "b") is keeps_old
    if not keeps_old:
        assert update.old_values == {} and delete.old_values == {}
    if vct.startswith("NEW_ROW"):
        assert update.new_values == {"A": "b", "B": 10}
    assert [c.name for c in data[0].column_types] == ["Id", "A", "B"]
    assert data[0].column_types[0].type == {"code": "INT64"}


def test_googlesql_matches_stock_client(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient],
    spanner_emulator: Emulator,
) -> None:
    """The same query through the stock client (default decoding) gives the same records."""
    from google.api_core.datetime_helpers import DatetimeWithNanoseconds
    from google.cloud.spanner_v1 import param_types

    def stock_ts(ns: int) -> Any:  # keeps the nanoseconds in the stock client's params
        return DatetimeWithNanoseconds.from_rfc3339(Timestamp.from_ns(ns).rfc3339())

    db, path = gsql
    client = client_factory(path)
    start = Timestamp.now().ns
    _dml(db, "INSERT INTO Orders (Id, Name, Qty, Doc) VALUES "
             "(1, 'Zoë', 2, JSON '{\"a\":[1,{\"b\":null}]}'), (2, NULL, NULL, NULL)")
    _dml(db, "UPDATE Orders SET Qty = 3 WHERE Id = 1")
    end = _after_commits()
    _, partitions = read_all(client, "OrdersStream", start, end)
    compared = 0
    for token, records in partitions.items():
        if token == INITIAL_PARTITION_TOKEN:
            continue
        with db.snapshot() as snap:
            rows = snap.execute_sql(
                "SELECT ChangeRecord FROM READ_OrdersStream(@s, @e, @t, 500)",
                params={"s": stock_ts(_parent_start(partitions, token)), "e": stock_ts(end - 1),
                        "t": token},
                param_types={"s": param_types.TIMESTAMP, "e": param_types.TIMESTAMP,
                             "t": param_types.STRING},
            )
            stock = [r for row in rows for r in records_from_stock_row(row, token)]
        # heartbeats depend on when a query runs; data and partition records do not
        fast = [r for r in records if not isinstance(r, HeartbeatRecord)]
        assert fast == [r for r in stock if not isinstance(r, HeartbeatRecord)]
        compared += len(fast)
    assert compared >= 2


def test_postgresql_stream(
    pg: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    db, path = pg
    client = client_factory(path)
    info = client.describe_stream("OrdersStream")  # PostgreSQL folds names to lower case
    assert (info.name, info.dialect) == ("ordersstream", "POSTGRESQL")
    start = Timestamp.now().ns
    _dml(db, "INSERT INTO orders (id, name, qty, doc) VALUES (1, 'a', 1, '{\"x\": [1]}')")
    _dml(db, "UPDATE orders SET qty = 2 WHERE id = 1")
    _dml(db, "DELETE FROM orders WHERE id = 1")
    data, _ = read_all(client, "ordersstream", start, _after_commits())
    assert [r.mod_type for r in data] == ["INSERT", "UPDATE", "DELETE"]
    assert data[0].mods[0].new_values == {"name": "a", "qty": 1, "doc": {"x": [1]}}
    assert data[1].mods[0].old_values["qty"] == 1
    assert data[0].column_types[3].type == {"code": "JSON", "type_annotation": "PG_JSONB"}


def test_slice_bounds_keep_nanoseconds(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    """[start, end) is read with end_timestamp = end - 1 ns: exact to the nanosecond."""
    db, path = gsql
    client = client_factory(path)
    start = Timestamp.now().ns
    _dml(db, "INSERT INTO Orders (Id, Name) VALUES (100, 'ns')")
    data, partitions = read_all(client, "OrdersStream", start, _after_commits())
    (record,) = [r for r in data if r.mods[0].keys == {"Id": 100}]
    commit = record.commit_timestamp.ns
    token = record.partition_token
    parent_start = _parent_start(partitions, token)

    def data_in(lo: int, hi: int) -> list[DataChangeRecord]:
        return [r for r in client.read(ChangeStreamQuery("OrdersStream", token, lo, hi))
                if isinstance(r, DataChangeRecord)]

    assert data_in(commit, commit + 1) == [record]
    assert data_in(parent_start, commit) == []
    assert data_in(commit + 1, commit + 1_000_000) == []
    heartbeats = [r for r in client.read(ChangeStreamQuery("OrdersStream", token, commit + 1,
                                                           commit + 1_000_000, 100))
                  if isinstance(r, HeartbeatRecord)]
    assert all(commit + 1 <= record_position(h) < commit + 1_000_000 for h in heartbeats)


def test_child_partitions_appear_as_partitions_churn(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    db, path = gsql
    client = client_factory(path)
    start = Timestamp.now().ns
    for i in range(5):
        _dml(db, f"INSERT INTO Orders (Id, Name) VALUES ({200 + i}, 'churn')")
        time.sleep(1.2)
    end = _after_commits()
    data, partitions = read_all(client, "OrdersStream", start, end)
    assert sorted(r.mods[0].keys["Id"] for r in data if r.mods[0].new_values.get("Name")
                  == "churn") == [200 + i for i in range(5)]
    # partitions other than the root ended inside the window and named their children
    ended = {
        token: r for token, rs in partitions.items() if token != INITIAL_PARTITION_TOKEN
        for r in rs if isinstance(r, ChildPartitionsRecord)
    }
    assert ended, "expected partitions to split or merge within 6 s (they live 2-4 s)"
    for token, r in ended.items():
        assert start <= r.start_timestamp.ns < end
        assert all(token in c.parent_partition_tokens for c in r.child_partitions)
    # records are in commit order within each partition
    for rs in partitions.values():
        positions = [record_position(r) for r in rs]
        assert positions == sorted(positions)


def test_empty_slice_runs_no_query(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    client = client_factory(gsql[1])
    client.transport = _Exploding()
    assert list(client.read(ChangeStreamQuery("OrdersStream", "t", 10, 10))) == []


def test_query_parameters(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    client = client_factory(gsql[1], priority="low", query_timeout=42.0)
    recorder = _Recording(client.transport)
    client.transport = recorder
    now = Timestamp.now().ns
    roots = list(client.read(ChangeStreamQuery("OrdersStream", None, now - 10**6, now, 250)))
    assert roots and {r.partition_token for r in roots} == {INITIAL_PARTITION_TOKEN}
    sql, params, priority, timeout = recorder.calls[-1]
    assert "READ_OrdersStream(start_timestamp => @s, end_timestamp => @e" in sql
    assert params["s"] == ("TIMESTAMP", Timestamp.from_ns(now - 10**6).rfc3339())
    assert params["e"] == ("TIMESTAMP", Timestamp.from_ns(now - 1).rfc3339())
    assert params["t"] == ("STRING", None)
    assert params["h"] == ("INT64", "250")
    assert (priority, timeout) == ("LOW", 42.0)


# --- metadata and errors --------------------------------------------------------------------


def test_describe_stream(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    client = client_factory(gsql[1])
    info = client.describe_stream("OrdersStream")
    assert info.name == "OrdersStream"
    assert info.dialect == "GOOGLE_STANDARD_SQL"
    # the emulator has no partition_mode option: the default is IMMUTABLE_KEY_RANGE
    assert info.partition_mode == "IMMUTABLE_KEY_RANGE"
    assert not info.keys_follow_lineage  # its churn moves keys between unrelated partitions
    assert info.retention_ns == 36 * 3600 * 10**9
    assert client.describe_stream("S_NEW_ROW").retention_ns == 24 * 3600 * 10**9


def test_unknown_stream(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    client = client_factory(gsql[1])
    fix = r"'NoSuchStream' not found.*CREATE CHANGE STREAM"
    with pytest.raises(StreamNotFoundError, match=fix):
        client.describe_stream("NoSuchStream")
    now = Timestamp.now().ns
    with pytest.raises(StreamNotFoundError, match="OrdersStream"):
        list(client.read(ChangeStreamQuery("NoSuchStream", None, now - 10**6, now)))


def test_unknown_database(
    spanner_emulator: Emulator, client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    spanner_emulator.create_instance()
    client = client_factory(spanner_emulator.database_path("no_such_db"))
    with pytest.raises(StreamNotFoundError, match="does not exist: fix the path or create it"):
        client.describe_stream("OrdersStream")


def test_stream_name_is_validated_before_any_sql(
    client_factory: Callable[..., SpannerChangeStreamClient], spanner_emulator: Emulator
) -> None:
    client = client_factory(spanner_emulator.database_path("x"))
    client.transport = _Exploding()
    for bad in ["Orders; DROP TABLE x", "1abc", "", "a-b", "x" * 200]:
        with pytest.raises(StreamNotFoundError, match="not a change stream name"):
            client.read(ChangeStreamQuery(bad, None, 0, 10))
        with pytest.raises(StreamNotFoundError, match="not a change stream name"):
            client.describe_stream(bad)


def test_start_before_retention(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    client = client_factory(gsql[1])
    now = Timestamp.now().ns
    long_ago = now - 3 * 86_400 * 10**9
    before = (r"is before what change stream .OrdersStream. holds .*start later with --reset "
              r".*a changed start_at alone does not move it")
    with pytest.raises(ChangeStreamError, match=before) as err:
        list(client.read(ChangeStreamQuery("OrdersStream", None, long_ago, now)))
    assert isinstance(err.value, UserInputError)  # bad input: the CLI exits 2


def test_foreign_partition_token(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    client = client_factory(gsql[1])
    now = Timestamp.now().ns
    with pytest.raises(ChangeStreamError, match=r"does not belong.*reset the pipeline"):
        list(client.read(ChangeStreamQuery("OrdersStream", "bogus", now - 10**6, now)))


def test_permission_denied_names_the_role(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    sleeps: list[float] = []
    client = client_factory(gsql[1], retry=RetryPolicy(sleep=sleeps.append))
    client.describe_stream("OrdersStream")
    client.transport = _Failing(client.transport, [gexc.PermissionDenied("caller lacks select")])
    now = Timestamp.now().ns
    with pytest.raises(ChangeStreamError, match=r"roles/spanner.databaseReader"):
        list(client.read(ChangeStreamQuery("OrdersStream", None, now - 10**6, now)))
    assert sleeps == []  # permanent errors are not retried


def test_errors_that_are_not_rpc_errors_propagate_unchanged(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    sleeps: list[float] = []
    client = client_factory(gsql[1], retry=RetryPolicy(sleep=sleeps.append))
    client.describe_stream("OrdersStream")
    client.transport = _Failing(client.transport, [KeyError("a bug")])
    now = Timestamp.now().ns
    with pytest.raises(KeyError, match="a bug"):
        list(client.read(ChangeStreamQuery("OrdersStream", None, now - 10**6, now)))
    assert sleeps == []


# --- retries --------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [
    gexc.ServiceUnavailable("try again"),
    gexc.Aborted("aborted"),
    gexc.DeadlineExceeded("deadline"),
    gexc.ResourceExhausted("quota"),
    gexc.InternalServerError("Received RST_STREAM with error code 2"),
])
def test_transient_errors_mid_stream_resume_without_gaps_or_duplicates(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient],
    error: Exception,
) -> None:
    db, path = gsql
    keys = range(300, 340)
    olds = ", ".join(f"({k}, 'old')" for k in keys if k % 2)
    _dml(db, "DELETE FROM Orders WHERE Id >= 300 AND Id < 400",
         f"INSERT INTO Orders (Id, Name) VALUES {olds}")
    start = _after_commits()  # past the setup transaction, which must not be in the window
    # One transaction, an INSERT, an UPDATE and a DELETE record at one commit timestamp in
    # every partition its rows fall in (many rows, so each partition gets all three kinds).
    news = ", ".join(f"({k}, 'r')" for k in keys if not k % 2)
    _dml(db, f"INSERT INTO Orders (Id, Name) VALUES {news}",
         "UPDATE Orders SET Qty = 1 WHERE Id >= 300 AND Id < 400 AND MOD(Id, 4) = 1",
         "DELETE FROM Orders WHERE Id >= 300 AND Id < 400 AND MOD(Id, 4) = 3")
    end = _after_commits()
    clean = client_factory(path)
    _, partitions = read_all(clean, "OrdersStream", start, end)
    token, expected = max(
        ((t, rs) for t, rs in partitions.items() if t != INITIAL_PARTITION_TOKEN),
        key=lambda item: sum(isinstance(r, DataChangeRecord) for r in item[1]),
    )
    expected = [r for r in expected if not isinstance(r, HeartbeatRecord)]
    data = [r for r in expected if isinstance(r, DataChangeRecord)]
    assert {r.mod_type for r in data} == {"INSERT", "UPDATE", "DELETE"}
    assert len({r.commit_timestamp.ns for r in data}) == 1
    parent_start = _parent_start(partitions, token)

    sleeps: list[float] = []
    flaky = client_factory(path, retry=RetryPolicy(attempts=4, initial=0.5, maximum=1.0,
                                                   sleep=sleeps.append))
    flaky.describe_stream("OrdersStream")
    # fail after the first record, then again at once (no progress), then let it through
    failing = _Failing(flaky.transport, [error, error], after_rows=1)
    flaky.transport = failing
    got = list(flaky.read(ChangeStreamQuery("OrdersStream", token, parent_start, end, 500)))
    assert [r for r in got if not isinstance(r, HeartbeatRecord)] == expected
    assert len(sleeps) == 2 and all(0 <= s <= 1.0 for s in sleeps)
    # the retry re-read from the last consumed position, not from the slice start
    starts = [params["s"][1] for _, params, _, _ in failing.calls]
    first = record_position(got[0])
    assert starts[0] == Timestamp.from_ns(parent_start).rfc3339()
    assert starts[1] == Timestamp.from_ns(first).rfc3339()


def test_retries_are_bounded(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    sleeps: list[float] = []
    client = client_factory(gsql[1], retry=RetryPolicy(attempts=3, sleep=sleeps.append))
    client.describe_stream("OrdersStream")
    client.transport = _Failing(client.transport, [gexc.ServiceUnavailable("down")] * 10)
    now = Timestamp.now().ns
    with pytest.raises(TransientError, match=r"after 3 attempts.*UNAVAILABLE"):
        list(client.read(ChangeStreamQuery("OrdersStream", None, now - 10**6, now)))
    assert len(sleeps) == 2


def test_session_not_found_gets_a_new_session(
    gsql: tuple[Any, str], client_factory: Callable[..., SpannerChangeStreamClient]
) -> None:
    client = client_factory(gsql[1])
    client.describe_stream("OrdersStream")
    failing = _Failing(client.transport, [gexc.NotFound("Session not found: s1")])
    client.transport = failing
    now = Timestamp.now().ns
    got = list(client.read(ChangeStreamQuery("OrdersStream", None, now - 10**6, now)))
    assert got and all(isinstance(r, ChildPartitionsRecord) for r in got)
    assert failing.resets == 1


class _Longest(random.Random):
    def uniform(self, a: float, b: float) -> float:
        return b


def test_a_run_asked_to_stop_gives_a_failing_read_up_instead_of_retrying_it() -> None:
    """Once the run is asked to stop, a read that fails is not tried again, and a stop
    that comes during the backoff ends the wait: the run stops, the next run reads."""
    t = Timestamp.parse("2024-05-01T12:00:00Z").ns
    records: list[ChangeRecord] = [_data(i, t + i, f"t{i}") for i in range(4)]
    sleeps: list[float] = []
    client = SpannerChangeStreamClient(
        "projects/p/instances/i/databases/d",
        retry=RetryPolicy(attempts=6, initial=3.0, maximum=3.0, sleep=sleeps.append,
                          rng=_Longest()),
    )
    scripted = ScriptedTransport(records, fail_after=[2, 2, 2])
    client.transport = scripted
    query = ChangeStreamQuery("S", "tok", t, t + 100, stopping=lambda: True)
    got: list[ChangeRecord] = []
    with pytest.raises(TransientError, match="given up, as the run was asked to stop"):
        got.extend(client.read(query))
    assert got == records[:2] and len(scripted.queries) == 1 and sleeps == []

    # the stop comes while the retry waits out its 3 s: it waits no longer
    scripted = ScriptedTransport(records, fail_after=[2, 2, 2])
    client.transport = scripted
    query = ChangeStreamQuery("S", "tok", t, t + 100, stopping=lambda: len(sleeps) >= 2)
    with pytest.raises(TransientError, match="given up"):
        list(client.read(query))
    assert len(scripted.queries) == 1 and len(sleeps) == 2 and sum(sleeps) < 3.0


# --- dedupe across retries, exactly (scripted transport) ------------------------------------


def _data(seq: int, ts: int, txn: str) -> DataChangeRecord:
    from cdcflow.model import Mod

    return DataChangeRecord("tok", ts, f"{seq:08d}", txn, True, "T", [],
                            [Mod({"Id": seq})], "INSERT", "NEW_ROW", 1, 1)


def test_resume_skips_exactly_what_was_consumed_at_a_shared_timestamp() -> None:
    t = Timestamp.parse("2024-05-01T12:00:00.000000100Z").ns
    records: list[ChangeRecord] = [
        _data(0, t, "a"), _data(1, t + 5, "b"), HeartbeatRecord("tok", t + 5),
        _data(2, t + 5, "b"), _data(0, t + 5, "c"), _data(3, t + 9, "d"),
    ]
    client = SpannerChangeStreamClient(
        "projects/p/instances/i/databases/d", retry=RetryPolicy(sleep=lambda s: None)
    )
    # fail after 3 rows (inside the shared timestamp), then after 1 row of the re-read
    scripted = ScriptedTransport(records, fail_after=[3, 1])
    client.transport = scripted
    got = list(client.read(ChangeStreamQuery("S", "tok", t, t + 100)))
    assert got == records
    assert [q.start for q in scripted.queries] == [t, t + 5, t + 5]


@pytest.mark.parametrize(("rows_per_message", "fail_after"), [
    (1, [3, 1]), (2, [1, 1]), (2, [2, 0, 1]), (3, [1, 1]), (4, [1]), (6, [0, 1]),
])
def test_resume_after_messages_of_many_records_gives_each_record_once(
    rows_per_message: int, fail_after: list[int],
) -> None:
    # A read gives a message's records as one run; a failure (between messages) re-reads
    # from the last position given, without what was given there, also when the records
    # at that position span messages or share one with records before them.
    t = Timestamp.parse("2024-05-01T12:00:00.000000100Z").ns
    records: list[ChangeRecord] = [
        _data(0, t, "a"), _data(1, t + 5, "b"), HeartbeatRecord("tok", t + 5),
        _data(2, t + 5, "b"), _data(0, t + 5, "c"), _data(3, t + 9, "d"), _data(4, t + 9, "d"),
        HeartbeatRecord("tok", t + 12), _data(0, t + 20, "e"),
    ]
    client = SpannerChangeStreamClient(
        "projects/p/instances/i/databases/d", retry=RetryPolicy(sleep=lambda s: None)
    )
    scripted = ScriptedTransport(records, fail_after=fail_after,
                                 rows_per_message=rows_per_message)
    client.transport = scripted
    got = list(client.read(ChangeStreamQuery("S", "tok", t, t + 20)))

    def data_of(rs: list[ChangeRecord]) -> list[ChangeRecord]:
        return [r for r in rs if isinstance(r, DataChangeRecord)]

    assert data_of(got) == data_of(records[:-1])  # the last is at the end: not in the read
    # a heartbeat at the position a re-read starts from is dropped (it says nothing new)
    assert [r for r in got if isinstance(r, HeartbeatRecord)] in (
        [records[2], records[7]], [records[7]],
    )
    assert len(scripted.queries) == len(fail_after) + 1


@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def test_mutable_key_range_reads_30_minute_windows_until_the_partition_ends(
    dialect: str,
) -> None:
    from cdcflow.model import (
        ColumnType,
        Mod,
        MoveInEvent,
        PartitionEndRecord,
        PartitionEventRecord,
        PartitionStartRecord,
    )

    minute = 60 * 10**9
    t0 = Timestamp.parse("2024-05-01T12:00:00.000000001Z").ns

    def at(minutes: int) -> Timestamp:
        return Timestamp.from_ns(t0 + minutes * minute)

    records: list[ChangeRecord] = [
        PartitionStartRecord("tok", at(0), "00000000", ("p1",)),
        DataChangeRecord("tok", at(10), "00000001", "txn", True, "T",
                         [ColumnType("Id", {"code": "INT64"}, True, 1),
                          ColumnType("A", {"code": "STRING"}, False, 2)],
                         [Mod({"Id": 1}, {"A": "x"})], "INSERT", "NEW_VALUES", 1, 1),
        PartitionEventRecord("tok", at(40), "00000002", [MoveInEvent("src")]),
        HeartbeatRecord("tok", at(50)),
        PartitionEndRecord("tok", at(61), "00000003"),
        HeartbeatRecord("tok", at(95)),  # past the end: never read
    ]
    client = SpannerChangeStreamClient("projects/p/instances/i/databases/d")
    scripted = ScriptedTransport(
        records, stream="s", dialect=dialect,  # type: ignore[arg-type]
        partition_mode="MUTABLE_KEY_RANGE", retention="7d",
    )
    client.transport = scripted
    assert client.describe_stream("S").partition_mode == "MUTABLE_KEY_RANGE"
    got = list(client.read(ChangeStreamQuery("S", "tok", t0, t0 + 100 * minute)))
    assert got == records[:-1]
    windows = [(q.start - t0, (q.end or 0) - t0) for q in scripted.queries]
    assert windows == [(0, 30 * minute - 1), (30 * minute, 60 * minute - 1),
                       (60 * minute, 90 * minute - 1)]
    function = "READ_s(" if dialect == "GOOGLE_STANDARD_SQL" else "spanner.read_proto_bytes_s("
    assert all(function in q.sql for q in scripted.queries)


class _Roomy(ScriptedTransport):
    """Refuses, with RESOURCE_EXHAUSTED, a change stream query whose window holds more
    than ``room`` records (as the emulator does past 128 MB), after ``given`` messages."""

    def __init__(self, records: list[ChangeRecord], room: int, given: int = 0) -> None:
        super().__init__(records)
        self.room, self.given = room, given
        self.refused = 0

    def execute_streaming_sql(
        self, sql: str, params: Mapping[str, Param], *, priority: str, timeout: float,
        idle: float | None = None,
    ) -> Iterator[Any]:
        answer = super().execute_streaming_sql(sql, params, priority=priority,
                                               timeout=timeout, idle=idle)
        if "READ_" not in sql:
            return answer
        q = self.queries[-1]
        held = sum(q.start <= record_position(r) <= (q.end or q.start) for r in self.records)
        if held <= self.room:
            return answer
        self.refused += 1
        return self._refuse(answer)

    def _refuse(self, answer: Iterator[Any]) -> Iterator[Any]:
        for _ in range(self.given):
            yield next(answer)
        raise gexc.ResourceExhausted("Out of memory for MemoryAccountant")


@pytest.mark.parametrize("given", [0, 1])
def test_a_refused_window_is_read_in_narrower_windows_without_a_failed_attempt(
    given: int,
) -> None:
    second = 10**9
    t = Timestamp.parse("2024-05-01T12:00:00Z").ns
    records: list[ChangeRecord] = [_data(i, t + i * second // 10, f"x{i}") for i in range(100)]
    end = ChildPartitionsRecord("tok", t + 11 * second, "00000100", [])
    past = _data(101, t + 12 * second, "late")  # after the partition's end: never read
    sleeps: list[float] = []
    # one attempt: a refusal that narrows the window is not a failed attempt
    client = SpannerChangeStreamClient(
        "projects/p/instances/i/databases/d", retry=RetryPolicy(attempts=1, sleep=sleeps.append)
    )
    roomy = _Roomy([*records, end, past], room=12, given=given)
    client.transport = roomy
    got = list(client.read(ChangeStreamQuery("S", "tok", t, t + 60 * second)))
    assert got == [*records, end]
    assert roomy.refused >= 3 and len(sleeps) == roomy.refused
    windows = [(q.start, q.end) for q in roomy.queries if "READ_" in q.sql]
    # from the slice's start, no window begins past the partition's end
    assert windows[0][0] == t
    assert all(start <= record_position(end) for start, _ in windows)
    # a read window (not refused) is followed by the next one at its end, twice as wide
    answered = [(a, b) for a, b in windows if b is not None and
                sum(a <= record_position(r) <= b for r in records) <= 12]
    assert any((b + 1, b + 1 + 2 * (b + 1 - a) - 1) in windows for a, b in answered)
    # the client's next read starts at the widest window it saw answered: no refusal
    roomy.refused = 0
    again = list(client.read(ChangeStreamQuery("S", "tok", t, t + second)))
    assert again == records[:10]
    assert roomy.refused == 0


def test_a_window_that_cannot_narrow_fails_as_any_refusal_with_its_advice() -> None:
    t = Timestamp.parse("2024-05-01T12:00:00Z").ns
    # all at one commit timestamp: no window narrower than a millisecond holds less
    records: list[ChangeRecord] = [_data(i, t, f"x{i}") for i in range(20)]
    client = SpannerChangeStreamClient(
        "projects/p/instances/i/databases/d",
        retry=RetryPolicy(attempts=2, sleep=lambda s: None),
    )
    client.transport = _Roomy(records, room=5)
    with pytest.raises(TransientError, match=r"after 2 attempts .*RESOURCE_EXHAUSTED"):
        list(client.read(ChangeStreamQuery("S", "tok", t, t + 10**9)))


# --- caching and pickling -------------------------------------------------------------------


def test_cached_client_is_lazy_and_per_arguments() -> None:
    path = "projects/nowhere/instances/none/databases/nothing"
    a = cached_client(path)
    assert cached_client(path) is a
    assert cached_client(path, priority="HIGH") is not a
    assert cached_client(path, query_timeout=5) is not a
    assert isinstance(a, ChangeStreamClient)


def test_pickling_carries_only_the_arguments() -> None:
    path = "projects/nowhere/instances/none/databases/pickled"
    client = cached_client(path, priority="LOW", query_timeout=30)
    assert pickle.loads(pickle.dumps(client)) is client
    fresh = SpannerChangeStreamClient(path, priority="LOW", query_timeout=30)
    restored = pickle.loads(pickle.dumps(fresh))
    assert restored is client


def test_bad_arguments() -> None:
    with pytest.raises(StreamNotFoundError, match="projects/PROJECT/instances"):
        SpannerChangeStreamClient("shop")
    with pytest.raises(ValueError, match="LOW, MEDIUM, HIGH"):
        SpannerChangeStreamClient("projects/p/instances/i/databases/d", priority="urgent")
    with pytest.raises(ValueError, match="positive"):
        SpannerChangeStreamClient("projects/p/instances/i/databases/d", query_timeout=0)


# --- transport wrappers ---------------------------------------------------------------------


class _Recording:
    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, dict[str, Param], str, float]] = []
        self.resets = 0

    def execute_streaming_sql(
        self, sql: str, params: Mapping[str, Param], *, priority: str, timeout: float,
        idle: float | None = None,
    ) -> Iterator[Any]:
        self.calls.append((sql, dict(params), priority, timeout))
        return self.inner.execute_streaming_sql(sql, params, priority=priority, timeout=timeout,
                                                idle=idle)

    def reset_session(self) -> None:
        self.resets += 1
        self.inner.reset_session()

    def close(self) -> None:
        self.inner.close()


class _Failing(_Recording):
    """Raises the given errors, one per change stream call, after ``after_rows`` rows."""

    def __init__(self, inner: Any, errors: list[Exception], after_rows: int = 0) -> None:
        super().__init__(inner)
        self.errors = list(errors)
        self.after_rows = after_rows

    def execute_streaming_sql(
        self, sql: str, params: Mapping[str, Param], *, priority: str, timeout: float,
        idle: float | None = None,
    ) -> Iterator[Any]:
        stream = super().execute_streaming_sql(sql, params, priority=priority, timeout=timeout,
                                               idle=idle)
        if "READ_" not in sql or not self.errors:
            return stream
        error = self.errors.pop(0)
        return self._fail(stream, error)

    def _fail(self, stream: Iterator[Any], error: Exception) -> Iterator[Any]:
        rows = 0
        for prs in _one_row_per_message(stream):
            if rows >= self.after_rows:
                raise error
            rows += len(prs.values)
            yield prs
        raise error


def _one_row_per_message(stream: Iterator[Any]) -> Iterator[Any]:
    """Split the emulator's multi-row messages so a failure can land between rows (the
    transport answers serialized messages: split ones are protobuf messages)."""
    from google.cloud.spanner_v1.types import PartialResultSet

    for prs in stream:
        if isinstance(prs, bytes):
            prs = PartialResultSet.pb().FromString(prs)
        if prs.chunked_value or len(prs.values) <= 1:
            yield prs
            continue
        for i, value in enumerate(prs.values):
            single = type(prs)()
            if i == 0:
                single.metadata.CopyFrom(prs.metadata)
            single.values.append(value)
            yield single


class _Exploding:
    def execute_streaming_sql(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        raise AssertionError("no query may run")

    def reset_session(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("error", "advice"), [
    (lambda: gexc.ResourceExhausted("Query result too large"), "out of capacity or quota"),
    (lambda: gexc.ServiceUnavailable("connection reset"), "check the network path"),
])
def test_spent_retries_name_the_fix_for_their_status(
    error: Callable[[], BaseException], advice: str
) -> None:
    t = Timestamp.parse("2024-01-01T00:00:00Z").ns
    records = [HeartbeatRecord("tok", t + i) for i in range(3)]
    client = SpannerChangeStreamClient(
        "projects/p/instances/i/databases/d",
        retry=RetryPolicy(attempts=2, sleep=lambda s: None),
    )
    client.transport = ScriptedTransport(records, fail_after=[0, 0, 0], error=error)
    with pytest.raises(TransientError, match=advice) as info:
        list(client.read(ChangeStreamQuery("S", "tok", t, t + 10)))
    assert "after 2 attempts" in str(info.value)


def test_a_transport_written_before_the_stop_check_is_called_as_then() -> None:
    """A transport whose execute_streaming_sql takes no ``stopping`` (the Transport seam
    before it had one) still reads for a run that has a stop check."""

    class Older(ScriptedTransport):
        def execute_streaming_sql(  # type: ignore[override]
            self, sql: str, params: Mapping[str, Param], *, priority: str, timeout: float,
            idle: float | None = None,
        ) -> Iterator[Any]:
            return super().execute_streaming_sql(sql, params, priority=priority,
                                                 timeout=timeout, idle=idle)

    t = Timestamp.parse("2024-05-01T12:00:00Z").ns
    records: list[ChangeRecord] = [_data(i, t + i, f"t{i}") for i in range(3)]
    client = SpannerChangeStreamClient("projects/p/instances/i/databases/d")
    client.transport = Older(records)
    query = ChangeStreamQuery("S", "tok", t, t + 100, stopping=lambda: False)
    assert list(client.read(query)) == records
