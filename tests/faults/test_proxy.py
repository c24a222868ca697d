"""The fault proxy itself, over a real echo server on loopback: bytes pass unchanged,
a reset breaks connections with an RST, a stall delays bytes without closing anything,
a drop closes connections and refuses new ones for a while, chaos is seeded and bounded."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from tests.faults.proxy import FaultProxy, _schedule


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        while True:
            try:
                data = sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            sock.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo() -> Iterator[str]:
    server = _Server(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(echo: str) -> Iterator[FaultProxy]:
    with FaultProxy(echo, lifetime=60) as p:
        yield p


def _connect(proxy: FaultProxy, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=timeout)


def _exchange(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_bytes_pass_unchanged_both_ways(proxy: FaultProxy) -> None:
    payload = os.urandom(3 << 20)  # larger than every socket buffer on the way
    socks = [_connect(proxy) for _ in range(3)]
    try:
        results: list[bytes] = [b""] * len(socks)

        def talk(i: int) -> None:
            results[i] = _exchange(socks[i], payload)

        threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(socks))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(r == payload for r in results)
        assert proxy.stats.accepted == 3
        assert proxy.stats.bytes_up == proxy.stats.bytes_down == 3 * len(payload)
    finally:
        for s in socks:
            s.close()


def test_half_close_is_forwarded(proxy: FaultProxy) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"last words")
        sock.shutdown(socket.SHUT_WR)  # the echo server sees EOF, answers, then closes
        got = b""
        while chunk := sock.recv(1024):
            got += chunk
        assert got == b"last words"


def test_reset_breaks_open_connections_with_rst(proxy: FaultProxy) -> None:
    a, b = _connect(proxy), _connect(proxy)
    try:
        assert _exchange(a, b"hello") == b"hello"
        assert _exchange(b, b"world") == b"world"
        assert proxy.reset_all() == 2
        for sock in (a, b):
            with pytest.raises(ConnectionResetError):
                sock.recv(16)  # an RST, not a FIN (which would read as b"")
        assert proxy.stats.reset == 2
        # New connections work again right away.
        with _connect(proxy) as c:
            assert _exchange(c, b"again") == b"again"
        assert [e.kind for e in proxy.events] == ["reset"]
    finally:
        a.close()
        b.close()


def test_stall_delays_bytes_and_keeps_connections_open(proxy: FaultProxy) -> None:
    with _connect(proxy) as sock:
        assert _exchange(sock, b"before") == b"before"
        began = time.monotonic()
        assert proxy.stall(1.5) == 1
        assert proxy.faulty
        sock.sendall(b"during")
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(16)  # nothing comes back while stalled, and nothing closes
        sock.settimeout(5)
        assert sock.recv(16) == b"during"
        waited = time.monotonic() - began
        assert 1.3 <= waited < 3.0, waited
        assert not proxy.faulty
        assert _exchange(sock, b"after") == b"after"


def test_stall_holds_new_connections_too(proxy: FaultProxy) -> None:
    proxy.stall(1.0)
    began = time.monotonic()
    with _connect(proxy) as sock:  # the connect itself succeeds: the proxy is listening
        assert _exchange(sock, b"ping") == b"ping"
    assert time.monotonic() - began >= 0.8


def test_blackhole_silences_open_connections_for_good_but_not_new_ones(
    proxy: FaultProxy,
) -> None:
    with _connect(proxy) as old:
        assert _exchange(old, b"before") == b"before"
        assert proxy.blackhole() == 1
        old.sendall(b"into the void")  # accepted by the kernel, dropped by the proxy
        old.settimeout(1.0)
        with pytest.raises(TimeoutError):
            old.recv(16)  # nothing comes back, and nothing closes
        with _connect(proxy) as new:
            assert _exchange(new, b"fresh") == b"fresh"
        old.sendall(b"still nothing")
        with pytest.raises(TimeoutError):
            old.recv(16)
    assert proxy.stats.blackholed_bytes == len(b"into the void") + len(b"still nothing")
    assert [e.kind for e in proxy.events] == ["blackhole"]


def test_drop_closes_and_refuses_then_recovers(proxy: FaultProxy) -> None:
    sock = _connect(proxy)
    try:
        assert _exchange(sock, b"ok") == b"ok"
        assert proxy.drop(1.0) == 1
        sock.settimeout(5)
        assert sock.recv(16) == b""  # closed (FIN) by the proxy
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        time.sleep(1.3)
        with _connect(proxy) as again:
            assert _exchange(again, b"back") == b"back"
        assert proxy.stats.dropped == 1
    finally:
        sock.close()


def test_overlapping_faults_last_as_long_as_the_longest(proxy: FaultProxy) -> None:
    proxy.drop(1.5)
    proxy.drop(0.3)  # a shorter drop must not reopen early
    time.sleep(0.6)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    time.sleep(1.2)
    with _connect(proxy) as sock:
        assert _exchange(sock, b"x") == b"x"


def test_heal_ends_stalls_and_drops_at_once(proxy: FaultProxy) -> None:
    with _connect(proxy) as sock:
        proxy.stall(30)
        sock.sendall(b"held")
        time.sleep(0.3)
        began = time.monotonic()
        proxy.heal()
        assert sock.recv(16) == b"held"
        assert time.monotonic() - began < 1.0
    proxy.drop(30)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
    proxy.heal()
    assert not proxy.faulty
    with _connect(proxy) as sock:
        assert _exchange(sock, b"open") == b"open"


def test_chaos_is_seeded_and_bounded(echo: str) -> None:
    assert _schedule(5, 0.2, 3.0, ("reset", "drop", "stall"), (0.1, 0.3), (0.1, 0.3), 99) == (
        _schedule(5, 0.2, 3.0, ("reset", "drop", "stall"), (0.1, 0.3), (0.1, 0.3), 99)
    )
    assert _schedule(5, 0.2, 3.0, ("reset",), (0.1, 0.3), (0.1, 0.3), 99) != (
        _schedule(6, 0.2, 3.0, ("reset",), (0.1, 0.3), (0.1, 0.3), 99)
    )
    expected = _schedule(5, 0.2, 1.5, ("reset", "drop", "stall"), (0.1, 0.3), (0.1, 0.3), 1000)
    with FaultProxy(echo, lifetime=30) as proxy:
        proxy.chaos(5, 0.2, duration=1.5, stall_seconds=(0.1, 0.3), drop_seconds=(0.1, 0.3))
        assert proxy.chaos_running()
        time.sleep(2.0)
        assert not proxy.chaos_running()
        assert [(e.kind, round(e.seconds, 6)) for e in proxy.events] == [
            (k, round(s, 6)) for _, k, s in expected
        ]
        time.sleep(0.4)  # the last drop or stall has ended
        with _connect(proxy) as sock:
            assert _exchange(sock, b"calm") == b"calm"


def test_proxy_stops_by_itself_after_its_lifetime(echo: str) -> None:
    proxy = FaultProxy(echo, lifetime=0.5).start()
    sock = _connect(proxy)
    try:
        assert _exchange(sock, b"x") == b"x"
        time.sleep(1.0)
        assert not proxy.running
        sock.settimeout(2)
        assert sock.recv(16) == b""
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        with pytest.raises(RuntimeError, match="not running"):
            proxy.stall(1)
    finally:
        sock.close()
        proxy.stop()


def test_only_loopback_targets() -> None:
    with pytest.raises(ValueError, match="loopback"):
        FaultProxy("192.0.2.1:9010")
    with pytest.raises(ValueError, match="HOST:PORT"):
        FaultProxy("localhost")
