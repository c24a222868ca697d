"""The change-stream source: ReadChangeStream, the composite of DetectPartitions and
ReadPartition."""

from __future__ import annotations

import pytest

import cdcflow as cf
import cdcflow.testing
import cdcflow.transforms
from cdcflow.errors import PipelineDefinitionError
from cdcflow.model import DataChangeRecord, Timestamp
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, DetectPartitions, ReadChangeStream, ReadPartition

DB = "projects/p/instances/i/databases/shop"
T0 = 1_700_000_000 * 10**9
MS = 1_000_000


def scripted() -> ScriptedChangeStream:
    stream = ScriptedChangeStream("Orders", partitions=2, origin=T0)
    for i in range(12):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=T0 + (i + 1) * 50 * MS)
    stream.split("p0", at=T0 + 200 * MS, into=["a", "b"])
    stream.merge(["b", "p1"], at=T0 + 400 * MS, into="m")
    return stream


def order(records: list[DataChangeRecord]) -> list[tuple[int, str, str, str]]:
    return sorted(
        (r.commit_timestamp.ns, r.server_transaction_id, r.partition_token, r.record_sequence)
        for r in records
    )


def test_exported_from_the_facades() -> None:
    assert cf.ReadChangeStream is ReadChangeStream
    assert "ReadChangeStream" in cf.__all__
    assert "ReadChangeStream" in cdcflow.transforms.__all__


def test_expands_into_the_two_primitives_under_its_label() -> None:
    pipeline = cf.Pipeline("p")
    pipeline | ReadChangeStream(DB, "Orders") | cf.Print()
    assert list(pipeline.graph.edges) == [
        ("ReadChangeStream/DetectPartitions", "ReadChangeStream/ReadPartition"),
        ("ReadChangeStream/ReadPartition", "Print"),
    ]
    pipeline.validate()
    assert pipeline.graph.nodes["ReadChangeStream/DetectPartitions"]["kind"] == "Source"
    assert pipeline.graph.nodes["ReadChangeStream/ReadPartition"]["kind"] == "Read"


def test_a_label_names_the_composite() -> None:
    pipeline = cf.Pipeline("p")
    pipeline | "orders" >> ReadChangeStream(DB, "Orders") | cf.Print()
    assert sorted(pipeline.graph) == ["Print", "orders/DetectPartitions", "orders/ReadPartition"]


def test_arguments_reach_the_primitives() -> None:
    source = ReadChangeStream(
        DB, "Orders", start_at="-10m", end_at="2030-01-01T00:00:00Z", heartbeat="250ms",
        max_inflight=4, max_inflight_bytes=1 << 20, priority="low", query_timeout="30s",
    )
    pipeline = cf.Pipeline("p")
    pipeline | source | cf.Print()
    detect = pipeline.transform("ReadChangeStream/DetectPartitions")
    read = pipeline.transform("ReadChangeStream/ReadPartition")
    assert isinstance(detect, DetectPartitions) and isinstance(read, ReadPartition)
    assert (detect.database, detect.stream, detect.start_at) == (DB, "Orders", "-10m")
    assert detect.end_ns(0) == Timestamp.parse("2030-01-01T00:00:00Z").ns + 1
    assert (detect.priority, detect.query_timeout, detect.client) == ("LOW", 30.0, None)
    assert (read.heartbeat_millis, read.max_inflight, read.max_inflight_bytes) == (
        250, 4, 1 << 20
    )


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"database": "shop", "stream": "Orders"}, "projects/PROJECT/instances"),
        ({"database": DB, "stream": "1bad"}, "identifier"),
        ({"database": DB, "stream": "Orders", "heartbeat": "10m"}, "1ms to 300s"),
        ({"database": DB, "stream": "Orders", "max_inflight": 0}, "use 1 or more"),
        ({"database": DB, "stream": "Orders", "priority": "urgent"}, "LOW, MEDIUM, HIGH"),
    ],
)
def test_bad_arguments_fail_when_built(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(PipelineDefinitionError, match=fragment):
        ReadChangeStream(**kwargs)  # type: ignore[arg-type]


def test_must_be_applied_to_the_pipeline_itself() -> None:
    pipeline = cf.Pipeline("p")
    records = pipeline | ReadChangeStream(DB, "Orders")
    records | "again" >> ReadChangeStream(DB, "Orders") | cf.Print()
    with pytest.raises(PipelineDefinitionError, match="applied to the pipeline itself"):
        pipeline.validate()


def test_reads_what_the_two_primitives_read() -> None:
    stream = scripted()
    end = T0 + 600 * MS
    composite, primitives = Collect(), Collect()
    one = cf.Pipeline("composite")
    one | ReadChangeStream(stream="Orders", start_at=T0, end_at=end, client=stream) | composite
    two = cf.Pipeline("primitives")
    (two
     | DetectPartitions(stream="Orders", start_at=T0, end_at=end, client=stream)
     | ReadPartition()
     | primitives)
    first = cdcflow.testing.run(one, max_batch_span="100ms")
    second = cdcflow.testing.run(two, max_batch_span="100ms")
    assert first.reason == second.reason == "end reached"
    assert (first.splits, first.merges) == (1, 1)
    expected = order(stream.expected_records(T0, end + 1))
    assert len(expected) == 12
    assert order(composite.items) == order(primitives.items) == expected
