"""WriteFiles against real files: exactly-once commits, output identity (manifests), sinks
sharing a directory (writers' column types and storage faults: test_fileio.py)."""

from __future__ import annotations

import errno
import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from cdcflow.errors import (
    OutputConflictError,
    PipelineDefinitionError,
    SinkError,
    SinkIOError,
    SinkSetupError,
    TransientError,
    UserInputError,
)
from cdcflow.model import HeartbeatRecord, Timestamp
from cdcflow.transforms.base import Sink, SinkContext, WriterContext
from cdcflow.transforms.files import _label_scope
from cdcflow.transforms.sinks import WriteFiles, WrittenFile
from cdcflow.transforms.tables import WriteTables


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


def _listing(directory: Path) -> list[str]:
    """The names a dataset reader sees (not ``_cdcflow/``, ``_watermark.json``, ``.*.tmp``)."""
    return sorted(n for n in os.listdir(directory) if not n.startswith(("_", ".")))


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


@pytest.fixture
def files(tmp_path: Path) -> tuple[WriteFiles, Path]:
    sink = WriteFiles("out/orders")
    sink.setup(SinkContext(pipeline="p", sink_label="out", base_dir=str(tmp_path)))
    return sink, tmp_path / "out" / "orders"


# -- commits --------------------------------------------------------------------------------


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
    assert (m_a.partition_token, m_a.slice_start, m_a.slice_end) == ("tok-a", 0, 10)
    assert _listing(out) == [] and len(_everything(out)) == 2  # nothing visible yet
    sink.commit(42, [m_a, m_b])
    final_a = sink.final_name(42, "tok-a")
    assert final_a.startswith("part-0000000042-") and final_a.endswith(".jsonl")
    assert _listing(out) == sorted([final_a, sink.final_name(42, "tok-b")])
    lines = (out / final_a).read_bytes().splitlines()
    assert [orjson.loads(x) for x in lines] == [{"id": 1}, {"id": 2}]
    assert _everything(out) == sorted([final_a, sink.final_name(42, "tok-b"),
                                       "_cdcflow/part.jsonl/batch-0000000042.json",
                                       "_cdcflow/owner.json"])
    before = {n: (out / n).read_bytes() for n in _everything(out)}
    sink.commit(42, [m_a, m_b])  # a second commit of the same batch
    assert {n: (out / n).read_bytes() for n in _everything(out)} == before


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
    assert len(_everything(out)) == 5  # the file, its manifest, the owner, two temporary files
    sink.commit(7, [replay])
    assert {n: (out / n).read_bytes() for n in _listing(out)} == committed
    assert len(_everything(out)) == 3


def test_abort_leaves_nothing(files: tuple[WriteFiles, Path]) -> None:
    sink, out = files
    msg = _run_task(sink, 5, "tok", [{"a": 1}], "att")
    stray = sink.open_writer(_wctx(5, "tok2", "other"))
    stray.write({"a": 2})
    sink.abort(5, [msg])
    assert _everything(out) == []
    writer = sink.open_writer(_wctx(6, "tok", "att"))
    writer.write({"a": 3})
    writer.abort()
    assert _everything(out) == []


def test_commit_without_files_fails_loudly(files: tuple[WriteFiles, Path]) -> None:
    sink, out = files
    ghost = WrittenFile(str(out / ".gone.tmp"), str(out / "part-x.jsonl"), 1, "t", 0, 10)
    with pytest.raises(SinkError, match="shared by the driver"):
        sink.commit(1, [ghost])
    # checked before the manifest is written (the claim of the directory comes first)
    assert _everything(out) == ["_cdcflow/owner.json"]


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
    assert _everything(out) == ["_watermark.json"]


