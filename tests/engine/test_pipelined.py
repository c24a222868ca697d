"""Pipelined batches: batch N+1 reads while batch N's sinks and store commit, exactly once.

Each test runs under every runner (the ``runner`` fixture). The SIGKILL tests of the
overlap are in test_crash.py (``ahead:N``, ``batch:N``, ``planned:N``).
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import cdcflow as cf
from cdcflow.engine.listener import BatchStats, EngineListener, RunSummary
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner
from cdcflow.errors import SinkError, SinkIOError
from cdcflow.metadata import MemoryStore, SQLiteStore
from cdcflow.model import BatchPlan, DataChangeRecord
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, DetectPartitions, ReadPartition, Sink, WriteFiles
from cdcflow.transforms.base import SinkWriter, WriterContext

# The sinks below are opened where the tasks run (Spark's Python workers too), which cannot
# import this test module by name: they travel by value, as a pipeline file's classes do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

S = 1_000_000_000
T0 = 1_700_000_000 * S
END = T0 + 20 * S


def backlog(writes: int = 200, seed: int = 5) -> ScriptedChangeStream:
    """A stream in the past (the run lags the clock and catches up) with a split."""
    rng = random.Random(seed)
    s = ScriptedChangeStream("S", partitions=2, buckets=16, origin=T0)
    s.split("p0", at=T0 + 5 * S, into=["a", "b"])
    for i in range(writes):
        with s.transaction(at=T0 + rng.randrange(0, 19 * S)) as tx:
            tx.write("T", rng.randrange(10), "UPDATE", {"i": i})
    return s


def pipeline(stream: Any, *sinks: Sink[Any, Any], end: int | None = END - 1) -> cf.Pipeline:
    p = cf.Pipeline("pipe")
    pc = p | DetectPartitions(stream="S", start_at=T0, end_at=end, client=stream)
    pc = pc | ReadPartition(heartbeat="500ms")
    for sink in sinks:
        pc | sink
    return p


def run(
    runner: Runner, p: cf.Pipeline, store: Any = None, listener: EngineListener | None = None,
    engine_hook: Any = None, **options: Any,
) -> RunSummary:
    opts = {"max_batch_span": 2.0, "batch_interval": 0.0, "batch_retries": 0, **options}
    engine = Engine(p, store or MemoryStore(), runner, RunOptions(**opts), listener)
    if engine_hook is not None:
        engine_hook(engine)
    return engine.run()


class _Opened:
    """A Collect writer that notes when its task opened it, in a file both runners share."""

    def __init__(self, inner: SinkWriter[Any, Any], log: str, batch_id: int) -> None:
        self.inner = inner
        with open(log, "a") as f:
            f.write(f"{batch_id} {time.time()!r}\n")

    def write(self, element: Any) -> None:
        self.inner.write(element)

    def close(self) -> Any:
        return self.inner.close()

    def abort(self) -> None:
        self.inner.abort()


class SlowCollect(Collect[Any]):
    """Collect whose commit takes ``delay`` seconds; notes (batch, commit start, commit end)
    on the driver and when each task opened its writer (:func:`opened`)."""

    def __init__(self, log: Path, delay: float) -> None:
        super().__init__()
        self.log, self.delay = str(log), delay
        self.commits: list[tuple[int, float, float]] = []

    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, list[Any]]:
        return _Opened(super().open_writer(ctx), self.log, ctx.batch_id)

    def commit(self, batch_id: int, messages: Sequence[list[Any]]) -> None:
        began = time.time()
        time.sleep(self.delay)
        super().commit(batch_id, messages)
        self.commits.append((batch_id, began, time.time()))


def opened(log: Path) -> dict[int, float]:
    """Batch id -> when its first writer opened."""
    first: dict[int, float] = {}
    for line in log.read_text().splitlines():
        batch, at = line.split()
        first[int(batch)] = min(first.get(int(batch), float("inf")), float(at))
    return first


def read_while_committing(sink: SlowCollect, log: Path) -> tuple[int, int]:
    """(batches N whose successor's reads began before N's sink commit ended, batches N
    whose successor read anything)."""
    starts = opened(log)
    ends = {batch: end for batch, _, end in sink.commits}
    followed = [n for n in ends if n + 1 in starts and n + 1 in ends]
    return sum(starts[n + 1] < ends[n] for n in followed), len(followed)


def test_the_next_batch_reads_while_the_last_one_commits(runner: Runner, tmp_path: Path) -> None:
    s = backlog()
    piped = SlowCollect(tmp_path / "piped.log", delay=0.2)
    summary = run(runner, pipeline(s, piped))
    assert summary.reason == "end reached" and summary.batches >= 8
    overlapped, followed = read_while_committing(piped, tmp_path / "piped.log")
    assert followed >= 6
    # Every batch is read ahead on the memory runner (but for one whose thread started late
    # on a loaded machine); Spark's job start may take longer than the commit: half.
    assert overlapped >= (followed - 1 if runner.name == "memory" else followed // 2)

    serial = SlowCollect(tmp_path / "serial.log", delay=0.2)
    run(runner, pipeline(s, serial), pipelined=False)
    assert read_while_committing(serial, tmp_path / "serial.log")[0] == 0
    # the same output, in the same order, exactly once
    assert [ident(r) for r in piped.items] == [ident(r) for r in serial.items]
    want = s.expected_records(T0, END)
    assert sorted(map(ident, piped.items)) == sorted(map(ident, want))


def ident(r: DataChangeRecord) -> tuple[int, str, str, str]:
    return r.commit_timestamp.ns, r.server_transaction_id, r.partition_token, r.record_sequence


def test_nothing_is_read_ahead_when_caught_up_with_the_clock(
    runner: Runner, tmp_path: Path
) -> None:
    now = time.time_ns()
    s = ScriptedChangeStream("S", origin=now - 60 * S)
    for i in range(60):  # changes at the clock for 9 s, so every batch has some
        with s.transaction(at=now + i * 150_000_000) as tx:
            tx.write("T", i % 5, "UPDATE", {"i": i})
    sink = SlowCollect(tmp_path / "live.log", delay=0.05)
    p = cf.Pipeline("live")
    p | DetectPartitions(stream="S", start_at="-1s", client=s) | ReadPartition() | sink
    summary = run(runner, p, max_batches=6, batch_interval=0.1, max_batch_span=10.0)
    assert summary.batches == 6
    overlapped, followed = read_while_committing(sink, tmp_path / "live.log")
    assert followed >= 2 and overlapped == 0


class Events(EngineListener):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        self.events.append(("planned", plan.batch_id))

    def on_sinks_committed(self, batch_id: int) -> None:
        self.events.append(("sinks", batch_id))

    def on_batch(self, stats: BatchStats) -> None:
        self.events.append(("batch", stats.batch_id))


def test_listener_events_stay_in_batch_order(runner: Runner, tmp_path: Path) -> None:
    listener = Events()
    sink = SlowCollect(tmp_path / "o.log", delay=0.2)
    summary = run(runner, pipeline(backlog(), sink), listener=listener)
    n = summary.batches
    assert listener.events == [
        (stage, b) for b in range(1, n + 1) for stage in ("planned", "sinks", "batch")
    ]
    assert read_while_committing(sink, tmp_path / "o.log")[0] >= 1


class FailingFiles(WriteFiles):
    """WriteFiles whose commit of ``batch`` raises ``error`` the first ``times`` times,
    once the next batch (read ahead) has staged a file."""

    def __init__(self, path: Path, batch: int, error: Exception, times: int = 1) -> None:
        super().__init__(str(path))
        self.batch, self.error, self.times = batch, error, times

    def default_label(self) -> str:
        return "WriteFiles"

    def commit(self, batch_id: int, messages: Any) -> None:
        if batch_id == self.batch and self.times > 0:
            self.times -= 1
            wait_for_staged(Path(self.path), batch_id + 1)
            raise self.error
        super().commit(batch_id, messages)


def wait_for_staged(directory: Path, batch_id: int) -> None:
    deadline = time.monotonic() + 30
    while not staged(directory, batch_id):
        assert time.monotonic() < deadline, f"batch {batch_id} was not read ahead"
        time.sleep(0.002)


def staged(directory: Path, batch_id: int) -> list[str]:
    """The task attempts' files of ``batch_id`` (in the directory of its batch)."""
    try:
        names = os.listdir(directory / "_cdcflow" / "tmp" / f"{batch_id:010d}")
    except FileNotFoundError:
        return []
    return [n for n in names if n.startswith(f".part-{batch_id:010d}-") and n.endswith(".tmp")]


