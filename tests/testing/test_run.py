"""cdcflow.testing.run: one call runs a pipeline to its end on the memory runner with a
private store."""

from __future__ import annotations

import time

import pytest

import cdcflow as cf
import cdcflow.testing
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.errors import PipelineDefinitionError, UserInputError
from cdcflow.model import DataChangeRecord
from cdcflow.testing import ScriptedChangeStream

T0 = 1_700_000_000 * 10**9
MS = 1_000_000
END = T0 + 2_000 * MS


def stream_of(n: int = 30) -> ScriptedChangeStream:
    stream = ScriptedChangeStream("Orders", partitions=2, origin=T0)
    for i in range(n):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=T0 + (i + 1) * 50 * MS)
    stream.split("p0", at=T0 + 500 * MS, into=["a", "b"])
    stream.merge(["b", "p1"], at=T0 + 1_000 * MS, into="m")
    return stream


def build(
    stream: ScriptedChangeStream, out: cf.Collect, end_at: int | None = END, name: str = "t"
) -> cf.Pipeline:
    pipeline = cf.Pipeline(name)
    (pipeline
     | cf.ReadChangeStream(stream="Orders", start_at=T0, end_at=end_at, client=stream,
                           heartbeat="100ms")
     | out)
    return pipeline


def order(records: list[DataChangeRecord]) -> list[tuple[int, str, str, str]]:
    return sorted(
        (r.commit_timestamp.ns, r.server_transaction_id, r.partition_token, r.record_sequence)
        for r in records
    )


def test_runs_to_the_end_and_delivers_every_record_once() -> None:
    stream, out = stream_of(), cf.Collect()
    summary = cdcflow.testing.run(build(stream, out), max_batch_span="300ms")
    assert summary.reason == "end reached"
    assert summary.records == 30
    assert (summary.splits, summary.merges) == (1, 1)
    assert summary.batches > 1
    assert order(out.items) == order(stream.expected_records(T0, END + 1))


def test_each_call_has_a_private_store() -> None:
    stream = stream_of()
    first = cdcflow.testing.run(build(stream, cf.Collect()))
    out = cf.Collect()
    second = cdcflow.testing.run(build(stream, out))  # same name: a shared store would resume
    assert first.records == second.records == 30
    assert len(out.items) == 30


def test_no_end_is_refused_naming_the_fixes() -> None:
    pipeline = build(stream_of(), cf.Collect(), end_at=None)
    with pytest.raises(PipelineDefinitionError) as info:
        cdcflow.testing.run(pipeline)
    message = str(info.value)
    assert "has no end" in message
    assert "'ReadChangeStream/DetectPartitions' an end_at" in message
    assert "max_batches=N" in message and "duration=" in message


def test_a_limit_ends_a_pipeline_without_end_at() -> None:
    out = cf.Collect()
    summary = cdcflow.testing.run(build(stream_of(), out, end_at=None), max_batches=2,
                                  max_batch_span="200ms")
    assert summary.reason == "max batches"
    assert summary.batches == 2
    assert 0 < len(out.items) < 30


def test_no_pause_between_batches_by_default() -> None:
    # end_at a little ahead of the clock: the run follows the clock, one batch after
    # another without pause (thousands); with a 500ms interval it makes a few.
    class Count(EngineListener):
        def __init__(self) -> None:
            self.batches = 0

        def on_batch(self, stats: BatchStats) -> None:
            self.batches += 1

    def run(**options: object) -> int:
        origin = time.time_ns()
        stream = ScriptedChangeStream("Orders", origin=origin)
        stream.write("Orders", 1, "INSERT", {"n": 1}, at=origin + 10 * MS)
        pipeline = cf.Pipeline("clock")
        (pipeline
         | cf.ReadChangeStream(stream="Orders", start_at=origin, end_at=origin + 1_200 * MS,
                               client=stream)
         | cf.Collect())
        count = Count()
        summary = cdcflow.testing.run(pipeline, listener=count, **options)
        assert summary.reason == "end reached" and summary.records == 1
        return count.batches

    assert run() >= 20
    assert run(batch_interval="500ms") <= 5


@pytest.mark.parametrize("key", ["runner", "metadata", "on_engine"])
def test_runner_and_store_are_not_the_callers_choice(key: str) -> None:
    with pytest.raises(UserInputError, match=f"chooses {key} itself.*pipeline.run"):
        cdcflow.testing.run(build(stream_of(), cf.Collect()), **{key: None})


def test_options_are_checked_like_pipeline_run() -> None:
    pipeline = build(stream_of(), cf.Collect())
    with pytest.raises(UserInputError, match=r"unknown option 'speed'.*workers"):
        cdcflow.testing.run(pipeline, speed=11)
    summary = cdcflow.testing.run(pipeline, workers=1, max_batch_span=0.5)
    assert summary.reason == "end reached"


def test_an_invalid_pipeline_fails_before_the_end_check() -> None:
    with pytest.raises(PipelineDefinitionError, match="is empty"):
        cdcflow.testing.run(cf.Pipeline("empty"))


def test_what_is_not_a_pipeline_is_named() -> None:
    with pytest.raises(UserInputError, match="takes a Pipeline, got str 'x'"):
        cdcflow.testing.run("x")  # type: ignore[arg-type]
