"""Built-in sinks against real files: Collect, Print, WriteFiles (jsonl and parquet)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from cdcflow.errors import PipelineDefinitionError, SinkError
from cdcflow.model import HeartbeatRecord, Timestamp
from cdcflow.transforms.base import Sink, SinkContext, WriterContext
from cdcflow.transforms.sinks import Collect, Print, WriteFiles, WrittenFile


def _wctx(batch_id: int, token: str, attempt: str = "a1") -> WriterContext:
    return WriterContext(
        pipeline="p",
        sink_label="out",
        batch_id=batch_id,
        partition_token=token,
        slice_start=0,
        slice_end=10,
        attempt=attempt,
    )


def _run_task(
    sink: Sink[Any, Any], batch_id: int, token: str, elements: list[Any], attempt: str
) -> Any:
    """What a task does: pickle the sink over, open a writer, write, close."""
    remote = pickle.loads(pickle.dumps(sink))
    writer = remote.open_writer(_wctx(batch_id, token, attempt))
    for e in elements:
        writer.write(e)
    return pickle.loads(pickle.dumps(writer.close()))


def _listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_collect_commits_once_per_batch_in_message_order() -> None:
    sink: Collect[int] = Collect()
    m1 = _run_task(sink, 1, "a", [1, 2], "x")
    m2 = _run_task(sink, 1, "b", [3], "x")
    sink.commit(1, [m1, m2])
    assert sink.items == [1, 2, 3]
    sink.commit(1, [m1, m2])  # replayed batch id
    assert sink.items == [1, 2, 3]
    sink.commit(2, [_run_task(sink, 2, "a", [4], "y")])
    assert sink.items == [1, 2, 3, 4]
    assert pickle.loads(pickle.dumps(sink)).items == []  # tasks do not carry the items


def test_print_prints_committed_batches_once(capsys: pytest.CaptureFixture[str]) -> None:
    sink = Print()
    rec = HeartbeatRecord("p", Timestamp.from_ns(5))
    msg = _run_task(sink, 3, "a", [{"k": 1}, rec, 7], "x")
    assert capsys.readouterr().out == ""  # writers only buffer
    sink.commit(3, [msg])
    sink.commit(3, [msg])
    assert capsys.readouterr().out.splitlines() == [
        '{"k":1}',
        '{"partition_token":"p","timestamp":"1970-01-01T00:00:00.000000005Z"}',
        "7",
    ]
    reprs = Print(format="repr")
    reprs.commit(1, [_run_task(reprs, 1, "a", ["s"], "x")])
    assert capsys.readouterr().out == "'s'\n"
    with pytest.raises(PipelineDefinitionError, match="'json' or 'repr'"):
        Print(format="xml")  # type: ignore[arg-type]


@pytest.fixture
def files(tmp_path: Path) -> tuple[WriteFiles, Path]:
    sink = WriteFiles("out/orders")
    sink.setup(SinkContext(pipeline="p", sink_label="out", base_dir=str(tmp_path)))
    return sink, tmp_path / "out" / "orders"


def test_relative_path_resolves_in_setup_and_travels(files: tuple[WriteFiles, Path]) -> None:
    sink, out = files
    assert out.is_dir()
    assert pickle.loads(pickle.dumps(sink)).directory == str(out)
    with pytest.raises(SinkError, match="setup"):
        WriteFiles("rel").open_writer(_wctx(1, "a"))


def test_jsonl_commit_renames_and_is_idempotent(files: tuple[WriteFiles, Path]) -> None:
    sink, out = files
    m_a = _run_task(sink, 42, "tok-a", [{"id": 1}, {"id": 2}], "att1")
    m_b = _run_task(sink, 42, "tok-b", [HeartbeatRecord("tok-b", Timestamp.from_ns(9))], "att1")
    m_empty = _run_task(sink, 42, "tok-c", [], "att1")
    assert m_empty is None  # the engine passes no None to commit
    assert isinstance(m_a, WrittenFile) and m_a.count == 2
    assert all(name.startswith(".") for name in _listing(out))  # nothing visible yet
    sink.commit(42, [m_a, m_b])
    final_a = sink.final_name(42, "tok-a")
    assert final_a.startswith("part-0000000042-") and final_a.endswith(".jsonl")
    assert _listing(out) == sorted([final_a, sink.final_name(42, "tok-b")])
    lines = (out / final_a).read_bytes().splitlines()
    assert [orjson.loads(x) for x in lines] == [{"id": 1}, {"id": 2}]
    before = {n: (out / n).read_bytes() for n in _listing(out)}
    sink.commit(42, [m_a, m_b])  # a second commit of the same batch
    assert {n: (out / n).read_bytes() for n in _listing(out)} == before


def test_replay_rewrites_identical_files_and_cleans_strays(
    files: tuple[WriteFiles, Path],
) -> None:
    sink, out = files
    rows = [{"id": i, "v": "x" * i} for i in range(5)]
    sink.commit(7, [_run_task(sink, 7, "tok", rows, "first")])
    committed = {n: (out / n).read_bytes() for n in _listing(out)}
    # a failed attempt leaves a temp file behind, then the batch is replayed
    failed = sink.open_writer(_wctx(7, "tok", "crashed"))
    failed.write({"id": 99})
    replay = _run_task(sink, 7, "tok", rows, "second")
    assert len(_listing(out)) == 3
    sink.commit(7, [replay])
    assert {n: (out / n).read_bytes() for n in _listing(out)} == committed


def test_abort_leaves_nothing(files: tuple[WriteFiles, Path]) -> None:
    sink, out = files
    msg = _run_task(sink, 5, "tok", [{"a": 1}], "att")
    stray = sink.open_writer(_wctx(5, "tok2", "other"))
    stray.write({"a": 2})
    sink.abort(5, [msg])
    assert _listing(out) == []
    writer = sink.open_writer(_wctx(6, "tok", "att"))
    writer.write({"a": 3})
    writer.abort()
    assert _listing(out) == []


def test_commit_without_files_fails_loudly(files: tuple[WriteFiles, Path]) -> None:
    sink, out = files
    ghost = WrittenFile(str(out / ".gone.tmp"), str(out / "part-x.jsonl"), 1)
    with pytest.raises(SinkError, match="shared by the driver"):
        sink.commit(1, [ghost])


def test_unserializable_element_names_the_fix(files: tuple[WriteFiles, Path]) -> None:
    sink, _ = files
    writer = sink.open_writer(_wctx(1, "tok"))
    with pytest.raises(SinkError, match="Map"):
        writer.write(object())


def test_parquet_readable_with_nested_values_as_json(tmp_path: Path) -> None:
    sink = WriteFiles(tmp_path / "pq", format="parquet", prefix="rows")
    sink.setup(SinkContext(pipeline="p", sink_label="out", base_dir="/nonexistent"))
    rows = [{"id": 1, "tags": ["a"], "when": Timestamp.from_ns(3)}, {"id": 2, "extra": True}]
    msg = _run_task(sink, 9, "tok", rows, "att")
    sink.commit(9, [msg])
    (name,) = _listing(tmp_path / "pq")
    assert name == sink.final_name(9, "tok") and name.startswith("rows-0000000009-")
    table = pq.read_table(tmp_path / "pq" / name)
    assert table.to_pylist() == [
        {"id": 1, "tags": '["a"]', "when": "1970-01-01T00:00:00.000000003Z", "extra": None},
        {"id": 2, "tags": None, "when": None, "extra": True},
    ]


def test_parquet_mixed_column_types_name_the_fix(tmp_path: Path) -> None:
    sink = WriteFiles(str(tmp_path), format="parquet")
    writer = sink.open_writer(_wctx(1, "tok"))
    writer.write({"v": 1})
    writer.write({"v": "one"})
    with pytest.raises(SinkError, match="one type"):
        writer.close()


def test_watermark_file(files: tuple[WriteFiles, Path]) -> None:
    sink, out = files
    sink.on_watermark(Timestamp.parse("2024-05-01T12:00:00.000000001Z").ns)
    data = orjson.loads((out / "_watermark.json").read_bytes())
    assert data == {
        "low_watermark": "2024-05-01T12:00:00.000000001Z",
        "ns": Timestamp.parse("2024-05-01T12:00:00.000000001Z").ns,
    }
    sink.on_watermark(5)  # never moves backwards
    assert orjson.loads((out / "_watermark.json").read_bytes()) == data
    assert _listing(out) == ["_watermark.json"]


def test_invalid_arguments() -> None:
    with pytest.raises(PipelineDefinitionError, match="jsonl"):
        WriteFiles("x", format="csv")  # type: ignore[arg-type]
    with pytest.raises(PipelineDefinitionError, match="prefix"):
        WriteFiles("x", prefix="a/b")
    with pytest.raises(PipelineDefinitionError, match="directory path"):
        WriteFiles("")
