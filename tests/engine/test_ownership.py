"""One run per pipeline: the lease, takeovers, fencing, batch ids across resets, and a
source definition that changed under stored progress."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.listener import EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.ownership import Ownership, owner_gone
from cdcflow.errors import FencedError, LeaseHeldError, PipelineDefinitionError
from cdcflow.metadata import MemoryStore, SQLiteStore
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import BatchPlan, Lease
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream

S = 1_000_000_000
T0 = 1_700_000_000 * S


def _stream() -> ScriptedChangeStream:
    s = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(40):
        s.write("T", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S // 4)
    return s


def _pipeline(stream: ScriptedChangeStream, sink: cf.Sink[Any, Any], *, end: int = 12,
              slow: float = 0.0) -> cf.Pipeline:
    p = cf.Pipeline("owned")

    def pause(r: Any) -> Any:
        time.sleep(slow)
        return r

    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + end * S, client=stream)
     | cf.ReadPartition() | "pause" >> cf.Map(pause) | sink)
    return p


def _engine(p: cf.Pipeline, store: MetadataStore, **options: Any) -> Engine:
    opts = RunOptions(batch_interval=0, max_batch_span=1.0, **options)
    return Engine(p, store, InMemoryRunner(workers=2), opts)


def _in_thread(engine: Engine) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            engine.run()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    return t, errors


def _wait_for_lease(store: MetadataStore) -> Lease:
    for _ in range(200):
        lease = store.lease("owned")
        if lease is not None and lease.expires_at:
            return lease
        time.sleep(0.02)
    raise AssertionError("the first run never took the lease")


def test_a_second_run_fails_at_once_naming_the_owner(tmp_path: Any) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    first_out: cf.Collect[Any] = cf.Collect()
    first = _engine(_pipeline(_stream(), first_out, slow=0.01), store)
    thread, errors = _in_thread(first)
    lease = _wait_for_lease(store)
    second_out: cf.Collect[Any] = cf.Collect()
    began = time.monotonic()

    class Unopened(InMemoryRunner):  # the second run sets nothing up (Spark starts a JVM)
        def open(self, pipeline: str) -> None:
            raise AssertionError("a refused run opened its runner")

    with pytest.raises(LeaseHeldError) as refused:
        Engine(_pipeline(_stream(), second_out), store, Unopened(),
               RunOptions(batch_interval=0)).run()
    assert time.monotonic() - began < 5
    text = str(refused.value)
    assert f"{socket.gethostname()}:" in text and lease.run_id in text and "--takeover" in text
    assert "\n" not in text
    thread.join()
    assert errors == [] and second_out.items == []  # nothing delivered by the refused run
    assert len(first_out.items) == 40
    assert store.lease("owned").expires_at == 0  # type: ignore[union-attr]  # released


def test_a_takeover_fences_the_running_driver_out() -> None:
    store = MemoryStore()
    old_out: cf.Collect[Any] = cf.Collect()
    old = _engine(_pipeline(_stream(), old_out, slow=0.02), store)
    thread, errors = _in_thread(old)
    _wait_for_lease(store)
    time.sleep(0.3)
    new_out: cf.Collect[Any] = cf.Collect()
    summary = _engine(_pipeline(_stream(), new_out), store, takeover=True).run()
    thread.join()
    assert summary.reason == "end reached"
    assert len(errors) == 1 and isinstance(errors[0], FencedError)
    # the old driver committed nothing after the takeover: every batch id's progress was
    # written by exactly one driver, and together they read every change
    values = sorted(r.mods[0].new_values["v"] for r in [*old_out.items, *new_out.items])
    assert set(values) == set(range(40))


def test_a_driver_that_finds_its_lease_lost_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The old driver's heartbeat finds the lease taken (an error, once): its next store
    call is fenced, and the run ends with that error, not with a warning blaming a stop
    request nobody made."""
    store = MemoryStore()
    # Its records take 0.5 s each: taken over while it reads its second batch, its
    # heartbeat (every 0.1 s) finds the lease taken before its tasks return.
    old = _engine(_pipeline(_stream(), cf.Collect(), slow=0.5), store, lease_ttl=0.3)
    thread, errors = _in_thread(old)
    _wait_for_lease(store)
    deadline = time.monotonic() + 60
    while not any(b.committed_at for b in store.batches("owned")):
        assert time.monotonic() < deadline, "the first run committed no batch"
        time.sleep(0.02)
    time.sleep(0.1)
    with caplog.at_level(logging.INFO, logger="cdcflow"):
        _engine(_pipeline(_stream(), cf.Collect()), store, takeover=True).run()
        thread.join()
    assert len(errors) == 1 and isinstance(errors[0], FencedError)
    assert "no longer current" in str(errors[0])  # the run ends with it: the last line
    assert "after the stop request" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # said once
    lost = [r.getMessage() for r in caplog.records if "is lost" in r.getMessage()]
    assert lost == ["the lease of pipeline owned is lost (FencedError): stopping after the "
                    "current batch"]


