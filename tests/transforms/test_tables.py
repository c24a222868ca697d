"""WriteTables: change data per table in files near a target size, exactly once, on a local
directory, memory:// and a real S3 API server (moto) on loopback."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import SQLiteStore
from cdcflow.model import ColumnType, DataChangeRecord, Mod, Timestamp
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms.base import SinkContext, WriterContext
from cdcflow.transforms.tables import TaskRows, WriteTables

S = 1_000_000_000
T0 = 1_700_000_000 * S  # 2023-11-14T22:13:20Z
INT = {"code": "INT64"}
STR = {"code": "STRING"}


def _record(table: str, i: int, mod: str = "INSERT", *, at: int | None = None,
            extra: dict[str, tuple[Any, Any]] | None = None,
            wire: bool = False) -> DataChangeRecord:
    cols = {"id": (INT, i), "name": (STR, f"n{i}"), **(extra or {})}
    types = [ColumnType(n, t, n == "id", k + 1) for k, (n, (t, _)) in enumerate(cols.items())]
    values = {n: (str(v) if wire and t == INT else v) for n, (t, v) in cols.items() if n != "id"}
    key = {"id": str(i) if wire else i}
    m = Mod(key, {} if mod == "DELETE" else values, values if mod == "DELETE" else {})
    ts = Timestamp.from_ns(at if at is not None else T0 + i * 1000)
    return DataChangeRecord("p0", ts, f"{i:08d}",
                            f"txn-{i}", True, table, types, [m], mod, "OLD_AND_NEW_VALUES", 1, 1)


_OPENED: list[WriteTables] = []


@pytest.fixture(autouse=True)
def _close_sinks() -> Iterator[None]:
    """Close every sink a test set up (its upload thread ends with it)."""
    yield
    while _OPENED:
        _OPENED.pop().close()


def _sink(url: str, **kw: Any) -> WriteTables:
    sink = WriteTables(url, **kw)
    sink.setup(SinkContext("p", "WriteTables", "/"))
    _OPENED.append(sink)
    return sink


def _commit(sink: WriteTables, batch_id: int, records: Sequence[DataChangeRecord]) -> None:
    w = sink.open_writer(WriterContext("p", "WriteTables", batch_id, "p0", 0, 1, "a"))
    for r in records:
        w.write(r)
    message = w.close()
    sink.commit(batch_id, [message] if isinstance(message, TaskRows) else [])


def _parts(fs: Any, root: str) -> list[str]:
    return sorted(p for p in fs.find(root)
                  if "/part-" in p and not p.rsplit("/", 1)[1].startswith("."))


def test_many_small_batches_make_files_near_the_target_size(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), file_size="64KiB", flush_interval="1h")
    for b in range(1, 201):
        _commit(sink, b, [_record("Orders", b * 100 + j) for j in range(40)])
    sink.flush()
    files = sorted((tmp_path / "Orders").glob("part-*.parquet"),
                   key=lambda f: int(f.name.split("-")[1]))
    sizes = [f.stat().st_size for f in files]
    assert 2 <= len(files) < 40, sizes  # not one per batch
    assert all(s >= 0.6 * 65536 for s in sizes[:-1]), sizes  # near the target
    assert all(s <= 2.5 * 65536 for s in sizes), sizes
    table = ds.dataset(tmp_path / "Orders", format="parquet").to_table()
    assert table.num_rows == 200 * 40
    assert sorted(table["id"].to_pylist()) == sorted(b * 100 + j for b in range(1, 201)
                                                      for j in range(40))
    assert table.schema.field("id").type == pa.int64()
    assert sink.durable_batch() == 200
    # what an operator scrapes (cdcflow_sink_*): every file cut and uploaded, by reason
    m = sink.metrics()
    assert m["files_uploaded_total"] == len(files) == (
        m["files_cut_size_total"] + m["files_cut_flush_total"])
    assert m["files_cut_size_total"] >= len(files) - 1 and m["files_cut_interval_total"] == 0
    assert m["uploaded_bytes_total"] == sum(sizes) and m["upload_errors_total"] == 0
    assert m["spool_memory_bytes"] == m["spool_disk_bytes"] == m["open_files"] == 0
    assert m["uploads_queued"] == 0 and m["durable_batch"] == 200


def test_per_table_directories_schema_first_and_typed_values_from_wire_strings() -> None:
    url = f"memory://t-{uuid.uuid4().hex}"
    sink = _sink(url, file_size="1MiB", flush_interval="1h")
    ts = {"code": "TIMESTAMP"}
    extra = {"price": ({"code": "NUMERIC"}, "1.5"), "at": (ts, "2024-01-02T03:04:05.123456789Z"),
             "day": ({"code": "DATE"}, "2024-01-02"), "blob": ({"code": "BYTES"}, "aGk="),
             "ok": ({"code": "BOOL"}, True), "tags": ({"code": "ARRAY",
                                                        "array_element_type": INT}, ["1", "2"])}
    _commit(sink, 1, [_record("A", 1, extra=extra, wire=True), _record("B", 2, wire=True)])
    assert sink.durable_batch() == 0  # staged, not durable
    sink.flush()
    fs = fsspec.filesystem("memory")
    root = url.removeprefix("memory://")
    schema = json.loads(fs.cat_file(f"{root}/A/_schema/v1.json"))
    assert schema["key_columns"] == ["id"] and schema["version"] == 1
    assert [c["name"] for c in schema["columns"]][:2] == ["id", "name"]
    assert [p.rsplit("/", 2)[1] for p in _parts(fs, root)] == ["A", "B"]
    with fs.open(_parts(fs, root)[0], "rb") as f:
        t = pq.read_table(f)
    row = t.drop_columns(["at", "_commit_ts"]).to_pylist()[0]
    assert row["id"] == 1 and row["price"] == Decimal("1.5") and row["ok"] is True
    assert row["day"] == date(2024, 1, 2) and row["blob"] == b"hi" and row["tags"] == [1, 2]
    assert t.schema.field("at").type == pa.timestamp("ns", tz="UTC")
    assert t.column("at").cast(pa.int64())[0].as_py() % 1000 == 789  # nanoseconds kept
    assert row["_op"] == "INSERT" and row["_table"] == "A" and row["_txn"] == "txn-1"
    assert not any(pa.types.is_null(f.type) for f in t.schema)


def test_a_new_column_closes_the_file_and_writes_the_next_schema_version(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), flush_interval="1h")
    _commit(sink, 1, [_record("T", 1), _record("T", 2)])
    _commit(sink, 2, [_record("T", 3, extra={"email": (STR, "x@y")})])
    _commit(sink, 3, [_record("T", 4, "UPDATE")])  # an update's fewer columns fit v2
    sink.flush()
    names = sorted(p.name for p in (tmp_path / "T").glob("part-*"))
    assert names == ["part-1-1-1.parquet", "part-2-3-2.parquet"]
    m = sink.metrics()  # the first file cut by the schema change, the second by the flush
    assert (m["files_cut_schema_total"], m["files_cut_flush_total"]) == (1, 1)
    v2 = json.loads((tmp_path / "T/_schema/v2.json").read_text())
    assert [c["name"] for c in v2["columns"]] == ["id", "name", "email"]
    # the schema file is older than any data file of its version
    assert (tmp_path / "T/_schema/v2.json").stat().st_mtime_ns <= \
        (tmp_path / "T/part-2-3-2.parquet").stat().st_mtime_ns
    schema = pq.read_schema(tmp_path / "T/part-2-3-2.parquet")
    table = ds.dataset(tmp_path / "T", format="parquet", schema=schema).to_table()
    assert sorted(zip(table["id"].to_pylist(), table["email"].to_pylist(), strict=True)) == \
        [(1, None), (2, None), (3, "x@y"), (4, None)]


def test_date_partitions_and_debezium_rows(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), partition_by="hour", rows="debezium", flush_interval="1h")
    _commit(sink, 1, [_record("T", 1, at=T0), _record("T", 2, at=T0 + 3600 * S)])
    _commit(sink, 2, [_record("T", 1, "UPDATE", at=T0 + 3600 * S + 1000),
                      _record("T", 2, "DELETE", at=T0 + 3600 * S + 2000)])
    sink.flush()
    dirs = sorted(str(p.parent.relative_to(tmp_path)) for p in tmp_path.rglob("part-*"))
    assert dirs == ["T/date=2023-11-14/hour=22", "T/date=2023-11-14/hour=23"]
    rows = ds.dataset(tmp_path / "T", format="parquet", partitioning="hive").to_table().to_pylist()
    by_op = {r["op"]: r for r in rows}
    assert set(by_op) == {"c", "u", "d"}
    assert by_op["c"]["before"] is None and by_op["c"]["after"]["name"] in ("n1", "n2")
    assert by_op["d"]["after"] is None and by_op["d"]["before"]["id"] == 2
    assert by_op["u"]["source"]["transaction_id"] == "txn-1"
    assert by_op["u"]["ts_ms"] == (T0 + 3600 * S + 1000) // 1_000_000


def test_a_delete_only_batch_reads_back_with_the_inserts(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), file_size=1, flush_interval="1h")  # a file per batch
    _commit(sink, 1, [_record("T", i) for i in range(3)])
    _commit(sink, 2, [_record("T", i, "DELETE") for i in range(2)])
    sink.flush()
    assert len(list((tmp_path / "T").glob("part-*"))) == 2
    table = ds.dataset(tmp_path / "T", format="parquet").to_table()
    assert sorted(zip(table["_op"].to_pylist(), table["id"].to_pylist(), strict=True)) == \
        [("DELETE", 0), ("DELETE", 1), ("INSERT", 0), ("INSERT", 1), ("INSERT", 2)]


def test_jsonl_format(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), format="jsonl", flush_interval="1h")
    when = Timestamp.from_ns(T0 + 123)
    stamps = {"code": "ARRAY", "array_element_type": {"code": "TIMESTAMP"}}
    extra = {"n": ({"code": "NUMERIC"}, Decimal("1.50")), "b": ({"code": "BYTES"}, b"hi"),
             "at": ({"code": "TIMESTAMP"}, when), "ats": (stamps, [when, None])}
    _commit(sink, 1, [_record("T", 1, extra=extra)])
    sink.flush()
    (f,) = (tmp_path / "T").glob("part-*.jsonl")
    row = json.loads(f.read_text())
    assert row["id"] == 1 and row["_commit_ts"] == "2023-11-14T22:13:20.000001000Z"
    # the change stream's JSON forms, also inside arrays
    assert row["n"] == "1.50" and row["b"] == "aGk="
    assert row["at"] == row["ats"][0] == "2023-11-14T22:13:20.000000123Z"
    assert row["ats"][1] is None


def test_flush_interval_cuts_files(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), flush_interval="50ms")
    _commit(sink, 1, [_record("T", 1)])
    time.sleep(0.06)
    _commit(sink, 2, [_record("T", 2)])
    sink.drain()  # the cut file is uploaded in the background
    assert [p.name for p in (tmp_path / "T").glob("part-*")] == ["part-1-2-1.parquet"]
    assert sink.durable_batch() == 2
    assert json.loads((tmp_path / "_cdcflow/durable.json").read_text())["durable_batch"] == 2


def test_a_batch_looks_only_at_the_files_it_staged_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cdcflow.transforms import _tablespool

    sink = _sink(str(tmp_path), flush_interval="1h")
    _commit(sink, 1, [_record(f"T{t}", t) for t in range(300)])  # 300 open files
    sized: list[tuple[str, str]] = []
    size = _tablespool.OpenFile.size

    def counting(self: _tablespool.OpenFile, ratio: float) -> int:
        sized.append(self.key)
        return size(self, ratio)

    monkeypatch.setattr(_tablespool.OpenFile, "size", counting)
    for b in range(2, 6):
        _commit(sink, b, [_record("T7", 1000 + b)])
        assert sink.durable_batch() == 0 and sink.metrics()["uploads_queued"] == 0
    assert set(sized) == {("T7", "")}  # not the 299 idle tables' files
    sink.flush()
    assert len(list(tmp_path.glob("T*/part-*"))) == 300


# -- crashes in an engine run -------------------------------------------------------------


class _Crash(BaseException):
    """Stands for the process dying at that point. A BaseException, as a
    crash is not an error the engine may catch or wrap (it wraps a sink's errors)."""


class CrashingTables(WriteTables):
    def __init__(self, *args: Any, crash_at: tuple[str, int] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.crash_at = crash_at

    def _checkpoint(self, step: str, batch_id: int) -> None:
        if self.crash_at is not None and self.crash_at[0] == step and batch_id >= self.crash_at[1]:
            raise _Crash(f"{step} {batch_id}")


def _stream() -> ScriptedChangeStream:
    s = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(120):
        s.write("A" if i % 3 else "B", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S // 12)
    return s


def _run(store_path: Path, sink: WriteTables) -> Any:
    p = cf.Pipeline("tables")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 11 * S, client=_stream())
     | cf.ReadPartition() | sink)
    store = SQLiteStore(store_path)
    try:
        return Engine(p, store, InMemoryRunner(workers=2),
                      RunOptions(batch_interval=0, max_batch_span=1.0)).run()
    finally:
        store.close()


CRASHES = [("stage", 5), ("uploaded", 4), ("marked", 6), ("uploaded", 9)]


@pytest.mark.parametrize("spool_size", ["4MiB", "1KiB"], ids=["inline", "spooled"])
@pytest.mark.parametrize("crash", CRASHES, ids=[f"{s}-{b}" for s, b in CRASHES])
def test_a_crash_at_any_step_of_a_flush_loses_and_repeats_nothing(
    tmp_path: Path, crash: tuple[str, int], spool_size: str
) -> None:
    # spooled: every task's rows travel in a spool file of several chunks, staged one by one
    out = tmp_path / "out"
    with pytest.raises(_Crash):
        _run(tmp_path / "s.db", CrashingTables(str(out), file_size="2KiB", flush_interval="1h",
                                               spool_size=spool_size, crash_at=crash))
    summary = _run(tmp_path / "s.db", CrashingTables(str(out), file_size="2KiB",
                                                     flush_interval="1h", spool_size=spool_size))
    assert summary.reason == "end reached"
    v = ds.dataset(out, format="parquet", partitioning=None,
                   exclude_invalid_files=True).to_table(columns=["v", "_table"]).to_pylist()
    assert sorted(r["v"] for r in v) == list(range(120))
    assert {r["_table"] for r in v if r["v"] % 3 == 0} == {"B"}
    assert len(list(out.rglob("part-*"))) > 2


def test_after_the_store_commit_a_crash_replays_only_what_was_not_durable(tmp_path: Path) -> None:
    out = tmp_path / "out"
    from cdcflow.engine.listener import BatchStats, EngineListener

    class Listener(EngineListener):
        def on_batch(self, stats: BatchStats) -> None:
            if stats.batch_id == 7:
                raise _Crash("after store commit 7")

    p = cf.Pipeline("tables")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 11 * S, client=_stream())
     | cf.ReadPartition() | WriteTables(str(out), file_size="3KiB", flush_interval="1h"))
    store = SQLiteStore(tmp_path / "s.db")
    with pytest.raises(_Crash):
        Engine(p, store, InMemoryRunner(workers=2),
               RunOptions(batch_interval=0, max_batch_span=1.0), Listener()).run()
    assert store.durable_marks("tables")["WriteTables"] < 7  # committed, only staged
    store.close()
    _run(tmp_path / "s.db", WriteTables(str(out), file_size="3KiB", flush_interval="1h"))
    v = ds.dataset(out, format="parquet").to_table(columns=["v"])["v"].to_pylist()
    assert sorted(v) == list(range(120))


