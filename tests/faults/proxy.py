"""A TCP proxy on loopback that injects network faults while traffic flows.

:class:`FaultProxy` listens on ``127.0.0.1`` and forwards bytes, unchanged, to a target on
loopback (the Spanner emulator's gRPC port): the HTTP/2 traffic of google-cloud-spanner
passes through it as it would through a network. From any thread, while it forwards:

- :meth:`FaultProxy.reset_all` resets every open connection (``SO_LINGER`` 0, then close:
  both peers get a TCP RST, as from a middlebox that lost its state);
- :meth:`FaultProxy.drop` closes every open connection (FIN) and refuses new ones (the
  listening socket is closed, so a connect gets ECONNREFUSED) for a number of seconds;
- :meth:`FaultProxy.stall` stops forwarding for a number of seconds: connections stay
  open and bytes wait, so only a client deadline or keepalive can notice;
- :meth:`FaultProxy.blackhole` makes the connections open now carry nothing, for good
  (bytes sent on them are dropped), while new connections work: a path that died without
  a word, which only a client that opens a new connection gets past;
- :meth:`FaultProxy.heal` ends every drop and stall at once;
- :meth:`FaultProxy.chaos` applies those at random moments (uniform gaps averaging
  ``mean_interval``) from a seeded generator, for a bounded time; :attr:`FaultProxy.events`
  records what was applied and when, so a failing run can be replayed.

The proxy is bounded: it stops by itself ``lifetime`` seconds after :meth:`start` (and on
:meth:`stop`, or when its ``with`` block ends). It only listens on and connects to loopback
addresses. It runs an asyncio loop in a daemon thread; the control methods are thread-safe
and return once the fault is in force.

    with FaultProxy(emulator.host, lifetime=120) as proxy:
        env["SPANNER_EMULATOR_HOST"] = proxy.host
        proxy.stall(5)
        proxy.chaos(seed=7, mean_interval=2.0, duration=20)
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
import socket
import struct
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, TypeVar

__all__ = ["FaultEvent", "FaultKind", "FaultProxy", "ProxyStats"]

FaultKind = Literal["reset", "drop", "stall", "blackhole"]
_KINDS: tuple[FaultKind, ...] = ("reset", "drop", "stall")  # chaos's by default
_ALL_KINDS: tuple[FaultKind, ...] = (*_KINDS, "blackhole")
_CHUNK = 64 * 1024
_T = TypeVar("_T")


@dataclass(frozen=True)
class FaultEvent:
    """One fault the proxy applied: ``at`` seconds after :meth:`FaultProxy.start`,
    ``monotonic`` on ``time.monotonic()``'s clock, lasting ``seconds`` (0 for a reset),
    touching ``connections`` open connections."""

    at: float
    monotonic: float
    kind: FaultKind
    seconds: float
    connections: int

    def __str__(self) -> str:
        span = f" {self.seconds:.2f}s" if self.seconds else ""
        return f"t={self.at:6.2f}s {self.kind}{span} ({self.connections} conn)"


@dataclass
class ProxyStats:
    """Counters since start: connections accepted, bytes forwarded each way, connections
    ended by a reset or a drop, connections that could not reach the target, and bytes
    dropped by a black hole."""

    accepted: int = 0
    bytes_up: int = 0  # client -> target
    bytes_down: int = 0  # target -> client
    reset: int = 0
    dropped: int = 0
    upstream_failed: int = 0
    blackholed_bytes: int = 0
    open: int = field(default=0)


def _check_loopback(host: str) -> None:
    """Refuse any target that is not on this machine's loopback."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as e:
        msg = f"FaultProxy: cannot resolve {host!r} ({e}); give a loopback address"
        raise ValueError(msg) from None
    for info in infos:
        if not ipaddress.ip_address(info[4][0]).is_loopback:
            msg = f"FaultProxy: target {host!r} is not on loopback; use 127.0.0.1 or ::1"
            raise ValueError(msg)