def test_a_crashed_run_on_this_host_is_taken_over_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    dead = subprocess.Popen(["true"])
    dead.wait()
    store.acquire_lease("owned", f"{socket.gethostname()}:{dead.pid}", "crashed", 3600 * S)
    out: cf.Collect[Any] = cf.Collect()
    with caplog.at_level(logging.INFO, logger="cdcflow.engine"):
        assert _engine(_pipeline(_stream(), out), store).run().reason == "end reached"
    assert len(out.items) == 40
    taken = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert taken == [f"taking over pipeline owned from {socket.gethostname()}:{dead.pid}, "
                     "whose process is gone"]
    # a run that ended cleanly released its lease: the next one takes it over silently
    ended = subprocess.Popen(["true"])
    ended.wait()
    lease = store.acquire_lease("owned", f"{socket.gethostname()}:{ended.pid}", "ended",
                                3600 * S, replace=store.lease("owned").token)  # type: ignore[union-attr]
    store.release_lease("owned", lease)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cdcflow.engine"):
        assert _engine(_pipeline(_stream(), cf.Collect()), store).run().reason == "end reached"
    assert not [r for r in caplog.records if "taking over" in r.getMessage()]


def test_a_run_knows_whether_the_run_before_it_released_its_lease() -> None:
    # (a crashed run's successor plans narrower batches: see engine.pacing)
    store = MemoryStore()
    first = Ownership(store, "owned", 3600.0, lambda e: None)
    first.acquire(takeover=False)
    assert not first.predecessor_crashed  # none before it
    first.release()
    second = Ownership(store, "owned", 3600.0, lambda e: None)
    second.acquire(takeover=False)
    assert not second.predecessor_crashed  # released
    second.release()
    # as a crash leaves it: held, not released
    lease = store.lease("owned")
    assert lease is not None
    store.acquire_lease("owned", "elsewhere:1", "crashed", 3600 * S, replace=lease.token)
    third = Ownership(store, "owned", 3600.0, lambda e: None)
    third.acquire(takeover=True)
    assert third.predecessor_crashed
    third.release()


def test_an_owner_killed_but_not_reaped_yet_is_gone() -> None:
    """A supervisor that restarts a run before it reaps the one it killed: the dead run's
    pid still answers os.kill (a zombie), but it holds nothing."""
    child = subprocess.Popen(["sleep", "30"])
    try:
        lease = Lease(f"{socket.gethostname()}:{child.pid}", "r", 1, 0, 0, 10**19)
        assert not owner_gone(lease)
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not owner_gone(lease):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()


def test_a_live_owner_elsewhere_is_not_taken_over_without_the_flag() -> None:
    alive = subprocess.Popen(["sleep", "30"])
    try:
        lease = Lease(f"{socket.gethostname()}:{alive.pid}", "r", 1, 0, 0, 10**19)
        assert not owner_gone(lease)
        assert not owner_gone(Lease(f"elsewhere:{alive.pid + 99999}", "r", 1, 0, 0, 10**19))
        store = MemoryStore()
        store.acquire_lease("owned", lease.owner, "live", 3600 * S)
        with pytest.raises(LeaseHeldError, match="live"):
            _engine(_pipeline(_stream(), cf.Collect()), store).run()
    finally:
        alive.kill()
        alive.wait()


def test_an_expired_lease_of_a_run_elsewhere_is_taken_over_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    store.acquire_lease("owned", "elsewhere:1234", "stalled", S // 100)
    time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="cdcflow.engine"):
        summary = _engine(_pipeline(_stream(), cf.Collect()), store).run()
    assert summary.reason == "end reached"
    (line,) = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert "from elsewhere:1234 (run stalled), whose lease expired" in line


def test_batch_ids_go_on_after_a_reset_even_if_the_reset_run_died_early() -> None:
    store = MemoryStore()
    _engine(_pipeline(_stream(), cf.Collect(), end=3), store).run()
    last = store.last_batch_id("owned")
    assert last >= 3
    store.reset("owned")  # what a --reset run does before it dies without planning
    assert store.last_batch_id("owned") == last
    _engine(_pipeline(_stream(), cf.Collect(), end=3), store).run()
    first_new = min(b.batch_id for b in store.batches("owned", limit=1000))
    assert first_new == last + 1


