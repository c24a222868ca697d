"""Two-stage acks: a sink that stages batches and makes them durable later. After a crash
at any step of a flush, nothing it had made durable is delivered twice and nothing it had
not is lost (the engine replays the batch log above its durable mark, to it alone)."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import cdcflow as cf
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner
from cdcflow.metadata import SQLiteStore
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms.base import SinkContext, SinkWriter, WriterContext

# The sink below runs where the tasks run (Spark's Python workers too), which cannot import
# this test module by name: it travels by value, as a pipeline file's code does.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

S = 1_000_000_000
T0 = 1_700_000_000 * S


class _Crash(BaseException):
    """Stands for the process dying at that point. A BaseException, as a
    crash is not an error the engine may catch or wrap (it wraps a sink's errors)."""


class _ListWriter:
    def __init__(self) -> None:
        self.items: list[int] = []

    def write(self, element: int) -> None:
        self.items.append(element)

    def close(self) -> list[int] | None:
        return self.items or None

    def abort(self) -> None:
        self.items = []


class SegmentSink(cf.Sink[int, list[int]]):
    """Stages committed batches in memory; every ``every`` batches (and on flush) writes them
    as one segment file ``seg-<first>-<last>.json`` (temp file, then an atomic rename). Its
    durable batch is the largest ``last`` among the segments, read back from the directory
    after a restart. ``crash_at`` raises at one step: "stage", "segment-written" (temp
    file written, not renamed) or "renamed" (renamed, before the engine records it)."""

    def __init__(self, directory: Path, every: int, crash_at: tuple[str, int] | None = None):
        self.directory = directory
        self.every = every
        self.crash_at = crash_at
        self.staged: dict[int, list[int]] = {}

    def setup(self, ctx: SinkContext) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def _crash(self, step: str, batch_id: int) -> None:
        if self.crash_at == (step, batch_id):
            raise _Crash(f"{step} {batch_id}")

    def durable_batch(self) -> int:
        ends = [int(f.name.split("-")[2].split(".")[0]) for f in self.directory.glob("seg-*.json")]
        return max(ends, default=0)

    def open_writer(self, ctx: WriterContext) -> SinkWriter[int, list[int]]:
        return _ListWriter()

    def commit(self, batch_id: int, messages: Sequence[list[int]]) -> None:
        if batch_id <= self.durable_batch():
            return  # durable already
        self._crash("stage", batch_id)
        self.staged[batch_id] = sorted(v for m in messages for v in m)
        if len(self.staged) >= self.every:
            self._write_segment()

    def flush(self) -> None:
        if self.staged:
            self._write_segment()

    def _write_segment(self) -> None:
        first, last = min(self.staged), max(self.staged)
        values = [v for b in sorted(self.staged) for v in self.staged[b]]
        temp = self.directory / f".tmp-{first}-{last}"
        temp.write_text(json.dumps(values))
        self._crash("segment-written", last)
        os.replace(temp, self.directory / f"seg-{first}-{last}.json")
        self.staged = {}
        self._crash("renamed", last)

    def values(self) -> list[int]:
        return [v for f in sorted(self.directory.glob("seg-*.json"))
                for v in json.loads(f.read_text())]


class _CrashAfterStore(EngineListener):
    def __init__(self, batch_id: int) -> None:
        self.batch_id = batch_id

    def on_batch(self, stats: BatchStats) -> None:
        if stats.batch_id == self.batch_id:
            raise _Crash(f"after store commit {self.batch_id}")


def _stream() -> ScriptedChangeStream:
    s = ScriptedChangeStream("S", partitions=2, origin=T0)
    s.split("p0", at=T0 + 3 * S, into=["a", "b"])
    for i in range(80):
        s.write("T", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S // 8)
    return s


def _run(runner: Runner, store_path: Path, sink: SegmentSink,
         listener: EngineListener | None = None, label: str = "SegmentSink") -> Any:
    p = cf.Pipeline("staged")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 11 * S, client=_stream())
     | cf.ReadPartition() | "v" >> cf.Map(lambda r: r.mods[0].new_values["v"])
     | label >> sink)
    store = SQLiteStore(store_path)
    try:
        opts = RunOptions(batch_interval=0, max_batch_span=1.0)
        return Engine(p, store, runner, opts, listener).run()
    finally:
        store.close()


CRASHES = [
    ("stage", 4), ("stage", 6), ("segment-written", 6), ("renamed", 6),
    ("segment-written", 9), ("renamed", 3),
]


