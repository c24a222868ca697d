"""WriteTables' spool: slow uploads do not stall commits until the spool is full; past the
memory high watermark staged rows spill to local disk; the output is exactly once.

Storage is the real fsspec memory filesystem, slowed down only at the fsspec seam (its
``pipe_file``/``put_file``, what the sink's uploads call)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from cdcflow.errors import SinkIOError
from cdcflow.model import ColumnType, DataChangeRecord, Mod, Timestamp
from cdcflow.transforms.base import Sink, SinkContext, WriterContext
from cdcflow.transforms.tables import TaskRows, WriteTables

T0 = 1_700_000_000 * 1_000_000_000
LATENCY = 0.15


class SlowMemory(MemoryFileSystem):
    """The memory filesystem with a fixed latency per upload (and a switch to fail)."""

    protocol = "slowmem"
    failing = False
    uploads = 0
    answering = threading.Event()  # cleared: uploads hang (a storage that does not answer)
    answering.set()

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return str(MemoryFileSystem._strip_protocol(path.removeprefix("slowmem://")))

    def pipe_file(self, path: str, value: bytes, *args: Any, **kw: Any) -> None:
        self._slow()
        super().pipe_file(path, value, *args, **kw)

    def put_file(self, lpath: str, rpath: str, *args: Any, **kw: Any) -> None:
        self._slow()
        super().put_file(lpath, rpath, *args, **kw)

    def _slow(self) -> None:
        time.sleep(LATENCY)
        SlowMemory.answering.wait(60)
        if SlowMemory.failing:
            msg = "injected: the store is down"
            raise OSError(msg)
        SlowMemory.uploads += 1


fsspec.register_implementation("slowmem", SlowMemory, clobber=True)
COLS = (ColumnType("id", {"code": "INT64"}, True, 1),
        ColumnType("payload", {"code": "STRING"}, False, 2))


def _records(batch: int, n: int, tables: int) -> list[DataChangeRecord]:
    return [DataChangeRecord("p0", Timestamp.from_ns(T0 + batch * 10**9 + i), f"{i:08d}",
                             f"t{batch}-{i}", True, f"T{i % tables}", COLS,
                             [Mod({"id": batch * 100_000 + i}, {"payload": uuid.uuid4().hex * 6})],
                             "INSERT", "NEW_ROW", 1, 1) for i in range(n)]


def _commit(sink: WriteTables, batch: int, records: Sequence[DataChangeRecord]) -> None:
    w = sink.open_writer(WriterContext("p", "WriteTables", batch, "p0", 0, 1, "a"))
    for r in records:
        w.write(r)
    message = w.close()
    sink.commit(batch, [message] if isinstance(message, TaskRows) else [])


def _ids(root: str) -> list[int]:
    fs = fsspec.filesystem("memory")
    ids: list[int] = []
    for path in fs.find(root):
        if "/part-" in path:
            with fs.open(path, "rb") as f:
                ids += pq.read_table(f).column("id").to_pylist()
    return ids


@pytest.fixture
def root() -> str:
    return f"/spool-{uuid.uuid4().hex}"


def test_slow_uploads_spill_to_disk_without_stalling_commits(root: str, tmp_path: Any) -> None:
    sink = WriteTables(f"slowmem://{root}", file_size="16KiB", flush_interval="1h",
                       spool_memory="64KiB", spool_disk="64MiB", local_dir=str(tmp_path))
    sink.setup(SinkContext("p", "WriteTables", "/"))
    assert sink._stage_dir is None  # made at the first spill
    spilled, slowest, queued, t0 = False, 0.0, 0, time.monotonic()
    for b in range(1, 41):
        start = time.monotonic()
        _commit(sink, b, _records(b, 60, tables=3))
        if b > 1:  # batch 1 writes the tables' schema files, synchronously (schema first)
            slowest = max(slowest, time.monotonic() - start)
        usage = sink.metrics()
        stage = sink._stage_dir
        spilled = spilled or (usage["spool_disk_bytes"] > 0 and stage is not None
                              and stage.startswith(str(tmp_path)) and any(os.scandir(stage)))
        queued = max(queued, int(usage["uploads_queued"]))
        # high watermark + one batch's rows
        assert usage["spool_memory_bytes"] <= 64 * 1024 + 60 * 400
    committed = time.monotonic() - t0
    assert spilled, "past the memory high watermark, staged rows spill to local disk"
    assert queued > 3  # uploads lag behind...
    assert slowest < LATENCY  # ...and no commit waited for one
    assert committed < (queued + sink.metrics()["uploads_queued"]) * LATENCY
    assert sink.durable_batch() < 40  # what is only spooled is not durable
    sink.flush()
    usage = sink.metrics()
    assert (usage["spool_memory_bytes"], usage["spool_disk_bytes"], usage["uploads_queued"]) \
        == (0, 0, 0)
    assert sink.durable_batch() == 40
    sink.close()
    assert not os.path.exists(stage)  # the spill directory is removed
    ids = _ids(root)
    assert sorted(ids) == sorted(b * 100_000 + i for b in range(1, 41) for i in range(60))


def _spooled(sink: WriteTables) -> int:
    usage = sink.metrics()
    return int(usage["spool_memory_bytes"] + usage["spool_disk_bytes"])


def test_a_full_spool_waits_out_failing_uploads_within_its_bound(root: str) -> None:
    """Uploads failing (an outage): the commits go on until the spool is full, then the
    commit waits, the spool within its bound, until uploads succeed again; every row once.
    (Before, the commit raised SinkIOError, the engine's retry of the staged batch returned
    at once, and each next batch added to the spool: 5.8 times its bound in a 40 s
    outage.)"""
    limit = 64 * 1024
    sink = WriteTables(f"slowmem://{root}", file_size="8KiB", flush_interval="1h",
                       spool_memory="32KiB", spool_disk="32KiB")
    sink.setup(SinkContext("p", "WriteTables", "/"))
    _commit(sink, 1, _records(1, 60, tables=1))  # writes the schema file
    batch_bytes = 60 * 400
    SlowMemory.failing = True
    committed: list[int] = []
    errors: list[BaseException] = []

    def commits() -> None:
        try:
            for b in range(2, 40):
                _commit(sink, b, _records(b, 60, tables=1))
                committed.append(b)
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=commits, daemon=True)
    try:
        worker.start()
        most = 0
        for _ in range(30):  # 3 s of the outage
            time.sleep(0.1)
            most = max(most, _spooled(sink))
        waiting_at = len(committed)
        time.sleep(1.0)
        assert len(committed) == waiting_at < 38  # the commit waits
        assert most <= limit + batch_bytes  # the bound, and the batch that passed it
        assert not errors and sink.durable_batch() == 0
    finally:
        SlowMemory.failing = False
    worker.join(timeout=60)
    assert not worker.is_alive() and not errors and committed == list(range(2, 40))
    sink.flush()
    sink.close()
    ids = _ids(root)
    assert sorted(ids) == sorted(b * 100_000 + i for b in range(1, 40) for i in range(60))
    assert pa.array(ids).unique().to_pylist() == list(dict.fromkeys(ids))  # no duplicate


def test_a_stop_ends_a_commit_waiting_on_a_full_spool(root: str) -> None:
    """Asked to stop while the spool is full and uploads fail: the commit raises
    SinkIOError (the engine then abandons the batch; the next run replays it), and its
    retry waits again instead of letting the spool grow."""
    stopping = False
    sink = WriteTables(f"slowmem://{root}", file_size="8KiB", flush_interval="1h",
                       spool_memory="32KiB", spool_disk="32KiB")
    sink.setup(SinkContext("p", "WriteTables", "/", stopping=lambda: stopping))
    _commit(sink, 1, _records(1, 60, tables=1))
    SlowMemory.failing = True
    try:
        done = threading.Event()
        failed: list[BaseException] = []

        def commits() -> None:
            try:
                for b in range(2, 40):
                    _commit(sink, b, _records(b, 60, tables=1))
            except SinkIOError as exc:
                failed.append(exc)
            done.set()

        threading.Thread(target=commits, daemon=True).start()
        assert not done.wait(2.0)  # waiting on the full spool
        stopping = True
        assert done.wait(5.0)
        assert failed and "spool is full" in str(failed[0])
    finally:
        SlowMemory.failing = False
    sink.close()


def test_a_run_removes_what_dead_runs_left_in_its_local_directories(tmp_path: Any) -> None:
    import subprocess
    import sys

    from cdcflow.transforms._fileio import PREFIX

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    spilled = tmp_path / f"{PREFIX}{dead}-abc"  # a killed run's spill directory
    spilled.mkdir()
    (spilled / "1.part").write_bytes(b"x" * 100)
    # task spool files, named after the driver that reads them: a dead one's, however young
    spool = tmp_path / f"{PREFIX}{dead}-new.spool"
    spool.write_bytes(b"rows")
    mine = tmp_path / f"{PREFIX}{os.getpid()}-mine"  # a live process's: kept
    mine.mkdir()
    live = tmp_path / f"{PREFIX}{os.getpid()}-live.spool"
    live.write_bytes(b"rows")
    other = tmp_path / "cdcflow-tables-unrelated"
    other.mkdir()
    sink = WriteTables(f"memory://{uuid.uuid4().hex}", local_dir=str(tmp_path))
    sink.setup(SinkContext("p", "WriteTables", "/"))
    sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [mine.name, live.name, other.name])


def test_a_task_names_its_spool_file_after_the_driver(root: str, tmp_path: Any) -> None:
    # A Spark worker's task spools for the driver: the file is the driver's to sweep.
    import pickle
    import tempfile

    from cdcflow.transforms._fileio import PREFIX

    sink = WriteTables(f"memory://{root}", spool_size="1KiB", flush_interval="1h")
    sink.setup(SinkContext("p", "WriteTables", "/"))
    shipped = pickle.loads(pickle.dumps(sink))
    shipped._driver_pid = 999_999_999  # as another process's setup would have noted
    w = shipped.open_writer(WriterContext("p", "WriteTables", 1, "p0", 0, 1, "a"))
    for r in _large(1, 8, 4096):
        w.write(r)
    message = w.close()
    assert isinstance(message, TaskRows) and message.spool is not None
    assert os.path.basename(message.spool).startswith(f"{PREFIX}999999999-")
    assert os.path.dirname(message.spool) == tempfile.gettempdir()
    os.remove(message.spool)
    sink.close()


def test_a_replayed_batch_leaves_no_spool_file(root: str) -> None:
    # After a restart the first batches replay what storage holds already: the sink skips
    # them, and the spool files their tasks wrote go at once, not when the process ends.
    sink = WriteTables(f"memory://{root}", spool_size="1KiB", flush_interval="1h")
    sink.setup(SinkContext("p", "WriteTables", "/"))
    _commit(sink, 1, list(_large(1, 8, 4096)))
    sink.flush()
    assert sink.durable_batch() == 1
    spools = []
    for batch in (1, 1):  # the replay, then the engine's retry of the same commit
        w = sink.open_writer(WriterContext("p", "WriteTables", batch, "p0", 0, 1, "a"))
        for r in _large(batch, 8, 4096):
            w.write(r)
        message = w.close()
        assert isinstance(message, TaskRows) and message.spool is not None
        assert os.path.exists(message.spool)
        sink.commit(batch, [message])
        spools.append(message.spool)
    assert not any(os.path.exists(p) for p in spools)
    _commit(sink, 2, list(_large(2, 8, 4096)))  # staged: its spool file is read, then gone
    sink.flush()
    sink.close()
    assert sorted(_ids(root)) == sorted([100_000 + i for i in range(8)]
                                        + [200_000 + i for i in range(8)])


def _large(batch: int, n: int, payload: int, start: int = 0, tables: int = 1) -> Any:
    """``n`` records of ``payload`` bytes each, made as they are written (none kept)."""
    for i in range(start, start + n):
        yield DataChangeRecord("p0", Timestamp.from_ns(T0 + batch * 10**9 + i), f"{i:08d}",
                               f"t{batch}-{i}", True, f"T{i % tables}", COLS,
                               [Mod({"id": batch * 100_000 + i},
                                    {"payload": f"{i:08d}" * (payload // 8)})],
                               "INSERT", "NEW_ROW", 1, 1)


def test_a_task_spools_past_spool_size_bytes_of_records(root: str) -> None:
    sink = WriteTables(f"memory://{root}", spool_size="256KiB", flush_interval="1h")
    sink.setup(SinkContext("p", "WriteTables", "/"))
    w = sink.open_writer(WriterContext("p", "WriteTables", 1, "p0", 0, 1, "a"))
    for r in _large(1, 64, 32 << 10):  # 2 MiB of payload in 64 records
        w.write(r)
    message = w.close()
    assert isinstance(message, TaskRows) and message.spool is not None
    chunks = list(message.chunks())
    assert len(chunks) >= 6  # about 256 KiB of records each
    heads = message.described()
    assert sum(h.rows for h in heads) == 64 and all(h.data is None for h in heads)
    assert sum(h.nbytes for h in heads) >= 2 << 20
    sink.commit(1, [message])
    sink.flush()
    sink.close()
    assert sorted(_ids(root)) == [100_000 + i for i in range(64)]


def test_a_batch_larger_than_the_spool_memory_is_staged_a_chunk_at_a_time(
    root: str, tmp_path: Any
) -> None:
    import tracemalloc

    sink = WriteTables(f"memory://{root}", format="jsonl", spool_size="256KiB",
                       spool_memory="1MiB", file_size="1GiB", flush_interval="1h",
                       local_dir=str(tmp_path))
    sink.setup(SinkContext("p", "WriteTables", "/"))
    for batch in (1, 2):
        messages = []
        for task in range(2):  # two tasks of 400 records of 16 KiB: 12.5 MiB a batch
            w = sink.open_writer(WriterContext("p", "WriteTables", batch, f"p{task}", 0, 1, "a"))
            for r in _large(batch, 400, 16 << 10, start=400 * task):
                w.write(r)
            message = w.close()
            assert isinstance(message, TaskRows)
            messages.append(message)
        tracemalloc.start()
        try:
            sink.commit(batch, messages)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, f"the commit held {peak} bytes at once"
        assert sink.metrics()["spool_disk_bytes"] > 12 << 20  # spilled as it came
    sink.flush()
    sink.close()
    fs = fsspec.filesystem("memory")
    files = sorted(p.rsplit("/", 1)[1] for p in fs.find(root) if "/part-" in p)
    assert files == ["part-1-2-1.jsonl"]
    ids = [json.loads(line)["id"] for p in fs.find(root) if "/part-" in p
           for line in fs.cat(p).splitlines()]
    assert sorted(ids) == [b * 100_000 + i for b in (1, 2) for i in range(800)]


def test_a_spool_with_no_room_on_disk_goes_on_without_waiting(root: str, tmp_path: Any) -> None:
    # spool_disk=0: what the open files spill is over the limit at once; half of them are
    # cut and uploaded, and what the others hold no upload can free: the commit must not
    # wait for one.
    sink = WriteTables(f"memory://{root}", format="jsonl", spool_memory="64KiB",
                       spool_disk=0, file_size="1GiB", flush_interval="1h",
                       local_dir=str(tmp_path))
    sink.setup(SinkContext("p", "WriteTables", "/"))
    for batch in (1, 2, 3):
        began = time.monotonic()
        _commit(sink, batch, list(_large(batch, 100, 4096, tables=4)))
        assert time.monotonic() - began < 5
    sink.flush()
    sink.close()
    fs = fsspec.filesystem("memory")
    ids = [json.loads(line)["id"] for p in fs.find(root) if "/part-" in p
           for line in fs.cat(p).splitlines()]
    assert sorted(ids) == [b * 100_000 + i for b in (1, 2, 3) for i in range(100)]


def test_sizes_are_checked_and_name_their_setting() -> None:
    from cdcflow.errors import PipelineDefinitionError

    for kw, text in ((dict(spool_disk=-1), r"WriteTables\(spool_disk=-1\) is not a size"),
                     (dict(spool_size=1.5), r"WriteTables\(spool_size=1.5\) is not a size"),
                     (dict(file_size="4XB"), r"WriteTables\(file_size='4XB'\) is not a size"),
                     (dict(flush_interval="soon"),
                      r"WriteTables\(flush_interval=\.\.\.\): not a duration: 'soon'"),
                     (dict(flush_interval=-1),
                      r"WriteTables\(flush_interval=-1\): use a finite time > 0"),
                     (dict(flush_interval=0),
                      r"WriteTables\(flush_interval=0\): use a finite time > 0")):
        with pytest.raises(PipelineDefinitionError, match=text):
            WriteTables("memory://x", **kw)
    assert WriteTables("memory://x", spool_memory=0, spool_disk=2.0).spool_disk == 2


def test_a_local_dir_that_cannot_be_made_is_refused_at_setup(tmp_path: Any) -> None:
    from cdcflow.errors import SinkSetupError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    sink = WriteTables("memory://x", local_dir=str(blocker / "spill"))
    with pytest.raises(SinkSetupError, match=r"local_dir=.*cannot be made.*point local_dir"):
        sink.setup(SinkContext("p", "WriteTables", "/"))


def test_a_spill_that_fails_mid_batch_stops_the_run_and_the_next_replays_it(
    tmp_path: Any,
) -> None:
    # The batch is staged in part when its spill fails: retrying it would stage that part
    # twice, so the run stops; the next run replays it, exactly once.
    from pathlib import Path

    import cdcflow as cf
    from cdcflow.engine.listener import EngineListener
    from cdcflow.engine.loop import Engine, RunOptions
    from cdcflow.errors import SinkError
    from cdcflow.metadata import SQLiteStore
    from cdcflow.runners.in_memory import InMemoryRunner
    from cdcflow.testing import ScriptedChangeStream
    from tests.fs_helpers import read_only

    stream = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(60):
        stream.write("T", i, "INSERT", {"v": "x" * 2000}, at=T0 + (i + 1) * 10**9 // 12)
    local = Path(tmp_path) / "local"
    local.mkdir()
    out = Path(tmp_path) / "out"

    class ReadOnlyOnceStarted(EngineListener):
        def on_start(self, pipeline: str, runner: str, store_url: str) -> None:
            stack.enter_context(read_only(local))  # after setup checked it

    def run(listener: EngineListener | None = None) -> Any:
        p = cf.Pipeline("spill")
        (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 6 * 10**9, client=stream)
         | cf.ReadPartition()
         | WriteTables(str(out), format="jsonl", spool_memory="4KiB", file_size="1GiB",
                       flush_interval="1h", local_dir=str(local)))
        store = SQLiteStore(Path(tmp_path) / "s.db")
        try:
            return Engine(p, store, InMemoryRunner(workers=2),
                          RunOptions(batch_interval=0, max_batch_span=1.0), listener).run()
        finally:
            store.close()

    with contextlib.ExitStack() as stack, pytest.raises(
            SinkError, match=r"cannot spill rows to .*local.*staged in part, so the run stops"):
        run(ReadOnlyOnceStarted())
    assert not list(out.rglob("part-*"))
    assert run().reason == "end reached"
    ids = [json.loads(line)["id"] for f in out.rglob("part-*")
           for line in f.read_text().splitlines()]
    assert sorted(ids) == list(range(60))


def test_a_task_counts_every_record_it_holds(root: str) -> None:
    # One large record among 63 small ones, always at the same place: a writer that
    # measured one record in 64 would never see one, and hold them all.
    sink = WriteTables(f"memory://{root}", spool_size="1MiB", flush_interval="1h")
    sink.setup(SinkContext("p", "WriteTables", "/"))
    w = sink.open_writer(WriterContext("p", "WriteTables", 1, "p0", 0, 1, "a"))
    for i in range(64 * 32):
        payload = 512 << 10 if i % 64 == 10 else 16
        for r in _large(1, 1, payload, start=i):
            w.write(r)
    message = w.close()
    assert isinstance(message, TaskRows) and message.spool is not None
    assert len(list(message.chunks())) >= 12  # 16 MiB held at most 1 MiB (and one record)
    os.remove(message.spool)
    sink.close()


def _cut(n: int) -> Any:
    from cdcflow.transforms._tablespool import Cut

    return Cut(key=("T", ""), name=f"part-{n}", first=n, last=n, batch_id=n, data=b"x",
               local=None, size=1)


def test_failing_uploads_are_named_and_a_lasting_failure_stops_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A refused connection is retried until it mends: one warning naming it, one line
    when uploads succeed again. A failure retries do not mend (a missing bucket) stops
    the uploads after PERMANENT_TRIES tries, as a SinkError the driver sees."""
    from cdcflow.errors import SinkError
    from cdcflow.transforms import _tablespool as spool

    monkeypatch.setattr(spool, "PERMANENT_TRIES", 3)
    failures = [ConnectionRefusedError("refused")] * 4
    done: list[int] = []

    def put(cut: Any) -> None:
        if failures:
            raise SinkIOError("cannot write") from failures.pop()

    uploads = spool.Uploader(put, lambda cut: done.append(cut.first), "s3://lake/cdc")
    with caplog.at_level(logging.INFO, logger="cdcflow.sinks"):
        uploads.submit(_cut(1))
        assert uploads.wait(lambda: bool(done), timeout=20)
        lines = [r.getMessage() for r in caplog.records]
        warned = [line for line in lines if "uploads to s3://lake/cdc fail" in line]
        assert len(warned) == 1 and "retrying (1 failed try so far)" in warned[0]
        assert any("succeed again, after 4 failed tries" in line for line in lines)
        failures.extend([FileNotFoundError("The specified bucket does not exist")] * 10)
        uploads.submit(_cut(2))
        with pytest.raises(SinkError, match=r"uploads to s3://lake/cdc keep failing after 3 "
                                            r"tries.*does the bucket or directory exist") as err:
            uploads.wait(lambda: len(done) == 2, timeout=20)
    assert len(failures) == 7 and done == [1]
    # caused by the storage's error, not the SinkIOError: the engine does not retry it
    assert type(err.value.__cause__) is FileNotFoundError
    uploads.close()


