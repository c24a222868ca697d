"""Tasks: one slice read, claimed and pushed through the fused chain."""

from __future__ import annotations

import os
import pickle
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import cdcflow as cf
from cdcflow.engine.quota import approx_size
from cdcflow.engine.runner import Task, TaskResult
from cdcflow.engine.task import FailedElement, TaskProgram, execute_task, run_task
from cdcflow.errors import PipelineStopped
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    ChangeRecord,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    MoveInEvent,
    PartitionEndRecord,
    PartitionEventRecord,
    PartitionStartRecord,
    Slice,
)
from cdcflow.policy import ErrorPolicy
from cdcflow.stream import ChangeStreamQuery, StreamInfo
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import (
    Collect,
    DetectPartitions,
    DoFn,
    Filter,
    FlatMap,
    Map,
    ParDo,
    ReadPartition,
    Sink,
    WriteFiles,
)
from cdcflow.transforms.base import SinkContext, SinkWriter, WriterContext

S = 1_000_000_000
T0 = 1_700_000_000 * S


def scripted(n: int = 10) -> ScriptedChangeStream:
    s = ScriptedChangeStream("S", partitions=1, buckets=8, origin=T0)
    for i in range(n):
        s.write("T", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S)
    return s


def program(
    client: Any,
    *steps: Any,
    policy: ErrorPolicy | None = None,
    read: ReadPartition | None = None,
) -> TaskProgram:
    p = cf.Pipeline("t", error_policy=policy)
    pc = p | DetectPartitions(stream="S", start_at=T0, client=client) | (read or ReadPartition())
    for step in steps:
        if isinstance(step, list):  # branches: each a list of steps off the same input
            for branch in step:
                b = pc
                for t in branch:
                    b = b | t
        else:
            pc = pc | step
    p.validate()
    return TaskProgram.from_pipeline(p)


def task(token: str, start: int, end: int, batch: int = 1) -> Task:
    return Task("t", batch, Slice(token, start, end))


def items(result: TaskResult, label: str = "Collect") -> list[Any]:
    return list(result.sink_messages.get(label) or [])


def vals(records: Iterable[Any]) -> list[int]:
    return [r.mods[0].new_values["v"] for r in records]


def test_slice_reads_half_open_range_and_commits_its_end() -> None:
    prog = program(scripted(), Collect())
    result = run_task(prog, task("p0", T0 + 2 * S, T0 + 5 * S))
    assert vals(items(result)) == [1, 2, 3]  # commit times 2 s, 3 s, 4 s; 5 s is the next slice
    assert result.position == T0 + 5 * S and not result.ended and result.children == ()
    assert result.records == 3 and result.bytes > 0
    assert vals(items(run_task(prog, task("p0", T0 + 5 * S, T0 + 6 * S)))) == [4]


def test_root_partition_finishes_at_its_start_with_every_child() -> None:
    s = ScriptedChangeStream("S", partitions=3, origin=T0)
    result = run_task(program(s, Collect()), task(INITIAL_PARTITION_TOKEN, T0, T0 + 10 * S))
    assert result.ended and result.position == T0
    assert [c.token for c in result.children] == ["p0", "p1", "p2"]
    for child in result.children:
        # the root query's records list no parents: the lifecycle makes the root the parent
        assert child.parent_tokens == ()
        assert child.start == T0
    assert result.sink_messages == {}  # no writer opened without data


def test_split_finishes_the_partition_at_the_child_record() -> None:
    s = scripted().split("p0", at=T0 + 3 * S + 1, into=["a", "b"])
    result = run_task(program(s, Collect()), task("p0", T0, T0 + 100 * S))
    assert vals(items(result)) == [0, 1, 2]
    assert result.ended and result.position == T0 + 3 * S + 1
    assert [(c.token, c.parent_tokens, c.start) for c in result.children] == [
        ("a", ("p0",), T0 + 3 * S + 1),
        ("b", ("p0",), T0 + 3 * S + 1),
    ]


def test_merge_child_lists_every_parent() -> None:
    s = ScriptedChangeStream("S", partitions=2, origin=T0).merge(["p0", "p1"], at=T0 + S, into="m")
    result = run_task(program(s, Collect()), task("p1", T0, T0 + 5 * S))
    assert [(c.token, c.parent_tokens) for c in result.children] == [("m", ("p0", "p1"))]


