"""Snapshot then stream over ScriptedChangeStream: order, no gap, no overlap, exactly once.

The scripted stream knows each table's contents at any instant (its ``snapshot_rows`` plus
its transactions), so the ground truth of a snapshot at ``start - 1 ns`` is
``stream.rows_at(table, start - 1)``, and replaying the output (snapshot rows as upserts,
then the changes in output order) must give ``stream.rows_at(table, end)``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import cloudpickle
import orjson
import pytest

import cdcflow as cf
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner
from cdcflow.errors import ChangeStreamError, PipelineDefinitionError
from cdcflow.metadata import MemoryStore, SQLiteStore
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    DataChangeRecord,
    PartitionMetadata,
    PartitionState,
    is_snapshot_token,
    snapshot_table,
    snapshot_token,
)
from cdcflow.stream import RecordFilter
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, DetectPartitions, ReadPartition, WriteFiles

cloudpickle.register_pickle_by_value(sys.modules[__name__])

S = 1_000_000_000
T0 = 1_700_000_000 * S
START = T0 + 10 * S  # the stream is read from here; the snapshot is as of START - 1
END = T0 + 30 * S  # exclusive
ROWS = 2_500  # more than two chunks of 1000 rows


def shop(rows: int = ROWS, seed: int = 3) -> ScriptedChangeStream:
    """Two tables with rows at the origin, changed before and after START, with splits
    and merges after it; key 1 of Singers is deleted right at START, key 2 just before."""
    rng = random.Random(seed)
    s = ScriptedChangeStream(
        "S", partitions=2, buckets=32, origin=T0,
        snapshot_rows={
            "Singers": [({"SingerId": i}, {"Name": f"s{i}", "Rank": i % 7})
                        for i in range(rows)],
            "Albums": [({"AlbumId": i, "SingerId": i % 50}, {"Title": f"a{i}"})
                       for i in range(rows // 10)],
        },
    )
    s.split("p0", at=START + 3 * S, into=["a", "b"])
    s.merge(["b", "p1"], at=START + 9 * S, into="m")
    s.write("Singers", {"SingerId": 2}, "DELETE", at=START - 1)
    s.write("Singers", {"SingerId": 1}, "DELETE", at=START)
    for i in range(400):
        at = T0 + rng.randrange(0, 29 * S)
        key = rng.randrange(rows + 100)
        kind = rng.choice(["INSERT", "UPDATE", "UPDATE", "DELETE"])
        values = {} if kind == "DELETE" else {"Name": f"n{i}", "Rank": i % 5}
        s.write("Singers", {"SingerId": key}, kind, values, at=at)
    return s


def pipeline(
    stream: Any, *sinks: Any, name: str = "snap", snapshot: Any = True, **source: Any
) -> cf.Pipeline:
    p = cf.Pipeline(name)
    pc = p | DetectPartitions(stream="S", start_at=START, end_at=END - 1, client=stream,
                              snapshot=snapshot, **source)
    pc = pc | ReadPartition(heartbeat="500ms")
    for sink in sinks:
        pc | sink
    return p


def run(runner: Runner, p: cf.Pipeline, store: Any = None,
        listener: EngineListener | None = None, **options: Any) -> Any:
    opts = {"max_batch_span": 2.0, "batch_interval": 0.0, "batch_retries": 0, **options}
    return Engine(p, store or MemoryStore(), runner, RunOptions(**opts), listener).run()


def _row_key(r: DataChangeRecord, keys: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    return r.table_name, tuple(sorted(keys.items()))


def replay(records: list[DataChangeRecord]) -> dict[tuple[str, tuple[Any, ...]], dict[str, Any]]:
    """Apply the output in order: snapshot rows and INSERTs set a row, UPDATEs merge into
    it, DELETEs remove it (what a consumer of the output does)."""
    state: dict[tuple[str, tuple[Any, ...]], dict[str, Any]] = {}
    for r in records:
        for m in r.mods:
            key = _row_key(r, dict(m.keys))
            if r.mod_type == "DELETE":
                state.pop(key, None)
            elif r.mod_type == "INSERT" or key not in state:
                state[key] = {**m.new_values, **m.keys}
            else:
                state[key].update(m.new_values)
    return state


def truth(stream: ScriptedChangeStream, at: int, tables: tuple[str, ...] = ("Albums", "Singers")
          ) -> dict[tuple[str, tuple[Any, ...]], dict[str, Any]]:
    out = {}
    for table in tables:
        keys = {"Singers": ("SingerId",), "Albums": ("AlbumId", "SingerId")}[table]
        for row in stream.rows_at(table, at):
            out[(table, tuple(sorted((k, row[k]) for k in keys)))] = row
    return out


def test_snapshot_rows_come_first_and_with_the_changes_give_the_final_state(
    runner: Runner,
) -> None:
    s = shop()
    out = Collect()
    summary = run(runner, pipeline(s, out))
    assert summary.reason == "end reached"
    records: list[DataChangeRecord] = out.items
    flags = [r.is_snapshot for r in records]
    first_change = flags.index(False)
    assert all(flags[:first_change]) and not any(flags[first_change:])

    snap = records[:first_change]
    assert {r.partition_token for r in snap} == {"snapshot/Albums", "snapshot/Singers"}
    assert all(r.mod_type == "INSERT" and r.commit_timestamp.ns == START - 1 for r in snap)
    assert all(r.server_transaction_id == "snapshot" for r in snap)
    singers = sorted((r for r in snap if r.table_name == "Singers"),
                     key=lambda r: r.record_sequence)
    assert [r.record_sequence for r in singers] == ["00000000", "00000001", "00000002"]
    assert [len(r.mods) for r in singers] == [1000, 1000, len(s.rows_at("Singers", START - 1))
                                              - 2000]
    assert [r.is_last_record_in_transaction_in_partition for r in singers] == [
        False, False, True]

    # The snapshot is the database as of START - 1 ns: key 2 (deleted before) is gone, key 1
    # (deleted at START) is there, and its delete comes as a change.
    assert replay(snap) == truth(s, START - 1)
    in_snapshot = {key for key in replay(snap) if key[0] == "Singers"}
    assert ("Singers", (("SingerId", 1),)) in in_snapshot
    assert ("Singers", (("SingerId", 2),)) not in in_snapshot
    # No overlap, no gap: the changes are exactly those committed from START on ...
    changes = records[first_change:]
    assert Counter(_ident(r) for r in changes) == Counter(
        _ident(r) for r in s.expected_records(START, END)
    )
    # ... and snapshot plus changes replay to the database at the end.
    assert replay(records) == truth(s, END)


def _ident(r: DataChangeRecord) -> tuple[int, str, str, str]:
    return r.commit_timestamp.ns, r.server_transaction_id, r.partition_token, r.record_sequence


class _Crash(Exception):
    pass


class CrashAfterSinks(EngineListener):
    """Raises once the sinks committed batch ``batch``, before the store commits it."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_sinks_committed(self, batch_id: int) -> None:
        if batch_id == self.batch:
            raise _Crash(batch_id)