def test_invalid_arguments() -> None:
    with pytest.raises(PipelineDefinitionError, match="jsonl"):
        WriteFiles("x", format="csv")  # type: ignore[arg-type]
    with pytest.raises(PipelineDefinitionError, match="prefix"):
        WriteFiles("x", prefix="a/b")
    with pytest.raises(PipelineDefinitionError, match="directory path"):
        WriteFiles("")
    with pytest.raises(PipelineDefinitionError, match=r"WriteFiles\(None\): pass a directory"):
        WriteFiles(None)  # type: ignore[arg-type]
    # a URL is not a directory (it used to become ./s3:/lake/x): object storage is WriteTables'
    for url in ("s3://lake/x", "gs://b/x", "file:///tmp/x"):
        with pytest.raises(PipelineDefinitionError, match="use WriteTables"):
            WriteFiles(url)
    assert WriteFiles("out/s3:x").path == "out/s3:x"  # a colon in a path is a path


def test_the_new_errors_take_their_bases() -> None:
    assert issubclass(OutputConflictError, UserInputError)  # one line, exit code 2
    assert issubclass(SinkIOError, TransientError)  # the engine retries the batch
    assert not issubclass(SinkIOError, SinkError)


# -- output identity ------------------------------------------------------------------------


def _two_batches(out: Path) -> WriteFiles:
    """A first run: batches 1 and 2 of the root partition, slices [0, 10) and [10, 20)."""
    first = _sink(out)
    for batch, start in ((1, 0), (2, 10)):
        rows = [{"id": batch, "run": "first"}]
        message = _run_task(first, batch, "root", rows, "x", start=start, end=start + 10)
        first.commit(batch, [message])
    first.on_watermark(20)
    return first


def test_a_second_run_with_a_fresh_store_refuses_and_overwrites_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _two_batches(out)
    before = _committed(out)
    assert len(before) == 5  # two files, the newest manifest, the owner, the watermark
    # The same pipeline with a new store: batch ids start over at 1, its slices elsewhere.
    second = _sink(out)
    message = _run_task(second, 1, "root", [{"id": 1, "run": "second"}], "y", start=500, end=510)
    with pytest.raises(OutputConflictError) as info:
        second.commit(1, [message])
    text = str(info.value)
    assert "\n" not in text
    assert f"WriteFiles {out}: batch 1 already holds output this run did not commit" in text
    assert "write to a new path, resume with the metadata store that wrote it" in text
    assert "delete that output" in text
    assert _committed(out) == before  # not a byte changed
    assert _jsonl(out) == [{"id": 1, "run": "first"}, {"id": 2, "run": "first"}]
    # What the engine continues above; a batch past it commits next to the old output.
    assert second.last_committed_batch() == 2
    second.abort(1, [message])
    second.commit(3, [_run_task(second, 3, "root", [{"id": 3, "run": "second"}], "y",
                                start=500, end=510)])
    assert [r["run"] for r in _jsonl(out)] == ["first", "first", "second"]
    after = _committed(out)
    assert {n: after[n] for n in before if not n.startswith("_cdcflow/")} == {
        n: h for n, h in before.items() if not n.startswith("_cdcflow/")}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"start": 15}, "pipeline 'p' read other partitions or slices for it"),
        ({"token": "other"}, "pipeline 'p' read other partitions or slices for it"),
        ({"pipeline": "another"}, "holds the output of pipeline 'p', not 'another'"),
        ({"label": "dead-letter"}, "by sink 'out' of pipeline 'p'"),
    ],
)
def test_a_commit_unlike_the_batch_manifest_is_refused(
    tmp_path: Path, change: dict[str, Any], why: str
) -> None:
    out = tmp_path / "out"
    _two_batches(out)
    before = _committed(out)
    label = change.get("label", "out")
    sink = _sink(out, pipeline=change.get("pipeline", "p"), label=label)
    # batch 2, the newest: the batch a crash can leave pending, whose manifest is kept
    message = _run_task(sink, 2, change.get("token", "root"), [{"id": 9}], "z", label=label,
                        start=change.get("start", 10), end=20)
    with pytest.raises(OutputConflictError, match=why):
        sink.commit(2, [message])
    assert _committed(out) == before