def _split_host(target: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(target, tuple):
        return target
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        msg = f"FaultProxy: target {target!r}: write HOST:PORT, e.g. 127.0.0.1:9010"
        raise ValueError(msg)
    return host.strip("[]"), int(port)


class _Connection:
    """One proxied connection: the client's and the target's transports, two pumps."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.tasks: list[asyncio.Task[None]] = []
        self.blackholed = False

    def writers(self) -> tuple[asyncio.StreamWriter, asyncio.StreamWriter]:
        return self.client, self.upstream

    def abort(self, *, rst: bool) -> None:
        """Close both sides now: with an RST if ``rst`` (SO_LINGER 0), else a FIN."""
        for task in self.tasks:
            task.cancel()
        for writer in self.writers():
            if rst:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                writer.transport.abort()
            else:
                writer.close()


class FaultProxy:
    """Forwards ``127.0.0.1:port`` to ``target`` (``HOST:PORT`` on loopback).

    ``port`` 0 picks a free port (:attr:`host` tells which). ``lifetime`` bounds how long
    the proxy runs, in seconds: past it every connection is closed and the listener stops,
    whatever the caller does. Control methods may be called from any thread once
    :meth:`start` returned; they raise RuntimeError after the proxy stopped.
    """

    def __init__(
        self, target: str | tuple[str, int], *, port: int = 0, lifetime: float = 300.0
    ) -> None:
        self.target_host, self.target_port = _split_host(target)
        _check_loopback(self.target_host)
        if lifetime <= 0:
            msg = f"FaultProxy(lifetime={lifetime}): give a positive number of seconds"
            raise ValueError(msg)
        self.port = port
        self.lifetime = float(lifetime)
        self.stats = ProxyStats()
        self.events: list[FaultEvent] = []
        self._events_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._flowing: asyncio.Event | None = None
        self._stalled_until = 0.0
        self._dropped_until = 0.0
        self._stopped: asyncio.Event | None = None
        self._chaos: asyncio.Task[None] | None = None
        self._relisten: asyncio.Future[None] | None = None
        self._began = 0.0

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def host(self) -> str:
        """``127.0.0.1:PORT``: what a client connects to (SPANNER_EMULATOR_HOST)."""
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> FaultProxy:
        """Start listening; returns once connections are accepted."""
        if self._thread is not None:
            msg = "FaultProxy.start(): already started; create a new proxy"
            raise RuntimeError(msg)
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._main(ready))
            except BaseException as e:  # reported to start() if it happens before ready
                failure.append(e)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=main, name="fault-proxy", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            raise failure[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Close every connection and the listener; wait for the proxy's thread."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(self._request_stop)
            thread.join(timeout)

    def __enter__(self) -> FaultProxy:
        return self.start() if self._thread is None else self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _request_stop(self) -> None:
        assert self._stopped is not None
        self._stopped.set()

    async def _main(self, ready: threading.Event) -> None:
        self._stopped = asyncio.Event()
        self._flowing = asyncio.Event()
        self._flowing.set()
        await self._listen()
        self._began = time.monotonic()
        ready.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopped.wait(), self.lifetime)
        if self._chaos is not None:
            self._chaos.cancel()
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self._connections):
            conn.abort(rst=False)
        # Let the transports run their close callbacks before the loop goes away.
        await asyncio.sleep(0.05)

    async def _listen(self) -> None:
        """Open the listener on ``self.port`` (the same port again after a drop)."""
        last: OSError | None = None
        for _ in range(50):
            if self._server is not None:
                return  # a heal() reopened it meanwhile
            try:
                self._server = await asyncio.start_server(
                    self._accept, "127.0.0.1", self.port, reuse_address=True
                )
                self.port = self._server.sockets[0].getsockname()[1]
                return
            except OSError as e:  # the port is briefly unavailable after the drop
                last = e
                await asyncio.sleep(0.1)
        msg = f"FaultProxy: cannot listen on 127.0.0.1:{self.port} again ({last})"
        raise RuntimeError(msg)

    # -- forwarding ------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self.target_host, self.target_port
            )
        except OSError:
            self.stats.upstream_failed += 1
            writer.transport.abort()
            return
        conn = _Connection(writer, up_writer)
        self._connections.add(conn)
        self.stats.open = len(self._connections)
        up = asyncio.ensure_future(self._pump(conn, reader, up_writer, "bytes_up"))
        down = asyncio.ensure_future(self._pump(conn, up_reader, writer, "bytes_down"))
        conn.tasks = [up, down]
        try:
            await asyncio.gather(up, down, return_exceptions=True)
        finally:
            self._connections.discard(conn)
            self.stats.open = len(self._connections)
            for w in conn.writers():
                if not w.transport.is_closing():
                    w.transport.abort()

    async def _pump(
        self, conn: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
        counter: str,
    ) -> None:
        assert self._flowing is not None
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    # Half-close: the peer finished sending; the other direction goes on.
                    if writer.can_write_eof() and not writer.transport.is_closing():
                        writer.write_eof()
                    return
                # While stalled, hold the chunk; the kernel buffers fill up behind it.
                await self._flowing.wait()
                if conn.blackholed:
                    self.stats.blackholed_bytes += len(data)
                    continue
                # Counted before it is written, so a peer that has the bytes sees them counted.
                setattr(self.stats, counter, getattr(self.stats, counter) + len(data))
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            # One side broke: break the other one the same way (abortive close).
            writer.transport.abort()

    # -- faults ----------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        loop = self._loop
        if loop is None or not self.running:
            coro.close()
            msg = "FaultProxy: not running (start it, or it passed its lifetime)"
            raise RuntimeError(msg)
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    def _record(self, kind: FaultKind, seconds: float, connections: int) -> FaultEvent:
        now = time.monotonic()
        event = FaultEvent(now - self._began, now, kind, seconds, connections)
        with self._events_lock:
            self.events.append(event)
        return event

    def reset_all(self) -> int:
        """Reset every open connection (RST to both peers); return how many there were."""
        return self._call(self._reset_all())

    async def _reset_all(self) -> int:
        conns = list(self._connections)
        for conn in conns:
            conn.abort(rst=True)
        self.stats.reset += len(conns)
        self._record("reset", 0.0, len(conns))
        return len(conns)

    def drop(self, seconds: float) -> int:
        """Close every open connection (FIN) and refuse connections for ``seconds``;
        return how many connections were closed."""
        return self._call(self._drop(seconds))

    async def _drop(self, seconds: float) -> int:
        assert self._stopped is not None
        until = time.monotonic() + max(0.0, seconds)
        self._dropped_until = max(self._dropped_until, until)
        if self._server is not None:
            self._server.close()
            self._server = None
        conns = list(self._connections)
        for conn in conns:
            conn.abort(rst=False)
        self.stats.dropped += len(conns)
        self._record("drop", seconds, len(conns))
        asyncio.get_running_loop().call_later(seconds, self._undrop)
        return len(conns)

    def _undrop(self) -> None:
        assert self._stopped is not None
        if self._stopped.is_set() or time.monotonic() < self._dropped_until - 1e-3:
            return  # a longer drop came meanwhile; its own timer reopens
        if self._server is None:
            self._relisten = asyncio.ensure_future(self._listen())

    def stall(self, seconds: float) -> int:
        """Stop forwarding bytes for ``seconds`` (connections stay open, new ones are
        accepted but carry nothing); return how many connections were open."""
        return self._call(self._stall(seconds))

    async def _stall(self, seconds: float) -> int:
        assert self._flowing is not None
        until = time.monotonic() + max(0.0, seconds)
        self._stalled_until = max(self._stalled_until, until)
        self._flowing.clear()
        self._record("stall", seconds, len(self._connections))
        asyncio.get_running_loop().call_later(seconds, self._unstall)
        return len(self._connections)

    def _unstall(self) -> None:
        assert self._flowing is not None
        if time.monotonic() >= self._stalled_until - 1e-3:
            self._flowing.set()

    def blackhole(self) -> int:
        """From now on the connections open now carry nothing (what is sent on them is
        dropped, nothing is closed); new connections work. Return how many there were."""
        return self._call(self._blackhole())

    async def _blackhole(self) -> int:
        conns = [c for c in self._connections if not c.blackholed]
        for conn in conns:
            conn.blackholed = True
        self._record("blackhole", 0.0, len(conns))
        return len(conns)

    def heal(self) -> None:
        """End every drop and stall now (a running chaos schedule goes on)."""
        self._call(self._heal())

    async def _heal(self) -> None:
        assert self._flowing is not None
        self._stalled_until = self._dropped_until = 0.0
        self._flowing.set()
        if self._server is None:
            await self._listen()

    @property
    def faulty(self) -> bool:
        """True while a drop or a stall is in force."""
        now = time.monotonic()
        return now < self._stalled_until or now < self._dropped_until

    def chaos(
        self,
        seed: int,
        mean_interval: float,
        *,
        duration: float,
        kinds: Sequence[FaultKind] = _KINDS,
        stall_seconds: tuple[float, float] = (0.5, 3.0),
        drop_seconds: tuple[float, float] = (0.2, 2.0),
        max_events: int = 1000,
    ) -> None:
        """Apply random faults for ``duration`` seconds, in the background.

        Gaps between faults are uniform in ``[0, 2 * mean_interval]`` (so faults neither
        bunch up nor leave long calm stretches the way exponential gaps do); each fault is a
        kind from ``kinds`` and, for a stall or drop, a length drawn uniformly from
        ``stall_seconds`` / ``drop_seconds``. The same seed draws the same schedule. At most
        ``max_events`` faults; the schedule also ends with the proxy. A second call
        replaces the running schedule.
        """
        if mean_interval <= 0 or duration < 0 or not kinds:
            msg = "FaultProxy.chaos: mean_interval > 0, duration >= 0 and some kinds, please"
            raise ValueError(msg)
        unknown = set(kinds) - set(_ALL_KINDS)
        if unknown:
            msg = f"FaultProxy.chaos: unknown kinds {sorted(unknown)}; use {_ALL_KINDS}"
            raise ValueError(msg)
        plan = _schedule(seed, mean_interval, duration, kinds, stall_seconds, drop_seconds,
                         max_events)
        self._call(self._start_chaos(plan))

    async def _start_chaos(self, plan: list[tuple[float, FaultKind, float]]) -> None:
        if self._chaos is not None:
            self._chaos.cancel()
        self._chaos = asyncio.ensure_future(self._run_chaos(plan))

    async def _run_chaos(self, plan: list[tuple[float, FaultKind, float]]) -> None:
        began = time.monotonic()
        for offset, kind, seconds in plan:
            await asyncio.sleep(max(0.0, began + offset - time.monotonic()))
            if kind == "reset":
                await self._reset_all()
            elif kind == "drop":
                await self._drop(seconds)
            elif kind == "blackhole":
                await self._blackhole()
            else:
                await self._stall(seconds)

    def chaos_running(self) -> bool:
        """True while a :meth:`chaos` schedule has faults left to apply."""
        return self._chaos is not None and not self._chaos.done()


def _schedule(
    seed: int,
    mean_interval: float,
    duration: float,
    kinds: Sequence[FaultKind],
    stall_seconds: tuple[float, float],
    drop_seconds: tuple[float, float],
    max_events: int,
) -> list[tuple[float, FaultKind, float]]:
    """The (offset, kind, seconds) faults a seed draws: a pure function, so a printed seed
    replays the same schedule."""
    rng = random.Random(seed)
    plan: list[tuple[float, FaultKind, float]] = []
    t = rng.uniform(0, 2 * mean_interval)
    while t < duration and len(plan) < max_events:
        kind = rng.choice(list(kinds))
        seconds = 0.0
        if kind == "stall":
            seconds = rng.uniform(*stall_seconds)
        elif kind == "drop":
            seconds = rng.uniform(*drop_seconds)
        plan.append((t, kind, seconds))
        t += rng.uniform(0, 2 * mean_interval)
    return plan