def _lines(directory: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for path in sorted(directory.glob("part-*"))
        for line in path.read_bytes().splitlines()
    ]


@pytest.mark.parametrize("batch", [1, 2])
def test_a_crash_between_sink_and_store_commit_replays_exactly_once(
    runner: Runner, tmp_path: Path, batch: int
) -> None:
    s = shop(rows=300)
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    run(runner, pipeline(s, WriteFiles(clean)))
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path / 'state.db'}")
    with pytest.raises(_Crash):
        run(runner, pipeline(s, WriteFiles(crashed)), store, CrashAfterSinks(batch))
    pending = store.pending_plan("snap")
    assert pending is not None and pending.batch_id == batch
    if batch == 1:  # the snapshot batch: nothing is finished in the store yet
        assert {sl.token for sl in pending.slices} == {"snapshot/Albums", "snapshot/Singers"}
    summary = run(runner, pipeline(s, WriteFiles(crashed)), store)
    assert summary.reason == "end reached"
    store.close()
    got = _lines(crashed)
    assert got == _lines(clean)
    snapshot_rows = sum(len(r["mods"]) for r in got if r["is_snapshot"])
    assert snapshot_rows == len(s.rows_at("Singers", START - 1)) + len(
        s.rows_at("Albums", START - 1))
    idents = Counter((r["commit_timestamp"], r["server_transaction_id"],
                      r["partition_token"], r["record_sequence"]) for r in got)
    assert max(idents.values()) == 1


def test_a_failed_snapshot_read_commits_nothing_and_the_replay_reads_every_table_once(
    runner: Runner,
) -> None:
    store = MemoryStore()
    failing = shop(rows=300).fail_reads(1, after_records=0, error=ChangeStreamError,
                                       token="snapshot/Singers")
    with pytest.raises(Exception, match="scripted failure"):
        run(runner, pipeline(failing, Collect()), store)
    # no sink had the batch: its plan was not written, and the next run plans it again
    assert store.pending_plan("snap") is None and store.last_batch_id("snap") == 0
    assert {p.token: p.state for p in store.partitions("snap")}["snapshot/Albums"] == (
        PartitionState.CREATED
    )
    s = shop(rows=300)  # the same script, without the failure
    out = Collect()
    assert run(runner, pipeline(s, out), store).reason == "end reached"
    snap = [r for r in out.items if r.is_snapshot]
    assert Counter(r.table_name for r in snap) == {"Singers": 1, "Albums": 1}
    assert replay(out.items) == truth(s, END)


