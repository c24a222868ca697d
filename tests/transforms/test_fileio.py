"""WriteFiles' writers against real files: Parquet column types checked at ``write`` (and
the error policy that then applies, through the engine), all-null columns, storage faults
as SinkIOError."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import orjson
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.errors import SinkError, SinkIOError
from cdcflow.metadata import MemoryStore
from cdcflow.model import DataChangeRecord
from cdcflow.policy import ErrorPolicy
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import DetectPartitions, Map, ReadPartition
from cdcflow.transforms.base import Sink, SinkContext, WriterContext
from cdcflow.transforms.sinks import WriteFiles


def _wctx(
    batch_id: int, token: str, attempt: str = "a1", *, label: str = "out", start: int = 0,
    end: int = 10,
) -> WriterContext:
    return WriterContext(
        pipeline="p",
        sink_label=label,
        batch_id=batch_id,
        partition_token=token,
        slice_start=start,
        slice_end=end,
        attempt=attempt,
    )


def _run_task(
    sink: Sink[Any, Any], batch_id: int, token: str, elements: list[Any], attempt: str,
    **where: Any,
) -> Any:
    """What a task does: pickle the sink over, open a writer, write, close."""
    remote = pickle.loads(pickle.dumps(sink))
    writer = remote.open_writer(_wctx(batch_id, token, attempt, **where))
    for e in elements:
        writer.write(e)
    return pickle.loads(pickle.dumps(writer.close()))


def _sink(
    directory: Path, *, pipeline: str = "p", label: str = "out", **options: Any
) -> WriteFiles:
    sink = WriteFiles(directory, **options)
    sink.setup(SinkContext(pipeline=pipeline, sink_label=label, base_dir="/nonexistent"))
    return sink


def _temps_of(sink: WriteFiles, batch_id: int = 1) -> Path:
    """The directory where the task attempts of ``batch_id`` write (made)."""
    temps = Path(sink._temp_dir(batch_id))
    temps.mkdir(parents=True, exist_ok=True)
    return temps


def _everything(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def _committed(directory: Path) -> dict[str, str]:
    """sha256 of every file but temporary ones: the output, manifests, the watermark."""
    return {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest()
        for name in _everything(directory)
        if not any(part.startswith(".") for part in Path(name).parts)
    }


def _jsonl(directory: Path, pattern: str = "*.jsonl") -> list[Any]:
    rows = []
    for path in sorted(directory.glob(pattern)):
        rows += [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return rows


# -- Parquet column types -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("poison", "match"),
    [
        ({"v": "one"}, r"column 'v' holds double values in this file, this element has string"),
        ({"v": True}, "column 'v' holds double values in this file, this element has boolean"),
        ({"v": 2**60}, "column 'v' mixes floats with integers beyond 2\\*\\*53"),
        ({"v": 2**64}, "does not fit a 64-bit integer"),
        ({"id": "three"}, "column 'id' holds int64 values in this file, this element has string"),
    ],
)
def test_a_poison_parquet_row_fails_at_write_and_the_other_rows_land(
    tmp_path: Path, poison: dict[str, Any], match: str
) -> None:
    sink = _sink(tmp_path / "out", format="parquet")
    writer = sink.open_writer(_wctx(1, "tok"))
    writer.write({"id": 1, "v": 1})
    writer.write({"id": 2, "v": 2.5})  # ints and floats share a double column
    with pytest.raises(SinkError, match=match) as info:
        writer.write({"id": 3, **poison})
    assert "one type" in str(info.value) or "text" in str(info.value)
    writer.write({"id": 4, "v": None, "w": "late column"})
    message = writer.close()
    assert message.count == 3
    sink.commit(1, [message])
    table = pq.read_table(message.final)
    assert str(table.schema.field("v").type) == "double"
    assert table.to_pylist() == [
        {"id": 1, "v": 1.0, "w": None},
        {"id": 2, "v": 2.5, "w": None},
        {"id": 4, "v": None, "w": "late column"},
    ]


def test_a_float_after_large_integers_is_refused(tmp_path: Path) -> None:
    writer = _sink(tmp_path, format="parquet").open_writer(_wctx(1, "tok"))
    writer.write({"v": 2**60})
    with pytest.raises(SinkError, match="beyond 2\\*\\*53"):
        writer.write({"v": 0.5})
    writer.write({"v": 7})
    assert pq.read_table(writer.close().temp).column("v").to_pylist() == [2**60, 7]


@pytest.mark.parametrize("deletes_first", [False, True])
def test_an_all_delete_batch_reads_back_with_inserts(tmp_path: Path, deletes_first: bool) -> None:
    out = tmp_path / "out"
    sink = _sink(out, format="parquet")
    inserts = [{"op": "INSERT", "id": i, "name": f"n{i}", "qty": i * 10} for i in (1, 2)]
    deletes = [{"op": "DELETE", "id": i, "name": None, "qty": None} for i in (1, 2)]
    batches = [deletes, inserts] if deletes_first else [inserts, deletes]
    for batch, rows in enumerate(batches, start=1):
        sink.commit(batch, [_run_task(sink, batch, "tok", rows, "x")])
    delete_file = out / sink.final_name(1 if deletes_first else 2, "tok")
    assert str(pq.read_schema(delete_file).field("name").type) == "string"  # never null
    table = ds.dataset(out, format="parquet").to_table()  # no "cast from string to null"
    got = sorted(table.to_pylist(), key=lambda r: (r["op"], r["id"]))
    assert [(r["op"], r["id"], r["name"]) for r in got] == [
        ("DELETE", 1, None), ("DELETE", 2, None), ("INSERT", 1, "n1"), ("INSERT", 2, "n2"),
    ]
    # an all-null column is text: the first file's types are the dataset's
    assert [r["qty"] for r in got] == ([None, None, "10", "20"] if deletes_first
                                       else [None, None, 10, 20])


def _order_row(record: DataChangeRecord) -> dict[str, Any]:
    mod = record.mods[0]
    return {"id": mod.keys["id"], "qty": mod.new_values["qty"]}


def _rows_in_chunks(n: int) -> list[dict[str, Any]]:
    """Rows whose shape changes across chunks: ``late`` first appears at row 7, ``maybe`` is
    null until row 11, ``num`` is an int until row 13, then also a float."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        row: dict[str, Any] = {"id": i, "maybe": None if i < 11 else i * 2}
        row["num"] = i if i < 13 or i % 2 else i + 0.5
        if i >= 7:
            row["late"] = f"v{i}"
        rows.append(row)
    return rows


