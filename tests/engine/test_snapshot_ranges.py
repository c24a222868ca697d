"""A table split into key ranges over ScriptedChangeStream: the split, the ranges read in
parallel batches of bounded size, the stream after them, and a crash that reads again only
the ranges whose batch did not commit.

The ground truth is the scripted stream's: ``rows_at(table, START - 1)`` is the snapshot,
``rows_at(table, END)`` what the output replays to.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcflow.engine.listener import EngineListener
from cdcflow.engine.runner import Runner
from cdcflow.keyrange import range_token, token_range
from cdcflow.metadata import MemoryStore, SQLiteStore
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    BatchPlan,
    DataChangeRecord,
    PartitionState,
    is_snapshot_token,
    snapshot_table,
)
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, WriteFiles
from tests.engine.test_snapshot import (
    END,
    START,
    CrashAfterSinks,
    _Crash,
    _lines,
    pipeline,
    replay,
    run,
    shop,
    truth,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ROWS_PER_TASK = 400
TASKS_PER_BATCH = 3


class Plans(EngineListener):
    """The plans a run executed, in order."""

    def __init__(self) -> None:
        self.plans: list[BatchPlan] = []

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        self.plans.append(plan)


def split_pipeline(stream: Any, *sinks: Any, **source: Any) -> Any:
    return pipeline(stream, *sinks, snapshot_rows_per_task=ROWS_PER_TASK,
                    snapshot_tasks_per_batch=TASKS_PER_BATCH, **source)


def _mods(records: list[DataChangeRecord]) -> Counter[tuple[str, tuple[Any, ...]]]:
    return Counter((r.table_name, tuple(sorted(m.keys.items()))) for r in records for m in r.mods)


def test_a_large_table_is_read_in_key_ranges_in_bounded_batches_before_the_stream(
    runner: Runner,
) -> None:
    s = shop()
    singers = len(s.rows_at("Singers", START - 1))
    out, plans, store = Collect(), Plans(), MemoryStore()
    summary = run(runner, split_pipeline(s, out), store, plans)
    assert summary.reason == "end reached"

    first, *later = plans.plans
    # Batch 1: a task per table; Singers (about 2,500 rows) splits, Albums (250) is read.
    assert {sl.token for sl in first.slices} == {"snapshot/Albums", "snapshot/Singers"}
    snapshot_batches = [p for p in later if any(is_snapshot_token(s.token) for s in p.slices)]
    ranges = [sl.token for p in snapshot_batches for sl in p.slices]
    assert len(ranges) == len(set(ranges)) == -(-singers // ROWS_PER_TASK)
    assert all(snapshot_table(t) == "Singers" and token_range(t) is not None for t in ranges)
    assert [len(p.slices) for p in snapshot_batches] == [
        min(TASKS_PER_BATCH, len(ranges) - i) for i in range(0, len(ranges), TASKS_PER_BATCH)
    ]
    # The stream starts in the batch after the last range, never beside a range.
    stream_batches = later[len(snapshot_batches):]
    assert all(not is_snapshot_token(sl.token) for p in stream_batches for sl in p.slices)
    assert stream_batches[0].slices[0].token == INITIAL_PARTITION_TOKEN

    records: list[DataChangeRecord] = out.items
    flags = [r.is_snapshot for r in records]
    first_change = flags.index(False)
    assert all(flags[:first_change]) and not any(flags[first_change:])
    snap = records[:first_change]
    assert replay(snap) == truth(s, START - 1)
    assert max(_mods(snap).values()) == 1  # every snapshot row once
    by_token = Counter(r.partition_token for r in snap if r.table_name == "Singers")
    assert set(by_token) == set(ranges)  # each range's rows carry its own token
    assert replay(records) == truth(s, END)


def test_a_table_of_at_most_rows_per_task_rows_is_not_split() -> None:
    s = shop(rows=ROWS_PER_TASK)  # Singers has ROWS_PER_TASK rows at most before START
    plans, out = Plans(), Collect()
    run(InMemoryRunner(), split_pipeline(s, out), listener=plans)
    snapshot_tokens = {sl.token for p in plans.plans for sl in p.slices
                       if is_snapshot_token(sl.token)}
    assert snapshot_tokens == {"snapshot/Albums", "snapshot/Singers"}
    assert replay(out.items) == truth(s, END)


def test_a_crash_after_some_ranges_committed_reads_only_the_pending_ones_again(
    tmp_path: Path,
) -> None:
    s = shop()
    clean = tmp_path / "clean"
    run(InMemoryRunner(), split_pipeline(s, WriteFiles(clean)))
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path / 'state.db'}")
    crashed = tmp_path / "crashed"
    # Batch 3 is the second batch of ranges: its sinks commit, the store does not.
    with pytest.raises(_Crash):
        run(InMemoryRunner(workers=2), split_pipeline(s, WriteFiles(crashed)), store,
            CrashAfterSinks(3))
    states = {p.token: p.state for p in store.partitions("snap")}
    done = {t for t, state in states.items()
            if is_snapshot_token(t) and token_range(t) is not None and state == "FINISHED"}
    pending = store.pending_plan("snap")
    assert pending is not None and pending.batch_id == 3
    assert len(done) == TASKS_PER_BATCH  # batch 2's ranges
    assert all(states[sl.token] == PartitionState.RUNNING for sl in pending.slices)

    plans, again = Plans(), Collect()
    assert run(InMemoryRunner(workers=2), split_pipeline(s, WriteFiles(crashed), again), store,
               plans).reason == "end reached"
    store.close()
    assert plans.plans[0] == pending  # the pending batch, as planned
    read_again = {sl.token for p in plans.plans for sl in p.slices}
    assert not read_again & done  # finished ranges are never read again
    rows = sum(len(r.mods) for r in again.items if r.is_snapshot)
    singers = len(s.rows_at("Singers", START - 1))
    assert rows == singers - len(done) * ROWS_PER_TASK  # only the rows of unfinished ranges
    assert _lines(crashed) == _lines(clean)  # exactly once: the same output as without
    snapshot_rows = Counter(
        (r["table_name"], str(sorted(m["keys"].items())))
        for r in _lines(crashed) if r["is_snapshot"] for m in r["mods"]
    )
    assert max(snapshot_rows.values()) == 1
    assert sum(snapshot_rows.values()) == singers + len(s.rows_at("Albums", START - 1))


def test_a_failed_range_read_commits_nothing_and_the_replay_reads_its_batch_again() -> None:
    s = shop()
    ranges = s.snapshot_split("S", "Singers", START - 1, ROWS_PER_TASK)
    failing = shop().fail_reads(1, after_records=0, token=range_token("Singers", ranges[4]))
    store = MemoryStore()
    with pytest.raises(Exception, match="scripted failure"):
        run(InMemoryRunner(), split_pipeline(failing, Collect()), store)
    # its task failed: the batch's plan was not written, and the next run plans it again
    assert store.pending_plan("snap") is None
    unread = {p.token for p in store.partitions("snap")
              if is_snapshot_token(p.token) and p.state != PartitionState.FINISHED}
    assert range_token("Singers", ranges[4]) in unread
    assert range_token("Singers", ranges[0]) not in unread  # committed before
    out = Collect()
    assert run(InMemoryRunner(), split_pipeline(s, out), store).reason == "end reached"
    again = [r for r in out.items if r.is_snapshot]
    assert {r.partition_token for r in again} == unread  # the ranges not committed, once
    clean = Collect()
    run(InMemoryRunner(), split_pipeline(shop(), clean), MemoryStore())
    assert Counter(r.partition_token for r in again) == Counter(
        r.partition_token for r in clean.items if r.partition_token in unread)


keys = st.tuples(st.one_of(st.none(), st.integers(-3, 3)),
                 st.one_of(st.none(), st.sampled_from(["", "a", "b", "é"])),
                 st.one_of(st.none(), st.floats().map(lambda f: f + 0.0)))  # no -0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(keys, min_size=1, max_size=60, unique_by=lambda k: repr(k)),
       st.integers(1, 12))
def test_the_twin_s_ranges_cover_its_table_once(rows: list[Any], rows_per_task: int) -> None:
    s = ScriptedChangeStream("S", snapshot_rows={
        "T": [({"a": a, "b": b, "c": c}, {"v": i}) for i, (a, b, c) in enumerate(rows)]})
    ranges = s.snapshot_split("S", "T", 0, rows_per_task)
    assert (ranges == []) == (len(rows) <= rows_per_task)
    seen = [m.new_values["v"] for r in ranges or [None] for rec in s.snapshot("S", "T", 0, r)
            for m in rec.mods]
    assert sorted(seen) == list(range(len(rows)))
    for r in ranges:
        n = sum(len(rec.mods) for rec in s.snapshot("S", "T", 0, r))
        assert n == rows_per_task or r.hi is None


def test_a_failed_split_stores_no_range_and_the_replay_splits_the_same() -> None:
    store = MemoryStore()
    failing = shop().fail_reads(1, token="snapshot/Singers")
    with pytest.raises(Exception, match="scripted failure"):
        run(InMemoryRunner(), split_pipeline(failing, Collect()), store)
    assert not any(token_range(p.token) for p in store.partitions("snap")
                   if is_snapshot_token(p.token))
    s, out = shop(), Collect()
    assert run(InMemoryRunner(), split_pipeline(s, out), store).reason == "end reached"
    tokens = {r.partition_token for r in out.items if r.is_snapshot and r.table_name == "Singers"}
    assert tokens == {range_token("Singers", r) for r in s.snapshot_split(
        "S", "Singers", START - 1, ROWS_PER_TASK)}
    assert replay(out.items) == truth(s, END)
