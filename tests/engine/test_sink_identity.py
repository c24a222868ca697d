"""Sinks and the engine: two sinks never write the same output, batch ids go on above
output a sink already holds (a lost or new store), and a sink's storage fault is a batch
failure retried with backoff, not an element error."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.errors import LostProgressError, PipelineDefinitionError, SinkIOError
from cdcflow.metadata import MemoryStore, SQLiteStore
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream

S = 1_000_000_000
T0 = 1_700_000_000 * S


def _stream() -> ScriptedChangeStream:
    s = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(30):
        s.write("T", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S // 5)
    return s


def _run(p: cf.Pipeline, store: Any, base: Path, **options: Any) -> Any:
    opts = RunOptions(batch_interval=0, max_batch_span=1.0, base_dir=str(base), **options)
    return Engine(p, store, InMemoryRunner(workers=2), opts).run()


def _files(p: cf.Pipeline, *sinks: Any) -> cf.Pipeline:
    src = p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 7 * S, client=_stream())
    rows = src | cf.ReadPartition() | "row" >> cf.Map(lambda r: {"v": r.mods[0].new_values["v"]})
    for sink in sinks:
        rows | sink
    return p


def test_two_sinks_writing_the_same_files_are_refused_naming_both(tmp_path: Path) -> None:
    p = _files(cf.Pipeline("twice"), "a" >> cf.WriteFiles("out"), "b" >> cf.WriteFiles("out"))
    with pytest.raises(PipelineDefinitionError, match="'a' and 'b' would write the same"):
        _run(p, MemoryStore(), tmp_path)


def test_a_jsonl_and_a_parquet_sink_share_a_directory(tmp_path: Path) -> None:
    p = _files(cf.Pipeline("both"), "j" >> cf.WriteFiles("out", format="jsonl"),
               "q" >> cf.WriteFiles("out", format="parquet"))
    assert _run(p, MemoryStore(), tmp_path).reason == "end reached"
    import pyarrow.dataset as ds

    parquet = sorted(str(f) for f in (tmp_path / "out").glob("*.parquet"))
    table = ds.dataset(parquet, format="parquet").to_table()
    assert sorted(table.column("v").to_pylist()) == list(range(30))
    lines = [line for f in (tmp_path / "out").glob("*.jsonl") for line in f.read_text().split()]
    assert len(lines) == 30


def _digest(root: Path) -> dict[str, str]:
    return {str(f.relative_to(root)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(root.rglob("*")) if f.is_file()}


def test_a_new_store_continues_above_existing_output_and_overwrites_nothing(
    tmp_path: Path,
) -> None:
    p = _files(cf.Pipeline("files"), cf.WriteFiles("out"))
    _run(p, SQLiteStore(tmp_path / "first.db"), tmp_path)
    before = _digest(tmp_path / "out")
    # the state file is lost: a new store would start the pipeline over into the same
    # directory, delivering everything again: refused, naming the sink and --reset
    second = SQLiteStore(tmp_path / "second.db")
    with pytest.raises(LostProgressError,
                       match=r"sink 'WriteFiles' holds its output up to batch \d+.*--reset"):
        _run(_files(cf.Pipeline("files"), cf.WriteFiles("out")), second, tmp_path)
    assert _digest(tmp_path / "out") == before and second.pending_plan("files") is None
    # starting over on purpose
    _run(_files(cf.Pipeline("files"), cf.WriteFiles("out")), second, tmp_path, reset=True)
    after = _digest(tmp_path / "out")
    output = {name: digest for name, digest in before.items() if name.startswith("part-")}
    assert all(after[name] == digest for name, digest in output.items())  # nothing overwritten
    first_ids = {n.split("-")[1] for n in before if n.startswith("part-")}
    new_ids = {n.split("-")[1] for n in after if n.startswith("part-")} - first_ids
    assert new_ids and min(map(int, new_ids)) > max(map(int, first_ids))


class _FailingDisk(cf.Sink[Any, int]):
    """Its storage fails on the first attempt of every task of the batch (counted in files:
    each task gets its own copy of the sink)."""

    def __init__(self, counts: Path) -> None:
        self.counts = counts
        self.committed: list[int] = []

    def open_writer(self, ctx: Any) -> Any:
        sink = self
        mark = self.counts / f"{ctx.batch_id}-{ctx.partition_token}"
        n = 2 if mark.exists() else 1
        mark.touch()

        class W:
            count = 0

            def write(self, element: Any) -> None:
                if n == 1:
                    raise SinkIOError("disk full (test); the batch is retried with backoff")
                self.count += 1

            def close(self) -> int:
                return self.count

            def abort(self) -> None:
                return None

        del sink
        return W()

    def commit(self, batch_id: int, messages: Any) -> None:
        self.committed.append(sum(messages))


def test_a_storage_fault_retries_the_batch_not_the_element(tmp_path: Path) -> None:
    (tmp_path / "counts").mkdir()
    sink = _FailingDisk(tmp_path / "counts")
    p = cf.Pipeline("disk", error_policy=cf.ErrorPolicy(retries=5, backoff=0, then="skip"))
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 7 * S, client=_stream())
     | cf.ReadPartition() | sink)
    summary = _run(p, MemoryStore(), tmp_path, retry_backoff=0.0, batch_retries=3)
    assert summary.reason == "end reached" and summary.skipped == 0 and summary.retried == 0
    assert sum(sink.committed) == 30  # every element written, none skipped


def test_a_lost_store_under_writetables_output_is_refused_then_reset_starts_over(
    tmp_path: Path,
) -> None:
    def pipeline() -> cf.Pipeline:
        p = cf.Pipeline("tables")
        (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 7 * S, client=_stream())
         | cf.ReadPartition() | cf.WriteTables(str(tmp_path / "lake"), format="jsonl"))
        return p

    _run(pipeline(), SQLiteStore(tmp_path / "first.db"), tmp_path)
    durable = orjson.loads((tmp_path / "lake" / "_cdcflow" / "durable.json").read_bytes())
    assert durable["pipeline"] == "tables" and durable["durable_batch"] > 0
    second = SQLiteStore(tmp_path / "second.db")
    with pytest.raises(LostProgressError, match=r"sink 'WriteTables' holds its output up to "
                       rf"batch {durable['durable_batch']}"):
        _run(pipeline(), second, tmp_path)
    assert _run(pipeline(), second, tmp_path, reset=True).reason == "end reached"
    # a store that knows the batches (the first one, or the second after its reset) runs
    assert _run(pipeline(), SQLiteStore(tmp_path / "first.db"), tmp_path).reason == "end reached"


def test_a_memory_store_starts_over_by_choice_without_a_refusal(tmp_path: Path) -> None:
    # memory:// keeps nothing between runs (cdcflow.testing.run uses one): every run starts
    # over, so output an earlier run left is not a sign of lost progress.
    for _ in range(2):
        _run(_files(cf.Pipeline("files"), cf.WriteFiles("out")), MemoryStore(), tmp_path)
    lines = [line for f in (tmp_path / "out").glob("*.jsonl")
             for line in f.read_text().splitlines()]
    assert len(lines) == 2 * 30


def test_a_sink_added_to_a_pipeline_with_progress_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sink added later takes the changes from then on: it was silent, and its
    directory's _watermark.json then claimed all the changes below it."""
    store = SQLiteStore(tmp_path / "s.db")
    _run(_files(cf.Pipeline("grows"), "a" >> cf.WriteFiles("a")), store, tmp_path,
         max_batches=2)
    with caplog.at_level(logging.WARNING, logger="cdcflow"):
        _run(_files(cf.Pipeline("grows"), "a" >> cf.WriteFiles("a"),
                    "b" >> cf.WriteFiles("b")), store, tmp_path)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m for m in said if "holds no output" in m] == [
        "sink 'b' holds no output of pipeline grows, which resumes from stored progress: if "
        "the sink is new to the pipeline, it receives the changes from here on, not those "
        "committed before (to fill it from the start, run it in a pipeline of its own)"]
    store.close()