def test_a_resumed_run_reads_only_the_tables_whose_snapshot_is_not_committed() -> None:
    from cdcflow.runners.in_memory import InMemoryRunner

    s = shop(rows=300)
    store = MemoryStore()
    p = pipeline(s, out := Collect())
    # What a run leaves when Albums' snapshot committed and Singers' did not.
    albums = PartitionMetadata(
        token=snapshot_token("Albums"), parent_tokens=(), start=START - 1, end=START,
        watermark=START, state=PartitionState.FINISHED, created_at=1, finished_at=2,
    )
    singers = PartitionMetadata(
        token=snapshot_token("Singers"), parent_tokens=(), start=START - 1, end=START,
        watermark=START - 1, state=PartitionState.CREATED, created_at=1,
    )
    root = PartitionMetadata(
        token=INITIAL_PARTITION_TOKEN, parent_tokens=(albums.token, singers.token),
        start=START, end=END, watermark=START, state=PartitionState.CREATED, created_at=1,
    )
    store.insert_partitions("snap", [albums, singers, root])
    store.set_source("snap", json.dumps(
        p.transform(p.labels_of_kind("Source")[0]).definition(), sort_keys=True))
    assert run(InMemoryRunner(), p, store).reason == "end reached"
    snap = [r for r in out.items if r.is_snapshot]
    assert {r.table_name for r in snap} == {"Singers"}
    assert replay(out.items) == truth(s, END, ("Singers",))


def test_the_source_filters_apply_to_snapshot_rows() -> None:
    from cdcflow.runners.in_memory import InMemoryRunner

    s = shop(rows=30)
    out = Collect()
    p = pipeline(s, out, tables=["Singers"], columns={"Singers": ["Name"]}, typed=False)
    run(InMemoryRunner(), p)
    snap = [r for r in out.items if r.is_snapshot]
    assert {r.table_name for r in snap} == {"Singers"}  # snapshot=True: the tables read
    assert [c.name for c in snap[0].column_types] == ["SingerId", "Name"]
    mod = snap[0].mods[0]
    assert set(mod.new_values) == {"Name"} and isinstance(mod.keys["SingerId"], str)  # wire

    none = Collect()
    run(InMemoryRunner(), pipeline(s, none, name="updates", mod_types=["UPDATE"]))
    assert none.items and not any(r.is_snapshot for r in none.items)


def test_partitions_of_a_first_run_and_their_collection() -> None:
    from cdcflow.runners.in_memory import InMemoryRunner

    s = shop(rows=30)
    store = MemoryStore()
    run(InMemoryRunner(), pipeline(s, Collect(), snapshot=["Singers"]), store, max_batches=1)
    parts = {p.token: p for p in store.partitions("snap")}
    assert parts["snapshot/Singers"].state == PartitionState.FINISHED
    assert parts[INITIAL_PARTITION_TOKEN].parent_tokens == ("snapshot/Singers",)
    assert parts[INITIAL_PARTITION_TOKEN].state == PartitionState.CREATED
    assert "snapshot/Albums" not in parts
    run(InMemoryRunner(), pipeline(s, Collect(), snapshot=["Singers"]), store, gc_ttl=0)
    assert not any(is_snapshot_token(t) for t in (p.token for p in store.partitions("snap")))


def test_a_changed_snapshot_setting_warns_or_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from cdcflow.runners.in_memory import InMemoryRunner

    s = shop(rows=10)
    store = MemoryStore()
    run(InMemoryRunner(), pipeline(s, Collect(), snapshot=["Singers"]), store, max_batches=1)
    with pytest.raises(PipelineDefinitionError, match=r"snapshot 'Singers' -> '\*'"):
        run(InMemoryRunner(), pipeline(s, Collect()), store, max_batches=1, strict=True)
    with caplog.at_level(logging.WARNING, logger="cdcflow.engine"):
        run(InMemoryRunner(), pipeline(s, Collect(), snapshot=False), store, max_batches=1)
    assert "snapshot 'Singers' -> None" in caplog.text


