"""Built-in sinks Collect and Print (WriteFiles: test_files.py)."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path
from typing import Any

import pytest

from cdcflow.errors import PipelineDefinitionError
from cdcflow.model import HeartbeatRecord, Timestamp
from cdcflow.transforms.base import Sink, SinkContext, WriterContext
from cdcflow.transforms.sinks import Collect, Print


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


def test_print_spills_a_large_task_to_a_local_file_and_prints_it_in_order(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("cdcflow.transforms.sinks.PRINT_MEMORY", 64)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sink = Print(format="repr")
    sink.setup(SinkContext("p", "Print", str(tmp_path)))
    lines = [f"line {i}\nwith a newline" for i in range(40)]
    message = _run_task(sink, 1, "a", lines, "x")
    assert message.spool is not None and len(message.lines) < 40  # most went to disk
    assert os.path.exists(message.spool)
    sink.commit(1, [message])
    assert capsys.readouterr().out == "".join(f"{line!r}\n" for line in lines)
    assert not os.path.exists(message.spool)  # the commit took it
    aborted = _run_task(sink, 2, "a", lines, "y")
    assert aborted.spool is not None
    sink.abort(2, [aborted])
    assert not os.path.exists(aborted.spool)


def test_print_on_another_machine_keeps_its_lines_in_the_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("cdcflow.transforms.sinks.PRINT_MEMORY", 64)
    sink = Print()
    sink.setup(SinkContext("p", "Print", "."))
    shipped = pickle.loads(pickle.dumps(sink))
    monkeypatch.setattr(socket, "gethostname", lambda: "an-executor")
    writer = shipped.open_writer(WriterContext("p", "Print", 1, "a", 0, 1, "x"))
    for i in range(100):
        writer.write(i)
    message = writer.close()
    assert message.spool is None and message.lines == tuple(str(i) for i in range(100))


def test_collect_and_print_write_nowhere_of_their_own() -> None:
    # the Sink defaults: no location to collide on, no committed batches to continue above
    for sink in (Collect(), Print()):
        assert sink.output_location() is None
        assert sink.last_committed_batch() == 0


@pytest.mark.parametrize("sink", ["files-jsonl", "files-parquet", "tables-jsonl",
                                  "tables-parquet", "tables-csv", "print"])
def test_every_writer_keeps_json_integers_past_64_bits(
    sink: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A JSON value holding 2**70 stopped every sink (orjson refuses such integers)."""
    import cdcflow as cf
    from cdcflow.testing import ScriptedChangeStream, run
    from cdcflow.transforms import WriteTables

    t0 = 1_700_000_000 * 10**9
    stream = ScriptedChangeStream("S", origin=t0)
    stream.write("Docs", {"id": 1}, "INSERT", {"js": {"big": 2**70, "l": [-(2**80)]}},
                 at=t0 + 1000)
    kind, _, form = sink.partition("-")
    made: Any = {
        "files": lambda: cf.WriteFiles(tmp_path / "out", format=form),
        "tables": lambda: WriteTables(f"file://{tmp_path / 'out'}", format=form),
        "print": lambda: cf.Print(),
    }[kind]()
    p = cf.Pipeline("big-ints")
    (p | cf.ReadChangeStream(stream="S", start_at=t0, end_at=t0 + 5000, client=stream) | made)
    assert run(p).records == 1
    if kind == "print":
        text = capsys.readouterr().out
    elif form == "parquet":
        import pyarrow.parquet as pq

        (path,) = [f for f in (tmp_path / "out").rglob("*.parquet") if f.is_file()]
        text = str(pq.read_table(path).to_pylist())
    else:
        (path,) = [f for f in (tmp_path / "out").rglob(f"*.{form}") if f.is_file()]
        text = path.read_text()
    assert "1180591620717411303424" in text and "-1208925819614629174706176" in text


def _two_branches_into(sink: Any) -> Any:
    import cdcflow as cf
    import cdcflow.testing
    from cdcflow.testing import ScriptedChangeStream

    t0 = 1_700_000_000 * 10**9
    stream = ScriptedChangeStream("S", partitions=2, origin=t0)
    for i in range(6):
        stream.write("T", i, "INSERT", {"v": i}, at=t0 + (i + 1) * 1000)
    p = cf.Pipeline("branches")
    rows = (p | cf.DetectPartitions(stream="S", start_at=t0, end_at=t0 + 10_000, client=stream)
            | cf.ReadPartition())
    rows | "a" >> cf.Map(lambda r: ("a", r.mods[0].new_values["v"])) | "to a" >> sink
    rows | "b" >> cf.Map(lambda r: ("b", r.mods[0].new_values["v"])) | "to b" >> sink
    return cdcflow.testing.run(p)


def test_one_collect_at_the_end_of_two_branches_gets_both(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Labelled copies of one sink share its items and its record of committed batches:
    each branch's commit of a batch is its own, not a replay of the other's."""
    out: Collect[Any] = Collect()
    _two_branches_into(out)
    assert sorted(out.items) == sorted((b, v) for b in "ab" for v in range(6))
    _two_branches_into(Print(format="repr"))
    printed = capsys.readouterr().out.splitlines()
    assert sorted(printed) == sorted(repr((b, v)) for b in "ab" for v in range(6))


def test_a_collect_run_again_with_a_new_store_gets_the_new_batches() -> None:
    """A second run with a new store (cdcflow.testing.run: memory://) numbers its batches
    from where the sink's output ends, so they are not taken for replays of the first's."""
    import cdcflow as cf
    import cdcflow.testing
    from cdcflow.testing import ScriptedChangeStream

    t0 = 1_700_000_000 * 10**9
    stream = ScriptedChangeStream("S", partitions=1, origin=t0)
    stream.write("T", 1, "INSERT", {"v": 1}, at=t0 + 1000)
    out: Collect[Any] = Collect()
    p = cf.Pipeline("again")
    (p | cf.ReadChangeStream(stream="S", start_at=t0, end_at=t0 + 10_000, client=stream)
     | cf.Map(lambda r: r.mods[0].new_values["v"]) | out)
    cdcflow.testing.run(p)
    assert out.items == [1]
    stream.write("T", 2, "INSERT", {"v": 2}, at=t0 + 2000)
    cdcflow.testing.run(p)
    assert out.items == [1, 1, 2]  # the second run reads the stream again, from its start
