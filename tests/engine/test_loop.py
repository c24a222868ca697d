"""The engine over ScriptedChangeStream: exactly-once delivery, order, replay, policies.

Every test runs under every runner (the ``runner`` fixture: memory, and Spark on a shared
``local[2]`` session); one engine must behave the same on each.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import cloudpickle
import orjson
import pytest

import cdcflow as cf
from cdcflow.engine.listener import BatchStats, EngineListener, RunSummary
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner
from cdcflow.engine.task import FailedElement
from cdcflow.errors import PipelineStopped, StreamNotFoundError, TransientError
from cdcflow.metadata import MemoryStore, SQLiteStore, open_store
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    BatchPlan,
    ChangeRecord,
    DataChangeRecord,
    PartitionState,
    Timestamp,
)
from cdcflow.policy import ErrorPolicy
from cdcflow.stream import ChangeStreamClient, ChangeStreamQuery, StreamInfo
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, DetectPartitions, Map, ReadPartition, Sink, WriteFiles

# The functions below run where the tasks run (Spark's Python workers too), which cannot
# import this test module by name: they travel by value, as a pipeline file's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

S = 1_000_000_000
T0 = 1_700_000_000 * S
END = T0 + 30 * S  # exclusive end of the runs below (end_at is inclusive)


def churn_stream(writes: int = 300, seed: int = 7) -> ScriptedChangeStream:
    """Two partitions that split and merge several times; keys move between partitions."""
    rng = random.Random(seed)
    s = ScriptedChangeStream("S", partitions=2, buckets=32, origin=T0)
    s.split("p0", at=T0 + 3 * S, into=["a", "b"])
    s.merge(["b", "p1"], at=T0 + 7 * S, into="m")
    s.split("m", at=T0 + 11 * S, into=["m1", "m2", "m3"])
    s.merge(["a", "m1"], at=T0 + 15 * S + 5, into="n")
    s.split("n", at=T0 + 21 * S, into=["n1", "n2"])
    for i in range(writes):
        at = T0 + rng.randrange(0, 29 * S)
        with s.transaction(at=at) as tx:
            for _ in range(rng.choice([1, 1, 2, 3])):
                tx.write("T", rng.randrange(12), rng.choice(["INSERT", "UPDATE"]), {"i": i})
    return s


def pipeline(
    stream: ChangeStreamClient,
    *sinks: Sink,
    name: str = "eng",
    policy: ErrorPolicy | None = None,
    read: ReadPartition | None = None,
    steps: tuple[Any, ...] = (),
    end: int | None = END - 1,
) -> cf.Pipeline:
    p = cf.Pipeline(name, error_policy=policy)
    pc = p | DetectPartitions(stream="S", start_at=T0, end_at=end, client=stream)
    pc = pc | (read or ReadPartition(heartbeat="500ms"))
    for step in steps:
        pc = pc | step
    for sink in sinks:
        pc | sink  # unlabeled: `"label" >> sink` would apply a copy of the sink
    return p


def ident(r: DataChangeRecord) -> tuple[int, str, str, str]:
    return r.commit_timestamp.ns, r.server_transaction_id, r.partition_token, r.record_sequence


def run(
    runner: Runner,
    p: cf.Pipeline,
    store: Any = None,
    listener: EngineListener | None = None,
    **options: Any,
) -> RunSummary:
    opts = {"max_batch_span": 2.0, "batch_interval": 0.0, "batch_retries": 0, **options}
    engine = Engine(p, store or MemoryStore(), runner, RunOptions(**opts), listener)
    return engine.run()


def key_histories(records: list[DataChangeRecord]) -> dict[Any, list[tuple[int, str]]]:
    out: dict[Any, list[tuple[int, str]]] = {}
    for r in records:
        for m in r.mods:
            out.setdefault((r.table_name, m.keys["id"]), []).append(
                (r.commit_timestamp.ns, r.server_transaction_id)
            )
    return out


def read_jsonl(directory: Path) -> list[dict[str, Any]]:
    rows = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("part-"):
            with open(directory / name, "rb") as f:
                rows += [orjson.loads(line) for line in f]
    return rows


def test_every_record_once_in_per_key_commit_order(runner: Runner, tmp_path: Path) -> None:
    s = churn_stream()
    out = Collect()
    p = pipeline(s, out, WriteFiles(tmp_path / "files"))
    summary = run(runner, p, base_dir=str(tmp_path))
    expected = s.expected_records(T0, END)
    assert summary.reason == "end reached"
    assert summary.records == len(expected) == len(out.items)
    assert sorted(map(ident, out.items)) == sorted(map(ident, expected))
    # a key's changes arrive in commit order (the order Collect received them)
    assert key_histories(out.items) == key_histories(expected)
    assert summary.splits == 3 and summary.merges == 2
    assert summary.low_watermark == END
    assert set(summary.partitions) == {s.value for s in PartitionState}
    rows = read_jsonl(tmp_path / "files")
    assert len(rows) == len(expected)
    assert Counter(
        (r["server_transaction_id"], r["partition_token"], r["record_sequence"]) for r in rows
    ) == Counter(ident(r)[1:] for r in expected)
    watermark = orjson.loads((tmp_path / "files" / "_watermark.json").read_bytes())
    assert watermark["ns"] == END


def test_end_at_excludes_later_records_and_ends_the_run(runner: Runner) -> None:
    s = churn_stream(writes=100)
    s.write("T", 1, "UPDATE", {"i": -1}, at=END)  # just past end_at
    out = Collect()
    store = MemoryStore()
    summary = run(runner, pipeline(s, out), store)
    assert summary.reason == "end reached"
    assert all(r.commit_timestamp.ns < END for r in out.items)
    assert len(out.items) == len(s.expected_records(T0, END))
    assert all(p.state == PartitionState.FINISHED for p in store.partitions("eng"))
    again = run(runner, pipeline(s, out), store)  # a finished pipeline stays finished
    assert again.reason == "end reached" and again.batches == 0


def test_batches_that_stop_at_their_partitions_ends_follow_at_once(
    runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog read with an end_at in the past, its span within one batch: every slice
    stops at its partition's end, before the clock, so no batch is paced (the batch
    interval is for runs that caught up with the clock), neither the children's batch
    after the root's nor the end of the run after the last."""
    waits: list[float] = []
    stock = Engine._wait

    def recorded(self: Engine, seconds: float, deadline: float | None) -> None:
        waits.append(seconds)
        stock(self, seconds, deadline)

    monkeypatch.setattr(Engine, "_wait", recorded)
    origin = time.time_ns() - 20 * S  # a recent backlog: its lag is within one batch span
    s = ScriptedChangeStream("S", partitions=2, origin=origin)
    s.split("p0", at=origin + 3 * S, into=["a", "b"])
    for i in range(40):
        s.write("T", i % 7, "UPDATE", {"i": i}, at=origin + (i + 1) * S // 5)
    out = Collect()
    p = cf.Pipeline("eng")
    (p | DetectPartitions(stream="S", start_at=origin, end_at=origin + 10 * S, client=s)
     | ReadPartition(heartbeat="500ms") | out)
    summary = run(runner, p, batch_interval=30.0, max_batch_span=3600.0)
    assert summary.reason == "end reached"
    assert len(out.items) == len(s.expected_records(origin, origin + 10 * S + 1)) == 40
    assert summary.batches >= 3  # the root, the partitions, the children of the split
    assert [w for w in waits if w > 0] == []


def test_idle_stream_advances_its_watermark(runner: Runner) -> None:
    s = ScriptedChangeStream("S", partitions=3, origin=T0)
    seen: list[BatchStats] = []

    class Listen(EngineListener):
        def on_batch(self, stats: BatchStats) -> None:
            seen.append(stats)

    store = MemoryStore()
    summary = run(runner, pipeline(s, Collect()), store, Listen(), max_batch_span=5.0)
    assert summary.reason == "end reached" and summary.records == 0
    lows = [b.low_watermark for b in seen]
    assert lows == sorted(lows) and lows[-1] == END
    assert lows[0] < lows[1] < lows[2]  # empty slices still commit their end
    assert {p.watermark for p in store.partitions("eng") if p.token != INITIAL_PARTITION_TOKEN} == {
        END
    }


def test_live_pipeline_stops_on_max_batches_duration_and_request(runner: Runner) -> None:
    now = time.time_ns()
    s = ScriptedChangeStream("S", origin=now - 60 * S)
    p = cf.Pipeline("live")
    p | DetectPartitions(stream="S", start_at="-5s", client=s) | ReadPartition() | Collect()
    assert run(runner, p, max_batches=3).reason == "max batches"
    summary = run(runner, p, duration=0.3, batch_interval=0.05)
    assert summary.reason == "duration" and summary.batches >= 1
    assert summary.low_watermark > now - 6 * S

    class StopAfterTwo(EngineListener):
        def __init__(self) -> None:
            self.engine: Engine | None = None
            self.n = 0

        def on_batch(self, stats: BatchStats) -> None:
            self.n += 1
            if self.n == 2 and self.engine is not None:
                self.engine.request_stop()

    listener = StopAfterTwo()
    engine = Engine(p, MemoryStore(), runner, RunOptions(batch_interval=0.01), listener)
    listener.engine = engine
    summary = engine.run()
    assert summary.reason == "interrupted" and summary.batches == 2


class _Crash(Exception):
    pass


class CrashAt(EngineListener):
    """Raises at ``stage`` of batch ``batch`` (an in-process stand-in for a crash)."""

    def __init__(self, stage: str, batch: int) -> None:
        self.stage, self.batch = stage, batch
        self.planned: list[tuple[BatchPlan, bool]] = []

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        self.planned.append((plan, replay))
        self._maybe("planned", plan.batch_id)

    def on_sinks_committed(self, batch_id: int) -> None:
        self._maybe("sinks", batch_id)

    def on_batch(self, stats: BatchStats) -> None:
        self._maybe("batch", stats.batch_id)

    def _maybe(self, stage: str, batch_id: int) -> None:
        if (stage, batch_id) == (self.stage, self.batch):
            raise _Crash(stage)


@pytest.mark.parametrize("stage", ["planned", "sinks", "batch"])
def test_replaying_a_pending_plan_gives_identical_output(
    runner: Runner, tmp_path: Path, stage: str
) -> None:
    s = churn_stream(writes=150)
    clean_dir, crash_dir = tmp_path / "clean", tmp_path / "crash"
    run(runner, pipeline(s, WriteFiles(clean_dir)))
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path / 'state.db'}")
    crash = CrashAt(stage, batch=6)
    with pytest.raises(_Crash):
        run(runner, pipeline(s, WriteFiles(crash_dir)), store, crash)
    pending = store.pending_plan("eng")
    # a plan is written once its tasks have returned: after on_planned, before the sinks
    assert (pending is not None) == (stage == "sinks")
    again = CrashAt("none", 0)
    summary = run(runner, pipeline(s, WriteFiles(crash_dir)), store, again)
    assert summary.reason == "end reached"
    if pending is not None:
        assert again.planned[0] == (pending, True)
        assert again.planned[0][0] == crash.planned[-1][0]
    elif stage == "planned":  # planned again, alike (the run ended cleanly: no narrowing)
        (plan, replayed), crashed = again.planned[0], crash.planned[-1][0]
        assert not replayed and (plan.batch_id, plan.slices) == (crashed.batch_id,
                                                                 crashed.slices)
    clean = sorted(n for n in os.listdir(clean_dir) if n.startswith("part-"))
    assert clean == sorted(n for n in os.listdir(crash_dir) if n.startswith("part-"))
    for name in clean:
        assert (clean_dir / name).read_bytes() == (crash_dir / name).read_bytes()
    store.close()


