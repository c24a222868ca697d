"""Transient error classification, and the retry policy the Spanner code uses (the
change stream client against a scripted transport: no emulator, no real time)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import pytest
from google.api_core import exceptions as gexc
from google.cloud.spanner_v1.types import PartialResultSet, TypeCode
from google.protobuf.struct_pb2 import Value

from cdcflow import backoff
from cdcflow.backoff import RetryPolicy
from cdcflow.errors import TransientError
from cdcflow.spanner import retry as spanner_retry
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.retry import TRANSIENT_CODES, is_transient, status_name
from cdcflow.spanner.transport import Param
from cdcflow.stream import ChangeStreamQuery


@pytest.mark.parametrize(("error", "transient"), [
    (gexc.ServiceUnavailable("x"), True),
    (gexc.Aborted("x"), True),
    (gexc.DeadlineExceeded("x"), True),
    (gexc.ResourceExhausted("x"), True),
    (gexc.InternalServerError("Received unexpected EOS on DATA frame from server"), True),
    (gexc.InternalServerError("stream terminated by RST_STREAM with error code: 2"), True),
    (gexc.InternalServerError("a bug in the server"), False),
    (gexc.PermissionDenied("x"), False),
    (gexc.InvalidArgument("x"), False),
    (gexc.NotFound("x"), False),
    (ValueError("x"), False),
])
def test_is_transient(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient


def test_transient_codes_are_the_ones_the_design_names() -> None:
    expected = {"UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
    assert expected == TRANSIENT_CODES


def test_the_policy_is_the_one_in_cdcflow_backoff() -> None:
    assert spanner_retry.RetryPolicy is backoff.RetryPolicy  # older imports keep working


def test_status_name_of_raw_grpc_errors() -> None:
    class RawError(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAVAILABLE

        def details(self) -> str:
            return "socket closed"

    assert status_name(RawError()) == "UNAVAILABLE"
    assert is_transient(RawError())


def test_full_jitter_stays_under_the_capped_exponential() -> None:
    policy = RetryPolicy(initial=0.1, maximum=1.0, multiplier=2.0, rng=random.Random(7))
    for retry, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (30, 1.0)]:
        delays = [policy.delay(retry) for _ in range(200)]
        assert all(0.0 <= d <= cap for d in delays)
        assert max(delays) > cap * 0.8  # jitter spans the range, not a fixed value


def test_backoff_sleeps_the_delay() -> None:
    slept: list[float] = []
    policy = RetryPolicy(initial=1.0, sleep=slept.append, rng=random.Random(1))
    policy.backoff(3)
    assert len(slept) == 1 and 0 <= slept[0] <= 4.0


@pytest.mark.parametrize("kwargs", [{"attempts": 0}, {"initial": -1}, {"multiplier": 0.5}])
def test_bad_policies(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


# --- the change stream client keeps its loop, with the policy's bounds -----------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _answer(rows: list[list[str]], width: int) -> Any:
    """One PartialResultSet holding ``rows`` of STRING columns."""
    pb = PartialResultSet.pb(PartialResultSet(metadata={"row_type": {"fields": [
        {"name": f"c{i}", "type_": {"code": TypeCode.STRING}} for i in range(width)
    ]}}))
    pb.values.extend(Value(string_value=v) for row in rows for v in row)
    return pb


class _Down:
    """A Transport (the client's test seam) that knows stream ``S`` but fails its change
    stream queries with UNAVAILABLE, each after ``took`` seconds of ``clock``; with
    ``metadata_down`` the metadata queries fail too (at once)."""

    def __init__(self, clock: _Clock, took: float, *, metadata_down: bool = False) -> None:
        self.clock, self.took, self.metadata_down = clock, took, metadata_down
        self.reads: list[float] = []
        self.metadata_calls = 0

    def execute_streaming_sql(self, sql: str, params: Mapping[str, Param], *, priority: str,
                              timeout: float, idle: float | None = None) -> Iterator[Any]:
        if "READ_" in sql:
            self.reads.append(self.clock.now)
            self.clock.now += self.took
            raise gexc.ServiceUnavailable("socket closed")
        self.metadata_calls += 1
        if self.metadata_down:
            raise gexc.ServiceUnavailable("socket closed")
        if "database_options" in sql:
            return iter([_answer([["GOOGLE_STANDARD_SQL"]], 1)])
        if "change_stream_options" in sql:
            return iter([_answer([], 2)])
        return iter([_answer([["S"]], 1)])

    def reset_session(self) -> None:
        pass

    def close(self) -> None:
        pass


def _client(clock: _Clock, transport: _Down, **bounds: float) -> SpannerChangeStreamClient:
    policy = RetryPolicy(initial=0.0, sleep=clock.sleep, clock=lambda: clock.now,
                         **bounds)  # type: ignore[arg-type]
    client = SpannerChangeStreamClient("projects/p/instances/i/databases/d", retry=policy)
    client.transport = transport
    return client


def test_the_reader_stops_retrying_at_the_policy_deadline() -> None:
    clock = _Clock()
    down = _Down(clock, took=1.0)
    client = _client(clock, down, attempts=100, deadline=2.5)
    with pytest.raises(TransientError, match=r"after 3 attempts \(UNAVAILABLE: socket closed"):
        list(client.read(ChangeStreamQuery("S", None, 10**18, 10**18 + 10**9)))
    assert down.reads == [0.0, 1.0, 2.0]  # a fourth would start at 3.0, past 2.5


def test_metadata_queries_retry_under_the_same_policy() -> None:
    clock = _Clock()
    down = _Down(clock, took=0.0, metadata_down=True)
    client = _client(clock, down, attempts=4)
    with pytest.raises(TransientError, match=r"after 4 attempts \(UNAVAILABLE"):
        client.describe_stream("S")
    assert down.metadata_calls == 4 and len(clock.slept) == 3


@pytest.mark.parametrize("emulator", ["10.0.0.9:9010", None])
def test_a_web_server_at_the_endpoint_is_a_configuration_error(
    emulator: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host:port where an HTTP server that is not Spanner answers (gRPC: UNIMPLEMENTED,
    'Received http2 header with status: 404'): one line naming the setting, exit 2."""
    from cdcflow.errors import ConfigurationError
    from cdcflow.spanner.translate import translate

    if emulator is None:
        monkeypatch.delenv("SPANNER_EMULATOR_HOST", raising=False)
    else:
        monkeypatch.setenv("SPANNER_EMULATOR_HOST", emulator)
    error = gexc.MethodNotImplemented(
        "Received http2 header with status: 404. This usually indicates that the "
        "'api_endpoint' configuration in ClientOptions is incorrect"
    )
    translated = translate(error, "projects/p/instances/i/databases/d", None)
    assert isinstance(translated, ConfigurationError)
    where = f"SPANNER_EMULATOR_HOST={emulator}" if emulator else "the Spanner endpoint"
    assert str(translated) == (f"{where} answered as a web server, not Spanner (HTTP status "
                               "404): fix the host:port")


def test_query_retries_log_one_line_per_window_and_level_and_count_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An outage fails every partition's read at once, again and again: the log gets one
    line per 10 s and level, the next saying how many it left out, not a line each."""
    import logging

    from cdcflow.spanner.retry import RetryLog

    now = [0.0]
    log = RetryLog(logging.getLogger("cdcflow.test.retries"), window=10.0,
                   clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="cdcflow.test.retries"):
        for partition in range(30):  # 30 reads fail within a second
            log.log(logging.WARNING, "the read of %s failed", f"p{partition}")
            log.log(logging.INFO, "the first failure of %s", f"p{partition}")
            now[0] += 0.03
        now[0] = 10.5
        log.log(logging.WARNING, "the read of %s failed", "p7")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.WARNING, "the read of p0 failed"),
        (logging.INFO, "the first failure of p0"),
        (logging.WARNING, "the read of p7 failed (and 29 more failed change stream queries "
                          "since the last such line)"),
    ]
