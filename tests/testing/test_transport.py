"""ScriptedTransport: the real Spanner reader decodes, resumes and windows over records
served in Spanner's wire protocol, with no server."""

from __future__ import annotations

import pytest

from cdcflow.errors import TransientError
from cdcflow.model import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    Timestamp,
)
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.retry import RetryPolicy
from cdcflow.stream import ChangeStreamQuery
from cdcflow.testing import ScriptedQuery, ScriptedTransport

DB = "projects/p/instances/i/databases/d"
T = Timestamp.parse("2024-05-01T12:00:00.000000100Z").ns
COLUMNS = [ColumnType("Id", {"code": "INT64"}, True, 1),
           ColumnType("Name", {"code": "STRING"}, False, 2)]


def data(seq: int, ts: int, name: str = "x") -> DataChangeRecord:
    return DataChangeRecord("tok", ts, f"{seq:08d}", f"txn{seq}", True, "Orders", COLUMNS,
                            [Mod({"Id": seq}, {"Name": name})], "INSERT",
                            "NEW_VALUES", 1, 1)


RECORDS: list[ChangeRecord] = [
    data(0, T), data(1, T + 10), HeartbeatRecord("tok", T + 20), data(2, T + 30, "y" * 50),
    ChildPartitionsRecord("tok", T + 40, "00000003", [ChildPartition("c", ("tok",))]),
]


def client_with(transport: ScriptedTransport) -> SpannerChangeStreamClient:
    client = SpannerChangeStreamClient(DB, retry=RetryPolicy(attempts=3, sleep=lambda s: None))
    client.transport = transport
    return client


@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
@pytest.mark.parametrize("chunk", [False, True])
def test_the_reader_decodes_what_is_served(dialect: str, chunk: bool) -> None:
    transport = ScriptedTransport(RECORDS, stream="Orders_S", dialect=dialect,  # type: ignore[arg-type]
                                  chunk=chunk)
    client = client_with(transport)
    info = client.describe_stream("orders_s")  # names match case-insensitively
    assert (info.name, info.dialect, info.partition_mode) == (
        "Orders_S", dialect, "IMMUTABLE_KEY_RANGE"
    )
    got = list(client.read(ChangeStreamQuery("orders_s", "tok", T, T + 100)))
    assert got == RECORDS
    assert transport.queries == [ScriptedQuery(transport.queries[0].sql, "tok", T, T + 99)]


def test_a_query_gets_the_records_of_its_inclusive_range() -> None:
    transport = ScriptedTransport(RECORDS)
    got = list(client_with(transport).read(ChangeStreamQuery("S", "tok", T + 10, T + 31)))
    assert got == RECORDS[1:4]
    assert (transport.queries[0].start, transport.queries[0].end) == (T + 10, T + 30)


def test_fail_after_drops_the_connection_and_the_reader_resumes() -> None:
    transport = ScriptedTransport(RECORDS, fail_after=[2, 0])
    got = list(client_with(transport).read(ChangeStreamQuery("S", "tok", T, T + 100)))
    assert got == RECORDS
    # the re-reads start where the reader had got to, not at the slice start
    assert [q.start for q in transport.queries] == [T, T + 10, T + 10]


def test_failures_past_the_retry_bound_surface() -> None:
    transport = ScriptedTransport(RECORDS, fail_after=[0, 0, 0])
    with pytest.raises(TransientError, match="after 3 attempts"):
        list(client_with(transport).read(ChangeStreamQuery("S", "tok", T, T + 100)))
    assert len(transport.queries) == 3


def test_a_custom_error_and_session_resets_are_recorded() -> None:
    from google.api_core import exceptions

    transport = ScriptedTransport(
        RECORDS, fail_after=[1], error=lambda: exceptions.NotFound("Session not found: s1")
    )
    client = client_with(transport)
    assert list(client.read(ChangeStreamQuery("S", "tok", T, T + 100))) == RECORDS
    assert transport.resets == 1
    client.close()
    assert transport.closed


def test_options_describe_the_stream() -> None:
    transport = ScriptedTransport([], partition_mode="MUTABLE_KEY_RANGE", retention="2d")
    info = client_with(transport).describe_stream("S")
    assert info.partition_mode == "MUTABLE_KEY_RANGE"
    assert info.retention_ns == 2 * 86_400 * 10**9


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"dialect": "MYSQL"}, "GOOGLE_STANDARD_SQL or POSTGRESQL"),
        ({"partition_mode": "ANY"}, "IMMUTABLE_KEY_RANGE or MUTABLE_KEY_RANGE"),
        ({"fail_after": [-1]}, "0 or more"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ScriptedTransport([], **kwargs)  # type: ignore[arg-type]
