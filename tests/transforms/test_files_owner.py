"""WriteFiles: a directory's naming scope (prefix, format) holds one pipeline's output.

A second pipeline on the same directory and prefix is refused at start (its batch ids are
not the first one's: it would add the same changes again under other batch ids), naming
the owner and the fix, and writes nothing; the same pipeline goes on (restart, --reset);
output written before owners were recorded is adopted; two pipelines claiming at once
cannot both win.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import orjson
import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions, RunSummary
from cdcflow.errors import LostProgressError, OutputConflictError, PipelineDefinitionError
from cdcflow.metadata import SQLiteStore
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms.base import SinkContext
from cdcflow.transforms.files import WriteFiles

S = 1_000_000_000
T0 = 1_700_000_000 * S
N = 40
OWNER = Path("_cdcflow/owner.json")


def _stream(n: int = N) -> ScriptedChangeStream:
    stream = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(n):
        stream.write("A" if i % 3 else "B", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S // 10)
    return stream


def _run(name: str, out: Path, store_path: Path, *, prefix: str = "part",
         reset: bool = False) -> RunSummary:
    stream = _stream()
    p = cf.Pipeline(name)
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + (N // 10 + 2) * S,
                             client=stream)
     | cf.ReadPartition()
     | cf.Map(lambda r: {"v": r.mods[0].new_values["v"]})
     | WriteFiles(out, prefix=prefix))
    store = SQLiteStore(store_path)
    try:
        return Engine(p, store, InMemoryRunner(),
                      RunOptions(batch_interval=0, max_batch_span=1.0, reset=reset)).run()
    finally:
        store.close()


def _values(out: Path, prefix: str = "part") -> list[int]:
    rows = []
    for path in sorted(out.glob(f"{prefix}-*.jsonl")):
        rows += [orjson.loads(line)["v"] for line in path.read_bytes().splitlines()]
    return sorted(rows)


def _snapshot(directory: Path) -> dict[str, str]:
    """sha256 of every file under ``directory``, temporary ones too."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in directory.rglob("*") if p.is_file()}


def test_a_second_pipeline_on_the_directory_is_refused_and_writes_nothing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "shared"
    assert _run("kv-A", out, tmp_path / "a.db").reason == "end reached"
    assert _values(out) == list(range(N))
    assert orjson.loads((out / OWNER).read_bytes()) == {"pipeline": "kv-A"}
    before = _snapshot(out)
    # another pipeline with its own store: refused at start, in one line naming the owner
    with pytest.raises(OutputConflictError) as info:
        _run("kv-B", out, tmp_path / "b.db")
    text = str(info.value)
    assert "\n" not in text
    assert f"WriteFiles {out} holds the output of pipeline 'kv-A', not 'kv-B'" in text
    assert "give each pipeline its own directory" in text
    assert _snapshot(out) == before  # not a byte written, not even a temporary file
    # the owner goes on: a restart, and a --reset that writes everything again above
    assert _run("kv-A", out, tmp_path / "a.db").reason == "end reached"
    assert _values(out) == list(range(N))
    assert _run("kv-A", out, tmp_path / "a.db", reset=True).reason == "end reached"
    assert _values(out) == sorted(list(range(N)) * 2)  # a reset reads the stream again
    # the owner with a lost store would start over and deliver it all again: refused,
    # unless it resets on purpose (batch ids then go on above its output)
    with pytest.raises(LostProgressError, match="no progress in the store"):
        _run("kv-A", out, tmp_path / "a2.db")
    assert _values(out) == sorted(list(range(N)) * 2)
    assert _run("kv-A", out, tmp_path / "a2.db", reset=True).reason == "end reached"
    assert _values(out) == sorted(list(range(N)) * 3)