@pytest.mark.parametrize("outage", ["failing", "silent"])
def test_a_run_asked_to_stop_does_not_wait_for_uploads_that_fail_or_get_no_answer(
    root: str, outage: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The run's end waits for the uploads; once the run was asked to stop (a signal),
    uploads that keep failing are given up: the rows are written again by the next run. A
    storage that does not answer (a stopped server) fails no call: the hanging upload is
    named in a warning, and a stopping run gives it up after STOP_PATIENCE (it waited for
    the storage's own timeouts, minutes)."""
    from cdcflow.transforms import _tablespool as spool
    from cdcflow.transforms import tables

    monkeypatch.setattr(spool, "SLOW_UPLOAD", 0.5)
    monkeypatch.setattr(tables, "STOP_PATIENCE", 1.0)
    stopping = threading.Event()
    sink = WriteTables(f"slowmem://{root}", flush_interval="1h")
    sink.setup(SinkContext("p", "WriteTables", "/", stopping=stopping.is_set))
    _commit(sink, 1, _records(1, 60, tables=1))
    if outage == "failing":
        SlowMemory.failing = True
    else:
        SlowMemory.answering.clear()
    try:
        raised: list[BaseException] = []

        def flush() -> None:
            try:
                sink.flush()
            except SinkIOError as exc:
                raised.append(exc)

        with caplog.at_level(logging.WARNING, logger="cdcflow.sinks"):
            flushed = threading.Thread(target=flush, daemon=True)
            flushed.start()
            flushed.join(2.0)
            assert flushed.is_alive()  # no stop asked: it waits for the storage
            said = " ".join(r.getMessage() for r in caplog.records)
            named = (r"the upload of \S+ to slowmem://\S+ has not finished in"
                     if outage == "silent"
                     else r"uploads to slowmem://\S+ fail \(OSError: injected")
            assert re.search(named, said), said
            began = time.monotonic()
            stopping.set()
            flushed.join(5.0)
            assert not flushed.is_alive() and time.monotonic() - began < 3.0
        (error,) = raised
        cause = r"injected: the store is down" if outage == "failing" else "no answer"
        assert re.search(rf"asked to stop while uploads to slowmem://.* fail \({cause}\); "
                         r"1 file\(s\) not durable", str(error))
    finally:
        SlowMemory.failing = False
        SlowMemory.answering.set()
        sink.close()
    if outage == "failing":
        assert _ids(root) == []  # nothing of batch 1 in storage: the next run writes it


class _Kept:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def write(self, element: Any) -> None:
        self.items.append(element)

    def close(self) -> list[Any]:
        return self.items

    def abort(self) -> None:
        pass


class _FailingCommit(Sink[Any, Any]):
    def open_writer(self, ctx: WriterContext) -> Any:
        return _Kept()

    def commit(self, batch_id: int, messages: Sequence[Any]) -> None:
        if any(messages):  # the first batch with data
            raise ValueError("the other sink's storage refused the batch")


def test_a_batch_that_fails_after_its_tasks_leaves_no_spool_file(
    root: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Another sink's commit fails before WriteTables' (which would have read the tasks'
    # spool files, and removed them): the batch is aborted, and the files went with it only
    # if the sinks are given the messages (they were given none).
    import tempfile

    import cdcflow as cf
    from cdcflow.engine.loop import Engine, RunOptions
    from cdcflow.errors import SinkError
    from cdcflow.metadata import MemoryStore
    from cdcflow.runners.in_memory import InMemoryRunner
    from cdcflow.testing import ScriptedChangeStream

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    made: list[str] = []
    mkstemp = tempfile.mkstemp

    def noted(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, path = mkstemp(*args, **kwargs)
        made.append(path)
        return fd, path

    monkeypatch.setattr(tempfile, "mkstemp", noted)
    stream = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(40):
        stream.write("T", i, "INSERT", {"payload": "x" * 2000}, at=T0 + (i + 1) * 10**7)
    p = cf.Pipeline("aborted")
    rows = (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 10**9, client=stream)
            | cf.ReadPartition())
    rows | "a-failing" >> _FailingCommit()
    rows | "lake" >> WriteTables(f"memory://{root}", spool_size="1KiB", flush_interval="1h")
    with pytest.raises(SinkError, match="refused the batch"):
        Engine(p, MemoryStore(), InMemoryRunner(workers=2),
               RunOptions(batch_interval=0, batch_retries=0)).run()
    assert not list(temp.glob("*.spool"))
    assert [p for p in made if p.endswith(".spool")]  # the tasks spooled
