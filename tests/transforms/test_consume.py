"""Consume: keyed concurrency, acks and nacks under the error policy, timeouts, drain, and
at-least-once delivery through the engine on every runner."""

from __future__ import annotations

import gc
import itertools
import json
import logging
import os
import random
import sys
import threading
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import cdcflow as cf
from cdcflow.engine.listener import EngineListener
from cdcflow.engine.loop import Engine, RunOptions, RunSummary
from cdcflow.engine.runner import Runner
from cdcflow.errors import (
    PipelineDefinitionError,
    PipelineStopped,
    SinkError,
    TransientError,
    WriterFailed,
    WriterStopped,
)
from cdcflow.metadata import MemoryStore
from cdcflow.model import BatchPlan
from cdcflow.policy import Decision, ErrorPolicy, FailedElement, Retry, Skip, Stop
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, Consume, Consumed, DetectPartitions, ReadPartition
from cdcflow.transforms import idempotency_key as ikey
from cdcflow.transforms.base import WriterContext

# The functions below run where the tasks run (Spark's Python workers too), which cannot
# import this test module by name: they travel by value, as a pipeline file's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

S = 1_000_000_000
T0 = 1_700_000_000 * S
END = T0 + 10 * S


def _writer(consume: Consume[Any], token: str = "tok") -> Any:
    return consume.open_writer(WriterContext("p", "consume", 1, token, 0, 10, "attempt"))