def test_snapshot_options_are_checked() -> None:
    s = shop(rows=10)
    with pytest.raises(PipelineDefinitionError, match="pass True or a list of table names"):
        DetectPartitions(stream="S", client=s, snapshot="Singers")  # type: ignore[arg-type]
    with pytest.raises(PipelineDefinitionError, match="'Albums' is not read"):
        DetectPartitions(stream="S", client=s, snapshot=["Albums"], tables=["Singers"])
    with pytest.raises(PipelineDefinitionError, match="name at least one table"):
        DetectPartitions(stream="S", client=s, snapshot=[])

    class Plain:
        def describe_stream(self, stream: str) -> object: ...
        def read(self, query: object) -> object: ...
        def close(self) -> None: ...

    with pytest.raises(PipelineDefinitionError, match=r"Plain.*cannot read tables"):
        DetectPartitions(stream="S", client=Plain(), snapshot=True)  # type: ignore[arg-type]
    source = DetectPartitions(stream="S", client=s, snapshot=["Singers", "Singers"])
    assert source.snapshot == ("Singers",)
    assert source.definition()["snapshot"] == "Singers"
    assert "snapshot" not in DetectPartitions(stream="S", client=s).definition()


def test_a_table_the_stream_does_not_track_stops_the_first_run() -> None:
    from cdcflow.runners.in_memory import InMemoryRunner

    with pytest.raises(PipelineDefinitionError, match=r"does not track table 'Nope' \(its "
                       r"tables: Albums, Singers\)"):
        run(InMemoryRunner(), pipeline(shop(rows=10), Collect(), snapshot=["Nope"]))


def test_scripted_snapshot_matches_the_ground_truth_and_its_view_shapes_it() -> None:
    s = shop(rows=20)
    records = list(s.snapshot("S", "Singers", START - 1))
    assert replay(records) == truth(s, START - 1, ("Singers",))
    assert all(snapshot_table(r.partition_token) == "Singers" for r in records)
    view = s.with_options(typed=False, filter=RecordFilter.build(columns={"Singers": ["Rank"]}))
    shaped = list(view.snapshot("S", "Singers", START - 1))
    assert set(shaped[0].mods[0].new_values) == {"Rank"}
    assert shaped[0].mods[0].new_values["Rank"] == str(records[0].mods[0].new_values["Rank"])
    assert list(s.snapshot("S", "Nothing", START)) == []
    with pytest.raises(ValueError, match="twice"):
        ScriptedChangeStream("S", snapshot_rows={"T": [(1, {}), (1, {"v": 2})]})


def test_batch_stats_count_snapshot_records() -> None:
    from cdcflow.runners.in_memory import InMemoryRunner

    seen: list[BatchStats] = []

    class Listen(EngineListener):
        def on_batch(self, stats: BatchStats) -> None:
            seen.append(stats)

    s = shop(rows=50)
    run(InMemoryRunner(), pipeline(s, Collect()), listener=Listen(), max_batches=1)
    assert seen[0].records == 2  # one record (chunk) per table
    assert seen[0].slices == 2


CRASH_SCRIPT = Path(__file__).with_name("snapshot_crash_pipeline.py")


def _crash_run(state: Path, kill: str | None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(CRASH_SCRIPT), str(state), *([kill] if kill else [])]
    return subprocess.run(args, capture_output=True, text=True, timeout=180, check=False)


@pytest.mark.parametrize("kills", [
    ["sinks:1"], ["task:2", "sinks:2"], ["task:3", "task:9"], ["sinks:3", "task:3"],
])
def test_sigkilled_runs_resume_the_snapshot_without_loss_or_duplicates(
    tmp_path: Path, kills: list[str]
) -> None:
    for kill in kills:
        killed = _crash_run(tmp_path, kill)
        assert killed.returncode == -signal.SIGKILL, (kill, killed.stderr[-3000:])
    done = _crash_run(tmp_path, None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "end reached"

    spec = importlib.util.spec_from_file_location("snapshot_crash_pipeline", CRASH_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    s = module.stream()
    rows = _lines(tmp_path / "out")
    snap = [r for r in rows if r["is_snapshot"]]
    got = Counter(
        (r["table_name"], orjson.dumps(m["keys"], option=orjson.OPT_SORT_KEYS))
        for r in snap for m in r["mods"]
    )
    want = Counter(
        (table, orjson.dumps({k: row[k] for k in keys}, option=orjson.OPT_SORT_KEYS))
        for table, keys in (("A", ("id",)), ("B", ("k",)))
        for row in s.rows_at(table, module.START - 1)
    )
    assert got == want  # every row of the snapshot once
    changes = Counter(
        (r["commit_timestamp"], r["server_transaction_id"], r["partition_token"],
         r["record_sequence"]) for r in rows if not r["is_snapshot"]
    )
    assert changes == Counter(
        (r.commit_timestamp.rfc3339(), r.server_transaction_id, r.partition_token,
         r.record_sequence) for r in s.expected_records(module.START, module.END)
    )
