"""How each Spanner operation of cdcflow notices a network fault, measured in-process.

The change-stream client (:class:`~cdcflow.spanner.client.SpannerChangeStreamClient`) and
the Spanner metadata store (:class:`~cdcflow.spanner.store.SpannerStore`) talk to the
emulator through a :class:`~tests.faults.proxy.FaultProxy`; each test applies one fault
and measures what the operation does: how long until it fails, whether a retry resumes
without losing or repeating records, how much CPU a wait burns. The numbers go to
docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cdcflow.errors import StoreError, TransientError
from cdcflow.model import (
    ChildPartitionsRecord,
    DataChangeRecord,
    PartitionMetadata,
    PartitionState,
)
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.emulator import Emulator, emulator_client
from cdcflow.spanner.retry import RetryPolicy
from cdcflow.spanner.store import SpannerStore
from cdcflow.spanner.workload import SHOP_STREAM, Workload, create_shop_database
from cdcflow.stream import ChangeStreamQuery
from tests.e2e_helpers import unique
from tests.faults.proxy import FaultProxy

pytestmark = pytest.mark.emulator

QUERY_TIMEOUT = 2.0


@pytest.fixture
def proxy(spanner_emulator: Emulator) -> Iterator[FaultProxy]:
    with FaultProxy(spanner_emulator.host, lifetime=120) as p:
        yield p


@pytest.fixture
def shop(spanner_emulator: Emulator) -> tuple[str, Any]:
    """A shop database with a few committed changes: (path, Database handle)."""
    name = unique("det")
    db = create_shop_database(spanner_emulator, name)
    return spanner_emulator.database_path(name), db


def _client(host: str) -> Any:
    """A google-cloud-spanner Client whose channels go to ``host``. SPANNER_EMULATOR_HOST
    (the session fixture sets it to the emulator) wins over client options, and the client
    reads it once, when it is built: so set it for that moment."""
    old = os.environ.get("SPANNER_EMULATOR_HOST")
    os.environ["SPANNER_EMULATOR_HOST"] = host
    try:
        client = emulator_client(host)
    finally:
        if old is None:
            del os.environ["SPANNER_EMULATOR_HOST"]
        else:
            os.environ["SPANNER_EMULATOR_HOST"] = old
    assert client.instance("test-instance").emulator_host == host
    return client


def _reader(proxy: FaultProxy, database: str, attempts: int = 6) -> SpannerChangeStreamClient:
    return SpannerChangeStreamClient(
        database, query_timeout=QUERY_TIMEOUT, retry=RetryPolicy(attempts=attempts),
        spanner_client=_client(proxy.host),
    )


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed(fn: Callable[[], Any]) -> tuple[float, Any, BaseException | None]:
    began = time.monotonic()
    try:
        result = fn()
    except Exception as e:
        return time.monotonic() - began, None, e
    return time.monotonic() - began, result, None


def _identity(record: Any) -> tuple[Any, ...]:
    if isinstance(record, DataChangeRecord):
        return ("data", record.commit_timestamp, record.record_sequence,
                record.server_transaction_id, len(record.mods))
    if isinstance(record, ChildPartitionsRecord):
        return ("children", record.start_timestamp, record.record_sequence,
                tuple(sorted(c.token for c in record.child_partitions)))
    return ("other", type(record).__name__)


# -- change-stream reads -----------------------------------------------------------------


def _root() -> ChangeStreamQuery:
    """The root query over the next millisecond (the stream is only seconds old: earlier
    starts may precede it)."""
    now = time.time_ns()
    return ChangeStreamQuery(SHOP_STREAM, None, now, now + 1_000_000)


def test_stalled_query_fails_at_its_deadline(proxy: FaultProxy, shop: tuple[str, Any]) -> None:
    database, _ = shop
    root = _root()
    reader = _reader(proxy, database, attempts=1)
    assert list(reader.read(root))  # connected and warm
    proxy.stall(30)
    try:
        took, _, error = _timed(lambda: list(reader.read(root)))
    finally:
        proxy.heal()
    print(f"\nstalled change-stream query failed after {took:.2f}s: {error}")
    assert isinstance(error, TransientError)
    assert "DEADLINE_EXCEEDED" in str(error)
    assert QUERY_TIMEOUT - 0.1 <= took < QUERY_TIMEOUT + 1.5


def test_query_retries_ride_out_a_stall_shorter_than_the_retry_budget(
    proxy: FaultProxy, shop: tuple[str, Any]
) -> None:
    database, _ = shop
    root = _root()
    reader = _reader(proxy, database)
    expected = [_identity(r) for r in reader.read(root)]
    proxy.stall(2.5 * QUERY_TIMEOUT)
    took, got, error = _timed(lambda: [_identity(r) for r in reader.read(root)])
    print(f"\nread across a {2.5 * QUERY_TIMEOUT:.0f}s stall: {took:.2f}s, error={error}")
    assert error is None
    assert got == expected
    assert took >= 2 * QUERY_TIMEOUT


def test_refused_connection_fails_fast_and_recovers(
    proxy: FaultProxy, shop: tuple[str, Any]
) -> None:
    database, _ = shop
    root = _root()
    reader = _reader(proxy, database, attempts=1)
    assert list(reader.read(root))
    proxy.drop(30)
    took, _, error = _timed(lambda: list(reader.read(root)))
    print(f"\nrefused change-stream query failed after {took:.2f}s: {error}")
    assert isinstance(error, TransientError)
    assert "UNAVAILABLE" in str(error)
    assert took < 1.0
    proxy.heal()
    # gRPC waits out its reconnect backoff (1 s, then 1.6x) before it dials again.
    began = time.monotonic()
    while True:
        with contextlib.suppress(TransientError):
            assert list(reader.read(root))
            break
        assert time.monotonic() - began < 10, "no reconnect within 10 s of the network's return"
        time.sleep(0.1)
    print(f"first successful read {time.monotonic() - began:.2f}s after the network returned")


def test_resets_mid_stream_resume_without_loss_or_duplicates(
    spanner_emulator: Emulator, proxy: FaultProxy, shop: tuple[str, Any]
) -> None:
    """Live reads of partitions while the workload commits and every connection is reset
    every 0.2 s: each read equals a fault-free read of the same query afterwards."""
    database, db = shop
    began = time.time_ns()
    reader = _reader(proxy, database, attempts=20)
    direct = SpannerChangeStreamClient(
        database, spanner_client=_client(spanner_emulator.host)
    )
    root = ChangeStreamQuery(SHOP_STREAM, None, began, began + 1)
    tokens = [c.token for r in direct.read(root) if isinstance(r, ChildPartitionsRecord)
              for c in r.child_partitions]
    workload = Workload(db, rate=30, seed=5)
    workload.start(seconds=5)
    stop = threading.Event()

    def resetter() -> None:
        while not stop.wait(0.2):
            proxy.reset_all()

    chaos = threading.Thread(target=resetter, daemon=True)
    chaos.start()
    end = began + 4_000_000_000
    queries = [ChangeStreamQuery(SHOP_STREAM, t, began, end, heartbeat_millis=100)
               for t in tokens]
    faulted: list[list[tuple[Any, ...]]] = [[] for _ in queries]

    def read(i: int) -> None:
        faulted[i] = [_identity(r) for r in reader.read(queries[i])]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(queries))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        chaos.join()
        workload.stop()
    clean = [[_identity(r) for r in direct.read(q)] for q in queries]
    data = sum(1 for rows in clean for r in rows if r[0] == "data")
    print(f"\n{len(queries)} live reads, {proxy.stats.reset} connections reset, "
          f"{data} data records compared")
    assert proxy.stats.reset >= 3
    assert data > 10
    for got, want in zip(faulted, clean, strict=True):
        got_data = [r for r in got if r[0] != "other"]
        want_data = [r for r in want if r[0] != "other"]
        assert got_data == want_data


def test_a_dead_connection_mid_stream_is_replaced_and_reads_resume_exactly(
    spanner_emulator: Emulator, proxy: FaultProxy, shop: tuple[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Live reads while the workload commits; once, the connection they use goes dead for
    good (open, carrying nothing; new connections work). Each stream stalls, and the
    retry goes out on a new connection: each read equals a fault-free read afterwards."""
    import cdcflow.spanner.client as client_module

    monkeypatch.setattr(client_module, "STALL_MIN_S", 1.0)  # stalls noticed after 1.2 s
    database, db = shop
    began = time.time_ns()
    reader = SpannerChangeStreamClient(
        database, query_timeout=60, retry=RetryPolicy(attempts=4),
        spanner_client=_client(proxy.host),
    )
    direct = SpannerChangeStreamClient(database, spanner_client=_client(spanner_emulator.host))
    root = ChangeStreamQuery(SHOP_STREAM, None, began, began + 1)
    tokens = [c.token for r in direct.read(root) if isinstance(r, ChildPartitionsRecord)
              for c in r.child_partitions]
    workload = Workload(db, rate=30, seed=6)
    workload.start(seconds=5)
    end = began + 5_000_000_000
    queries = [ChangeStreamQuery(SHOP_STREAM, t, began, end, heartbeat_millis=200)
               for t in tokens]
    faulted: list[list[tuple[Any, ...]]] = [[] for _ in queries]
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            faulted[i] = [_identity(r) for r in reader.read(queries[i])]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(queries))]
    try:
        for t in threads:
            t.start()
        time.sleep(1.5)
        dead = proxy.blackhole()
        accepted = proxy.stats.accepted
        for t in threads:
            t.join(60)
    finally:
        workload.stop()
    clean = [[_identity(r) for r in direct.read(q)] for q in queries]
    data = sum(1 for rows in clean for r in rows if r[0] == "data")
    print(f"\n{len(queries)} live reads, {dead} connection(s) went dead, "
          f"{proxy.stats.accepted - accepted} new, {data} data records compared")
    assert not errors, errors
    assert dead >= 1
    assert proxy.stats.accepted > accepted  # the reads went on over a new connection
    assert proxy.stats.blackholed_bytes > 0
    assert data > 10
    for got, want in zip(faulted, clean, strict=True):
        assert [r for r in got if r[0] != "other"] == [r for r in want if r[0] != "other"]