def test_a_replay_of_the_same_batch_is_idempotent(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = _two_batches(out)
    before = _committed(out)
    # a crash after the sink commit: the engine replays batch 2 (same slices, new attempts)
    # with the driver restarted, so from a new sink object
    again = _sink(out)
    message = _run_task(again, 2, "root", [{"id": 2, "run": "first"}], "y", start=10, end=20)
    again.commit(2, [message])
    assert _committed(out) == before
    assert first.last_committed_batch() == again.last_committed_batch() == 2


def test_a_replay_completes_a_commit_that_failed_after_its_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean, crashed = _sink(tmp_path / "clean"), _sink(tmp_path / "crashed")
    rows = {"a": [{"id": 1}], "b": [{"id": 2}, {"id": 3}]}

    def batch(sink: WriteFiles, attempt: str) -> list[WrittenFile]:
        return [_run_task(sink, 4, token, rows[token], attempt) for token in rows]

    clean.commit(4, batch(clean, "x"))
    real_replace, renamed = os.replace, []

    def replace(src: Any, dst: Any) -> None:
        if os.path.basename(dst).startswith("part-"):
            if renamed:  # the second file's rename: the device fails
                raise OSError(errno.EIO, "Input/output error")
            renamed.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(SinkIOError, match=r"cannot rename .*Input/output error; free") as info:
        crashed.commit(4, batch(crashed, "x"))
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    out = tmp_path / "crashed"
    assert len(_listing(out)) == 1 and (out / "_cdcflow/part.jsonl/batch-0000000004.json").exists()
    assert crashed.last_committed_batch() == 4  # the manifest claims the batch already
    crashed.commit(4, batch(crashed, "replay"))  # the engine's replay: same slices
    assert _committed(out) == _committed(tmp_path / "clean")
    assert [n for n in _everything(out) if n.startswith(".")] == []


def _manifests(out: Path) -> list[str]:
    return sorted(os.listdir(out / "_cdcflow" / "part.jsonl"))


def test_the_directory_keeps_only_the_newest_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One manifest per batch for ever was 86,400 files a day at 1 s batches, listed at every
    start; only the newest is ever read again (see WriteFiles.commit, step 4)."""
    out = tmp_path / "out"
    old = _sink(out)  # a version that kept every manifest
    monkeypatch.setattr(WriteFiles, "_prune_manifests", lambda self, newest: None)
    for batch in range(1, 5):
        old.commit(batch, [_run_task(old, batch, "root", [{"id": batch}], "a")])
    assert len(_manifests(out)) == 4
    monkeypatch.undo()
    sink = _sink(out)  # the next run: one listing at start, then each commit by name
    assert (sink.owned_batch(), sink.last_committed_batch()) == (4, 4)
    for batch in (5, 6, 9):  # a batch without files writes none, and keeps the last
        sink.commit(batch, [_run_task(sink, batch, "root", [{"id": batch}], "a")])
        assert _manifests(out) == [f"batch-{batch:010d}.json"]
        sink.commit(batch + 1, [])
        assert _manifests(out) == [f"batch-{batch:010d}.json"]
    # what the newest manifest is read for still works: a replay of the newest batch, and
    # the batches a later run finds
    sink.commit(9, [_run_task(sink, 9, "root", [{"id": 9}], "replay")])
    again = _sink(out)
    assert (again.owned_batch(), again.last_committed_batch()) == (9, 9)
    assert [r["id"] for r in _jsonl(out)] == [1, 2, 3, 4, 5, 6, 9]


def test_a_manifest_that_cannot_be_deleted_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    sink = _sink(out)
    sink.commit(1, [_run_task(sink, 1, "root", [{"id": 1}], "a")])
    real_remove = os.remove

    def remove(path: Any) -> None:
        if os.path.basename(path).startswith("batch-"):
            raise PermissionError(errno.EACCES, "Permission denied")
        real_remove(path)

    monkeypatch.setattr(os, "remove", remove)
    sink.commit(2, [_run_task(sink, 2, "root", [{"id": 2}], "a")])  # committed all the same
    assert "cannot delete the old manifest of batch 1: Permission denied" in caplog.text
    assert _manifests(out) == ["batch-0000000001.json", "batch-0000000002.json"]
    monkeypatch.undo()
    sink.commit(3, [_run_task(sink, 3, "root", [{"id": 3}], "a")])
    assert _manifests(out) == ["batch-0000000003.json"]
    assert [r["id"] for r in _jsonl(out)] == [1, 2, 3]


def test_last_committed_batch_counts_manifests_and_older_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = _sink(out)
    assert sink.last_committed_batch() == 0
    for batch in (3, 12):
        sink.commit(batch, [_run_task(sink, batch, "t", [{"id": batch}], "x")])
    sink.commit(13, [])  # a batch without output leaves nothing to count
    assert sink.last_committed_batch() == 12
    # a file of a version that kept no manifests; another format's file is not ours
    (out / sink.final_name(40, "t")).write_text('{"id": 40}\n')
    (out / "part-0000000099-0123456789abcdef.parquet").write_bytes(b"PAR1")
    assert sink.last_committed_batch() == 40
    assert _sink(out, format="parquet").last_committed_batch() == 99
    before = _committed(out)
    with pytest.raises(OutputConflictError, match="exists and no manifest of this sink claims it"):
        sink.commit(40, [_run_task(sink, 40, "t", [{"id": 41}], "x")])
    assert _committed(out) == before


def test_an_unreadable_manifest_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = _sink(out)
    (out / "_cdcflow/part.jsonl").mkdir(parents=True)
    (out / "_cdcflow/part.jsonl/batch-0000000001.json").write_text("{not json")
    with pytest.raises(OutputConflictError, match="is not one cdcflow wrote"):
        sink.commit(1, [_run_task(sink, 1, "t", [{"id": 1}], "x")])
    assert _listing(out) == []


def test_an_empty_commit_over_existing_output_changes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _two_batches(out)
    before = _committed(out)
    _sink(out, pipeline="another").commit(1, [])  # nothing to write: nothing to refuse
    assert _committed(out) == before


# -- sinks sharing a directory ----------------------------------------------------------------


def test_jsonl_and_parquet_sinks_in_one_directory_read_back_intact(tmp_path: Path) -> None:
    out = tmp_path / "out"
    lines, table = _sink(out, label="lines"), _sink(out, label="table", format="parquet")
    assert lines.output_location() == str(out / "part-*.jsonl")
    assert table.output_location() == str(out / "part-*.parquet")
    data = [{"id": i, "name": f"n{i}"} for i in range(4)]
    for batch in (1, 2):
        # one task runs both writers, with one attempt id
        mj = _run_task(lines, batch, "tok", data, "task-attempt", label="lines")
        mp = _run_task(table, batch, "tok", data, "task-attempt", label="table")
        assert os.path.basename(mj.temp) != os.path.basename(mp.temp)
        lines.commit(batch, [mj])  # sweeps its own leftovers, never the other sink's file
        table.commit(batch, [mp])
    assert _jsonl(out) == data + data
    parquet = ds.dataset(sorted(str(p) for p in out.glob("*.parquet")), format="parquet")
    assert parquet.to_table().to_pylist() == data + data
    # an aborted batch of one sink leaves the other's temporary file alone
    mj = _run_task(lines, 3, "tok", data, "t3", label="lines")
    mp = _run_task(table, 3, "tok", data, "t3", label="table")
    lines.abort(3, [])
    assert not os.path.exists(mj.temp) and os.path.exists(mp.temp)
    table.commit(3, [mp])
    assert len(ds.dataset(sorted(str(p) for p in out.glob("*.parquet"))).to_table()) == 12


def test_a_dead_letter_sink_in_the_main_directory(tmp_path: Path) -> None:
    out = tmp_path / "out"
    main = _sink(out, label="files")
    same = _sink(out, label="dead-letter")
    # the same final names: the locations are equal, so the engine refuses the pipeline ...
    assert same.output_location() == main.output_location()
    main.commit(1, [_run_task(main, 1, "tok", [{"id": 1}], "t", label="files")])
    before = _committed(out)
    # ... and a commit that comes anyway is refused before it overwrites anything
    failed = _run_task(same, 1, "tok", [{"error": "x"}], "t", label="dead-letter")
    with pytest.raises(OutputConflictError, match="by sink 'files'"):
        same.commit(1, [failed])
    assert _committed(out) == before
    # a prefix of its own makes it safe
    dead = _sink(out, label="dead-letter", prefix="failed")
    assert dead.output_location() == str(out / "failed-*.jsonl")
    dead.commit(1, [_run_task(dead, 1, "tok", [{"error": "x"}], "t", label="dead-letter")])
    assert _jsonl(out, "part-*.jsonl") == [{"id": 1}]
    assert _jsonl(out, "failed-*.jsonl") == [{"error": "x"}]


def test_a_directory_that_cannot_be_made_is_a_setup_error(tmp_path: Path) -> None:
    """A configuration error (exit 2), as for WriteTables."""
    (tmp_path / "afile").write_text("")
    sink = WriteFiles(tmp_path / "afile" / "out")
    with pytest.raises(SinkSetupError, match=r"WriteFiles cannot create .*afile/out: Not a "
                                             r"directory; choose a writable path"):
        sink.setup(SinkContext(pipeline="p", sink_label="out", base_dir=str(tmp_path)))


def test_a_directory_it_cannot_write_in_is_a_setup_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An existing directory on a read-only mount (or without permission) is refused at
    setup (exit 2), not at the first commit as a storage failure (exit 1)."""
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    if os.access(out, os.W_OK):  # root: permissions do not stop it (a read-only mount would)
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, *a, **kw: (
            os.fspath(p) != str(out) and real(p, mode, *a, **kw)))
    try:
        with pytest.raises(SinkSetupError, match=r"WriteFiles cannot write in .*/ro \(a "
                                                 r"read-only filesystem or no permission\)"):
            WriteFiles(out).setup(SinkContext(pipeline="p", sink_label="out",
                                              base_dir=str(tmp_path)))
        with pytest.raises(SinkSetupError, match=r"WriteTables cannot write in .*/ro"):
            WriteTables(str(out)).setup(SinkContext(pipeline="p", sink_label="t",
                                                    base_dir=str(tmp_path)))
    finally:
        out.chmod(0o755)


