"""Paced batches: the span follows what tasks read, so a batch's busiest task reads about
``max_task_bytes`` (cdcflow.engine.pacing)."""

from __future__ import annotations

import time
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.pacing import FIRST_SPAN_NS, MIN_SPAN_NS, Pacer
from cdcflow.engine.runner import TaskResult
from cdcflow.metadata import MemoryStore
from cdcflow.model import BatchPlan, BatchRecord, Slice, snapshot_token
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream

S = 1_000_000_000
MiB = 1 << 20


def _batch(slices: list[tuple[str, int, int, int]]) -> tuple[BatchPlan, list[TaskResult]]:
    """A plan of (token, start, end) slices and results that read ``bytes`` to the end."""
    plan = BatchPlan(1, max(e for _, _, e, _ in slices), [Slice(t, s, e) for t, s, e, _ in slices])
    results = [TaskResult(token=t, position=e, ended=False, bytes=n) for t, _, e, n in slices]
    return plan, results


def test_without_a_budget_every_batch_spans_max_batch_span() -> None:
    pacer = Pacer(10 * S)
    assert pacer.span_ns == 10 * S
    pacer.observe(*_batch([("a", 0, S, 10**12)]))
    assert pacer.span_ns == 10 * S


def test_the_span_follows_the_fastest_task_within_twice_the_last_and_max_span() -> None:
    pacer = Pacer(10 * S, 8 * MiB)
    assert pacer.span_ns == 10 * S
    # 32 MiB in one second in the busiest task: a quarter second holds 8 MiB.
    pacer.observe(*_batch([("a", 0, S, 32 * MiB), ("b", 0, S, MiB)]))
    assert pacer.span_ns == S // 4
    # A slower batch lets it grow, at most twice per batch, up to max_batch_span.
    pacer.observe(*_batch([("a", 0, S // 4, 1024)]))
    assert pacer.span_ns == S // 2
    for _ in range(10):
        pacer.observe(*_batch([("a", 0, S, 0)]))
    assert pacer.span_ns == 10 * S
    # A huge commit in one timestamp: never below the shortest span.
    pacer.observe(*_batch([("a", 0, 10, 10**12)]))
    assert pacer.span_ns == MIN_SPAN_NS
    # A table's snapshot is no commit time: it does not count.
    pacer.observe(*_batch([(snapshot_token("T"), 0, 1, 10**12)]))
    assert pacer.span_ns == 2 * MIN_SPAN_NS


def test_a_run_goes_on_from_the_span_the_last_committed_batch_left() -> None:
    def entry(batch_id: int, committed: bool, **stats: float) -> BatchRecord:
        return BatchRecord(batch_id, 0, 0, 1 if committed else None, 1, stats=stats)

    log = [entry(9, False), entry(8, True, next_span_ns=3 * S), entry(7, True, next_span_ns=S)]
    assert Pacer.resume(10 * S, MiB, log).span_ns == 3 * S
    assert Pacer.resume(2 * S, MiB, log).span_ns == 2 * S  # max_batch_span lowered since
    assert Pacer.resume(10 * S, MiB, [entry(8, True)]).span_ns == 10 * S  # an older log
    assert Pacer.resume(10 * S, MiB, []).span_ns == 10 * S
    assert Pacer.resume(10 * S, None, log).span_ns == 10 * S


def test_a_run_after_crashes_halves_the_span_once_per_crashed_run() -> None:
    def log(lease_token: int) -> list[BatchRecord]:
        stats = {"next_span_ns": 8 * S, "lease_token": lease_token}
        return [BatchRecord(9, 0, 0, None, 1), BatchRecord(8, 0, 0, 1, 1, stats=stats)]

    # The run that committed batch 8 (lease 5) ended cleanly: this one (6) goes on from it.
    assert Pacer.resume(10 * S, MiB, log(5), lease_token=6).span_ns == 8 * S
    # It crashed (its lease was not released): half.
    assert Pacer.resume(10 * S, MiB, log(5), lease_token=6, crashed=True).span_ns == 4 * S
    # Two more runs owned the pipeline since and committed nothing: they crashed too.
    assert Pacer.resume(10 * S, MiB, log(5), lease_token=8, crashed=True).span_ns == S
    assert Pacer.resume(10 * S, MiB, log(5), lease_token=99).span_ns == MIN_SPAN_NS
    # An entry committed before the lease token was logged, or no lease token: as it was.
    older = [BatchRecord(8, 0, 0, 1, 1, stats={"next_span_ns": 8 * S})]
    assert Pacer.resume(10 * S, MiB, older, lease_token=9, crashed=True).span_ns == 8 * S
    assert Pacer.resume(10 * S, MiB, log(5)).span_ns == 8 * S
    # A fixed span (no max_task_bytes) is narrowed too, and doubles back batch by batch.
    fixed = Pacer.resume(10 * S, None, log(5), lease_token=7, crashed=True)
    assert fixed.span_ns == 10 * S // 4
    fixed.observe(*_batch([("a", 0, S, 10**12)]))
    assert fixed.span_ns == 5 * S
    fixed.observe(*_batch([("a", 0, S, 10**12)]))
    assert fixed.span_ns == 10 * S


def test_max_task_bytes_takes_sizes() -> None:
    assert RunOptions(max_task_bytes="64MiB").max_task_bytes == 64 * MiB
    assert RunOptions(max_task_bytes=None).max_task_bytes is None
    with pytest.raises(ValueError, match="max_task_bytes='lots' is not a size"):
        RunOptions(max_task_bytes="lots")
    with pytest.raises(ValueError, match="1 byte or more"):
        RunOptions(max_task_bytes=0)


class _Bytes(EngineListener):
    def __init__(self) -> None:
        self.batches: list[int] = []

    def on_batch(self, stats: BatchStats) -> None:
        self.batches.append(stats.bytes)


def _backlog(max_task_bytes: int | None) -> tuple[list[int], int]:
    """A backlog of 400 changes of about 64 KiB, 10 ms apart: (bytes per batch, changes)."""
    origin = time.time_ns() - 60 * S
    stream = ScriptedChangeStream("S", origin=origin)
    for i in range(400):
        stream.write("T", i, "INSERT", {"blob": "x" * 65_536}, at=origin + S + i * S // 100)
    out: cf.Collect[Any] = cf.Collect()
    p = cf.Pipeline("paced")
    (p | cf.DetectPartitions(stream="S", start_at=origin, end_at=origin + 6 * S, client=stream)
     | cf.ReadPartition() | out)
    listener = _Bytes()
    opts = RunOptions(max_task_bytes=max_task_bytes, max_batch_span=2.0, batch_interval=0)
    summary = Engine(p, MemoryStore(), InMemoryRunner(workers=1), opts, listener).run()
    assert summary.reason == "end reached"
    keys = sorted(r.mods[0].keys["id"] for r in out.items)
    assert keys == list(range(400))  # each once
    return listener.batches, len(out.items)


def test_a_backlog_of_large_changes_commits_in_batches_of_about_max_task_bytes() -> None:
    paced, _ = _backlog(2 * MiB)
    # Batch 1 reads the root partition; batch 2 spans max_batch_span, two seconds (1 s of
    # changes, 6.3 MiB), which makes batch 3 twice the aim (its changes are twice as dense);
    # the span then follows the rate.
    assert paced[1] > 6 * MiB and paced[2] < 4.1 * MiB, paced
    assert 2 * MiB * 0.9 < max(paced[3:-1]) < 2 * MiB * 1.1, paced
    unpaced, _ = _backlog(None)
    assert max(unpaced) > 12 * MiB, unpaced  # a 2 s span of changes: 12.6 MiB


def test_a_first_batch_spans_ten_seconds_and_the_spans_double_up_to_max_batch_span() -> None:
    pacer = Pacer(60 * S, 8 * MiB)
    assert pacer.span_ns == FIRST_SPAN_NS == 10 * S
    spans = []
    for _ in range(4):  # tasks that read little: the span doubles, up to the cap
        pacer.observe(*_batch([("a", 0, pacer.span_ns, 1024)]))
        spans.append(pacer.span_ns // S)
    assert spans == [20, 40, 60, 60]
    assert Pacer(2 * S, 8 * MiB).span_ns == 2 * S  # a cap under ten seconds
    assert Pacer(60 * S).span_ns == 60 * S  # unpaced: every batch spans the cap
    assert Pacer.resume(60 * S, MiB, []).span_ns == 10 * S  # a pipeline's first run


class _Ends(EngineListener):
    def __init__(self) -> None:
        self.ends: list[int] = []

    def on_batch(self, stats: BatchStats) -> None:
        self.ends.append(stats.end)


def test_a_sparse_backlog_catches_up_in_wider_and_wider_batches() -> None:
    """Five minutes of one small change every 5 s, read with the default options: each
    batch queries every partition, so the spans grow (10, 20, 40, 60 s past the low
    watermark) and few batches read it all."""
    origin = time.time_ns() - 600 * S
    stream = ScriptedChangeStream("S", origin=origin)
    for i in range(60):
        stream.write("T", i, "INSERT", {"v": i}, at=origin + S + i * 5 * S)
    out: cf.Collect[Any] = cf.Collect()
    p = cf.Pipeline("sparse")
    (p | cf.DetectPartitions(stream="S", start_at=origin, end_at=origin + 301 * S,
                             client=stream)
     | cf.ReadPartition() | out)
    listener = _Ends()
    opts = RunOptions(batch_interval=0)
    summary = Engine(p, MemoryStore(), InMemoryRunner(workers=1), opts, listener).run()
    assert summary.reason == "end reached"
    assert sorted(r.mods[0].keys["id"] for r in out.items) == list(range(60))
    # Batch 1 reads the root partition up to 10 s; its children start at the origin.
    ends = [(end - origin) // S for end in listener.ends]
    assert ends == [10, 20, 60, 120, 180, 240, 300, 360], ends  # 10 s spans: 32 batches


def test_with_batch_steps_all_tasks_of_a_batch_read_about_batch_bytes() -> None:
    pacer = Pacer(60 * S, 128 * MiB, batch_bytes=8 * MiB)
    # four tasks, 1 MiB per second each: 4 MiB/s in all, so two seconds hold 8 MiB
    pacer.observe(*_batch([(t, 0, 10 * S, 10 * MiB) for t in "abcd"]))
    assert pacer.span_ns == 2 * S
    pacer.observe(*_batch([("a", 0, S, 1024)]))  # a quiet batch: twice the span
    assert pacer.span_ns == 4 * S
    assert Pacer.resume(60 * S, MiB, [], 8 * MiB).batch_bytes == 8 * MiB


def _held_state(bounded: bool, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A minute of 10 KB changes on four partitions, three of which split, read through
    GroupTransactions with the default 60 s cap: the step state (bytes) after each batch;
    ``bounded``: all tasks of a batch paced to 4 MiB (else no such bound)."""
    from cdcflow.engine import loop
    from cdcflow.transforms import GroupTransactions

    monkeypatch.setattr(loop, "STEP_BATCH_BYTES", 4 * MiB if bounded else None)
    origin = time.time_ns() - 600 * S
    stream = ScriptedChangeStream("S", partitions=4, origin=origin)
    for i in range(3000):  # 50 a second
        stream.write("T", i, "INSERT", {"blob": "x" * 10_000}, at=origin + S + i * S // 50)
    for k, at in enumerate((15, 35, 50)):
        stream.split(f"p{k}", at=origin + at * S)
    store = MemoryStore()
    sizes: list[int] = []

    class _State(EngineListener):
        def on_batch(self, stats: BatchStats) -> None:
            sizes.append(len(store.step_state("held") or b""))

    out: cf.Collect[Any] = cf.Collect()
    p = cf.Pipeline("held")
    (p | cf.DetectPartitions(stream="S", start_at=origin, end_at=origin + 70 * S, client=stream)
     | cf.ReadPartition() | GroupTransactions() | out)
    summary = Engine(p, store, InMemoryRunner(workers=1), RunOptions(batch_interval=0),
                     _State()).run()
    assert summary.reason == "end reached"
    assert sorted(t.records[0].mods[0].keys["id"] for t in out.items) == list(range(3000))
    return sizes


def test_a_pipeline_with_batch_steps_keeps_its_state_near_the_batch_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A split holds the low watermark back until its children are read, one batch later:
    GroupTransactions then holds the other partitions' changes of the batch since the
    split. Pacing all tasks of a batch to ``STEP_BATCH_BYTES`` (4 MiB here) bounds it."""
    paced = _held_state(True, monkeypatch)
    assert 0 < max(paced) < 4 * MiB, paced
    unpaced = _held_state(False, monkeypatch)
    assert max(unpaced) > 2 * max(paced), (paced, unpaced)  # 7.0 MB against 1.9 MB