def test_a_changed_source_warns_or_with_strict_refuses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    _engine(_pipeline(_stream(), cf.Collect(), end=3), store, max_batches=1).run()
    with caplog.at_level(logging.WARNING, logger="cdcflow.engine"):
        _engine(_pipeline(_stream(), cf.Collect(), end=5), store, max_batches=1).run()
    warned = [r.getMessage() for r in caplog.records if "source changed" in r.getMessage()]
    assert len(warned) == 1 and "end_at" in warned[0] and "--reset" in warned[0]
    with pytest.raises(PipelineDefinitionError, match=r"end_at.*--reset"):
        _engine(_pipeline(_stream(), cf.Collect(), end=5), store, strict=True).run()
    # --reset takes the new definition
    _engine(_pipeline(_stream(), cf.Collect(), end=5), store, reset=True, max_batches=1).run()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cdcflow.engine"):
        _engine(_pipeline(_stream(), cf.Collect(), end=5), store, strict=True).run()
    assert not [r for r in caplog.records if "source changed" in r.getMessage()]


_SLOW_RELEASE = """
import sys, time
import cdcflow as cf
from cdcflow.engine.listener import EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import MemoryStore
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream


class SlowRelease(MemoryStore):  # a store that stopped answering as the run ends
    def release_lease(self, pipeline, lease):
        print("releasing", flush=True)
        time.sleep(60)


T0 = 10**18
stream = ScriptedChangeStream("S", partitions=1, origin=T0)
p = cf.Pipeline("slow-release")
(p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 10**9, client=stream)
 | cf.ReadPartition() | cf.Collect())
try:
    Engine(p, SlowRelease(), InMemoryRunner(), RunOptions(batch_interval=0)).run()
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_a_signal_while_the_lease_is_released_stops_with_a_warning() -> None:
    """The run's end waits on a store that does not answer to release the lease: a SIGTERM
    stops it at once with a warning (the lease lapses by itself), not Python's default
    death by signal without a word."""
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_RELEASE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "releasing"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "signal 15 while the lease was being released: stopping now; the lease lapses " \
           "by itself" in err



def test_a_run_taken_over_while_idle_does_not_flush_its_staged_output(tmp_path: Any) -> None:
    """A run that another run took over (it was paused past its lease, say) must not make
    its staged output durable on its way out: the run that took over replays those batches
    into the same tables, so the old run's final flush held them twice."""
    from cdcflow.transforms import WriteTables

    now = time.time_ns()
    stream = ScriptedChangeStream("S", partitions=1, origin=now - 3 * S)
    for i in range(20):
        stream.write("T", i, "INSERT", {"v": i}, at=now - 3 * S + i * S // 10)
    p = cf.Pipeline("owned")
    lake = tmp_path / "lake"
    (p | cf.DetectPartitions(stream="S", start_at=now - 3 * S, client=stream)
     | cf.ReadPartition() | WriteTables(f"file://{lake}", format="jsonl", flush_interval="1h"))
    old = Engine(p, MemoryStore(), InMemoryRunner(workers=1),
                 RunOptions(batch_interval=5.0, max_batch_span=10.0, lease_ttl=0.3))
    store = old.store
    thread, errors = _in_thread(old)
    _wait_for_lease(store)
    for _ in range(100):  # caught up: the changes are staged, and the run waits for more
        if store.last_batch_id("owned") >= 2 and store.pending_plan("owned") is None:
            break
        time.sleep(0.05)
    store.acquire_lease("owned", "elsewhere:1", "newer", 60 * S, replace=True)
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], FencedError), errors
    assert sorted(f.name for f in lake.rglob("part-*")) == []


def test_a_lease_that_cannot_be_released_is_one_warning_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store plugin's error there came with its traceback, without --debug."""

    class Sticky(MemoryStore):
        def release_lease(self, pipeline: str, lease: Lease) -> None:
            raise RuntimeError("boom in release_lease")

    with caplog.at_level(logging.INFO, logger="cdcflow"):
        _engine(_pipeline(_stream(), cf.Collect(), end=2), Sticky()).run()
    (said,) = [r for r in caplog.records if "could not release the lease" in r.getMessage()]
    assert "(Sticky.release_lease() raised RuntimeError: boom in release_lease)" in (
        said.getMessage())
    assert not said.exc_info  # no traceback without --debug