def test_output_location_needs_setup_for_a_relative_path() -> None:
    with pytest.raises(SinkError, match="setup"):
        WriteFiles("rel").output_location()
    assert WriteFiles("/abs/out", prefix="x").output_location() == "/abs/out/x-*.jsonl"


def test_a_killed_runs_watermark_temp_file_is_removed_by_the_next_setup(tmp_path: Path) -> None:
    out = tmp_path / "out"
    first = WriteFiles(out)
    first.setup(SinkContext(pipeline="p", sink_label="out", base_dir=str(tmp_path)))
    first.on_watermark(5)
    assert [n for n in os.listdir(out) if n.startswith(".")] == []  # renamed into place
    # what a run SIGKILLed before its rename left (its process is gone), and the file of a
    # run still writing one (this process): only the first is garbage
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    left = out / f"._watermark.json.{_label_scope('out')}.{dead}.tmp"
    live = out / f"._watermark.json.{_label_scope('out')}.{os.getpid()}.tmp"
    left.write_bytes(b"{")
    live.write_bytes(b"{")
    again = WriteFiles(out)
    again.setup(SinkContext(pipeline="p", sink_label="out", base_dir=str(tmp_path)))
    assert not left.exists() and live.exists()


def test_the_watermark_file_never_moves_back_across_runs(tmp_path: Path) -> None:
    """A run that starts over (--reset, a memory:// store) begins below the watermark an
    earlier run wrote; the file keeps the larger value, which still holds (the earlier
    output is there)."""
    out = tmp_path / "out"

    def stored() -> int:
        return int(orjson.loads((out / "_watermark.json").read_bytes())["ns"])

    _sink(out).on_watermark(100)
    again = _sink(out)
    again.on_watermark(50)
    assert stored() == 100
    again.on_watermark(150)
    assert stored() == 150