@pytest.mark.parametrize("crash", CRASHES, ids=[f"{s}-{b}" for s, b in CRASHES])
def test_a_crash_at_any_step_of_a_flush_loses_and_repeats_nothing(
    runner: Runner, tmp_path: Path, crash: tuple[str, int]
) -> None:
    out = tmp_path / "out"
    with pytest.raises(_Crash):
        _run(runner, tmp_path / "s.db", SegmentSink(out, every=3, crash_at=crash))
    summary = _run(runner, tmp_path / "s.db", SegmentSink(out, every=3))
    assert summary.reason == "end reached"
    assert sorted(SegmentSink(out, 3).values()) == list(range(80))


@pytest.mark.parametrize("after", [2, 5])
def test_a_crash_after_the_store_commit_replays_only_what_was_not_durable(
    runner: Runner, tmp_path: Path, after: int
) -> None:
    out = tmp_path / "out"
    with pytest.raises(_Crash):
        _run(runner, tmp_path / "s.db", SegmentSink(out, every=3), _CrashAfterStore(after))
    durable_before = SegmentSink(out, 3).durable_batch()
    assert durable_before < after  # batches were committed but only staged
    store = SQLiteStore(tmp_path / "s.db")
    assert store.durable_marks("staged") == {"SegmentSink": durable_before}
    store.close()
    _run(runner, tmp_path / "s.db", SegmentSink(out, every=3))
    assert sorted(SegmentSink(out, 3).values()) == list(range(80))


class _DiesAtCommit(SegmentSink):
    """A SegmentSink whose process dies at its ``nth`` commit (a run that lives that long)."""

    def __init__(self, directory: Path, nth: int) -> None:
        super().__init__(directory, every=1000)  # cuts a segment only when flushed
        self.nth, self.commits = nth, 0

    def commit(self, batch_id: int, messages: Sequence[list[int]]) -> None:
        self.commits += 1
        if self.commits == self.nth:
            raise _Crash(f"commit {self.commits}")
        super().commit(batch_id, messages)


def test_runs_that_die_before_a_staging_sink_cuts_a_file_still_make_progress(
    tmp_path: Path,
) -> None:
    # Every run dies at its third sink commit, long before the sink would cut a segment.
    # The replayed batches are made durable one by one, so the next run has less to replay;
    # before, each run replayed all the committed batches not durable, and died doing it.
    from cdcflow.runners.in_memory import InMemoryRunner

    out = tmp_path / "out"
    crashes = 0
    while crashes < 40:
        try:
            summary = _run(InMemoryRunner(), tmp_path / "s.db", _DiesAtCommit(out, 3))
        except _Crash:
            crashes += 1
            continue
        assert summary.reason == "end reached"
        break
    assert 2 <= crashes < 40, crashes  # it took crashes, and a run got through
    assert sorted(SegmentSink(out, 3).values()) == list(range(80))


def test_a_renamed_staging_sink_that_was_owed_batches_is_refused(tmp_path: Path) -> None:
    """A staging sink renamed after a crash would start at the last committed batch under
    its new label, and the batches its old label had staged were lost for good (silently):
    refused in one line, naming the way out; under its old label it gets them."""
    from cdcflow.errors import OwedOutputError, UserInputError
    from cdcflow.runners.in_memory import InMemoryRunner

    out, db = tmp_path / "out", tmp_path / "s.db"
    with pytest.raises(_Crash):
        _run(InMemoryRunner(), db, SegmentSink(out, every=100), _CrashAfterStore(5))
    assert SegmentSink(out, 100).values() == []  # five batches committed, none durable
    with pytest.raises(OwedOutputError) as refused:
        _run(InMemoryRunner(), db, SegmentSink(out, every=100), label="lake")
    text = str(refused.value)
    assert isinstance(refused.value, UserInputError) and "\n" not in text  # exit 2
    assert "sink 'lake' is new to the pipeline, while 'SegmentSink' (batches 1..5) left it" \
        in text
    assert "give it its old label back and run once" in text and "--reset" in text
    assert SegmentSink(out, 100).values() == []
    _run(InMemoryRunner(), db, SegmentSink(out, every=100))  # its old label: all of it
    assert sorted(SegmentSink(out, 100).values()) == list(range(80))
    # owed nothing now (a graceful end made it durable): the rename goes through
    assert _run(InMemoryRunner(), db, SegmentSink(out, every=100), label="lake").batches == 0


def test_a_graceful_end_makes_everything_durable(tmp_path: Path) -> None:
    from cdcflow.runners.in_memory import InMemoryRunner

    out = tmp_path / "out"
    _run(InMemoryRunner(workers=2), tmp_path / "s.db", SegmentSink(out, every=100))
    assert sorted(SegmentSink(out, 100).values()) == list(range(80))
    store = SQLiteStore(tmp_path / "s.db")
    assert store.durable_marks("staged")["SegmentSink"] == store.last_batch_id("staged")
    store.close()