def test_a_directory_is_one_pipelines_whatever_the_prefix(tmp_path: Path) -> None:
    """Its _watermark.json is one pipeline's: another pipeline is refused there with a
    prefix of its own too, while a sink of the owner may use another prefix."""
    out = tmp_path / "shared"
    _run("kv-A", out, tmp_path / "a.db")
    before = _snapshot(out)
    with pytest.raises(OutputConflictError, match="pipeline 'kv-A', not 'kv-B'"):
        _run("kv-B", out, tmp_path / "b.db", prefix="b")
    assert _snapshot(out) == before
    assert _run("kv-A", out, tmp_path / "a2.db", prefix="b").reason == "end reached"
    assert _values(out) == _values(out, "b") == list(range(N))


def test_a_claim_of_a_run_that_wrote_nothing_says_so_and_how_to_drop_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    (out / OWNER).parent.mkdir(parents=True)
    (out / OWNER).write_bytes(orjson.dumps({"pipeline": "kv-A"}))  # a run that failed at start
    with pytest.raises(OutputConflictError) as refused:
        _run("kv-B", out, tmp_path / "b.db")
    text = str(refused.value)
    assert "was claimed by pipeline 'kv-A'" in text and "which wrote no output there" in text
    assert f"delete {out / OWNER}" in text
    (out / OWNER).unlink()  # the fix it names
    assert _run("kv-B", out, tmp_path / "b.db").reason == "end reached"
    assert _values(out) == list(range(N))