def test_a_parquet_writer_spills_chunks_and_writes_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _rows_in_chunks(20)
    in_memory = _sink(tmp_path / "whole", format="parquet")
    whole = _run_task(in_memory, 1, "tok", rows, "a1")
    in_memory.commit(1, [whole])
    monkeypatch.setattr("cdcflow.transforms._fileio.SPILL_ROWS", 3)  # writers made from now
    spilled_sink = _sink(tmp_path / "spilled", format="parquet")
    writer = spilled_sink.open_writer(_wctx(1, "tok"))
    for row in rows:
        writer.write(row)
    spills = sorted(p.name for p in _temps_of(spilled_sink).glob("*.spill"))
    assert len(spills) == 6  # 18 of the 20 rows went to disk, 3 at a time
    spilled = writer.close()
    assert not list(_temps_of(spilled_sink).glob("*.spill"))  # close removes them
    spilled_sink.commit(1, [spilled])
    (a,), (b,) = (list((tmp_path / d).glob("part-*.parquet")) for d in ("whole", "spilled"))
    expected = pq.read_table(a)
    got = pq.read_table(b)
    assert got.schema == expected.schema
    assert str(got.schema.field("num").type) == "double"
    assert str(got.schema.field("maybe").type) == "int64"
    assert got.to_pylist() == expected.to_pylist()
    assert got.to_pylist() == [{"id": r["id"], "maybe": r["maybe"], "num": float(r["num"]),
                                "late": r.get("late")} for r in rows]
    assert pq.ParquetFile(b).num_row_groups == 7