def test_a_query_waiting_for_its_first_message_on_a_dead_connection_is_retried_soon(
    proxy: FaultProxy, shop: tuple[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connection dies between two reads: the next query gets no first message. The
    stall bound (not the 60 s query deadline) ends it, and the retry, on a new connection,
    reads what a read before the fault read."""
    import cdcflow.spanner.client as client_module

    monkeypatch.setattr(client_module, "STALL_MIN_S", 1.0)
    database, _ = shop
    root = _root()
    reader = SpannerChangeStreamClient(
        database, query_timeout=60, retry=RetryPolicy(attempts=3),
        spanner_client=_client(proxy.host),
    )
    expected = [_identity(r) for r in reader.read(root)]
    accepted = proxy.stats.accepted
    assert proxy.blackhole() == 1
    took, got, error = _timed(lambda: [_identity(r) for r in reader.read(root)])
    print(f"\nread over a dead connection: {took:.2f}s, error={error}, "
          f"{proxy.stats.accepted - accepted} new connection(s)")
    assert error is None
    assert got == expected
    assert proxy.stats.accepted > accepted
    assert took < 20  # 6 heartbeats of 1 s (the stall bound): not the 60 s deadline
    reader.close()


# -- the Spanner metadata store ----------------------------------------------------------


def _store(spanner_emulator: Emulator, proxy: FaultProxy, **options: Any) -> SpannerStore:
    name = unique("meta")
    spanner_emulator.create_database(name)
    store = SpannerStore(spanner_emulator.database_path(name),
                         client=_client(proxy.host), **options)
    store.ensure_schema()
    return store


def _partition(token: str) -> PartitionMetadata:
    now = time.time_ns()
    return PartitionMetadata(
        token=token, parent_tokens=(), start=now, end=now + 1, watermark=now,
        state=PartitionState.CREATED, heartbeat_millis=1000, created_at=now,
    )


def _store_calls(store: SpannerStore) -> dict[str, Callable[[], Any]]:
    """A store read and a store commit, by name."""
    return {
        "read": lambda: store.partitions("p"),
        "commit": lambda: store.insert_partitions("p", [_partition(unique("t"))]),
    }


class _Call:
    """``fn`` running in a daemon thread, so a test can give up waiting on it."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.outcome: list[Any] = []  # the result or the error, once it returned
        self.began = time.monotonic()
        self.took = 0.0

        def target() -> None:
            try:
                self.outcome.append(fn())
            except Exception as e:
                self.outcome.append(e)
            self.took = time.monotonic() - self.began

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def wait(self, seconds: float) -> bool:
        """True if the call returned within ``seconds``."""
        self.thread.join(seconds)
        return not self.thread.is_alive()


@pytest.mark.parametrize("operation", ["read", "commit"])
def test_a_stalled_store_call_fails_at_its_deadlines_instead_of_hanging(
    spanner_emulator: Emulator, proxy: FaultProxy, operation: str
) -> None:
    # A half-open connection answers nothing: only the RPC deadline (call_timeout) notices
    # it, and the retry policy's deadline bounds the whole operation.
    store = _store(spanner_emulator, proxy, call_timeout=2.0,
                   retry=RetryPolicy(attempts=10, initial=0.1, maximum=0.5, deadline=6.0))
    calls = _store_calls(store)
    calls[operation]()  # warm: sessions exist, the connection is up
    proxy.stall(60)
    call = _Call(calls[operation])
    try:
        finished = call.wait(12.0)
    finally:
        proxy.heal()
        call.wait(30.0)
    print(f"\nstalled store {operation}: returned within 12 s: {finished}; "
          f"after {call.took:.1f}s: {call.outcome}")
    assert finished, f"the store {operation} was still blocked 12 s into a stall"
    assert isinstance(call.outcome[0], StoreError)
    assert "DEADLINE_EXCEEDED" in str(call.outcome[0])


@pytest.mark.parametrize("operation", ["read", "commit"])
def test_a_store_call_rides_out_a_stall_shorter_than_its_retry_budget(
    spanner_emulator: Emulator, proxy: FaultProxy, operation: str
) -> None:
    store = _store(spanner_emulator, proxy, call_timeout=2.0)
    calls = _store_calls(store)
    calls[operation]()
    proxy.stall(5)  # heals itself after 5 s
    call = _Call(calls[operation])
    assert call.wait(20.0), f"the store {operation} was still blocked 20 s after a 5 s stall"
    print(f"\nstore {operation} under a 5 s stall: returned after {call.took:.1f}s: "
          f"{call.outcome}")
    assert not isinstance(call.outcome[0], Exception)  # it succeeded
    assert 4.5 <= call.took < 12


@pytest.mark.parametrize("operation", ["read", "commit"])
def test_a_store_call_gets_past_a_dead_connection_on_a_new_one(
    spanner_emulator: Emulator, proxy: FaultProxy, operation: str
) -> None:
    store = _store(spanner_emulator, proxy, call_timeout=2.0)
    calls = _store_calls(store)
    calls[operation]()
    accepted = proxy.stats.accepted
    assert proxy.blackhole() >= 1  # dead for good: only a new connection gets through
    call = _Call(calls[operation])
    assert call.wait(20.0), f"the store {operation} was still blocked 20 s after it began"
    print(f"\nstore {operation} over a dead connection: returned after {call.took:.1f}s: "
          f"{call.outcome}; {proxy.stats.accepted - accepted} new connection(s)")
    assert not isinstance(call.outcome[0], Exception)  # it succeeded
    assert proxy.stats.accepted > accepted
    store.close()


def test_the_lease_renews_past_a_dead_connection_before_it_lapses(
    spanner_emulator: Emulator, proxy: FaultProxy
) -> None:
    """With the default 30 s call deadline, a renewal over a dead connection would pass the
    30 s lease's expiry; the lease's calls have a deadline of their own (5 s)."""
    store = _store(spanner_emulator, proxy)
    assert store.call_timeout == 30
    ttl = 30 * 10**9
    lease = store.acquire_lease("p", "me", "run-1", ttl)
    accepted = proxy.stats.accepted
    assert proxy.blackhole() >= 1
    call = _Call(lambda: store.renew_lease("p", lease, ttl))
    finished = call.wait(20.0)
    print(f"\nlease renewed over a dead connection: {finished} after {call.took:.1f}s: "
          f"{call.outcome}; {proxy.stats.accepted - accepted} new connection(s)")
    assert finished, "renewing the lease was still blocked 20 s in (its time to live is 30 s)"
    assert not isinstance(call.outcome[0], Exception), call.outcome[0]
    assert call.outcome[0].token == lease.token
    assert call.outcome[0].expires_at > lease.expires_at
    assert proxy.stats.accepted > accepted
    assert store.partitions("p") == []  # a call outside the lease's goes out on the new one
    store.close()


def test_a_store_opened_over_a_dead_connection_gets_past_it(
    spanner_emulator: Emulator, proxy: FaultProxy
) -> None:
    """The process's connection dies; then a store is opened (a restarted run's first
    steps): its admin calls (does the database exist? the schema) and its data calls
    each pass one deadline, then go out on new connections."""
    first = _store(spanner_emulator, proxy, call_timeout=2.0)
    first.partitions("p")
    assert proxy.blackhole() >= 1
    accepted = proxy.stats.accepted
    name = unique("meta")
    spanner_emulator.create_database(name)
    store = SpannerStore(spanner_emulator.database_path(name), client=_client(proxy.host),
                         call_timeout=2.0, retry=RetryPolicy(attempts=20, deadline=30.0))
    call = _Call(lambda: (store.ensure_schema(), store.partitions("p")))
    assert call.wait(60.0), "opening the store was still blocked after 60 s"
    print(f"\nstore opened over a dead connection: {call.took:.1f}s: {call.outcome}; "
          f"{proxy.stats.accepted - accepted} new connection(s)")
    assert not isinstance(call.outcome[0], Exception), call.outcome[0]
    assert proxy.stats.accepted > accepted
    assert call.took < 20
    store.close()
    first.close()


def test_store_read_backs_off_while_connections_are_refused(
    spanner_emulator: Emulator, proxy: FaultProxy
) -> None:
    store = _store(spanner_emulator, proxy)
    store.partitions("p")
    proxy.drop(4)
    cpu = _cpu()
    took, _, error = _timed(lambda: store.partitions("p"))
    burned = _cpu() - cpu
    print(f"\nstore read during a 4 s outage: {took:.2f}s, {burned:.2f}s CPU, error={error}")
    # Bounded backoff (DESIGN.md section 4) sleeps between attempts: a 4 s wait costs
    # milliseconds of CPU, not seconds.
    assert burned < 0.5


def test_store_commit_waits_out_a_refused_connection(
    spanner_emulator: Emulator, proxy: FaultProxy
) -> None:
    store = _store(spanner_emulator, proxy)
    store.insert_partitions("p", [_partition("a")])
    proxy.drop(3)
    cpu = _cpu()
    took, inserted, error = _timed(lambda: store.insert_partitions("p", [_partition("b")]))
    burned = _cpu() - cpu
    print(f"\nstore commit during a 3 s outage: {took:.2f}s, {burned:.2f}s CPU, error={error}")
    assert error is None and inserted == 1
    assert 2.5 <= took < 15
    assert burned < 0.5
    assert [p.token for p in store.partitions("p")] in (["a", "b"], ["b", "a"])


def test_store_survives_resets_between_and_during_calls(
    spanner_emulator: Emulator, proxy: FaultProxy
) -> None:
    store = _store(spanner_emulator, proxy)
    stop = threading.Event()

    def resetter() -> None:
        while not stop.wait(0.05):
            proxy.reset_all()

    chaos = threading.Thread(target=resetter, daemon=True)
    chaos.start()
    errors: list[str] = []
    inserted = 0
    try:
        # 40 inserts at least, and on until the resets have hit the store several times
        # (a fast machine may do 40 between two resets)
        while inserted < 40 or (proxy.stats.reset < 5 and inserted < 1000):
            try:
                store.insert_partitions("p", [_partition(f"t{inserted:04d}")])
            except StoreError as e:
                errors.append(str(e))
            inserted += 1
    finally:
        stop.set()
        chaos.join()
    stored = [p.token for p in store.partitions("p")]
    print(f"\n{inserted} inserts under resets every 50 ms: {proxy.stats.reset} resets, "
          f"{len(errors)} StoreErrors {errors[:2]}; {len(stored)} rows")
    assert proxy.stats.reset >= 5
    # An insert that failed may have committed; one that succeeded must be there, once.
    assert len(stored) == len(set(stored))
    failed = {f"t{i:04d}" for i in range(inserted)} - set(stored)
    assert len(failed) <= len(errors)