class _MutableClient:
    """A MUTABLE_KEY_RANGE partition, built in code (the emulator lacks the mode)."""

    def __init__(self, records: Sequence[ChangeRecord]) -> None:
        self.records = list(records)

    def describe_stream(self, stream: str) -> StreamInfo:
        return StreamInfo(stream, partition_mode="MUTABLE_KEY_RANGE")

    def read(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        return iter(self.records)

    def close(self) -> None:
        return None


def _data(token: str, at: int, v: int) -> DataChangeRecord:
    return DataChangeRecord(
        partition_token=token, commit_timestamp=at, record_sequence="00000000",
        server_transaction_id=f"t{v}", is_last_record_in_transaction_in_partition=True,
        table_name="T", column_types=(), mods=(Mod({"id": v}, {"v": v}),), mod_type="INSERT",
        value_capture_type="NEW_ROW", number_of_records_in_transaction=1,
        number_of_partitions_in_transaction=1,
    )


def test_mutable_key_range_records() -> None:
    client = _MutableClient([
        _data("k", T0 + 1, 1),
        PartitionEventRecord("k", T0 + 2, "00000001", move_in_events=(MoveInEvent("x"),)),
        PartitionStartRecord("k", T0 + 3, "00000002", ("k2", "k3")),
        _data("k", T0 + 4, 2),
        PartitionEndRecord("k", T0 + 5, "00000003"),
    ])
    result = run_task(program(client, Collect()), task("k", T0, T0 + S))
    assert vals(items(result)) == [1, 2]  # the event record is not emitted downstream
    assert result.ended and result.position == T0 + 5
    assert [(c.token, c.parent_tokens, c.start) for c in result.children] == [
        ("k2", (), T0 + 3),
        ("k3", (), T0 + 3),
    ]


def test_mutable_key_range_root_finishes_at_its_start_record() -> None:
    client = _MutableClient([PartitionStartRecord(INITIAL_PARTITION_TOKEN, T0, "0", ("a", "b"))])
    result = run_task(program(client, Collect()), task(INITIAL_PARTITION_TOKEN, T0, T0 + S))
    assert result.ended and result.position == T0
    assert [(c.token, c.parent_tokens) for c in result.children] == [("a", ()), ("b", ())]


def test_branching_chain_fans_out_and_each_sink_gets_its_elements() -> None:
    evens, odds = Collect(), Collect()
    prog = program(
        scripted(6),
        Map(lambda r: r.mods[0].new_values["v"]),
        [
            ["evens" >> Filter(lambda v: v % 2 == 0), "E" >> evens],
            ["odds" >> Filter(lambda v: v % 2 == 1), "twice" >> FlatMap(lambda v: [v, v]),
             "O" >> odds],
        ],
    )
    result = run_task(prog, task("p0", T0, T0 + 100 * S))
    assert items(result, "E") == [0, 2, 4]
    assert items(result, "O") == [1, 1, 3, 3, 5, 5]


class _Lifecycle(DoFn):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def setup(self) -> None:
        self.calls.append("setup")

    def process(self, element: Any) -> Iterable[Any]:
        self.calls.append("process")
        yield list(self.calls)

    def teardown(self) -> None:
        self.calls.append("teardown")


def test_dofn_setup_once_per_task_and_tasks_do_not_share_instances() -> None:
    prog = program(scripted(3), ParDo(_Lifecycle()), Collect())
    first = items(run_task(prog, task("p0", T0, T0 + 100 * S)))
    again = items(run_task(prog, task("p0", T0, T0 + 100 * S)))
    assert first == again == [
        ["setup", "process"],
        ["setup", "process", "process"],
        ["setup", "process", "process", "process"],
    ]


def test_execute_task_round_trips_bytes_and_caches_the_program() -> None:
    prog_bytes = cloudpickle.dumps(program(scripted(3), Collect()))
    out = [
        pickle.loads(execute_task(prog_bytes, pickle.dumps(task("p0", T0, T0 + 100 * S))))
        for _ in range(2)
    ]
    assert vals(items(out[0])) == vals(items(out[1])) == [0, 1, 2]
    assert items(out[0])[0].commit_timestamp.ns == T0 + S
    from cdcflow.engine import task as task_module

    cached = [p for p in task_module._programs.values() if p.pipeline == "t"]
    assert cached  # the unpickled program is kept for the next task of the run


def test_a_result_the_standard_pickler_refuses_travels_by_cloudpickle() -> None:
    """Results are pickled with the standard pickler (faster); one it refuses (a sink
    message of a class made inside a function) goes by cloudpickle, as before."""

    class Made:  # a local class: the standard pickler cannot name it
        def __init__(self, n: int) -> None:
            self.n = n

    class Counting(Sink):
        def open_writer(self, ctx: WriterContext) -> Any:
            class W:
                n = 0

                def write(self, element: Any) -> None:
                    self.n += 1

                def close(self) -> Any:
                    return Made(self.n)

                def abort(self) -> None:
                    return None

            return W()

        def commit(self, batch_id: int, messages: Sequence[Any]) -> None:
            return None

    prog_bytes = cloudpickle.dumps(program(scripted(3), Counting()))
    with pytest.raises((pickle.PicklingError, AttributeError)):
        pickle.dumps(Made(1))
    result = pickle.loads(execute_task(prog_bytes, pickle.dumps(task("p0", T0, T0 + 100 * S))))
    (message,) = result.sink_messages.values()
    assert type(message).__name__ == "Made" and message.n == 3


def test_tasks_given_one_program_object_hash_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from cdcflow.engine import task as task_module

    hashed: list[int] = []
    sha256 = task_module.hashlib.sha256

    def counting(data: bytes) -> Any:
        hashed.append(len(data))
        return sha256(data)

    monkeypatch.setattr(task_module.hashlib, "sha256", counting)
    prog_bytes = cloudpickle.dumps(program(scripted(3), Collect()))
    for _ in range(5):  # the in-memory runner passes one bytes object to every task
        execute_task(prog_bytes, pickle.dumps(task("p0", T0, T0 + 100 * S)))
    assert len(hashed) == 1
    execute_task(bytes(bytearray(prog_bytes)), pickle.dumps(task("p0", T0, T0 + 100 * S)))
    assert len(hashed) == 2  # equal bytes in another object: found by their hash


class _AttemptSink(Sink):
    def open_writer(self, ctx: WriterContext) -> SinkWriter:
        return _AttemptWriter(ctx)

    def commit(self, batch_id: int, messages: Sequence[Any]) -> None:
        return None


class _AttemptWriter:
    def __init__(self, ctx: WriterContext) -> None:
        self.ctx = ctx

    def write(self, element: Any) -> None:
        return None

    def close(self) -> Any:
        return self.ctx

    def abort(self) -> None:
        return None


def test_writer_context_names_the_slice_and_a_unique_attempt() -> None:
    prog = program(scripted(2), _AttemptSink())
    ctxs = [run_task(prog, task("p0", T0, T0 + 9 * S, batch=4)).sink_messages["_AttemptSink"]
            for _ in range(2)]
    assert ctxs[0].batch_id == 4 and ctxs[0].partition_token == "p0"
    assert (ctxs[0].slice_start, ctxs[0].slice_end) == (T0, T0 + 9 * S)
    assert ctxs[0].attempt != ctxs[1].attempt


def _boom_at_3(r: Any) -> Any:
    if r.mods[0].new_values["v"] == 3:
        raise ValueError("bad row")
    return r


def test_failure_aborts_writers_and_leaves_no_files(tmp_path: Path) -> None:
    files = WriteFiles(tmp_path / "out")
    files.setup(SinkContext("t", "WriteFiles", str(tmp_path)))
    prog = program(scripted(), Map(_boom_at_3), files, policy=ErrorPolicy(retries=0))
    with pytest.raises(PipelineStopped) as info:
        run_task(prog, task("p0", T0, T0 + 100 * S))
    text = str(info.value)
    assert "'Map(_boom_at_3)'" in text and "partition p0" in text and "bad row" in text
    assert "ValueError" in text and "attempt" in text
    # no file (the directory of the batch's attempts stays for the driver's abort to remove)
    assert [f for _, _, names in os.walk(tmp_path / "out") for f in names] == []


def test_skip_sends_failed_elements_to_the_dead_letter_sink() -> None:
    dead = "failed" >> Collect()
    policy = ErrorPolicy(retries=1, backoff=0.001, then="skip", dead_letter=dead)  # type: ignore[arg-type]
    result = run_task(program(scripted(5), Map(_boom_at_3), Collect(), policy=policy),
                      task("p0", T0, T0 + 100 * S))
    assert vals(items(result)) == [0, 1, 2, 4]
    (failed,) = items(result, "failed")
    assert isinstance(failed, FailedElement)
    assert failed.label == "Map(_boom_at_3)" and "bad row" in failed.error
    assert failed.partition_token == "p0" and failed.commit_timestamp.ns == T0 + 4 * S
    assert failed.element.mods[0].new_values["v"] == 3
    assert result.counters["skipped"] == 1 and result.counters["retries"] == 1


class _Flaky(DoFn):
    """Fails the first two calls for every element (state lives in the task's copy)."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def process(self, element: Any) -> Iterable[Any]:
        v = element.mods[0].new_values["v"]
        self.seen[v] = self.seen.get(v, 0) + 1
        if self.seen[v] <= 2:
            raise ConnectionError("flaky")
        yield v


def test_retries_with_backoff_then_succeed() -> None:
    policy = ErrorPolicy(retries=2, backoff=0.001, max_backoff=0.002)
    result = run_task(program(scripted(4), ParDo(_Flaky()), Collect(), policy=policy),
                      task("p0", T0, T0 + 100 * S))
    assert items(result) == [0, 1, 2, 3]
    assert result.counters["retries"] == 8


class _FailingWriteSink(Sink):
    def open_writer(self, ctx: WriterContext) -> SinkWriter:
        return _FailingWriter()

    def commit(self, batch_id: int, messages: Sequence[Any]) -> None:
        return None


class _FailingWriter:
    def __init__(self) -> None:
        self.items: list[Any] = []

    def write(self, element: Any) -> None:
        if element == 2:
            raise OSError("disk full")
        self.items.append(element)

    def close(self) -> Any:
        return self.items

    def abort(self) -> None:
        return None


def test_sink_write_errors_follow_the_policy() -> None:
    dead = "dl" >> Collect()
    skip = ErrorPolicy(retries=0, then="skip", dead_letter=dead)  # type: ignore[arg-type]
    steps = (Map(lambda r: r.mods[0].new_values["v"]), "out" >> _FailingWriteSink())
    result = run_task(program(scripted(4), *steps, policy=skip), task("p0", T0, T0 + 100 * S))
    assert result.sink_messages["out"] == [0, 1, 3]
    assert [f.label for f in items(result, "dl")] == ["out"]
    with pytest.raises(PipelineStopped, match=r"'out' failed.*disk full"):
        run_task(program(scripted(4), *steps, policy=ErrorPolicy(retries=0)),
                 task("p0", T0, T0 + 100 * S))


def _jitter(r: Any) -> int:
    time.sleep(random.random() * 0.003)
    return int(r.mods[0].new_values["v"])


@pytest.mark.parametrize("max_bytes", [64 << 20, 1])
def test_max_inflight_keeps_record_order(max_bytes: int) -> None:
    s = scripted(60)
    read = ReadPartition(heartbeat="100ms", max_inflight=8, max_inflight_bytes=max_bytes)
    result = run_task(program(s, Map(_jitter), Collect(), read=read),
                      task("p0", T0, T0 + 100 * S))
    assert items(result) == list(range(60))
    assert result.position == T0 + 100 * S


def test_max_inflight_failure_is_raised_in_record_order() -> None:
    read = ReadPartition(max_inflight=4)
    prog = program(scripted(20), Map(_jitter), Map(_boom_at_3_v), Collect(), read=read,
                   policy=ErrorPolicy(retries=0))
    with pytest.raises(PipelineStopped, match="bad row") as info:
        run_task(prog, task("p0", T0, T0 + 100 * S))
    assert "ValueError: bad row" in str(info.value)


def _boom_at_3_v(v: int) -> int:
    if v == 3:
        raise ValueError("bad row")
    return v


def test_heartbeats_only_advance_progress() -> None:
    s = ScriptedChangeStream("S", origin=T0)
    prog = program(s, Collect(), read=ReadPartition(heartbeat="1s"))
    result = run_task(prog, task("p0", T0, T0 + 10 * S))
    assert result.records == 0 and result.position == T0 + 10 * S and not result.ended
    assert all(not isinstance(x, HeartbeatRecord) for x in items(result))



class _Measured:
    """A client whose reads say each record's size (as the Spanner reader's do)."""

    def __init__(self, inner: ScriptedChangeStream, size: int) -> None:
        self.inner = inner
        self.size = size

    def describe_stream(self, stream: str) -> StreamInfo:
        return self.inner.describe_stream(stream)

    def close(self) -> None:
        self.inner.close()

    def read(self, query: ChangeStreamQuery) -> Any:
        outer = self

        class Reading:
            def __iter__(self) -> Any:
                return iter(outer.inner.read(query))

            def size_of(self, record: ChangeRecord) -> int | None:
                return outer.size if isinstance(record, DataChangeRecord) else None

        return Reading()


def test_a_reader_that_measures_its_records_sets_their_size() -> None:
    s = scripted(4)
    result = run_task(program(_Measured(s, 12_345), Collect()), task("p0", T0, T0 + 100 * S))
    assert result.records == 4 and result.bytes == 4 * 12_345
    plain = run_task(program(s, Collect()), task("p0", T0, T0 + 100 * S))
    assert plain.bytes == sum(approx_size(r) for r in items(plain))