def test_a_parquet_writer_spills_by_bytes_as_well_as_by_rows(tmp_path: Path) -> None:
    """Large rows: the writer holds at most SPILL_BYTES of payload (plus the row that
    crossed it), whatever the row count; the file holds every row."""
    from cdcflow.transforms._fileio import SPILL_BYTES

    big = "x" * (1 << 20)
    sink = _sink(tmp_path / "big", format="parquet")
    writer = sink.open_writer(_wctx(1, "tok"))
    held = []
    for i in range(40):
        writer.write({"id": i, "text": f"{i}{big}"})
        held.append(writer._columns.bytes)  # type: ignore[attr-defined]
    assert max(held) < SPILL_BYTES + (2 << 20)
    assert len(list(_temps_of(sink).glob("*.spill"))) == 40 * len(big) // SPILL_BYTES
    sink.commit(1, [writer.close()])
    (path,) = (tmp_path / "big").glob("part-*.parquet")
    table = pq.read_table(path)
    assert table.column("id").to_pylist() == list(range(40))
    assert [len(t) for t in table.column("text").to_pylist()] == [
        len(f"{i}{big}") for i in range(40)
    ]


def test_long_text_columns_are_not_dictionary_encoded(tmp_path: Path) -> None:
    """A column of long, mostly distinct texts gains nothing from a dictionary, and the
    encoder would hold several copies of each row group trying; short columns keep it."""
    sink = _sink(tmp_path / "enc", format="parquet")
    writer = sink.open_writer(_wctx(1, "tok"))
    for i in range(50):
        writer.write({"op": "UPDATE", "body": f"{i}" + "x" * 1000})
    sink.commit(1, [writer.close()])
    (path,) = (tmp_path / "enc").glob("part-*.parquet")
    group = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {group.column(i).path_in_schema: group.column(i).encodings
                 for i in range(group.num_columns)}
    assert any("DICTIONARY" in e for e in encodings["op"])
    assert not any("DICTIONARY" in e for e in encodings["body"])
    assert pq.read_table(path).column("body").to_pylist()[7] == "7" + "x" * 1000


def test_spill_files_of_an_aborted_or_crashed_writer_are_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("cdcflow.transforms._fileio.SPILL_ROWS", 2)
    sink = _sink(tmp_path, format="parquet")
    temps = _temps_of(sink)
    aborted = sink.open_writer(_wctx(1, "tok", "a1"))
    for row in _rows_in_chunks(5):
        aborted.write(row)
    assert len(list(temps.glob("*.spill"))) == 2
    aborted.abort()
    assert not list(temps.glob("*.spill"))
    crashed = sink.open_writer(_wctx(1, "tok", "a2"))  # a task that died mid-slice
    for row in _rows_in_chunks(5):
        crashed.write(row)
    assert len(list(temps.glob("*.spill"))) == 2
    retried = _run_task(sink, 1, "tok", _rows_in_chunks(5), "a3")
    sink.commit(1, [retried])
    # the commit swept every attempt's leftovers, and their batch's directory
    assert not temps.exists() and not list(tmp_path.glob(".*"))
    assert len(pq.read_table(next(tmp_path.glob("part-*.parquet")))) == 5


def test_through_the_engine_a_poison_row_is_dead_lettered_and_the_rest_commits(
    tmp_path: Path,
) -> None:
    s, t0 = 1_000_000_000, 1_700_000_000_000_000_000
    stream = ScriptedChangeStream("S", origin=t0)
    for i in range(6):
        stream.write("Orders", i, "INSERT", {"qty": "lots" if i == 3 else i}, at=t0 + (i + 1) * s)
    dead = "failed" >> WriteFiles("out", prefix="failed")
    policy = ErrorPolicy(retries=1, backoff=0.001, then="skip", dead_letter=dead)
    pipeline = cf.Pipeline("poison", error_policy=policy)
    (pipeline
     | DetectPartitions(stream="S", start_at=t0, end_at=t0 + 10 * s, client=stream)
     | ReadPartition()
     | Map(_order_row)
     | "orders" >> WriteFiles("out", format="parquet"))
    options = RunOptions(max_batch_span=60.0, batch_interval=0.0, base_dir=str(tmp_path))
    summary = Engine(pipeline, MemoryStore(), InMemoryRunner(workers=2), options).run()
    assert summary.reason == "end reached"
    out = tmp_path / "out"
    table = ds.dataset(sorted(str(p) for p in out.glob("part-*.parquet"))).to_table()
    assert sorted(table.to_pylist(), key=lambda r: r["id"]) == [
        {"id": i, "qty": i} for i in (0, 1, 2, 4, 5)
    ]
    (failed,) = _jsonl(out, "failed-*.jsonl")
    assert failed["label"] == "orders" and failed["element"] == {"id": 3, "qty": "lots"}
    assert "column 'qty' holds int64 values in this file" in failed["error"]


