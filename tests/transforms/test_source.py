"""The change-stream source: ReadChangeStream, the composite of DetectPartitions and
ReadPartition."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
        ({"database": DB, "stream": "Orders", "max_inflight": 0}, "use a whole number, 1 or"),
        ({"database": DB, "stream": "Orders", "max_inflight": True}, "use a whole number"),
        ({"database": DB, "stream": "Orders", "max_inflight_bytes": "abc"},
         r"ReadChangeStream\(max_inflight_bytes='abc'\) is not a size; write e.g. 64MiB"),
        ({"database": DB, "stream": "Orders", "max_inflight_bytes": "10XB"}, "not a size"),
        ({"database": DB, "stream": "Orders", "max_inflight_bytes": 0}, "1 byte or more"),
        ({"database": DB, "stream": "Orders", "max_inflight_bytes": -1}, "1 byte or more"),
        ({"database": DB, "stream": "Orders", "max_inflight_bytes": "1.5"}, "bytes is whole"),
        ({"database": DB, "stream": "Orders", "max_inflight_bytes": 1.5}, "use a size"),
        ({"database": DB, "stream": "Orders", "max_inflight_bytes": True}, "use a size"),
        ({"database": DB, "stream": "Orders", "priority": "urgent"}, "LOW, MEDIUM, HIGH"),
        # values of the wrong type: named, not an error from deep inside
        ({"database": 42, "stream": "Orders"}, "projects/PROJECT/instances"),
        ({"database": DB, "stream": 42}, r"stream=42\): a change stream name"),
        ({"database": DB, "stream": "Orders", "priority": 1}, "LOW, MEDIUM, HIGH"),
        ({"database": DB, "stream": "Orders", "start_at": 1.7e9},
         r"start_at=\.\.\.\): not a time: 1700000000\.0 \(float\).*int\(t \* 1e9\)"),
        ({"database": DB, "stream": "Orders", "end_at": True}, r"not a time: True \(bool\)"),
        ({"database": DB, "stream": "Orders", "end_at": b"now"}, "RFC 3339 text, a datetime"),
        ({"database": DB, "stream": "Orders", "query_timeout": ["1s"]},
         r"query_timeout=\.\.\.\): not a duration"),
        ({"database": DB, "stream": "Orders", "query_timeout": -1},
         r"query_timeout=-1\): use a finite time > 0"),
        ({"database": DB, "stream": "Orders", "heartbeat": "often"},
         r"heartbeat=\.\.\.\): not a duration: 'often'"),
        ({"stream": "Orders", "client": 5}, r"client=5\): pass a change stream client"),
    ],
)
def test_bad_arguments_fail_when_built(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(PipelineDefinitionError, match=fragment):
        ReadChangeStream(**kwargs)  # type: ignore[arg-type]


def test_the_byte_quota_may_be_written_as_size_text() -> None:
    assert ReadChangeStream(DB, "Orders", max_inflight_bytes="64MiB").read.max_inflight_bytes \
        == 64 << 20
    assert cf.ReadPartition(max_inflight_bytes=1000).max_inflight_bytes == 1000


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


# --- typed values and pushed-down filters ---------------------------------------------------


def test_read_options_reach_the_source_and_its_client() -> None:
    stream = scripted()
    source = ReadChangeStream(
        stream="Orders", start_at=T0, client=stream, typed=False, tables=["Orders"],
        columns={"Orders": ["n"]}, mod_types=["INSERT"], skip_unchanged=True,
    )
    detect = source.detect
    assert detect.typed is False and detect.filter is not None
    assert detect.filter.describe() == (
        "tables=Orders columns[Orders]=n mod_types=INSERT skip_unchanged")
    assert detect.client is not stream and detect.client.base is stream  # type: ignore[union-attr]
    assert detect.definition()["database"] == "<ScriptedChangeStream>"  # as without options
    assert detect.describe_params().endswith(
        "typed=False tables=Orders columns[Orders]=n mod_types=INSERT skip_unchanged")
    plain = DetectPartitions(DB, "Orders")
    assert (plain.typed, plain.filter, plain.client) == (True, None, None)
    assert DetectPartitions(stream="Orders", client=stream).client is stream


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"tables": "Orders"}, r"DetectPartitions\(tables='Orders': pass a list"),
        ({"tables": ["A"], "exclude_tables": ["B"]}, "use one of them"),
        ({"mod_types": ["UPSERT"]}, "INSERT, UPDATE, DELETE"),
        ({"columns": {"Items": ["x"]}, "tables": ["Orders"]}, "'Items' is not read"),
        ({"tables": 7}, r"tables=7: pass a list"),
        ({"exclude_tables": None, "mod_types": 1}, r"mod_types=1: pass a list"),
        ({"columns": ["Orders"]}, r"columns=\['Orders'\]: pass a dict of table names"),
        ({"columns": {1: ["x"]}}, "pass a dict of table names"),
        ({"snapshot": 3}, r"snapshot=3\): pass True or a list"),
    ],
)
def test_bad_read_options_fail_when_built(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(PipelineDefinitionError, match=fragment):
        ReadChangeStream(DB, "Orders", **kwargs)  # type: ignore[arg-type]


def test_a_client_without_read_options_is_refused_only_when_they_are_asked() -> None:
    class Plain:
        def describe_stream(self, stream: str) -> object: ...
        def read(self, query: object) -> object: ...
        def close(self) -> None: ...

    DetectPartitions(stream="Orders", client=Plain())  # type: ignore[arg-type]
    with pytest.raises(PipelineDefinitionError, match=r"Plain.*takes no read options"):
        DetectPartitions(stream="Orders", client=Plain(), typed=False)  # type: ignore[arg-type]


def test_a_filtered_pipeline_gets_only_what_it_wants_and_still_ends() -> None:
    stream = ScriptedChangeStream("Orders", partitions=2, origin=T0)
    for i in range(12):
        stream.write("Orders" if i % 3 else "Audit", {"id": i}, "INSERT", {"n": i},
                     at=T0 + (i + 1) * 50 * MS)
        stream.write("Orders", {"id": 100 + i}, "UPDATE", {"n": i}, old_values={"n": i},
                     at=T0 + (i + 1) * 50 * MS + 1)
    end = T0 + 700 * MS
    out = Collect()
    pipeline = cf.Pipeline("filtered")
    (pipeline
     | ReadChangeStream(stream="Orders", start_at=T0, end_at=end, client=stream,
                        exclude_tables=["Audit"], skip_unchanged=True)
     | out)
    summary = cdcflow.testing.run(pipeline, max_batch_span="100ms")
    assert summary.reason == "end reached"
    got = out.items
    assert [r.mods[0].keys["id"] for r in sorted(got, key=lambda r: r.commit_timestamp)] == [
        i for i in range(12) if i % 3]
    assert all(isinstance(r.mods[0].keys["id"], int) for r in got)  # typed by default
    detect = pipeline.transform("ReadChangeStream/DetectPartitions")
    assert order(got) == order(detect.client.expected_records(T0, end + 1))  # type: ignore[union-attr]


def test_an_unknown_table_stops_the_run_at_its_start() -> None:
    pipeline = cf.Pipeline("unknown")
    (pipeline
     | ReadChangeStream(stream="Orders", start_at=T0, end_at=T0 + MS, client=scripted(),
                        tables=["Order"])
     | Collect())
    with pytest.raises(PipelineDefinitionError, match=r"does not track table 'Order' \(its "
                                                      r"tables: Orders\)"):
        cdcflow.testing.run(pipeline)


def test_typed_false_delivers_the_wire_form() -> None:
    stream = scripted()
    out = Collect()
    pipeline = cf.Pipeline("wire")
    (pipeline
     | ReadChangeStream(stream="Orders", start_at=T0, end_at=T0 + 600 * MS, client=stream,
                        typed=False)
     | out)
    cdcflow.testing.run(pipeline, max_batch_span="100ms")
    assert sorted(r.mods[0].keys["id"] for r in out.items) == sorted(str(i) for i in range(12))


def test_unknown_names_are_one_line_and_exit_2_through_the_cli(tmp_path: Path) -> None:
    body = f"""
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

stream = ScriptedChangeStream("Orders", origin={T0})
stream.write("Orders", {{"id": 1}}, "INSERT", {{"total": 1}}, at={T0 + MS})
pipeline = cf.Pipeline("typo")
(pipeline
 | cf.ReadChangeStream(stream="Orders", start_at={T0}, end_at={T0 + 2 * MS}, client=stream,
                       columns={{"Orders": ["totl"]}})
 | cf.Print())
"""
    path = tmp_path / "pipe.py"
    path.write_text(body)
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("CDCFLOW_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "cdcflow", "run", str(path)], capture_output=True, text=True,
        timeout=120, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.splitlines() == [
        "cdcflow: error: change stream 'Orders' does not track column 'totl' of 'Orders' (its "
        "columns: id, total); fix columns= of the source"
    ]
