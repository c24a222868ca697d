"""What change stream queries cost: the reader's QueryStats, measured on a scripted wire
(ScriptedTransport) so failures land exactly where a test wants them."""

from __future__ import annotations

import time

import pytest
from google.api_core import exceptions as gexc

from cdcflow.errors import ChangeStreamError
from cdcflow.model import ChangeRecord, DataChangeRecord, Mod, Timestamp
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.retry import QUERY_BUCKETS, QueryStats, RetryPolicy, query_bucket_labels
from cdcflow.stream import ChangeStreamQuery
from cdcflow.testing import ScriptedTransport

T = Timestamp.parse("2024-05-01T12:00:00Z").ns


def _records(n: int) -> list[ChangeRecord]:
    return [
        DataChangeRecord("tok", T + i, f"{i:08d}", f"tx{i}", True, "T", [], [Mod({"Id": i})],
                         "INSERT", "NEW_ROW", 1, 1)
        for i in range(n)
    ]


def _client(transport: ScriptedTransport) -> SpannerChangeStreamClient:
    client = SpannerChangeStreamClient(
        "projects/p/instances/i/databases/d", retry=RetryPolicy(sleep=lambda s: None)
    )
    client.transport = transport
    return client


def _buckets(counters: dict[str, int], kind: str) -> int:
    return sum(v for k, v in counters.items() if k.startswith(f"{kind}/"))


def test_every_query_and_every_retried_error_is_counted() -> None:
    records = _records(6)
    # the first query fails after 3 rows, the second after 1, the third runs clean
    client = _client(ScriptedTransport(records, fail_after=[3, 1]))
    reading = client.read(ChangeStreamQuery("S", "tok", T, T + 100))
    assert list(reading) == records
    counters = reading.counters()
    assert counters["spanner_queries"] == 3
    assert counters["spanner_errors/UNAVAILABLE"] == 2
    assert _buckets(counters, "spanner_query_seconds") == 3
    assert _buckets(counters, "spanner_first_response_seconds") == 3
    assert 0 < counters["spanner_first_response_us"] <= counters["spanner_query_us"]
    # a scripted wire answers at once: every query lands in the small buckets (a loaded
    # machine may take more than the smallest, 10 ms, now and then)
    fast = [b for b in QUERY_BUCKETS if b <= 0.25]
    assert sum(counters.get(f"spanner_query_seconds/{b}", 0) for b in fast) == 3


def test_time_the_caller_holds_records_is_not_the_query_s() -> None:
    client = _client(ScriptedTransport(_records(5)))
    reading = client.read(ChangeStreamQuery("S", "tok", T, T + 100))
    held = time.perf_counter()
    for _ in reading:
        time.sleep(0.05)
    held = time.perf_counter() - held
    counters = reading.counters()
    assert held >= 0.25
    assert counters["spanner_queries"] == 1
    assert counters["spanner_query_us"] < 50_000, counters


def test_an_abandoned_read_counts_its_query_up_to_the_last_record_taken() -> None:
    client = _client(ScriptedTransport(_records(5)))
    reading = client.read(ChangeStreamQuery("S", "tok", T, T + 100))
    assert next(reading) is not None
    time.sleep(0.2)  # the caller works on the record, then stops reading (a claim failed)
    counters = reading.counters()
    assert counters["spanner_queries"] == 1
    assert counters["spanner_query_us"] < 100_000, counters
    with pytest.raises(StopIteration):
        next(reading)  # counters() ended the read


def test_errors_are_counted_by_grpc_code_also_when_they_end_the_read() -> None:
    denied = _client(ScriptedTransport(_records(3), fail_after=[1],
                                       error=lambda: gexc.PermissionDenied("no")))
    reading = denied.read(ChangeStreamQuery("S", "tok", T, T + 100))
    with pytest.raises(ChangeStreamError, match="permission denied"):
        list(reading)
    counters = reading.counters()
    assert counters["spanner_queries"] == 1
    assert [k for k in counters if k.startswith("spanner_errors")] == [
        "spanner_errors/PERMISSION_DENIED"
    ]
    assert counters["spanner_errors/PERMISSION_DENIED"] == 1
    # an error that is not an RPC error is cdcflow's or a bug, not Spanner's: not counted
    broken = _client(ScriptedTransport(_records(3), fail_after=[1],
                                       error=lambda: ValueError("bug")))
    reading = broken.read(ChangeStreamQuery("S", "tok", T, T + 100))
    with pytest.raises(ValueError, match="bug"):
        list(reading)
    counters = reading.counters()
    assert counters["spanner_queries"] == 1
    assert not [k for k in counters if k.startswith("spanner_errors")]


def test_an_empty_slice_runs_and_counts_no_query() -> None:
    client = _client(ScriptedTransport(_records(1)))
    reading = client.read(ChangeStreamQuery("S", "tok", T, T))
    assert list(reading) == []
    assert reading.counters() == {}


def test_buckets_follow_prometheus_le() -> None:
    stats = QueryStats()
    stats.query(QUERY_BUCKETS[2], None)  # on a bound: in that bucket (le means <=)
    stats.query(QUERY_BUCKETS[2] + 1e-9, 0.0)
    stats.query(10_000.0, None)
    labels = query_bucket_labels()
    assert labels[-1] == "+Inf" and len(labels) == len(QUERY_BUCKETS) + 1
    assert stats.counters[f"spanner_query_seconds/{labels[2]}"] == 1
    assert stats.counters[f"spanner_query_seconds/{labels[3]}"] == 1
    assert stats.counters["spanner_query_seconds/+Inf"] == 1
    assert stats.counters[f"spanner_first_response_seconds/{labels[0]}"] == 1
    assert stats.counters["spanner_queries"] == 3