# -- storage faults -------------------------------------------------------------------------

_FULL = "/dev/full"  # every write to it fails with ENOSPC: a real full disk
needs_dev_full = pytest.mark.skipif(not os.path.exists(_FULL), reason="needs Linux /dev/full")


@needs_dev_full
def test_a_full_disk_under_a_jsonl_writer_is_a_sink_io_error(tmp_path: Path) -> None:
    sink = _sink(tmp_path)
    ctx = _wctx(1, "tok")
    temps = _temps_of(sink)
    os.symlink(_FULL, temps / sink.temp_name(ctx))
    writer = sink.open_writer(ctx)
    writer.write({"id": 1})  # buffered: the disk is hit when the file is flushed
    with pytest.raises(SinkIOError, match=r"No space left on device; free space") as info:
        writer.close()
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno == errno.ENOSPC
    # a write large enough to reach the disk fails at once, and the writer stays failed, so a
    # retry of the element cannot commit a file with a torn line
    ctx = _wctx(1, "tok", "second")
    os.symlink(_FULL, temps / sink.temp_name(ctx))
    writer = sink.open_writer(ctx)
    with pytest.raises(SinkIOError, match="No space left"):
        writer.write({"blob": "x" * 1_000_000})
    with pytest.raises(SinkIOError, match="No space left"):
        writer.write({"id": 2})
    with pytest.raises(SinkIOError, match="No space left"):
        writer.close()
    writer.abort()
    assert not os.path.lexists(temps / sink.temp_name(ctx))


@needs_dev_full
def test_a_full_disk_under_a_parquet_writer_is_a_sink_io_error(tmp_path: Path) -> None:
    sink = _sink(tmp_path, format="parquet")
    ctx = _wctx(1, "tok")
    os.symlink(_FULL, _temps_of(sink) / sink.temp_name(ctx))
    writer = sink.open_writer(ctx)
    writer.write({"id": 1, "payload": "x" * 100_000})
    with pytest.raises(SinkIOError, match=r"No space left on device; free space"):
        writer.close()