def temps_left(directory: Path) -> list[str]:
    """Every task attempt's file left anywhere under ``directory``."""
    return [f for _, _, names in os.walk(directory) for f in names if ".tmp" in f]


def files(directory: Path) -> dict[str, bytes]:
    return {n: (directory / n).read_bytes() for n in os.listdir(directory)
            if n.startswith("part-")}


def test_a_failed_sink_commit_drops_the_batch_read_ahead(
    runner: Runner, tmp_path: Path
) -> None:
    s = backlog()
    clean, out = tmp_path / "clean", tmp_path / "out"
    run(runner, pipeline(s, WriteFiles(str(clean))))
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path / 'state.db'}")
    failing = FailingFiles(out, 4, SinkError("the sink is down"))
    with pytest.raises(SinkError, match="the sink is down"):
        run(runner, pipeline(s, failing), store)
    pending = store.pending_plan("pipe")
    assert pending is not None and pending.batch_id == 4
    assert store.last_batch_id("pipe") == 4  # batch 5 read ahead, never planned
    assert not staged(out, 5)  # and its staged output aborted
    summary = run(runner, pipeline(s, FailingFiles(out, 0, SinkError("unused"))), store)
    assert summary.reason == "end reached"
    assert files(out) == files(clean)
    assert not temps_left(out)
    store.close()