def test_a_sink_is_not_called_new_after_a_run_that_committed_no_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A first run that stopped before its first batch committed (``--for 0``) stored
    progress that delivered nothing: the next run warned that the sink was new to the
    pipeline and would miss what was committed before, which was nothing."""
    store = SQLiteStore(tmp_path / "s.db")
    summary = _run(_files(cf.Pipeline("late"), "a" >> cf.WriteFiles("a")), store, tmp_path,
                   duration=0)
    assert summary.batches == 0 and store.partitions("late")
    with caplog.at_level(logging.WARNING, logger="cdcflow"):
        _run(_files(cf.Pipeline("late"), "a" >> cf.WriteFiles("a")), store, tmp_path)
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not [m for m in said if "holds no output" in m], said
    store.close()


def test_a_quiet_pipeline_s_files_sink_is_not_called_new_when_it_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A WriteFiles sink of a pipeline that has read no change yet holds no data file: every
    restart warned that it was new to the pipeline. Its first commit leaves a manifest
    with no file, once."""
    store = SQLiteStore(tmp_path / "s.db")

    def quiet() -> cf.Pipeline:
        p = cf.Pipeline("quiet")
        (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 7 * S,
                                 client=ScriptedChangeStream("S", partitions=2, origin=T0))
         | cf.ReadPartition() | cf.WriteFiles("out"))
        return p

    _run(quiet(), store, tmp_path, max_batches=2)
    manifests = list((tmp_path / "out" / "_cdcflow").rglob("batch-*.json"))
    assert len(manifests) == 1 and orjson.loads(manifests[0].read_bytes())["files"] == []
    with caplog.at_level(logging.WARNING, logger="cdcflow"):
        assert _run(quiet(), store, tmp_path).reason == "end reached"
    assert not [r for r in caplog.records if "holds no output" in r.getMessage()]
    assert list((tmp_path / "out").glob("*.jsonl")) == []
    store.close()