def test_a_run_whose_lease_cannot_be_renewed_stops_a_lease_after_it_ran_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store (a plugin) whose renewals keep failing while its other calls work: the
    run went on for ever, its side effects waiting for a lease it did not have. It now
    stops once a whole lease has passed since the lease ran out, in one error line."""
    from cdcflow.errors import LeaseLapsedError

    class NoRenewal(MemoryStore):
        def renew_lease(self, pipeline: str, lease: Lease, ttl_ns: int) -> Lease:
            raise RuntimeError("boom in renew_lease")

    now = time.time_ns()
    stream = ScriptedChangeStream("S", partitions=1, origin=now - 3 * S)
    for i in range(20):
        stream.write("T", i, "INSERT", {"v": i}, at=now - 3 * S + i * S // 10)
    p = cf.Pipeline("owned")
    (p | cf.DetectPartitions(stream="S", start_at=now - 3 * S, client=stream)  # no end
     | cf.ReadPartition() | cf.Collect())
    engine = Engine(p, NoRenewal(), InMemoryRunner(workers=1),
                    RunOptions(batch_interval=0.1, max_batch_span=1.0, lease_ttl=0.6))
    with caplog.at_level(logging.INFO, logger="cdcflow"):
        thread, errors = _in_thread(engine)
        thread.join(timeout=30)
    assert not thread.is_alive(), "the run went on without its lease"
    assert len(errors) == 1 and isinstance(errors[0], LeaseLapsedError), errors
    assert "boom in renew_lease" in str(errors[0])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
              and "renewing the lease" in r.getMessage()]
    assert warned and all("NoRenewal.renew_lease() raised RuntimeError: boom in renew_lease" in w
                          for w in warned)
    assert "could not be renewed" in str(errors[0])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # said once
    assert "is lost (LeaseLapsedError)" in caplog.text


def test_a_run_whose_lease_renewal_hangs_stops_and_does_not_wait_for_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A renew_lease that never returns: the heartbeat could not say anything, the run
    went on committing with a lapsed lease, and stopping it hung for good waiting for the
    heartbeat thread. A watch now stops it a lease after the lease ran out, and the
    release does not wait for the hung call."""
    from cdcflow.engine import ownership
    from cdcflow.errors import LeaseLapsedError

    monkeypatch.setattr(ownership, "_RELEASE_WAIT", 0.5)
    hang = threading.Event()

    class Hanging(MemoryStore):
        def renew_lease(self, pipeline: str, lease: Lease, ttl_ns: int) -> Lease:
            hang.wait(60)
            raise RuntimeError("released by the test")

    now = time.time_ns()
    stream = ScriptedChangeStream("S", partitions=1, origin=now - 3 * S)
    stream.write("T", 1, "INSERT", {"v": 1}, at=now - 2 * S)
    p = cf.Pipeline("owned")
    (p | cf.DetectPartitions(stream="S", start_at=now - 3 * S, client=stream)  # no end
     | cf.ReadPartition() | cf.Collect())
    engine = Engine(p, Hanging(), InMemoryRunner(workers=1),
                    RunOptions(batch_interval=0.1, max_batch_span=1.0, lease_ttl=0.6))
    try:
        with caplog.at_level(logging.INFO, logger="cdcflow"):
            began = time.monotonic()
            thread, errors = _in_thread(engine)
            thread.join(timeout=20)
            took = time.monotonic() - began
        assert not thread.is_alive(), "the run went on, or its stop waited for the renewal"
        assert len(errors) == 1 and isinstance(errors[0], LeaseLapsedError), errors
        assert "renew_lease() has not answered" in str(errors[0])
        assert took < 8, took
        assert "has not answered for" in caplog.text  # said while it waits
        assert "could not release the lease of owned (renewing it has not answered" in (
            caplog.text)
    finally:
        hang.set()


class _AbortsNoted(cf.Collect[Any]):
    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[int] = []

    def abort(self, batch_id: int, messages: Any) -> None:
        self.aborted.append(batch_id)
        super().abort(batch_id, messages)


def test_a_run_fenced_out_mid_batch_leaves_the_batch_to_the_run_that_took_over() -> None:
    """A sink's abort sweeps every attempt's leftovers of the batch id, and the run that
    took the pipeline over may be writing that batch (WriteFiles' temporary files were
    deleted under it): a run whose lease is lost aborts nothing."""
    store = MemoryStore()
    taken: list[int] = []

    class TakeOver(EngineListener):  # another run takes the pipeline as batch 2 is read
        def on_planned(self, plan: BatchPlan, replay: bool) -> None:
            lease = store.lease("owned")
            if plan.batch_id == 2 and lease is not None:
                taken.append(store.acquire_lease("owned", "elsewhere:1", "new", 3600 * S,
                                                 replace=lease.token).token)

    sink = _AbortsNoted()
    opts = RunOptions(batch_interval=0, max_batch_span=1.0)
    engine = Engine(_pipeline(_stream(), sink), store, InMemoryRunner(workers=2), opts,
                    TakeOver())
    with pytest.raises(FencedError):
        engine.run()
    assert taken and sink.aborted == []