class BatchFileSink(cf.Sink[int, list[int]]):
    """Makes each batch durable in its commit: ``b-<batch>.json`` (a batch committed again
    is skipped)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def setup(self, ctx: SinkContext) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def open_writer(self, ctx: WriterContext) -> SinkWriter[int, list[int]]:
        return _ListWriter()

    def commit(self, batch_id: int, messages: Sequence[list[int]]) -> None:
        path = self.directory / f"b-{batch_id}.json"
        if not path.exists():
            path.write_text(json.dumps(sorted(v for m in messages for v in m)))

    def values(self) -> list[int]:
        return [v for f in self.directory.glob("b-*.json") for v in json.loads(f.read_text())]


@pytest.mark.parametrize("crash", ["after store commit 5", "stage 6"])
def test_a_reset_first_delivers_what_the_old_progress_owed_every_sink(
    runner: Runner, tmp_path: Path, crash: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Batches committed but only staged, and a batch left pending, reach the staging sink
    before a reset forgets the old progress: both sinks then hold the same changes. The log
    says a reset is under way before that delivery (a run stopped during it keeps the old
    progress) and when it is done."""
    staged_out, files_out = tmp_path / "staged", tmp_path / "files"

    def run(start: int, sink: SegmentSink, reset: bool = False,
            listener: EngineListener | None = None) -> Any:
        p = cf.Pipeline("staged")
        read = (p | cf.DetectPartitions(stream="S", start_at=start, end_at=T0 + 11 * S,
                                        client=_stream())
                | cf.ReadPartition() | "v" >> cf.Map(lambda r: r.mods[0].new_values["v"]))
        read | "segments" >> sink
        read | "files" >> BatchFileSink(files_out)
        store = SQLiteStore(tmp_path / "s.db")
        try:
            opts = RunOptions(batch_interval=0, max_batch_span=1.0, reset=reset)
            return Engine(p, store, runner, opts, listener).run()
        finally:
            store.close()

    if crash == "stage 6":
        first = SegmentSink(staged_out, every=100, crash_at=("stage", 6))
        listener: EngineListener | None = None
    else:
        first, listener = SegmentSink(staged_out, every=100), _CrashAfterStore(5)
    with pytest.raises(_Crash):
        run(T0, first, listener=listener)
    assert SegmentSink(staged_out, 100).values() == []  # nothing durable there yet
    # reset, starting after every change: what follows comes from before the reset only
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="cdcflow"):
        summary = run(T0 + 21 * S // 2, SegmentSink(staged_out, every=100), reset=True)
    assert summary.reason == "end reached"
    said = [r.getMessage() for r in caplog.records]
    begun = next(i for i, m in enumerate(said) if "resetting;" in m)
    again = [i for i, m in enumerate(said) if " again for " in m]
    done = next(i for i, m in enumerate(said) if "reset done" in m)
    assert "run with --reset again" in said[begun]
    assert again and begun < min(again) and max(again) < done
    assert "partition(s) is forgotten" in said[done]
    staged = SegmentSink(staged_out, 100).values()
    files = BatchFileSink(files_out).values()
    assert len(staged) == len(set(staged)) and len(files) == len(set(files))
    assert sorted(staged) == sorted(files)
    assert len(files) >= 20  # five batches' worth of changes at least


def test_a_reset_is_the_way_out_of_a_batch_that_fails_every_time(
    runner: Runner, tmp_path: Path
) -> None:
    """A pending batch whose reads fail every time (partition p0's: as a start past the
    stream's retention does) cannot be delivered before the reset: a warning says so, and
    the reset run goes on (p0 split into a and b before its new start)."""
    from cdcflow.errors import ChangeStreamError, SparkTaskError

    files_out = tmp_path / "files"

    def run(stream: ScriptedChangeStream, start: int, reset: bool = False) -> Any:
        p = cf.Pipeline("stuck")
        (p | cf.DetectPartitions(stream="S", start_at=start, end_at=T0 + 11 * S, client=stream)
         | cf.ReadPartition() | "v" >> cf.Map(lambda r: r.mods[0].new_values["v"])
         | "files" >> BatchFileSink(files_out))
        store = SQLiteStore(tmp_path / "s.db")
        try:
            opts = RunOptions(batch_interval=0, max_batch_span=1.0, reset=reset, batch_retries=0)
            return Engine(p, store, runner, opts).run()
        finally:
            store.close()

    def failing() -> ScriptedChangeStream:
        return _stream().fail_reads(10_000, error=ChangeStreamError, token="p0")

    with pytest.raises((ChangeStreamError, SparkTaskError), match="scripted failure"):
        run(failing(), T0)
    summary = run(failing(), T0 + 5 * S, reset=True)
    assert summary.reason == "end reached"
    assert sorted(BatchFileSink(files_out).values()) == list(range(39, 80))
