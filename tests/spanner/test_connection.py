"""Connection: a call past its deadline retires the API it went out on; the next calls
go out on a new connection. (On the emulator, through a proxy whose connections go dead:
tests/faults/test_detection.py.)"""

from __future__ import annotations

import time
from typing import Any

import pytest

from cdcflow.spanner import connection as conn_module
from cdcflow.spanner.connection import STREAM_WINDOW, Connection, connection_api, past_deadline


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class _Api:
    def __init__(self, n: int) -> None:
        self.n = n
        self.transport = _Transport()


class _Clock:
    def __init__(self, now: list[float]) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now[0]


@pytest.fixture
def now(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The connection module's monotonic clock, set by the test: ``now[0] += 5``."""
    clock = [1000.0]
    monkeypatch.setattr(conn_module, "time", _Clock(clock))
    return clock


def _deadline() -> Exception:
    from google.api_core.exceptions import DeadlineExceeded

    return DeadlineExceeded("no answer")  # type: ignore[no-untyped-call]


def _unavailable() -> Exception:
    from google.api_core.exceptions import ServiceUnavailable

    return ServiceUnavailable("refused")  # type: ignore[no-untyped-call]


def test_past_deadline_knows_api_core_and_grpc_errors() -> None:
    import grpc

    class RpcError(grpc.RpcError):  # type: ignore[misc]
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DEADLINE_EXCEEDED

    assert past_deadline(_deadline())
    assert past_deadline(RpcError())
    assert not past_deadline(_unavailable())
    assert not past_deadline(ValueError("x"))


def test_only_a_call_past_its_deadline_retires_the_connection() -> None:
    opened: list[int] = []

    def open_api(n: int) -> _Api:
        opened.append(n)
        return _Api(n)

    c = Connection(open_api, "test", longest_call=30)
    first = c.api()
    assert c.api() is first and opened == [0]
    c.failed(first, _unavailable())  # a refused connection is not a dead one
    assert c.api() is first
    c.failed(first, _deadline())
    c.failed(first, _deadline())  # a second call that failed on it: retired once
    second = c.api()
    assert second is not first and opened == [0, 1] and c.replaced == 1
    assert not first.transport.closed  # calls still on it go on until their deadline
    c.failed(first, _deadline())  # a late report about the retired one changes nothing
    assert c.api() is second


def test_retired_connections_close_once_their_calls_are_past_deadline(now: list[float]) -> None:
    c = Connection(_Api, "test", longest_call=10)
    c.deadline(20)  # a longer call went out: retired APIs are kept 20 s
    a = c.api()
    c.failed(a, _deadline())
    now[0] += 15
    b = c.api()
    c.failed(b, _deadline())
    assert not a.transport.closed  # 15 s < 20 s: a call on it may still run
    now[0] += 10
    d = c.api()
    c.failed(d, _deadline())
    assert a.transport.closed and not b.transport.closed
    e = c.api()
    c.close()
    assert b.transport.closed and d.transport.closed and e.transport.closed


def test_a_retired_connection_closes_with_the_next_call_past_its_deadlines(
    now: list[float],
) -> None:
    c = Connection(_Api, "test", longest_call=10)
    a = c.api()
    c.failed(a, _deadline())
    b = c.api()
    now[0] += 5
    assert c.api() is b and not a.transport.closed
    now[0] += 6  # every call a carried is past its deadline now: no failure needed
    assert c.api() is b and a.transport.closed and not b.transport.closed


def test_an_api_that_cannot_be_replaced_is_never_closed_while_in_use(now: list[float]) -> None:
    only = _Api(0)
    c = Connection(lambda _: only, "test", longest_call=10)
    c.failed(c.api(), _deadline())
    assert c.api() is only  # "retired", and given again: there is no other
    now[0] += 60
    assert c.api() is only and not only.transport.closed


def test_close_leaves_the_first_connection_to_its_owner() -> None:
    c = Connection(_Api, "test", longest_call=10)
    first = c.api()
    c.close()
    assert not first.transport.closed


def test_a_new_connection_to_spanner_keeps_the_stock_settings_and_adds_its_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Cloud Spanner path (not the emulator's): endpoint, credentials and the stock
    channel options as the stock client sets them, plus the argument that keeps gRPC from
    sharing another channel's connection. Nothing connects: channels dial lazily."""
    from google.cloud import spanner
    from google.cloud.spanner_v1.services.spanner.transports.grpc import SpannerGrpcTransport
    from google.oauth2.credentials import Credentials

    monkeypatch.delenv("SPANNER_EMULATOR_HOST", raising=False)
    seen: list[dict[str, Any]] = []
    stock = SpannerGrpcTransport.create_channel

    def spy(host: str, **kwargs: Any) -> Any:
        seen.append({"host": host, **kwargs})
        return stock(host, **kwargs)

    monkeypatch.setattr(SpannerGrpcTransport, "create_channel", spy)
    client = spanner.Client(project="p", credentials=Credentials(token="t"),  # type: ignore[no-untyped-call]
                            disable_builtin_metrics=True)
    began = time.monotonic()
    api = connection_api(client, None)
    other = connection_api(client, None)
    assert time.monotonic() - began < 5
    assert len(seen) == 2
    options = dict(seen[0]["options"])
    # a number of its own: two new connections never share one
    assert options["cdcflow.connection"] != dict(seen[1]["options"])["cdcflow.connection"]
    assert options["grpc.max_receive_message_length"] == -1  # the stock options are kept
    # what a query receives ahead of its reader is bounded: a fixed stream window
    assert (options["grpc.http2.bdp_probe"], options["grpc.http2.lookahead_bytes"]) == (
        0, STREAM_WINDOW)
    assert "keepalive" in " ".join(options)
    assert seen[0]["host"].startswith("spanner.googleapis.com")
    assert api.transport.grpc_channel is not None
    for made in (api, other):
        made.transport.close()


def test_close_closes_the_first_connection_when_it_was_opened_here() -> None:
    c = Connection(_Api, "test", longest_call=10, owns_first=True)
    first = c.api()
    c.close()
    assert first.transport.closed


def test_the_reader_s_every_connection_has_the_fixed_stream_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A query's transport (the emulator's path here) reads on channels of its own, the
    first one too: none takes gRPC's growing windows, which let tens of MB of large
    records pile up ahead of a reader the byte quota holds back."""
    import grpc

    from cdcflow.spanner.transport import GrpcTransport

    monkeypatch.setenv("SPANNER_EMULATOR_HOST", "127.0.0.1:1")
    seen: list[dict[str, Any]] = []
    stock = grpc.insecure_channel

    def spy(target: str, options: Any = None, compression: Any = None) -> Any:
        seen.append(dict(options or ()))
        return stock(target, options=options, compression=compression)

    monkeypatch.setattr(grpc, "insecure_channel", spy)
    transport = GrpcTransport("projects/p/instances/i/databases/d")
    try:
        first = transport._spanner_api()
        transport._connection.failed(first, _deadline())
        transport._spanner_api()  # the next connection
    finally:
        transport.close()
    assert len(seen) == 2
    for options in seen:
        assert options["grpc.http2.bdp_probe"] == 0
        assert options["grpc.http2.lookahead_bytes"] == STREAM_WINDOW


def test_a_new_connection_to_the_admin_api(monkeypatch: pytest.MonkeyPatch) -> None:
    from google.cloud import spanner
    from google.cloud.spanner_admin_database_v1.services.database_admin import (
        DatabaseAdminClient,
    )
    from google.oauth2.credentials import Credentials

    monkeypatch.delenv("SPANNER_EMULATOR_HOST", raising=False)
    client = spanner.Client(project="p", credentials=Credentials(token="t"),  # type: ignore[no-untyped-call]
                            disable_builtin_metrics=True)
    for emulator in (None, "127.0.0.1:1"):
        admin = connection_api(client, emulator, admin=True)
        assert isinstance(admin, DatabaseAdminClient)
        transport: Any = admin.transport
        assert transport.grpc_channel is not None
        transport.close()