def _eventually(check: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


# -- the writer: keyed concurrency ------------------------------------------------------------


def test_each_keys_calls_run_in_order_and_never_overlap() -> None:
    lock = threading.Lock()
    spans: dict[int, list[tuple[int, float, float]]] = defaultdict(list)
    running: set[int] = set()
    peak = 0

    def fn(element: tuple[int, int]) -> None:
        nonlocal peak
        key, seq = element
        with lock:
            running.add(key)
            peak = max(peak, len(running))
        start = time.monotonic()
        time.sleep(random.random() * 0.003)
        end = time.monotonic()
        with lock:
            running.discard(key)
            spans[key].append((seq, start, end))

    consume = Consume(fn, max_inflight=16, key=lambda e: e[0])
    writer = _writer(consume)
    keys = 40
    for seq in range(1200):
        writer.write((random.randrange(keys), seq))
    message = writer.close()
    assert message == Consumed(elements=1200, acked=1200, calls=1200)
    assert peak > 8  # the pool did run many keys at once
    assert sum(len(calls) for calls in spans.values()) == 1200
    for calls in spans.values():
        assert [seq for seq, _, _ in calls] == sorted(seq for seq, _, _ in calls)
        for (_, _, end), (_, start, _) in itertools.pairwise(calls):
            assert start >= end  # one call of a key at a time


def _sleep_10ms(element: Any) -> None:
    time.sleep(0.01)


class _Overlap:
    """A call that sleeps 10 ms and notes how many calls ran at once at most."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = self.most = 0

    def __call__(self, element: int) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.01)
        with self.lock:
            self.running -= 1


def test_max_inflight_runs_calls_concurrently() -> None:
    most = {}
    for n in (1, 16):
        calls = _Overlap()
        writer = _writer(Consume(calls, max_inflight=n))
        for i in range(100):
            writer.write(i)
        assert writer.close() == Consumed(elements=100, acked=100, calls=100)
        most[n] = calls.most
    # at most max_inflight at once, and many at once when allowed (how many exactly
    # depends on how fast the reader hands them over)
    assert most[1] == 1
    assert 8 <= most[16] <= 16, most


def test_a_task_with_few_elements_starts_few_threads() -> None:
    """Workers start as keys become due: a task with two keys starts two threads, not
    max_inflight (at 10,000 partitions, 64 threads per task cost seconds a batch)."""
    seen: list[int] = []

    def fn(e: int) -> None:
        seen.append(sum(t.name == "cdcflow-consume-consume" for t in threading.enumerate()))
        time.sleep(0.05)

    writer = _writer(Consume(fn, max_inflight=64, key=lambda e: e % 2))
    for i in range(6):
        writer.write(i)
    assert writer.close() == Consumed(elements=6, acked=6, calls=6)
    assert seen and max(seen) == 2, seen


def test_a_retry_due_while_every_started_thread_is_busy_gets_a_thread_of_its_own() -> None:
    calls: list[tuple[str, float]] = []
    began = time.monotonic()

    def fn(e: str) -> None:
        calls.append((e, time.monotonic() - began))
        if e == "a" and len(calls) == 1:
            raise ConnectionError("once")
        if e == "b":
            time.sleep(1.0)

    policy = ErrorPolicy(handler=lambda err, el, tok, n: Retry(after=0.2))
    writer = _writer(Consume(fn, max_inflight=2, key=lambda e: e, on_error=policy))
    writer.write("a")
    _eventually(lambda: len(calls) == 1)  # a failed: its one thread waits out the delay...
    time.sleep(0.02)
    writer.write("b")  # ...and takes b, which runs 1 s: a, due at 0.2 s, needs another
    assert writer.close() == Consumed(elements=2, acked=2, calls=3, retries=1)
    (again,) = [at for e, at in calls[1:] if e == "a"]
    assert 0.2 <= again < 0.8, calls  # not after b's 1 s call


def test_writes_block_while_the_pool_and_its_queue_are_full() -> None:
    release = threading.Event()
    writer = _writer(Consume(lambda e: release.wait(10), max_inflight=2))
    for i in range(2 * 5):  # 2 in flight, 8 waiting
        writer.write(i)
    blocked = threading.Thread(target=writer.write, args=(10,))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # backpressure: the reader waits
    release.set()
    blocked.join(5)
    assert not blocked.is_alive()
    assert writer.close() == Consumed(elements=11, acked=11, calls=11)


# -- nacks under the error policy -------------------------------------------------------------


def test_nacks_are_retried_then_skipped_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    lock = threading.Lock()
    attempts: Counter[int] = Counter()
    acked: list[int] = []

    def fn(n: int) -> None:
        with lock:
            attempts[n] += 1
            tries = attempts[n]
        if n % 10 == 7:
            msg = f"bad {n}"
            raise ValueError(msg)
        if n % 10 == 3 and tries <= 2:
            msg = f"flaky {n}"
            raise ConnectionError(msg)
        with lock:
            acked.append(n)

    policy = ErrorPolicy(retries=2, backoff=0.001, then="skip")
    writer = _writer(Consume(fn, max_inflight=4, key=lambda n: n % 4, on_error=policy))
    with caplog.at_level(logging.WARNING, logger="cdcflow.consume"):
        for n in range(40):
            writer.write(n)
        message = writer.close()
    assert message.elements == 40 and message.acked == 36 and message.skipped == 4
    assert message.retries == 4 * 2 + 4 * 2  # 3, 13, 23, 33 and 7, 17, 27, 37
    assert message.calls == 40 + message.retries
    assert sorted(message.errors) == [f"ValueError: bad {n}" for n in (17, 27, 37, 7)]
    assert sorted(acked) == [n for n in range(40) if n % 10 != 7]
    for k in range(4):  # a retried element still came before its key's later elements
        mine = [n for n in acked if n % 4 == k]
        assert mine == sorted(mine)
    skipped = [r.getMessage() for r in caplog.records if "skipped an element" in r.getMessage()]
    assert len(skipped) == 4 and all("after 3 attempt(s): ValueError" in s for s in skipped)


def test_a_retry_waits_its_delay_and_holds_its_key() -> None:
    calls: list[tuple[str, float]] = []

    def fn(e: str) -> None:
        calls.append((e, time.monotonic()))
        if e == "a" and len(calls) == 1:
            raise ConnectionError("once")

    policy = ErrorPolicy(handler=lambda err, el, tok, n: Retry(after=0.1))
    writer = _writer(Consume(fn, max_inflight=4, key=lambda e: "same", on_error=policy))
    writer.write("a")
    writer.write("b")
    assert writer.close() == Consumed(elements=2, acked=2, calls=3, retries=1)
    assert [e for e, _ in calls] == ["a", "a", "b"]
    assert calls[1][1] - calls[0][1] >= 0.1


def test_a_retry_waiting_its_delay_holds_no_thread() -> None:
    """With one thread, a key waiting out a Retry's delay lets other keys' calls run."""
    calls: list[tuple[str, float]] = []

    def fn(e: str) -> None:
        calls.append((e, time.monotonic()))
        if e == "a" and len(calls) == 1:
            raise ConnectionError("once")

    policy = ErrorPolicy(handler=lambda err, el, tok, n: Retry(after=0.5))
    writer = _writer(Consume(fn, max_inflight=1, key=lambda e: e[0], on_error=policy))
    for e in ("a", "a2", "b", "c"):
        writer.write(e)
    assert writer.close() == Consumed(elements=4, acked=4, calls=5, retries=1)
    order = [e for e, _ in calls]
    assert order == ["a", "b", "c", "a", "a2"]  # b and c did not wait for a's delay
    at = dict(calls[1:3])
    assert at["c"] - calls[0][1] < 0.4
    assert calls[3][1] - calls[0][1] >= 0.5


def test_retry_delays_do_not_count_against_the_drain_timeout() -> None:
    """A call that fails fast, retried after delays longer than drain_timeout, is waited
    for: the drain bounds time without any call finishing, and a delay is not that."""
    calls: list[float] = []

    def fn(e: str) -> None:
        calls.append(time.monotonic())
        if len(calls) <= 2:
            raise ConnectionError("down")

    policy = ErrorPolicy(handler=lambda err, el, tok, n: Retry(after=0.4))
    writer = _writer(Consume(fn, drain_timeout=0.2, on_error=policy))
    writer.write("a")
    assert writer.close() == Consumed(elements=1, acked=1, calls=3, retries=2)
    assert calls[2] - calls[0] >= 0.8


async def _async_send(e: object) -> None:
    pass


def _generator_send(e: object) -> Any:
    yield e


class _AsyncCallable:
    async def __call__(self, e: object) -> None:
        pass


def test_functions_whose_call_does_nothing_are_refused() -> None:
    """An async or generator fn would return at once, its work not done, and every element
    would be acked: refused where the pipeline is defined, and a call that returns an
    awaitable stops the run with the fix."""
    for fn, kind in ((_async_send, "an async function"),
                     (_generator_send, "a generator function"),
                     (_AsyncCallable(), "an async function")):
        with pytest.raises(PipelineDefinitionError, match=f"fn is {kind}.*asyncio.run"):
            Consume(fn)
    writer = _writer(Consume(lambda e: _async_send(e)))
    writer.write(1)
    with pytest.raises(PipelineDefinitionError, match=r"fn returned coroutine.*plain function"):
        writer.close()


def test_fn_ending_the_process_stops_the_run_with_one_line() -> None:
    def fn(e: int) -> None:
        sys.exit(3)

    writer = _writer(Consume(fn))
    writer.write(1)
    with pytest.raises(PipelineStopped, match=r"fn raised SystemExit\(3\).*may not end the "
                                              r"process"):
        writer.close()


def test_stop_fails_the_writer_with_pipeline_stopped() -> None:
    def fn(e: str) -> None:
        if e == "bad":
            raise ValueError("no good")

    seen: list[tuple[str, str, int]] = []

    def handler(error: Exception, element: Any, token: str, attempt: int) -> Decision:
        seen.append((element, token, attempt))
        return Stop()

    writer = _writer(Consume(fn, on_error=ErrorPolicy(handler=handler)), token="p7")
    writer.write("bad")

    def write_fails() -> bool:
        try:
            writer.write("more")
        except PipelineStopped:
            return True
        return False

    _eventually(write_fails)  # the reader stops soon after the stop
    with pytest.raises(PipelineStopped, match="partition p7 after 1 attempt") as info:
        writer.close()
    assert isinstance(info.value.__cause__, ValueError)
    assert seen == [("bad", "p7", 1)]


def test_a_handler_that_raises_fails_the_writer() -> None:
    def handler(error: Exception, element: Any, token: str, attempt: int) -> Decision:
        raise RuntimeError("handler broke")

    writer = _writer(Consume(lambda e: 1 / 0, on_error=ErrorPolicy(handler=handler)))
    writer.write(1)
    with pytest.raises(PipelineStopped, match="handler raised RuntimeError: handler broke"):
        writer.close()


# -- timeouts, drain, abort -------------------------------------------------------------------


def test_a_call_past_the_timeout_is_abandoned_and_retried() -> None:
    release = threading.Event()
    calls: Counter[str] = Counter()
    returned: list[str] = []

    def fn(e: str) -> None:
        calls[e] += 1
        if e == "stuck" and calls[e] == 1:
            release.wait(10)
            return
        returned.append(e)

    policy = ErrorPolicy(retries=1, backoff=0)
    consume = Consume(fn, max_inflight=1, key=lambda e: "k", timeout="50ms", on_error=policy)
    writer = _writer(consume)
    began = time.monotonic()
    writer.write("stuck")
    writer.write("next")
    message = writer.close()
    assert time.monotonic() - began < 2
    assert message == Consumed(elements=2, acked=2, calls=3, retries=1, timeouts=1)
    assert returned == ["stuck", "next"]  # a fresh thread took over, in key order
    release.set()


def test_a_timed_out_call_can_be_skipped() -> None:
    release = threading.Event()
    policy = ErrorPolicy(retries=0, then="skip")
    writer = _writer(Consume(lambda e: release.wait(10), timeout=0.05, on_error=policy))
    writer.write(1)
    message = writer.close()
    release.set()
    assert message is not None and message.skipped == 1 and message.timeouts == 1
    assert message.errors == ("TimeoutError: the call did not return within 0.05s",)


def test_too_many_stuck_calls_fail_the_task() -> None:
    release = threading.Event()
    forever = ErrorPolicy(handler=lambda err, el, tok, n: Retry(0))
    writer = _writer(Consume(lambda e: release.wait(10), timeout=0.02, on_error=forever))
    writer.write(1)
    try:
        with pytest.raises(SinkError, match=r"9 calls are stuck past timeout=0.02s"):
            writer.close()
    finally:
        release.set()


def test_close_drains_every_element_before_it_returns() -> None:
    done: list[int] = []

    def fn(n: int) -> None:
        time.sleep(0.05)
        done.append(n)

    writer = _writer(Consume(fn, max_inflight=4))
    for n in range(20):
        writer.write(n)
    assert len(done) < 20
    assert writer.close() == Consumed(elements=20, acked=20, calls=20)
    assert sorted(done) == list(range(20))


def test_close_past_the_drain_timeout_fails_the_task() -> None:
    release = threading.Event()
    writer = _writer(Consume(lambda e: release.wait(10), drain_timeout=0.1))
    writer.write(1)
    try:
        with pytest.raises(SinkError, match=r"not acknowledged at the task's end: no call "
                                             r"finished for 0\.1s.*a replay of the batch"):
            writer.close()
    finally:
        release.set()


def test_a_hung_call_holding_a_full_queue_fails_the_task_after_the_drain_timeout() -> None:
    """The hung call's key holds its later elements in the queue until it is full: write
    blocks, so close (and its drain_timeout) would never come. write gives up after
    drain_timeout without any call finishing, as a whole-writer failure."""
    release = threading.Event()

    def fn(n: int) -> None:
        if n == 0:
            release.wait(30)

    writer = _writer(Consume(fn, max_inflight=2, key=lambda n: 0, drain_timeout=0.5))
    began = time.monotonic()
    try:
        with pytest.raises(WriterFailed, match=r"no call finished for 0\.5s while the pool"):
            for n in range(100):
                writer.write(n)
        assert time.monotonic() - began < 5
        writer.abort()
    finally:
        release.set()


def test_a_revoked_guard_ends_a_write_waiting_on_a_hung_call() -> None:
    """A second Ctrl-C (or a lost lease) revokes the run's guard: a write blocked behind a
    hung call fails with the guard's error within a second, and abort does not wait for the
    hung call."""
    release = threading.Event()
    revoked: list[BaseException] = []

    def guard() -> None:
        if revoked:
            raise revoked[0]

    def fn(n: int) -> None:
        if n == 0:
            release.wait(30)

    ctx = WriterContext("p", "consume", 1, "tok", 0, 10, "attempt", guard=guard)
    writer = Consume(fn, max_inflight=2, key=lambda n: 0).open_writer(ctx)
    threading.Timer(0.3, lambda: revoked.append(PipelineStopped("aborted"))).start()
    began = time.monotonic()
    try:
        with pytest.raises(PipelineStopped, match="aborted"):
            for n in range(100):
                writer.write(n)
        writer.abort()
        assert time.monotonic() - began < 3
    finally:
        release.set()


def test_a_stop_requested_while_calls_are_retried_gives_the_batch_up() -> None:
    """A graceful stop (SIGTERM, --for) while the downstream fails: the writer does not
    retry on (it could for minutes) but gives the batch up as transient, which the engine
    turns into a stopped run; without retries pending, a stop lets the batch finish."""
    stopping = threading.Event()
    calls = [0]

    def failing(e: str) -> None:
        calls[0] += 1
        raise ConnectionError("down")

    ctx = WriterContext("p", "consume", 1, "tok", 0, 10, "attempt", stopping=stopping.is_set)
    policy = ErrorPolicy(handler=lambda err, el, tok, n: Retry(after=2))
    writer = Consume(failing, on_error=policy).open_writer(ctx)
    writer.write("a")
    threading.Timer(0.3, stopping.set).start()
    began = time.monotonic()
    with pytest.raises(WriterStopped, match=r"asked to stop while 1 element.*retried"):
        writer.close()
    assert time.monotonic() - began < 1.5 and calls[0] == 1
    assert isinstance(WriterStopped("x"), TransientError)
    # a healthy writer finishes its batch after the stop
    done = Consume(lambda e: time.sleep(0.2)).open_writer(ctx)
    done.write("b")
    assert done.close() == Consumed(elements=1, acked=1, calls=1)


def test_a_call_within_its_timeout_is_waited_for_past_the_drain_timeout() -> None:
    """timeout=2s with drain_timeout=0.3s: a call of 1 s is within its timeout, so the
    writer waits for it rather than fail the task at the drain timeout."""
    writer = _writer(Consume(lambda e: time.sleep(1.0), timeout=2, drain_timeout=0.3))
    writer.write("slow")
    assert writer.close() == Consumed(elements=1, acked=1, calls=1)


class _Big:
    """An element a weak reference can watch."""


def test_an_acked_element_is_not_kept_alive_by_its_thread() -> None:
    """Once acked, an element has left the byte quota: a pool thread waiting for its next
    call must not hold it (with 2 MB elements, 16 threads a task held 32 MB unaccounted)."""
    done: list[int] = []
    elements = [_Big() for _ in range(4)]
    refs = [weakref.ref(e) for e in elements]
    writer = _writer(Consume(lambda e: done.append(1), max_inflight=4))
    for element in elements:
        writer.write(element)
    del elements, element
    _eventually(lambda: len(done) == 4)
    time.sleep(0.1)  # every thread is back waiting for work
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    assert writer.close() == Consumed(elements=4, acked=4, calls=4)


def test_abort_drops_waiting_elements() -> None:
    calls: list[int] = []

    def fn(n: int) -> None:
        calls.append(n)
        time.sleep(0.05)

    writer = _writer(Consume(fn))
    for n in range(5):
        writer.write(n)
    writer.abort()
    so_far = len(calls)
    time.sleep(0.2)
    assert so_far == len(calls) <= 2
    with pytest.raises(SinkError, match="after close"):
        writer.write(9)


def test_a_writer_that_took_nothing_commits_nothing() -> None:
    writer = _writer(Consume(print))
    assert writer.close() is None


# -- definition and bookkeeping ---------------------------------------------------------------


def test_bad_definitions_are_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="takes a function"):
        Consume("print")  # type: ignore[arg-type]
    with pytest.raises(PipelineDefinitionError, match="whole number >= 1"):
        Consume(print, max_inflight=0)
    with pytest.raises(PipelineDefinitionError,
                       match=r"Consume\(timeout=0\): use a finite time > 0"):
        Consume(print, timeout=0)
    with pytest.raises(PipelineDefinitionError,
                       match=r"Consume\(drain_timeout=\.\.\.\): not a duration: 'soon'"):
        Consume(print, drain_timeout="soon")
    dead = ErrorPolicy(then="skip", dead_letter=Collect())
    with pytest.raises(PipelineDefinitionError, match="go to the pipeline's dead-letter sink"):
        Consume(print, on_error=dead)
    writer = _writer(Consume(print, key=lambda e: [e]))
    with pytest.raises(TypeError, match="not hashable"):
        writer.write(1)


def test_commit_counts_each_batch_once_on_the_driver(caplog: pytest.LogCaptureFixture) -> None:
    consume = Consume(print, max_inflight=2)
    labelled = "notify" >> consume
    assert isinstance(labelled, Consume) and consume.default_label() == "Consume(print)"
    assert consume.describe_params() == "max_inflight=2"
    one = Consumed(elements=3, acked=2, skipped=1, calls=4, retries=1, errors=("E: x",))
    with caplog.at_level(logging.WARNING, logger="cdcflow.consume"):
        labelled.commit(1, [one, one])
        labelled.commit(1, [one, one])  # a replayed batch: bookkeeping only once
        labelled.commit(2, [])
    assert consume.stats() == Consumed(6, 4, 2, 8, 2, 0, ("E: x", "E: x"))
    assert consume.committed_batches == 2
    assert "notify skipped 2 element(s) in batch 1, e.g. E: x; E: x" in caplog.text
    copy = cloudpickle.loads(cloudpickle.dumps(consume))
    assert copy.stats() == Consumed() and copy.max_inflight == 2


# -- through the engine, on every runner -------------------------------------------------------


def _stream(writes: int = 120, seed: int = 3) -> ScriptedChangeStream:
    """Two partitions, one of which splits; single-mod changes to 12 keys."""
    rng = random.Random(seed)
    s = ScriptedChangeStream("S", partitions=2, buckets=16, origin=T0)
    s.split("p0", at=T0 + 4 * S, into=["a", "b"])
    for i in range(writes):
        s.write("T", rng.randrange(12), "UPDATE", {"i": i}, at=T0 + rng.randrange(0, 9 * S))
    return s


def _row(r: cf.DataChangeRecord) -> int:
    return int(r.mods[0].keys["id"])


class _Recorder:
    """Appends one JSON line per returned call to ``path`` (from any process): the record's
    idempotency key, its row key, the call's monotonic start and end, and the pid. Raises on
    the record whose value is ``poison``."""

    def __init__(self, path: Path, poison: int | None = None) -> None:
        self.path, self.poison = str(path), poison

    def __call__(self, r: cf.DataChangeRecord) -> None:
        if r.mods[0].new_values["i"] == self.poison:
            msg = f"poison {self.poison}"
            raise ValueError(msg)
        start = time.monotonic()
        time.sleep(random.random() * 0.002)
        line = {"id": ikey(r), "row": _row(r), "start": start, "end": time.monotonic(),
                "pid": os.getpid()}
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def calls(self) -> list[dict[str, Any]]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f]


class _Consulted:
    """A pipeline error handler that leaves a mark when it is asked."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __call__(self, error: Exception, element: Any, token: str, attempt: int) -> Decision:
        with open(self.path, "a") as f:
            f.write(f"{type(error).__name__}\n")
        return Stop()


def _run(
    runner: Runner, s: ScriptedChangeStream, consume: Consume[Any], store: Any = None,
    listener: EngineListener | None = None, policy: ErrorPolicy | None = None,
    *, pipelined: bool = True,
) -> RunSummary:
    p = cf.Pipeline("consume", error_policy=policy)
    source = DetectPartitions(stream="S", start_at=T0, end_at=END - 1, client=s)
    p | source | ReadPartition() | consume
    opts = RunOptions(max_batch_span=2.0, batch_interval=0.0, batch_retries=0,
                      pipelined=pipelined)
    return Engine(p, store or MemoryStore(), runner, opts, listener).run()


def test_every_change_is_consumed_once_in_per_key_order(runner: Runner, tmp_path: Path) -> None:
    s = _stream()
    recorder = _Recorder(tmp_path / "calls.jsonl")
    consume = Consume(recorder, max_inflight=8, key=_row)
    summary = _run(runner, s, consume)
    expected = s.expected_records(T0, END)
    assert summary.reason == "end reached" and summary.records == len(expected)
    calls = recorder.calls()
    assert Counter(c["id"] for c in calls) == Counter(ikey(r) for r in expected)  # exactly once
    stats = consume.stats()
    assert stats == Consumed(elements=len(expected), acked=len(expected), calls=len(expected))
    assert consume.committed_batches == summary.batches > 3
    by_row: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for c in sorted(calls, key=lambda c: c["start"]):
        by_row[c["row"]].append(c)
    for row, mine in by_row.items():
        want = [ikey(r) for r in sorted(expected, key=lambda r: r.commit_timestamp.ns)
                if _row(r) == row]
        assert [c["id"] for c in mine] == want  # commit order per key
        assert all(b["start"] >= a["end"] for a, b in itertools.pairwise(mine))
    pids = {c["pid"] for c in calls}
    # the pool lives where the task runs: a Spark executor's Python worker
    assert (pids == {os.getpid()}) == (runner.name == "memory")


class _Flaky:
    """Raises ConnectionError on the first call for a record whose value is divisible by 5
    (a retry acks it) and ValueError on every call for one divisible by 7 (skipped)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __call__(self, r: cf.DataChangeRecord) -> None:
        i = r.mods[0].new_values["i"]
        if i % 7 == 0:
            msg = f"bad {i}"
            raise ValueError(msg)
        if i % 5 == 0 and not os.path.exists(f"{self.path}.{i}"):
            open(f"{self.path}.{i}", "w").close()
            msg = f"flaky {i}"
            raise ConnectionError(msg)


def test_consumes_skips_and_retries_are_counted_with_the_pipelines(
    runner: Runner, tmp_path: Path
) -> None:
    s = _stream()
    values = [r.mods[0].new_values["i"] for r in s.expected_records(T0, END)]
    consume = Consume(_Flaky(tmp_path / "seen"), max_inflight=4, key=_row,
                      on_error=ErrorPolicy(retries=2, backoff=0.001, then="skip"))
    batches: list[Any] = []

    class Batches(EngineListener):
        def on_batch(self, stats: Any) -> None:
            batches.append(stats)

    summary = _run(runner, s, consume, listener=Batches())
    skipped = sum(1 for i in values if i % 7 == 0)
    retried = 2 * skipped + sum(1 for i in values if i % 5 == 0 and i % 7 != 0)
    assert skipped > 0 and retried > skipped
    assert consume.stats().skipped == skipped and consume.stats().retries == retried
    assert (summary.skipped, summary.retried) == (skipped, retried)
    assert sum(b.counters.get("skipped", 0) for b in batches) == skipped
    assert sum(b.counters.get("retries", 0) for b in batches) == retried


def test_stop_commits_nothing_of_the_batch_and_replays_it(
    runner: Runner, tmp_path: Path
) -> None:
    s = _stream()
    expected = sorted(s.expected_records(T0, END), key=lambda r: r.commit_timestamp.ns)
    poison = int(expected[len(expected) // 2].mods[0].new_values["i"])
    store, path = MemoryStore(), tmp_path / "calls.jsonl"
    stopping = Consume(_Recorder(path, poison), on_error=ErrorPolicy(retries=1, backoff=0.001))
    consulted = tmp_path / "consulted"

    class Planned(EngineListener):
        def __init__(self) -> None:
            self.plans: list[BatchPlan] = []

        def on_planned(self, plan: BatchPlan, replay: bool) -> None:
            self.plans.append(plan)

    planned = Planned()
    with pytest.raises(PipelineStopped, match=f"ValueError: poison {poison}"):
        _run(runner, s, stopping, store, planned,
             policy=ErrorPolicy(handler=_Consulted(consulted)))
    assert not consulted.exists()  # Consume's own stop passed through the pipeline's policy
    # its tasks failed, so its plan was not written: the next run plans it again
    assert store.pending_plan("consume") is None
    stopped_batch = _records_in(planned.plans[-1], expected)
    assert poison in {int(r.mods[0].new_values["i"]) for r in stopped_batch}
    committed = stopping.stats()
    assert committed.acked == committed.elements < len(expected) - len(stopped_batch) + 1

    fixed = Consume(_Recorder(path))
    assert _run(runner, s, fixed, store).reason == "end reached"
    counts = Counter(c["id"] for c in _Recorder(path).calls())
    assert set(counts) == {ikey(r) for r in expected}  # nothing lost
    again = {i for i, n in counts.items() if n > 1}
    assert again and again <= {ikey(r) for r in stopped_batch}  # only the replayed batch
    assert committed.acked + fixed.stats().acked == len(expected)


@pytest.mark.parametrize("policy", [None, "skip"])
def test_a_call_returning_a_coroutine_stops_the_run_as_a_definition_error(
    runner: Runner, policy: str | None
) -> None:
    """Whenever the writer notices (at a later write or at close), the same error: not an
    element's failure for the pipeline's policy to retry or skip."""
    s = _stream()
    pipeline_policy = ErrorPolicy(then="skip", backoff=0.001) if policy else None
    with pytest.raises(PipelineDefinitionError, match="fn returned coroutine"):
        _run(runner, s, Consume(_coroutine_of, max_inflight=2), policy=pipeline_policy)


def _coroutine_of(r: Any) -> Any:
    return _async_send(r)


def _skip(error: Exception, element: Any, token: str, attempt: int) -> Decision:
    return Skip() if isinstance(error, ValueError) else Retry(after=0.001)


def test_without_a_policy_of_its_own_consume_follows_the_pipelines(
    runner: Runner, tmp_path: Path
) -> None:
    """The pipeline's ErrorPolicy decides about Consume's failed calls when Consume has no
    on_error, and the elements it skips go to the pipeline's dead-letter sink."""
    s = _stream()
    values = [r.mods[0].new_values["i"] for r in s.expected_records(T0, END)]
    dead = "dead" >> Collect[Any]()
    assert isinstance(dead, Collect)
    consume = Consume(_Flaky(tmp_path / "seen"), max_inflight=4, key=_row)
    summary = _run(runner, s, consume, policy=ErrorPolicy(handler=_skip, dead_letter=dead))
    bad = sorted(i for i in values if i % 7 == 0)
    assert summary.reason == "end reached" and bad
    assert summary.skipped == summary.dead_lettered == len(bad)
    assert sorted(f.element.mods[0].new_values["i"] for f in dead.items) == bad
    assert all(isinstance(f, FailedElement) and f.label == "Consume(_Flaky)"
               and f.error.startswith("ValueError: bad")
               and f.partition_token == f.element.partition_token
               and f.commit_timestamp == f.element.commit_timestamp for f in dead.items)
    # a policy of Consume's own skips to the pipeline's dead letter too, also when the
    # pipeline stops on its functions' errors (then="stop")
    for then in ("skip", "stop"):
        dead_too = "dead" >> Collect[Any]()
        assert isinstance(dead_too, Collect)
        own = Consume(_Flaky(tmp_path / f"seen-{then}"), max_inflight=4, key=_row,
                      on_error=ErrorPolicy(retries=1, backoff=0.001, then="skip"))
        summary = _run(runner, s, own, policy=ErrorPolicy(then=then, dead_letter=dead_too))
        assert summary.dead_lettered == len(bad) == len(dead_too.items)


class _CrashAfterSinks(EngineListener):
    """Fails the run after the sinks of batch ``batch`` committed, before the store did."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.plans: dict[int, BatchPlan] = {}

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        self.plans[plan.batch_id] = plan

    def on_sinks_committed(self, batch_id: int) -> None:
        if batch_id == self.batch:
            raise RuntimeError("crash")


def _records_in(plan: BatchPlan, records: list[cf.DataChangeRecord]) -> list[cf.DataChangeRecord]:
    return [
        r for r in records
        for sl in plan.slices
        if sl.token == r.partition_token and sl.start <= r.commit_timestamp.ns < sl.end
    ]


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_a_replayed_batch_calls_fn_again(runner: Runner, tmp_path: Path, pipelined: bool) -> None:
    s = _stream()
    expected = s.expected_records(T0, END)
    store, path = MemoryStore(), tmp_path / "calls.jsonl"
    crash = _CrashAfterSinks(batch=3)
    consume = Consume(_Recorder(path), max_inflight=4, key=_row)
    with pytest.raises(RuntimeError, match="crash"):
        _run(runner, s, consume, store, crash, pipelined=pipelined)
    replayed = _records_in(crash.plans[3], expected)
    assert replayed, "the crashed batch should hold changes"
    consume = Consume(_Recorder(path), max_inflight=4, key=_row)
    assert _run(runner, s, consume, store, pipelined=pipelined).reason == "end reached"
    counts = Counter(c["id"] for c in _Recorder(path).calls())
    assert set(counts) == {ikey(r) for r in expected}
    assert max(counts.values()) == 2  # at least once: the crashed batch's changes twice
    twice = {i for i, n in counts.items() if n == 2}
    assert {ikey(r) for r in replayed} <= twice
    if not pipelined:
        assert twice == {ikey(r) for r in replayed}
    else:
        # Batch 4 was read ahead (its calls made) while batch 3 committed; it is read
        # again after the restart. Nothing of the committed batches 1 and 2 repeats.
        committed = {ikey(r) for b in (1, 2) for r in _records_in(crash.plans[b], expected)}
        assert not twice & committed