def test_a_transient_sink_failure_retries_the_batch_after_dropping_the_next(
    runner: Runner, tmp_path: Path
) -> None:
    s = backlog()
    clean, out = tmp_path / "clean", tmp_path / "out"
    run(runner, pipeline(s, WriteFiles(str(clean))))
    failing = FailingFiles(out, 3, SinkIOError("disk hiccup"), times=1)
    summary = run(runner, pipeline(s, failing), batch_retries=1, retry_backoff=0.0)
    assert summary.reason == "end reached"
    assert files(out) == files(clean)
    assert not temps_left(out)


class StopDuring(EngineListener):
    """Requests a stop once batch ``batch``'s sinks committed (the next batch reads)."""

    def __init__(self, batch: int, out: Path) -> None:
        self.batch, self.out = batch, out
        self.engine: Engine | None = None
        self.read_ahead = False

    def on_sinks_committed(self, batch_id: int) -> None:
        if batch_id == self.batch and self.engine is not None:
            wait_for_staged(self.out, batch_id + 1)
            self.read_ahead = True
            self.engine.request_stop()


def test_a_stop_ends_the_run_after_the_batch_that_commits(
    runner: Runner, tmp_path: Path
) -> None:
    s = backlog()
    clean, out = tmp_path / "clean", tmp_path / "out"
    run(runner, pipeline(s, WriteFiles(str(clean))))
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path / 'state.db'}")
    stop = StopDuring(3, out)

    def hook(engine: Engine) -> None:
        stop.engine = engine

    summary = run(runner, pipeline(s, WriteFiles(str(out))), store, stop, hook)
    assert stop.read_ahead
    assert (summary.reason, summary.batches) == ("interrupted", 3)
    assert store.pending_plan("pipe") is None and store.last_batch_id("pipe") == 3
    assert not staged(out, 4)
    assert run(runner, pipeline(s, WriteFiles(str(out))), store).reason == "end reached"
    assert files(out) == files(clean)
    store.close()