# -- a real S3 API server (moto) on loopback, and a SIGKILL mid-run ------------------------

_CHILD = textwrap.dedent('''
    import sys, time
    import cdcflow as cf
    from cdcflow.engine.listener import EngineListener
    from cdcflow.engine.loop import Engine, RunOptions
    from cdcflow.metadata import SQLiteStore
    from cdcflow.runners.in_memory import InMemoryRunner
    from cdcflow.testing import ScriptedChangeStream

    S, T0 = 1_000_000_000, 1_700_000_000 * 1_000_000_000
    stream = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(300):
        stream.write("A" if i % 3 else "B", i, "INSERT", {"v": i, "s": f"x{i}"},
                     at=T0 + (i + 1) * S // 15)

    class Slow(EngineListener):
        def on_batch(self, stats):
            print("batch", stats.batch_id, flush=True)
            time.sleep(float(sys.argv[2]))

    p = cf.Pipeline("s3")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 21 * S, client=stream)
     | cf.ReadPartition()
     | cf.WriteTables("s3://bucket/cdc", file_size="2KiB", flush_interval="1h"))
    store = SQLiteStore(sys.argv[1])
    Engine(p, store, InMemoryRunner(workers=2),
           RunOptions(batch_interval=0, max_batch_span=1.0), Slow()).run()
    store.close()
    print("done", flush=True)
''')


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    # moto keeps its buckets in the process, across servers: each test starts empty
    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"))
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.mkdir("bucket")
    yield endpoint
    server.stop()