def test_output_written_before_owners_were_recorded_is_adopted(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    _run("kv-A", out, tmp_path / "a.db")
    (out / OWNER).unlink()  # what a version that recorded no owner left
    before = _snapshot(out)
    # its manifests name kv-A: another pipeline is refused, and claims nothing
    with pytest.raises(OutputConflictError, match="holds the output of pipeline 'kv-A'"):
        _run("kv-B", out, tmp_path / "b.db")
    assert _snapshot(out) == before
    # kv-A adopts it and goes on
    assert _run("kv-A", out, tmp_path / "a.db").reason == "end reached"
    assert orjson.loads((out / OWNER).read_bytes()) == {"pipeline": "kv-A"}
    assert _values(out) == list(range(N))


def test_files_of_a_version_without_manifests_are_adopted_by_the_first_pipeline(
    tmp_path: Path,
) -> None:
    out = tmp_path / "shared"
    out.mkdir()
    (out / "part-0000000007-0123456789abcdef.jsonl").write_text('{"v": -1}\n')
    assert _run("kv-B", out, tmp_path / "b.db").reason == "end reached"
    assert orjson.loads((out / OWNER).read_bytes()) == {"pipeline": "kv-B"}
    assert _values(out) == [-1, *range(N)]
    with pytest.raises(OutputConflictError, match="holds the output of pipeline 'kv-B'"):
        _run("kv-A", out, tmp_path / "a.db")


def test_a_renamed_pipeline_takes_over_by_writing_its_name_in_the_owner_record(
    tmp_path: Path,
) -> None:
    out = tmp_path / "shared"
    _run("kv-A", out, tmp_path / "a.db")
    with pytest.raises(OutputConflictError, match=f"write its new name in {out / OWNER}"):
        _run("kv-A2", out, tmp_path / "a.db")
    (out / OWNER).write_bytes(orjson.dumps({"pipeline": "kv-A2"}))
    # progress is kept by name: the renamed pipeline starts over, which it must ask for
    with pytest.raises(LostProgressError, match="'kv-A2' has no progress"):
        _run("kv-A2", out, tmp_path / "a.db")
    assert _run("kv-A2", out, tmp_path / "a.db", reset=True).reason == "end reached"


def test_an_unreadable_owner_record_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    (out / OWNER).parent.mkdir(parents=True)
    (out / OWNER).write_text("{not json")
    sink = WriteFiles(out)
    sink.setup(SinkContext("kv-A", "WriteFiles", "/"))
    with pytest.raises(OutputConflictError, match="is not one cdcflow wrote"):
        sink.last_committed_batch()


def test_two_pipelines_claiming_an_empty_directory_at_once_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both look at the directory before either claims it (a barrier holds each after its
    look): the claim is an exclusive create, so one wins and the other is refused."""
    out = tmp_path / "shared"
    both_looked = threading.Barrier(2, timeout=20)
    looked: set[int] = set()
    real = WriteFiles._read_owner

    def read_owner(self: WriteFiles, path: str) -> str | None:
        owner = real(self, path)
        if id(self) not in looked:
            looked.add(id(self))
            both_looked.wait()
        return owner

    monkeypatch.setattr(WriteFiles, "_read_owner", read_owner)
    outcome: dict[str, str] = {}

    def claim(pipeline: str) -> None:
        sink = WriteFiles(out)
        sink.setup(SinkContext(pipeline, "WriteFiles", str(tmp_path)))
        try:
            sink.last_committed_batch()
            outcome[pipeline] = "claimed"
        except OutputConflictError:
            outcome[pipeline] = "refused"

    runs = [threading.Thread(target=claim, args=(name,)) for name in ("kv-A", "kv-B")]
    for t in runs:
        t.start()
    for t in runs:
        t.join(30)
    assert sorted(outcome.values()) == ["claimed", "refused"], outcome
    owner = orjson.loads((out / OWNER).read_bytes())["pipeline"]
    assert outcome[owner] == "claimed"
    assert [p for p in out.rglob("*") if p.is_file()] == [out / OWNER]  # no temporary file


def test_a_pipeline_refused_at_start_leaves_no_claim(tmp_path: Path) -> None:
    """Two sinks with one location are refused before the first batch, and the directory
    stays free: the corrected pipeline (under another name) then runs."""
    out = tmp_path / "shared"
    stream = _stream(10)
    bad = cf.Pipeline("files-v1")
    read = (bad | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 3 * S, client=stream)
            | cf.ReadPartition())
    read | "a" >> WriteFiles(out)
    read | "b" >> WriteFiles(out)
    store = SQLiteStore(tmp_path / "s.db")
    try:
        with pytest.raises(PipelineDefinitionError, match="sinks 'a' and 'b' would write"):
            Engine(bad, store, InMemoryRunner(), RunOptions(batch_interval=0)).run()
    finally:
        store.close()
    assert not (out / "_cdcflow").exists()
    assert _run("files", out, tmp_path / "s.db").reason == "end reached"
    assert orjson.loads((out / OWNER).read_bytes()) == {"pipeline": "files"}


_PIPELINE = textwrap.dedent('''
    import os

    import cdcflow as cf
    from cdcflow.testing import ScriptedChangeStream

    S, T0 = 1_000_000_000, 1_700_000_000 * 1_000_000_000
    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    for i in range(5):
        stream.write("A", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S // 10)
    pipeline = cf.Pipeline(os.environ["NAME"])
    (pipeline | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 2 * S, client=stream)
     | cf.ReadPartition() | cf.WriteFiles("../shared"))
''')


def test_the_cli_refuses_a_second_pipeline_in_one_line_with_exit_2(tmp_path: Path) -> None:
    """Each pipeline file has its own directory, so its own default store."""
    done = {}
    for name in ("kv-A", "kv-B"):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "pipeline.py"
        path.write_text(_PIPELINE)
        done[name] = subprocess.run(
            [sys.executable, "-m", "cdcflow", "run", str(path)],
            env={**os.environ, "NAME": name}, capture_output=True, text=True, timeout=120)
    assert done["kv-A"].returncode == 0, done["kv-A"].stderr[-2000:]
    refused = done["kv-B"]
    assert refused.returncode == 2, refused.stderr[-2000:]
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cdcflow: error: WriteFiles {tmp_path / 'shared'} holds the "
                           "output of pipeline 'kv-A', not 'kv-B'")
    assert "Traceback" not in refused.stderr


def _set_up(directory: Path) -> WriteFiles:
    """A sink of pipeline p writing ``directory``, set up as a run's is."""
    sink = WriteFiles(directory)
    sink.setup(SinkContext("p", "out", "/"))
    return sink


def test_two_runs_of_the_pipeline_on_two_stores_cannot_both_write_the_directory(
    tmp_path: Path,
) -> None:
    """The pipeline started again with another metadata store (the default one, say) is
    refused as having lost its progress; run with --reset as that says while the first
    run goes on, both wrote every change into the directory, without a word. Each run's
    sink was set up before the other committed; the first commit that finds a later batch
    committed by the other run is refused, and writes nothing."""
    from tests.transforms.test_files import _run_task

    first, other = _set_up(tmp_path), _set_up(tmp_path)
    first.commit(5, [_run_task(first, 5, "tok", [{"v": 1}], "a")])
    other.commit(9, [_run_task(other, 9, "tok", [{"v": 1}], "b")])  # the reset run's ids
    message = _run_task(first, 6, "tok", [{"v": 2}], "c")
    with pytest.raises(OutputConflictError,
                       match=r"batch 9 was committed here by another run while this run "
                             r"commits batch 6: two runs of pipeline 'p'"):
        first.commit(6, [message])
    assert len(list(tmp_path.glob("part-0000000005-*"))) == 1
    assert not list(tmp_path.glob("part-0000000006-*"))  # nothing of batch 6 is visible
    other.commit(10, [_run_task(other, 10, "tok", [{"v": 2}], "d")])  # the later goes on
    assert len(list(tmp_path.glob("part-0000000010-*"))) == 1


def test_two_runs_committing_one_batch_id_at_once_are_named_not_taken_for_a_bad_path(
    tmp_path: Path,
) -> None:
    """The reset run on another store plans its first batch at the id the first run is
    committing. Its commit, between the first run's look at the directory and its renames,
    swept the batch's temporary files, the first run's too: the first run said neither its
    temporary file nor its final one exists and blamed a path not shared by the executors
    (exit 1). It is refused as one of two runs writing the output (exit 2)."""
    from tests.transforms.test_files import _run_task

    first, other = _set_up(tmp_path), _set_up(tmp_path)
    first.commit(9, [_run_task(first, 9, "tok-a", [{"v": 1}], "a")])
    ours = _run_task(first, 10, "tok-a", [{"v": 2}], "b")
    theirs = _run_task(other, 10, "tok-b", [{"v": 9}], "c")
    looked = first._read_manifest

    def look_then_other_commits(batch_id: int) -> object:
        seen = looked(batch_id)
        if not first_looked:
            first_looked.append(batch_id)
            other.commit(10, [theirs])  # sweeps tmp/0000000010/, the first run's file too
        return seen

    first_looked: list[int] = []
    first._read_manifest = look_then_other_commits  # type: ignore[method-assign]
    with pytest.raises(OutputConflictError,
                       match=r"batch 10 was committed here by another run while this run "
                             r"commits batch 10: two runs of pipeline 'p'"):
        first.commit(10, [ours])


def test_two_runs_at_one_batch_id_are_named_when_the_other_committed_first(
    tmp_path: Path,
) -> None:
    """The other run committed the batch before this one looked, reading one of its
    partitions with the same slice: its manifest fits that file, and its commit swept
    this run's temporary file of the other partition. That is two runs, not a path the
    executors do not share."""
    from tests.transforms.test_files import _run_task

    first, other = _set_up(tmp_path), _set_up(tmp_path)
    first.commit(9, [_run_task(first, 9, "tok-a", [{"v": 1}], "a")])
    ours = [_run_task(first, 10, "tok-a", [{"v": 2}], "b"),
            _run_task(first, 10, "tok-b", [{"v": 3}], "b")]
    other.commit(10, [_run_task(other, 10, "tok-a", [{"v": 2}], "c")])
    with pytest.raises(OutputConflictError,
                       match=r"batch 10 was committed here by another run while this run "
                             r"commits batch 10: two runs of pipeline 'p'"):
        first.commit(10, ours)