def _value(r: DataChangeRecord) -> int:
    return int(r.mods[0].new_values["i"])


class _Poison:
    """Raises on records whose value is ``bad``, unless ``fixed``."""

    def __init__(self, bad: int, fixed: bool = False) -> None:
        self.bad, self.fixed = bad, fixed

    def __call__(self, r: DataChangeRecord) -> int:
        if _value(r) == self.bad and not self.fixed:
            msg = f"poison {self.bad}"
            raise ValueError(msg)
        return _value(r)


def test_stop_policy_commits_nothing_past_the_failure_and_resumes(runner: Runner) -> None:
    s = churn_stream(writes=120)
    expected = s.expected_records(T0, END)
    bad = _value(expected[len(expected) // 2])
    store, out = MemoryStore(), Collect()
    policy = ErrorPolicy(retries=1, backoff=0.001)
    failing = pipeline(s, out, policy=policy, steps=(Map(_Poison(bad)),))
    with pytest.raises(PipelineStopped, match=f"poison {bad}"):
        run(runner, failing, store)
    # the failed batch's plan was never written (its tasks failed): the next run plans it
    # again; the poison record's partition was not committed past it
    assert store.pending_plan("eng") is None
    poison = next(r for r in expected if _value(r) == bad)
    stored = {p.token: p for p in store.partitions("eng")}
    held = stored.get(poison.partition_token)
    assert held is None or held.watermark <= poison.commit_timestamp.ns
    assert bad not in out.items and all(v in [_value(r) for r in expected] for v in out.items)
    delivered_before = list(out.items)
    fixed = pipeline(s, out, policy=policy, steps=(Map(_Poison(bad, fixed=True)),))
    assert run(runner, fixed, store).reason == "end reached"
    assert Counter(out.items) == Counter(_value(r) for r in expected)
    assert out.items[: len(delivered_before)] == delivered_before


def test_skip_policy_sends_failures_to_the_dead_letter_sink(runner: Runner) -> None:
    s = churn_stream(writes=80)
    expected = s.expected_records(T0, END)
    bad = _value(expected[10])
    out, dead = Collect(), "dead" >> Collect()
    assert isinstance(dead, Collect)
    policy = ErrorPolicy(retries=2, backoff=0.001, then="skip", dead_letter=dead)
    summary = run(runner, pipeline(s, out, policy=policy, steps=(Map(_Poison(bad)),)))
    assert summary.reason == "end reached"
    n_bad = sum(1 for r in expected if _value(r) == bad)
    assert n_bad >= 1 and len(dead.items) == n_bad
    assert all(isinstance(f, FailedElement) and f"poison {bad}" in f.error for f in dead.items)
    assert Counter(out.items) == Counter(_value(r) for r in expected if _value(r) != bad)


class FlakyReads:
    """A ChangeStreamClient over ``stream`` whose first ``count`` reads fail with
    TransientError after ``after_records`` records.

    Unlike ``ScriptedChangeStream.fail_reads``, whose counter lives in each unpickled copy,
    the failures are counted in files under ``marks``: a Spark task attempt that failed is
    retried in a Python worker with a fresh copy, which would fail again, and again.
    """

    def __init__(
        self, stream: ScriptedChangeStream, marks: Path, count: int, after_records: int
    ) -> None:
        self.stream, self.marks = stream, marks
        self.count, self.after_records = count, after_records
        marks.mkdir(parents=True, exist_ok=True)

    def describe_stream(self, stream: str) -> StreamInfo:
        return self.stream.describe_stream(stream)

    def read(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        records = self.stream.read(query)
        return self._failing(records) if self._claim_failure() else records

    def _claim_failure(self) -> bool:
        for i in range(self.count):
            try:  # O_EXCL: exactly one read, in any process, claims each failure
                os.close(os.open(self.marks / f"failure-{i}", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            return True
        return False

    def _failing(self, records: Iterator[ChangeRecord]) -> Iterator[ChangeRecord]:
        for i, record in enumerate(records):
            if i >= self.after_records:
                break
            yield record
        msg = "flaky read: UNAVAILABLE"
        raise TransientError(msg)

    def close(self) -> None:
        self.stream.close()


def test_transient_read_failures_are_retried_per_batch(runner: Runner, tmp_path: Path) -> None:
    # The engine retries the batch (memory); Spark retries the failed task first.
    s = churn_stream(writes=60)
    flaky = FlakyReads(s, tmp_path / "failures", count=2, after_records=1)
    out = Collect()
    summary = run(runner, pipeline(flaky, out), batch_retries=3, retry_backoff=0.001)
    assert summary.reason == "end reached"
    assert len(os.listdir(tmp_path / "failures")) == 2  # both failures did happen
    assert sorted(map(ident, out.items)) == sorted(map(ident, s.expected_records(T0, END)))


def test_transient_failures_beyond_the_retries_leave_nothing_planned(runner: Runner) -> None:
    # The tasks failed: no sink had the batch, so its plan was not written, and the next
    # run plans it again (perhaps narrower: see engine.pacing).
    s = churn_stream(writes=10).fail_reads(50)
    store = MemoryStore()
    with pytest.raises(TransientError) as info:
        run(runner, pipeline(s, Collect()), store, batch_retries=1, retry_backoff=0.001)
    assert "scripted failure" in str(info.value)
    if runner.name == "spark":
        # Spark gave up after its own task attempts; the task's own error reaches the
        # engine (so its batch retries applied), with a note naming the Spark task's slice.
        assert any(INITIAL_PARTITION_TOKEN in note for note in info.value.__notes__)
    assert any("the next run plans it again" in note for note in info.value.__notes__)
    assert store.pending_plan("eng") is None and store.last_batch_id("eng") == 0
    out = Collect()
    again = churn_stream(writes=10)
    assert run(runner, pipeline(again, out), store).reason == "end reached"
    assert sorted(map(ident, out.items)) == sorted(map(ident, again.expected_records(T0, END)))


def test_a_sink_commit_failing_past_the_retries_leaves_the_plan_pending(
    runner: Runner,
) -> None:
    # A sink may have committed the batch before another failed: the next run replays the
    # plan as it is, with the same slices.
    class Failing(Collect[Any]):
        def commit(self, batch_id: int, messages: Sequence[list[Any]]) -> None:
            raise TransientError("the sink's storage is down")

    s = churn_stream(writes=10)
    store = MemoryStore()
    with pytest.raises(TransientError) as info:
        run(runner, pipeline(s, Failing()), store, batch_retries=1, retry_backoff=0.001)
    assert any("replays it" in note for note in info.value.__notes__)
    pending = store.pending_plan("eng")
    assert pending is not None and pending.batch_id == 1


def _slow_value(r: DataChangeRecord) -> tuple[int, int]:
    time.sleep(random.random() * 0.002)
    return r.commit_timestamp.ns, _value(r)


def test_max_inflight_gives_the_same_output_in_the_same_order(runner: Runner) -> None:
    s = churn_stream(writes=200)
    outputs = []
    for read in (
        ReadPartition(heartbeat="500ms"),
        ReadPartition(heartbeat="500ms", max_inflight=6, max_inflight_bytes=4096),
    ):
        out = Collect()
        run(runner, pipeline(s, out, read=read, steps=(Map(_slow_value),)))
        outputs.append(out.items)
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(s.expected_records(T0, END))


def test_gc_removes_finished_partitions_once_children_started(runner: Runner) -> None:
    s = churn_stream(writes=20)
    store = MemoryStore()
    out = Collect()
    summary = run(runner, pipeline(s, out), store, gc_ttl=0.0)
    assert summary.reason == "end reached"
    left = {p.token for p in store.partitions("eng")}
    assert left == {"m2", "m3", "n1", "n2"}  # the partitions that reached the end
    assert len(out.items) == len(s.expected_records(T0, END))


def test_unknown_stream_surfaces_the_clients_error(runner: Runner) -> None:
    s = ScriptedChangeStream("Other", origin=T0)
    with pytest.raises(StreamNotFoundError, match="stream='Other'"):
        run(runner, pipeline(s, Collect()))


def test_reset_starts_over_and_sqlite_state_resumes(runner: Runner, tmp_path: Path) -> None:
    s = churn_stream(writes=50)
    url = f"sqlite:///{tmp_path / 'state.db'}"
    out = Collect()
    store = open_store(url)
    first = run(runner, pipeline(s, out), store, max_batches=4)
    assert first.reason == "max batches"
    store.close()
    store = open_store(url)  # a new process would see the same
    rest = run(runner, pipeline(s, out), store)
    assert rest.reason == "end reached"
    assert len(out.items) == len(s.expected_records(T0, END))
    again = run(runner, pipeline(s, out), store, reset=True)
    assert again.reason == "end reached"
    # batch ids continue past the reset, so the same sink takes the new batches
    assert again.records * 2 == len(out.items)
    assert (
        min(b.batch_id for b in store.batches("eng", limit=1000))
        == first.batches + rest.batches + 1
    )
    store.close()


def test_listener_sees_each_batch_in_order(runner: Runner) -> None:
    events: list[tuple[str, Any]] = []

    class Listen(EngineListener):
        def on_start(self, pipeline: str, runner: str, store_url: str) -> None:
            events.append(("start", (pipeline, runner)))

        def on_planned(self, plan: BatchPlan, replay: bool) -> None:
            events.append(("planned", plan.batch_id))

        def on_sinks_committed(self, batch_id: int) -> None:
            events.append(("sinks", batch_id))

        def on_batch(self, stats: BatchStats) -> None:
            events.append(("batch", stats.batch_id))

        def on_stop(self, summary: RunSummary) -> None:
            events.append(("stop", summary.reason))

    summary = run(runner, pipeline(churn_stream(writes=5), Collect()), listener=Listen())
    assert events[0] == ("start", ("eng", runner.name)) and events[-1] == ("stop", "end reached")
    middle = events[1:-1]
    assert middle == [
        (stage, n) for n in range(1, summary.batches + 1) for stage in ("planned", "sinks", "batch")
    ]


def test_relative_sink_paths_resolve_against_base_dir(runner: Runner, tmp_path: Path) -> None:
    s = churn_stream(writes=20)
    summary = run(runner, pipeline(s, WriteFiles("out/rel")), base_dir=str(tmp_path))
    assert summary.reason == "end reached"
    assert len(read_jsonl(tmp_path / "out" / "rel")) == len(s.expected_records(T0, END))


def test_a_stop_during_the_batch_retries_ends_the_run_without_them(runner: Runner) -> None:
    # A supervisor's SIGTERM during an outage: the run stops at once as interrupted, not
    # after the remaining retries with the outage's error; the next run plans the batch
    # again (its tasks failed, so no sink had it and its plan was not written).
    s = churn_stream(writes=10)
    failing = churn_stream(writes=10).fail_reads(50)
    store = MemoryStore()

    class StopOnRetry(EngineListener):
        def __init__(self) -> None:
            self.engine: Engine | None = None
            self.retries: list[int] = []

        def on_batch_retry(self, batch_id: int, error: BaseException) -> None:
            self.retries.append(batch_id)
            assert self.engine is not None
            self.engine.request_stop()

    listener = StopOnRetry()
    options = RunOptions(batch_retries=5, retry_backoff=30.0)
    engine = Engine(pipeline(failing, Collect()), store, runner, options, listener)
    listener.engine = engine
    began = time.monotonic()
    summary = engine.run()
    assert summary.reason == "interrupted" and summary.batches == 0
    assert listener.retries == [1]  # one failure, no retry after the stop (no 30 s backoff)
    assert time.monotonic() - began < 20
    assert store.pending_plan("eng") is None and store.last_batch_id("eng") == 0

    out = Collect()
    again = run(runner, pipeline(s, out), store)
    assert again.reason == "end reached"
    assert sorted(map(ident, out.items)) == sorted(map(ident, s.expected_records(T0, END)))


def test_sigterm_stops_after_the_batch_and_a_second_one_aborts(runner: Runner) -> None:
    # pipeline.run() in an application's main thread that leaves SIGTERM to cdcflow: the
    # first signal stops after the current batch, the second aborts at once (as a second
    # Ctrl-C does); the next run replays the batch.
    import signal

    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        pytest.skip("SIGTERM has a handler in this process")
    s = churn_stream(writes=30)
    store = MemoryStore()

    class Signal(EngineListener):
        def __init__(self, times: int) -> None:
            self.times = times

        def on_planned(self, plan: BatchPlan, replay: bool) -> None:
            if plan.batch_id == 2:
                for _ in range(self.times):
                    os.kill(os.getpid(), signal.SIGTERM)

    once = run(runner, pipeline(s, Collect()), store, Signal(1))
    assert once.reason == "interrupted" and once.batches == 2  # batch 2 finished first
    with pytest.raises(KeyboardInterrupt):
        run(runner, pipeline(s, Collect()), MemoryStore(), Signal(2))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back


def test_a_signal_while_the_runner_starts_waits_for_it_then_closes_it() -> None:
    """Spark's start cut short by a signal left its JVM running with no parent: a signal
    waits until the runner has started, then the run ends (KeyboardInterrupt: exit 130)
    and the runner is closed."""
    from cdcflow.runners.in_memory import InMemoryRunner

    class SlowStart(InMemoryRunner):
        opened = closed = False

        def open(self, app_name: str) -> None:
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
            time.sleep(1.0)  # a session that takes its time to start
            super().open(app_name)
            self.opened = True

        def close(self) -> None:
            super().close()
            self.closed = True

    runner = SlowStart(workers=1)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # as the CLI has it
    try:
        with pytest.raises(KeyboardInterrupt):
            Engine(pipeline(churn_stream(writes=5), Collect()), MemoryStore(), runner,
                   RunOptions(batch_interval=0)).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert runner.opened and runner.closed


def test_the_collector_is_settled_while_batches_run_and_given_back(runner: Runner) -> None:
    import gc

    from cdcflow.processes import YOUNG_COLLECTION_THRESHOLD

    class Thresholds(EngineListener):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_batch(self, stats: BatchStats) -> None:
            self.seen.append(gc.get_threshold()[0])

    before = gc.get_threshold()
    gc.set_threshold(700, *before[1:])
    try:
        listener = Thresholds()
        out = Collect()
        run(runner, pipeline(churn_stream(writes=30), out), listener=listener)
        assert listener.seen and set(listener.seen) == {YOUNG_COLLECTION_THRESHOLD}
        assert gc.get_threshold()[0] == 700
        assert gc.get_freeze_count() == 0
        assert len(out.items) > 0
    finally:
        gc.set_threshold(*before)


def test_a_reset_to_a_later_start_says_which_changes_it_skips(
    runner: Runner, caplog: pytest.LogCaptureFixture
) -> None:
    """A reset of a pipeline that reads from start_at='now' (or any start past where its
    progress stood) read nothing of the changes in between, without a word."""
    s = churn_stream(writes=50)
    store = MemoryStore()
    first = run(runner, pipeline(s, Collect(), name="gap"), store, max_batches=3)
    assert first.reason == "max batches"
    stood = min(p.watermark for p in store.partitions("gap")
                if p.state != PartitionState.FINISHED)
    later = cf.Pipeline("gap")
    (later | DetectPartitions(stream="S", start_at=T0 + 20 * S, end_at=END - 1, client=s)
     | ReadPartition() | Collect())
    with caplog.at_level(logging.WARNING, logger="cdcflow.engine"):
        run(runner, later, store, reset=True)
    (said,) = [r.getMessage() for r in caplog.records if "the reset forgot" in r.getMessage()]
    assert Timestamp.from_ns(stood).rfc3339() in said
    assert Timestamp.from_ns(T0 + 20 * S).rfc3339() in said and "not read" in said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cdcflow.engine"):  # the same start: none
        run(runner, pipeline(s, Collect(), name="gap"), store, reset=True)
    assert not [r for r in caplog.records if "the reset forgot" in r.getMessage()]


def test_a_run_stopped_by_the_batch_that_reached_the_end_says_the_end_was_reached(
    runner: Runner,
) -> None:
    """A stop request while the batch that reaches end_at runs: the run says "end reached"
    (the CLI exits 0), not "interrupted", so that whoever stopped it learns the pipeline is
    complete; during the last batch of max_batches it says "max batches"."""
    s = ScriptedChangeStream("S", origin=T0)
    for i in range(3):
        s.write("T", {"id": i}, "INSERT", {"v": i}, at=T0 + (i + 1) * S)
    p = cf.Pipeline("ends-while-stopping")
    p | DetectPartitions(stream="S", start_at=T0, end_at=T0 + 5 * S, client=s) | \
        ReadPartition() | Collect()

    class StopWhilePlanned(EngineListener):  # the second batch: the first finds children
        engine: Engine | None = None

        def on_planned(self, plan: BatchPlan, replay: bool) -> None:
            if self.engine is not None and plan.batch_id == 2:
                self.engine.request_stop()

    listener = StopWhilePlanned()
    engine = Engine(p, MemoryStore(), runner, RunOptions(max_batch_span=60), listener)
    listener.engine = engine
    summary = engine.run()
    assert (summary.reason, summary.batches, summary.records) == ("end reached", 2, 3)
    # a stop during a batch that does not reach the end is still a stop
    p2 = cf.Pipeline("stops")
    p2 | DetectPartitions(stream="S", start_at=T0, end_at=T0 + 30 * S, client=s) | \
        ReadPartition() | Collect()
    engine = Engine(p2, MemoryStore(), runner, RunOptions(max_batch_span=2), listener)
    listener.engine = engine
    assert engine.run().reason == "interrupted"
    summary = run(runner, p, max_batches=2, max_batch_span=60)
    assert (summary.reason, summary.batches) == ("end reached", 2)
    assert run(runner, p2, max_batches=2, max_batch_span=2).reason == "max batches"
    # a stop during the last batch asked for: the run did what it was asked
    engine = Engine(p2, MemoryStore(), runner, RunOptions(max_batch_span=2, max_batches=2),
                    listener)
    listener.engine = engine
    assert engine.run().reason == "max batches"