def _staged(tmp_path: Path, lake: str = "lake") -> cf.Pipeline:
    from cdcflow.transforms import WriteTables

    p = cf.Pipeline("staged")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 7 * S, client=_stream())
     | cf.ReadPartition() | "lake" >> WriteTables(f"file://{tmp_path / lake}",
                                                  format="jsonl", flush_interval="1h"))
    return p


def test_a_staging_sink_that_holds_nothing_yet_is_not_called_new(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A WriteTables sink whose output is all staged (the run died before its first
    upload) holds nothing, though the store has it durable through the batches that read
    nothing: no warning (it came after every such crash)."""
    store = SQLiteStore(tmp_path / "s.db")
    with monkeypatch.context() as crash:  # the run ends without making its output durable
        crash.setattr(Engine, "_final_flush", lambda self, staged: None)
        _run(_staged(tmp_path), store, tmp_path, max_batches=2)
    assert not list((tmp_path / "lake").rglob("part-*"))
    with caplog.at_level(logging.WARNING, logger="cdcflow"):
        _run(_staged(tmp_path), store, tmp_path, max_batches=1)
    assert not [r for r in caplog.records if "holds no output" in r.getMessage()]
    assert list((tmp_path / "lake").rglob("part-*"))  # the staged batches, replayed
    store.close()


def test_a_staging_sink_moved_to_an_empty_location_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The same label, a new URL: the store has the sink's output durable through batches
    that held data, the new location holds none of it. Said, as for a sink that does not
    stage; once."""
    store = SQLiteStore(tmp_path / "s.db")
    _run(_staged(tmp_path), store, tmp_path, max_batches=3)
    assert list((tmp_path / "lake").rglob("part-*"))
    durable = store.durable_marks("staged")["lake"]
    with caplog.at_level(logging.WARNING, logger="cdcflow"):
        _run(_staged(tmp_path, lake="moved"), store, tmp_path, max_batches=1)
    said = [r.getMessage() for r in caplog.records if "holds no output" in r.getMessage()]
    assert said == [
        f"sink 'lake' holds no output of pipeline staged where it writes now, though the "
        f"store has its output durable through batch {durable}: if its location changed (or "
        f"its output was removed), what it wrote before is not there, and it receives the "
        f"changes from here on (to fill it from the start, run it in a pipeline of its own)"
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="cdcflow"):
        _run(_staged(tmp_path, lake="moved"), store, tmp_path, max_batches=1)
    assert not [r for r in caplog.records if "holds no output" in r.getMessage()]
    store.close()


def test_a_renamed_staging_sink_is_refused_without_being_called_new(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal came after a warning that the sink would take the changes from here
    on: two lines saying opposite things."""
    from cdcflow.engine.listener import EngineListener
    from cdcflow.errors import OwedOutputError
    from cdcflow.transforms import WriteTables

    class Crash(EngineListener):
        def on_batch(self, stats: Any) -> None:
            if stats.records:
                raise KeyboardInterrupt

    def staged(label: str) -> cf.Pipeline:
        p = cf.Pipeline("renamed")
        (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 7 * S, client=_stream())
         | cf.ReadPartition() | label >> WriteTables(f"file://{tmp_path / 'lake'}",
                                                     format="jsonl", flush_interval="1h"))
        return p

    store = SQLiteStore(tmp_path / "s.db")
    opts = RunOptions(batch_interval=0, max_batch_span=1.0, base_dir=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        Engine(staged("lake"), store, InMemoryRunner(workers=2), opts, Crash()).run()
    with caplog.at_level(logging.WARNING, logger="cdcflow"), pytest.raises(OwedOutputError):
        _run(staged("lake2"), store, tmp_path)
    assert not [r for r in caplog.records if "holds no output" in r.getMessage()]
    store.close()


class _Staging(cf.Sink):
    """A plugin's staging sink that says where it writes and how far it is durable, and
    not what it holds there (no last_committed_batch, no owned_batch): it cannot tell."""

    def __init__(self, path: str) -> None:
        self.path, self.durable = path, 0

    def open_writer(self, ctx: Any) -> Any:
        class Writer:
            def write(self, element: Any) -> None:
                pass

            def close(self) -> None:
                return None

            def abort(self) -> None:
                pass

        return Writer()

    def commit(self, batch_id: int, messages: Any) -> None:
        if batch_id % 2 == 0:  # durable every other batch
            self.durable = batch_id

    def durable_batch(self) -> int | None:
        return self.durable

    def output_location(self) -> str | None:
        return self.path


def test_a_sink_that_cannot_tell_what_it_holds_is_not_said_to_hold_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    store = SQLiteStore(tmp_path / "s.db")

    def pipeline() -> cf.Pipeline:
        p = cf.Pipeline("opaque")
        (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 7 * S, client=_stream())
         | cf.ReadPartition() | "staging" >> _Staging(str(tmp_path / "out")))
        return p

    _run(pipeline(), store, tmp_path, max_batches=3)
    assert store.durable_marks("opaque")["staging"] > 0
    with caplog.at_level(logging.WARNING, logger="cdcflow"):
        _run(pipeline(), store, tmp_path, max_batches=1)
    assert not [r for r in caplog.records if "holds no output" in r.getMessage()]
    store.close()