def test_a_failing_manifest_write_changes_nothing_visible(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = _sink(tmp_path)
    message = _run_task(sink, 1, "tok", [{"id": 1}], "x")

    def no_space(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(SinkIOError, match=r"cannot write .*batch-0000000001\.json"):
        sink.commit(1, [message])
    monkeypatch.undo()
    # no manifest, no final name: only the claim of the directory (a hidden owner record)
    assert list(_committed(tmp_path)) == ["_cdcflow/owner.json"]
    sink.commit(1, [message])  # the engine's retry of the batch
    assert _jsonl(tmp_path) == [{"id": 1}]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode bit")
def test_a_read_only_directory_is_a_sink_io_error(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = _sink(out)
    message = _run_task(sink, 1, "tok", [{"id": 1}], "x")
    out.chmod(0o500)
    try:
        writer = sink.open_writer(_wctx(2, "tok"))
        with pytest.raises(SinkIOError, match="Permission denied"):
            writer.write({"id": 2})
        with pytest.raises(SinkIOError, match="Permission denied"):
            sink.commit(1, [message])
    finally:
        out.chmod(0o700)


def test_a_commit_does_not_list_the_output_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit looks for failed attempts' files in its batch's own directory only: listing
    the output directory made every commit cost more as output piled up (127 ms a commit
    beside 260,000 files, 1.9 ms in an empty directory)."""
    from cdcflow.transforms import files

    out = tmp_path / "out"
    out.mkdir()
    for i in range(200):  # output of earlier batches, or anything else
        (out / f"part-{i:010d}-0000000000000000.jsonl").write_text("")
    sink = _sink(out)
    sink.last_committed_batch()  # what the engine asks at start (lists it, once)
    listed: list[str] = []
    real = files._listdir
    monkeypatch.setattr(files, "_listdir", lambda d: listed.append(d) or real(d))
    for batch in range(201, 204):
        sink.commit(batch, [_run_task(sink, batch, "tok", [{"id": batch}], "a")])
        sink.abort(batch + 100, [])
    assert listed and str(out) not in listed
    # its batch's temporary directory, and its naming scope's manifests (one, usually)
    assert all(d.startswith(str(out / "_cdcflow" / "tmp"))
               or d == sink._manifest_dir() for d in listed), listed
    assert not (out / "_cdcflow" / "tmp").exists() or not os.listdir(out / "_cdcflow" / "tmp")


def test_parquet_writers_open_at_once_share_the_process_spill_budget(tmp_path: Path) -> None:
    """Arrow's builders take several times a chunk's payload: with 2 MiB per writer the
    memory grew with the tasks of a process. Each open writer now spills at its share of
    SPILL_BYTES_PROCESS (never above SPILL_BYTES, never below SPILL_BYTES_LEAST), and a
    writer closed, aborted or dropped gives its share back."""
    import gc

    from cdcflow.transforms import _fileio

    gc.collect()  # writers earlier tests dropped unclosed
    assert _fileio._spill_share() == _fileio.SPILL_BYTES
    sink = _sink(tmp_path / "many", format="parquet")
    writers = [sink.open_writer(_wctx(1, f"tok{i}")) for i in range(8)]
    assert _fileio._spill_share() == _fileio.SPILL_BYTES_PROCESS // 8
    text = "x" * (100 << 10)
    for i in range(30):  # 3 MB each: spilled at 1 MiB
        for w in writers:
            w.write({"id": i, "text": text})
    spills = len(list(_temps_of(sink).glob("*.spill")))
    assert spills == 8 * 2  # 11 rows (1.1 MB) a chunk: two chunks spilled, the third held
    held = [w._columns.bytes for w in writers]  # type: ignore[attr-defined]
    assert max(held) < _fileio.SPILL_BYTES_PROCESS // 8
    many = [sink.open_writer(_wctx(1, f"more{i}")) for i in range(64)]
    assert _fileio._spill_share() == _fileio.SPILL_BYTES_LEAST
    for w in many[:60]:
        w.abort()
    del many
    gc.collect()  # the 4 left unclosed are dropped
    sink.commit(1, [w.close() for w in writers])
    assert _fileio._spill_share() == _fileio.SPILL_BYTES
    assert len(pq.read_table(tmp_path / "many").column("id")) == 8 * 30


def test_quiet_cut_requests_keeps_the_loop_s_own_handler_for_other_errors() -> None:
    """Requests an outage cut go to DEBUG; any other asyncio error still reaches the
    handler the loop had (its owner's), once however many sinks set up."""
    import asyncio

    from cdcflow.transforms._fileio import quiet_cut_requests

    class _Fs:
        async_impl = True

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop = loop

    loop = asyncio.new_event_loop()
    try:
        seen: list[str] = []
        loop.set_exception_handler(lambda lp, context: seen.append(context["message"]))
        quiet_cut_requests(_Fs(loop))
        quiet_cut_requests(_Fs(loop))  # a second sink: the same handler, not wrapped twice
        handler = loop.get_exception_handler()
        assert handler is not None
        cut = ConnectionResetError("Cannot write to closing transport")
        handler(loop, {"message": "Task exception was never retrieved", "exception": cut})
        handler(loop, {"message": "Task exception was never retrieved",
                       "exception": ValueError("a bug")})
        handler(loop, {"message": "something else", "exception": cut})
        assert seen == ["Task exception was never retrieved", "something else"]
    finally:
        loop.close()