def test_s3_run_killed_mid_run_and_restarted_writes_every_change_once(
    s3: str, tmp_path: Path
) -> None:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    db = str(tmp_path / "s.db")
    child = subprocess.Popen([sys.executable, str(script), db, "0.2"], stdout=subprocess.PIPE,
                             text=True, env=os.environ.copy())
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("batch") and int(line.split()[1]) >= 8:
            break
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=10)
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3}, skip_instance_cache=True)
    before = [p for p in fs.find("bucket/cdc") if "/part-" in p]
    assert before, "the killed run had written files"
    done = subprocess.run([sys.executable, str(script), db, "0"], capture_output=True,
                          text=True, timeout=60, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "done" in done.stdout
    fs.invalidate_cache()
    dataset = ds.dataset("bucket/cdc", filesystem=fs, format="parquet",
                         exclude_invalid_files=False)
    table = dataset.to_table(columns=["v", "s", "id", "_table"])
    assert sorted(table["v"].to_pylist()) == list(range(300))
    assert table.schema.field("v").type == pa.int64()
    assert table.schema.field("s").type == pa.string()
    assert len({p for p in fs.find("bucket/cdc") if "/part-" in p}) > len(before)
    assert fs.exists("bucket/cdc/A/_schema/v1.json")


def test_a_task_on_another_machine_sends_its_rows_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A cluster's executor cannot hand the driver a path on its own disk.
    sink = _sink(str(tmp_path), format="parquet", flush_interval="1h", spool_size="2KiB")
    shipped = pickle.loads(pickle.dumps(sink))  # as a task receives it
    monkeypatch.setattr(socket, "gethostname", lambda: "an-executor")
    writer = shipped.open_writer(WriterContext("p", "WriteTables", 1, "p0", 0, 1, "a"))
    for i in range(100):
        writer.write(_record("T", i))
    message = writer.close()
    assert isinstance(message, TaskRows) and message.spool is None and message.groups
    monkeypatch.undo()
    sink.commit(1, [pickle.loads(pickle.dumps(message))])
    sink.flush()
    ids = duckdb.connect().sql(
        f"SELECT id FROM read_parquet('{tmp_path}/T/part-*') ORDER BY id").fetchall()
    assert [i for (i,) in ids] == list(range(100))


@pytest.mark.parametrize("format", ["jsonl", "csv", "parquet"])
def test_small_numerics_are_written_without_an_exponent(tmp_path: Path, format: str) -> None:
    """NUMERIC as the change stream writes it (``str(Decimal)`` would give ``1E-9``): text
    in JSON lines, nine decimals in CSV, and a PostgreSQL NUMERIC's text in every format."""
    sink = _sink(str(tmp_path), format=format, flush_interval="1h")
    pg = {"code": "NUMERIC", "type_annotation": "PG_NUMERIC"}
    extra = {"n": ({"code": "NUMERIC"}, Decimal("-1E-9")), "m": ({"code": "NUMERIC"},
             Decimal("1E-7")), "pg": (pg, Decimal("-1E-9"))}
    _commit(sink, 1, [_record("T", 1, extra=extra)])
    sink.flush()
    (f,) = (tmp_path / "T").glob("part-*")
    text = f.read_text(errors="replace") if format != "parquet" else ""
    if format == "jsonl":
        row = json.loads(text)
        assert (row["n"], row["m"], row["pg"]) == ("-0.000000001", "0.0000001", "-0.000000001")
    elif format == "csv":
        assert "-0.000000001" in text and "0.000000100" in text and "E-" not in text
    else:
        table = ds.dataset(tmp_path / "T", format="parquet").to_table()
        assert table["pg"].to_pylist() == ["-0.000000001"]
        assert table["n"].to_pylist() == [Decimal("-1E-9")]


def test_uploads_wait_while_the_lease_ran_out_and_stop_once_taken_over(tmp_path: Path) -> None:
    """``SinkContext.guard`` is checked before each upload: a run paused past its lease
    uploads again once it is renewed, and a run another took over uploads nothing more
    (that run replays these batches: a late file of this run's repeated their rows)."""
    import threading

    from cdcflow.errors import FencedError, LeaseExpiredError

    failing: list[BaseException] = []

    def guard() -> None:
        if failing:
            raise failing[0]

    sink = WriteTables(str(tmp_path), format="jsonl", flush_interval="1h")
    sink.setup(SinkContext("p", "WriteTables", "/", guard=guard))
    _OPENED.append(sink)
    fs = fsspec.filesystem("file")
    _commit(sink, 1, [_record("T", 1)])
    failing.append(LeaseExpiredError("the lease ran out"))
    flushing = threading.Thread(target=sink.flush)
    flushing.start()
    time.sleep(0.5)
    assert flushing.is_alive() and _parts(fs, str(tmp_path)) == []  # waits
    failing.clear()  # renewed
    flushing.join(timeout=10)
    assert not flushing.is_alive() and len(_parts(fs, str(tmp_path))) == 1
    _commit(sink, 2, [_record("T", 2)])
    failing.append(FencedError("another run holds the pipeline now"))
    with pytest.raises(FencedError):
        sink.flush()
    assert len(_parts(fs, str(tmp_path))) == 1
