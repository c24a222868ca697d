"""Resuming stored progress with another source definition: an earlier end_at is applied
(every partition, and every child after it, ends there), anything else warns or, with
``strict``, refuses."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.listener import EngineListener, RunSummary
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.resume import END_KEY, end_cap
from cdcflow.engine.runner import Runner
from cdcflow.errors import PipelineDefinitionError
from cdcflow.metadata import MemoryStore, SQLiteStore
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import DataChangeRecord, PartitionState, Timestamp
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream

S = 1_000_000_000
T0 = 1_700_000_000 * S
NAME = "resumed"


def _stream() -> ScriptedChangeStream:
    """40 inserts 250 ms apart over 10 s; partition p0 splits at 2.5 s, its children merge
    back at 6.5 s (children inherit their parent's end)."""
    s = ScriptedChangeStream("S", partitions=2, origin=T0)
    s.split("p0", at=T0 + 5 * S // 2)
    s.merge(["p0.0", "p0.1"], at=T0 + 13 * S // 2)
    for i in range(40):
        s.write("T", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S // 4)
    return s


def _run(
    stream: ScriptedChangeStream, sink: cf.Collect[DataChangeRecord], store: MetadataStore,
    end_at: Any, runner: Runner | None = None, **options: Any,
) -> RunSummary:
    p = cf.Pipeline(NAME)
    p | cf.DetectPartitions(stream="S", start_at=T0, end_at=end_at, client=stream) | \
        cf.ReadPartition() | sink
    # a run that should end by itself but does not fails (reason "duration"), never hangs
    opts = RunOptions(**{"batch_interval": 0, "max_batch_span": 1.0, "duration": 30.0,
                         **options})
    return Engine(p, store, runner or InMemoryRunner(workers=2), opts).run()


def _keys(records: list[DataChangeRecord]) -> list[tuple[int, str, str, str]]:
    return sorted((r.commit_timestamp.ns, r.server_transaction_id, r.partition_token,
                   r.record_sequence) for r in records)


def test_an_earlier_end_at_is_applied_on_resume(runner: Runner, tmp_path: Path) -> None:
    stream, sink = _stream(), cf.Collect[DataChangeRecord]()
    store = SQLiteStore(tmp_path / "state.db")
    first = _run(stream, sink, store, None, runner, max_batches=2)
    assert first.reason == "max batches"
    read_first = len(sink.items)
    assert read_first < len(stream.expected_records(T0, T0 + 5 * S + 1))  # stopped short
    store.close()

    store = SQLiteStore(tmp_path / "state.db")  # a new run: the change is stored
    end = Timestamp.from_ns(T0 + 5 * S)
    second = _run(stream, sink, store, end.rfc3339(), runner)
    assert second.reason == "end reached"
    # every change up to end_at (inclusive) exactly once, none after it
    assert _keys(sink.items) == _keys(stream.expected_records(T0, T0 + 5 * S + 1))
    assert all(p.state == PartitionState.FINISHED for p in store.partitions(NAME))

    # The applied end_at is the stored definition now: the same run again has nothing to do
    again = _run(stream, sink, store, end.rfc3339(), runner)
    assert again.reason == "end reached" and again.batches == 0
    store.close()


def test_an_end_at_before_what_was_read_finishes_every_partition(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stream, sink, store = _stream(), cf.Collect[DataChangeRecord](), MemoryStore()
    _run(stream, sink, store, T0 + 9 * S, max_batches=7)
    read = _keys(sink.items)
    reached = max(p.watermark for p in store.partitions(NAME))
    assert reached > T0 + 3 * S
    with caplog.at_level(logging.INFO, logger="cdcflow.engine"):
        summary = _run(stream, sink, store, T0 + 3 * S)
    assert summary.reason == "end reached"
    assert _keys(sink.items) == read  # nothing more, nothing taken back
    assert all(p.state == PartitionState.FINISHED for p in store.partitions(NAME))
    messages = [r.getMessage() for r in caplog.records]
    assert any("end_at is now" in m for m in messages)
    assert any("past the new end_at" in m and "stays delivered" in m for m in messages)
    assert not any("source changed" in m for m in messages)


@pytest.mark.parametrize("later", [T0 + 8 * S, None, "-1s"])
def test_a_later_or_relative_end_at_is_not_applied(
    later: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    stream, sink, store = _stream(), cf.Collect[DataChangeRecord](), MemoryStore()
    _run(stream, sink, store, T0 + 4 * S)
    done = _keys(sink.items)
    assert done == _keys(stream.expected_records(T0, T0 + 4 * S + 1))
    with caplog.at_level(logging.WARNING, logger="cdcflow.engine"):
        summary = _run(stream, sink, store, later)
    # the stored end holds: the run ends at once with the output it had
    assert summary.reason == "end reached" and _keys(sink.items) == done
    warned = [r.getMessage() for r in caplog.records if "source changed" in r.getMessage()]
    assert len(warned) == 1
    assert "end_at can only move earlier, to an absolute time" in warned[0]
    assert "--reset" in warned[0]
    with pytest.raises(PipelineDefinitionError, match="end_at can only move earlier"):
        _run(stream, sink, store, later, strict=True)


def test_strict_applies_an_earlier_end_at() -> None:
    stream, sink, store = _stream(), cf.Collect[DataChangeRecord](), MemoryStore()
    _run(stream, sink, store, None, max_batches=1)
    summary = _run(stream, sink, store, T0 + 2 * S, strict=True)
    assert summary.reason == "end reached"
    assert _keys(sink.items) == _keys(stream.expected_records(T0, T0 + 2 * S + 1))


def test_a_change_besides_end_at_still_warns(caplog: pytest.LogCaptureFixture) -> None:
    stream, sink, store = _stream(), cf.Collect[DataChangeRecord](), MemoryStore()
    _run(stream, sink, store, None, max_batches=1)
    p = cf.Pipeline(NAME)
    p | cf.DetectPartitions(stream="S", start_at=T0 + S, end_at=T0 + 2 * S, client=stream) | \
        cf.ReadPartition() | sink
    with caplog.at_level(logging.WARNING, logger="cdcflow.engine"):
        Engine(p, store, InMemoryRunner(), RunOptions(batch_interval=0, max_batches=1)).run()
    warned = [r.getMessage() for r in caplog.records if "source changed" in r.getMessage()]
    assert len(warned) == 1 and "start_at" in warned[0] and "end_at" in warned[0]


@pytest.mark.parametrize("spelling", ["2023-11-14T22:13:20.000000000Z",
                                      "2023-11-14T22:13:20+00:00", T0])
def test_the_same_start_spelled_otherwise_is_no_change(
    spelling: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """start_at is compared as the instant it stands for: a catch-up run that spells the
    stored ``...20Z`` otherwise was warned of a changed source (and refused with strict)."""
    stream, sink, store = _stream(), cf.Collect[DataChangeRecord](), MemoryStore()

    def run(start: Any, **options: Any) -> RunSummary:
        p = cf.Pipeline(NAME)
        p | cf.DetectPartitions(stream="S", start_at=start, end_at=T0 + 2 * S,
                                client=stream) | cf.ReadPartition() | sink
        return Engine(p, store, InMemoryRunner(),
                      RunOptions(batch_interval=0, max_batch_span=1.0, **options)).run()

    assert run("2023-11-14T22:13:20Z", max_batches=1).reason == "max batches"
    with caplog.at_level(logging.WARNING, logger="cdcflow.engine"):
        assert run(spelling, strict=True).reason == "end reached"
    assert not [r for r in caplog.records if "source changed" in r.getMessage()]
    assert _keys(sink.items) == _keys(stream.expected_records(T0, T0 + 2 * S + 1))


def test_an_unchanged_end_at_holds_to_the_nanosecond() -> None:
    """A Timestamp end_at keeps its nanoseconds across a resume (its stored text does not:
    the partitions carry the end, and only an end applied on resume caps them)."""
    stream, sink, store = _stream(), cf.Collect[DataChangeRecord](), MemoryStore()
    last = T0 + 5 * S + 789
    stream.write("T", 99, "INSERT", {"v": 99}, at=last)
    end = Timestamp.from_ns(last)
    assert _run(stream, sink, store, end, max_batches=2).reason == "max batches"
    assert _run(stream, sink, store, end).reason == "end reached"
    assert _keys(sink.items) == _keys(stream.expected_records(T0, last + 1))
    assert max(r.commit_timestamp.ns for r in sink.items) == last


def test_end_cap_is_the_end_applied_on_resume() -> None:
    assert end_cap({"end_at": "2023-11-14T22:13:20Z"}) is None  # as the pipeline began
    assert end_cap({"end_at": "2023-11-14T22:13:20Z", END_KEY: T0 + 1}) == T0 + 1


def test_another_stream_cannot_resume_the_stored_progress() -> None:
    """The stored partitions are the old stream's: reading them in another stream failed
    later, with exit 1 or 2 depending on what the query said, after a warning that the
    run resumes."""
    stream, sink, store = _stream(), cf.Collect[DataChangeRecord](), MemoryStore()
    _run(stream, sink, store, None, max_batches=1)
    p = cf.Pipeline(NAME)
    other = ScriptedChangeStream("S2", partitions=2, origin=T0)
    p | cf.DetectPartitions(stream="S2", start_at=T0, client=other) | \
        cf.ReadPartition() | sink
    with pytest.raises(PipelineDefinitionError) as refused:
        Engine(p, store, InMemoryRunner(), RunOptions(batch_interval=0, max_batches=1)).run()
    text = str(refused.value)
    assert "stream 'S' -> 'S2'" in text and "another change stream's partitions" in text
    assert "--reset" in text and "\n" not in text


class _CrashOnData(EngineListener):
    """Stands for the process dying right after the store committed a batch with records
    (a BaseException: nothing in the engine catches it)."""

    def on_batch(self, stats: Any) -> None:
        if stats.records:
            raise KeyboardInterrupt


@pytest.mark.emulator
def test_a_reset_to_another_stream_first_delivers_what_the_old_one_owed(
    spanner_emulator: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batches the old progress owes a staging sink are read again from the stream
    they were made on: read from the new stream (the run's), every one failed on a
    partition token of another stream, and the reset went on without them."""
    from cdcflow.transforms import WriteTables

    monkeypatch.setenv("SPANNER_EMULATOR_HOST", spanner_emulator.host)
    db = spanner_emulator.create_database("resetsource", [
        "CREATE TABLE T (Id INT64 NOT NULL, V INT64) PRIMARY KEY (Id)",
        "CREATE CHANGE STREAM A FOR T", "CREATE CHANGE STREAM B FOR T"])
    path = spanner_emulator.database_path("resetsource")
    start = Timestamp.now()
    for i in range(20):
        with db.batch() as batch:
            batch.insert("T", ("Id", "V"), [(i, i)])
    end = Timestamp.now()
    lake = tmp_path / "lake"
    store = SQLiteStore(tmp_path / "s.db")

    def run(stream: str, begin: Timestamp, until: Timestamp,
            listener: EngineListener | None = None, **options: Any) -> Any:
        p = cf.Pipeline("resetsource")
        (p | cf.DetectPartitions(database=path, stream=stream, start_at=str(begin),
                                 end_at=str(until))
         | cf.ReadPartition() | "lake" >> WriteTables(f"file://{lake}", format="jsonl",
                                                      flush_interval="1h"))
        opts = RunOptions(batch_interval=0, **options)
        return Engine(p, store, InMemoryRunner(), opts, listener).run()

    with pytest.raises(KeyboardInterrupt):  # committed in the store, staged in the sink
        # one batch holds every insert, however slowly a loaded machine made them
        run("A", start, end, _CrashOnData(), max_batch_span=3600.0)
    assert not list(lake.rglob("part-*"))
    later = Timestamp.now()
    run("B", later, Timestamp.from_ns(later.ns + 10**9), reset=True)
    ids = sorted(json.loads(line)["Id"] for f in lake.rglob("part-*")
                 for line in f.read_text().splitlines())
    assert ids == list(range(20))
    store.close()
