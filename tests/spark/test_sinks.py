"""WriteSpark: rows staged by writers, committed with Spark, overwritten on replay."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.errors import PipelineDefinitionError, SinkError, SinkIOError
from cdcflow.metadata import open_store
from cdcflow.model import Timestamp
from cdcflow.spark.runner import SparkRunner
from cdcflow.spark.sinks import StagedFile, WriteSpark
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import DetectPartitions, Map, ReadPartition
from cdcflow.transforms.base import SinkContext, WriterContext

pytestmark = pytest.mark.spark

# _order_row runs in Spark's Python workers, which cannot import this module by name
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SCHEMA = "id BIGINT, name STRING, ts TIMESTAMP"
TS = Timestamp.from_ns(1_700_000_000_123_456_789)


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    runner = SparkRunner("local[2]")
    runner.open("test-spark-sinks")
    try:
        yield runner.session
    finally:
        runner.close()


def _run_batch(
    sink: WriteSpark, batch_id: int, attempt: str, tokens: tuple[str, ...] = ("a", "b")
) -> list[StagedFile]:
    """What a batch's tasks do: one writer per partition token, three rows each; the
    messages as the engine hands them to commit (no None)."""
    messages = []
    for token in tokens:
        ctx = WriterContext("pipe", "out", batch_id, token, 0, 10, attempt)
        writer = sink.open_writer(ctx)
        for i in range(3):
            writer.write({"id": batch_id * 100 + i, "name": token, "ts": TS})
        message = writer.close()
        if message is not None:
            messages.append(message)
    return messages


def _rows(spark: Any, fmt: str, path: Path) -> list[tuple[Any, ...]]:
    reader = spark.read.format(fmt)
    if fmt == "json":
        reader = reader.schema(SCHEMA + ", _batch_id BIGINT")
    df = reader.load(str(path))
    return sorted(tuple(r) for r in df.select("_batch_id", "id", "name").collect())


def _expected(*batches: int) -> list[tuple[Any, ...]]:
    return sorted((b, b * 100 + i, t) for b in batches for t in ("a", "b") for i in range(3))


@pytest.mark.parametrize("fmt", ["parquet", "json"])
def test_replayed_batch_overwrites_its_partition(spark: Any, tmp_path: Path, fmt: str) -> None:
    sink = WriteSpark(fmt, path="out", schema=SCHEMA)
    sink.setup(SinkContext("pipe", "out", str(tmp_path)))

    sink.commit(1, _run_batch(sink, 1, "first"))
    sink.commit(2, _run_batch(sink, 2, "first"))
    # a crash after the sink commit: the batch is replayed by new task attempts
    sink.commit(1, _run_batch(sink, 1, "replay"))
    # and the same messages committed twice (a crash between sink and store commit)
    messages = _run_batch(sink, 3, "first")
    sink.commit(3, messages)

    assert _rows(spark, fmt, tmp_path / "out") == _expected(1, 2, 3)
    partitions = sorted(p for p in os.listdir(tmp_path / "out") if p.startswith("_batch_id="))
    assert partitions == ["_batch_id=1", "_batch_id=2", "_batch_id=3"]
    assert sink.last_committed_batch() == 3  # a fresh store's run continues above it
    # the staged files of committed batches are gone
    staged = [f for _, _, files in os.walk(tmp_path / "out" / "_cdcflow_staging") for f in files]
    assert staged == []


def test_declared_schema_types_the_columns(spark: Any, tmp_path: Path) -> None:
    sink = WriteSpark("parquet", path=tmp_path / "typed", schema=SCHEMA)
    sink.setup(SinkContext("pipe", "out", str(tmp_path)))
    sink.commit(7, _run_batch(sink, 7, "x", tokens=("a",)))
    df = spark.read.parquet(str(tmp_path / "typed"))
    types = dict(df.dtypes)
    assert types == {"id": "bigint", "name": "string", "ts": "timestamp", "_batch_id": "int"}
    first = df.orderBy("id").first()
    assert first is not None
    assert first["ts"].replace(tzinfo=None) == spark.createDataFrame(
        [(TS.rfc3339(),)], "t STRING"
    ).selectExpr("CAST(t AS TIMESTAMP) AS t").first()["t"]


def test_failed_attempts_are_not_committed(spark: Any, tmp_path: Path) -> None:
    sink = WriteSpark("parquet", path="out", schema=SCHEMA)
    sink.setup(SinkContext("pipe", "out", str(tmp_path)))
    # a task attempt that died after writing: its file is named by no message
    lost = sink.open_writer(WriterContext("pipe", "out", 1, "a", 0, 10, "lost"))
    lost.write({"id": 999, "name": "a", "ts": TS})
    lost.close()
    sink.commit(1, _run_batch(sink, 1, "retry"))
    assert _rows(spark, "parquet", tmp_path / "out") == _expected(1)


def test_empty_batch_writes_nothing(spark: Any, tmp_path: Path) -> None:
    sink = WriteSpark("parquet", path="out")
    sink.setup(SinkContext("pipe", "out", str(tmp_path)))
    writer = sink.open_writer(WriterContext("pipe", "out", 1, "a", 0, 10, "x"))
    assert writer.close() is None
    sink.commit(1, [])  # the engine's messages of a batch whose writers wrote nothing
    assert not (tmp_path / "out").exists() or not any(
        p.startswith("_batch_id=") for p in os.listdir(tmp_path / "out")
    )


def test_table_target_overwrites_the_batch_partition(spark: Any, tmp_path: Path) -> None:
    table = "cdcflow_test_orders"
    spark.sql(f"DROP TABLE IF EXISTS {table}")
    sink = WriteSpark(
        "parquet",
        table=table,
        schema=SCHEMA,
        staging=tmp_path / "staging",
        options={"path": str(tmp_path / "tbl")},
    )
    sink.setup(SinkContext("pipe", "out", str(tmp_path)))
    try:
        sink.commit(1, _run_batch(sink, 1, "first"))
        sink.commit(2, _run_batch(sink, 2, "first"))
        sink.commit(1, _run_batch(sink, 1, "replay"))
        rows = spark.table(table).select("_batch_id", "id", "name").collect()
        assert sorted(tuple(r) for r in rows) == _expected(1, 2)
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {table}")


def test_writer_messages_are_staged_files(tmp_path: Path) -> None:
    sink = WriteSpark("json", path=tmp_path / "out")
    sink.setup(SinkContext("pipe", "out", str(tmp_path)))
    writer = sink.open_writer(WriterContext("pipe", "out", 4, "tok", 0, 10, "att"))
    writer.write({"id": 1})
    writer.write({"id": 2})
    message = writer.close()
    assert isinstance(message, StagedFile)
    assert message.rows == 2
    assert Path(message.path).read_text().splitlines() == ['{"id":1}', '{"id":2}']
    assert str(tmp_path / "out" / "_cdcflow_staging") in message.path
    sink.abort(4, [message])
    assert not Path(message.path).exists()


def test_configuration_errors_name_the_fix() -> None:
    with pytest.raises(PipelineDefinitionError, match="not both"):
        WriteSpark("parquet", path="a", table="t")
    with pytest.raises(PipelineDefinitionError, match="staging="):
        WriteSpark("parquet", table="t")
    with pytest.raises(PipelineDefinitionError, match="staging="):
        WriteSpark("jdbc", options={"url": "jdbc:x"})
    with pytest.raises(PipelineDefinitionError, match="format"):
        WriteSpark("", path="a")


def test_commit_without_setup_says_so() -> None:
    sink = WriteSpark("parquet", path="/tmp/x")
    with pytest.raises(SinkError, match="setup"):
        sink.open_writer(WriterContext("pipe", "out", 1, "a", 0, 10, "x"))


def test_output_location_is_the_resolved_path_or_the_table(tmp_path: Path) -> None:
    sink = WriteSpark("parquet", path="out")
    with pytest.raises(SinkError, match="setup"):
        sink.output_location()
    sink.setup(SinkContext("pipe", "out", str(tmp_path)))
    assert sink.output_location() == str(tmp_path / "out")
    # another sink, format and label on the same directory: both would overwrite its
    # partitions, so the locations are equal and the engine refuses the pipeline
    other = WriteSpark("json", path=str(tmp_path / "out") + "/", batch_column="b")
    other.setup(SinkContext("pipe", "other", "/elsewhere"))
    assert other.output_location() == sink.output_location()
    assert WriteSpark("orc", path="file:///data/x/").output_location() == "/data/x"
    assert WriteSpark("orc", path="s3a://bucket/x").output_location() == "s3a://bucket/x"
    table = WriteSpark("parquet", table="Shop.Orders", staging="/stage")
    assert table.output_location() == "table:shop.orders"
    appends = WriteSpark("jdbc", options={"url": "jdbc:x"}, staging="/stage")
    assert appends.output_location() is None


def test_last_committed_batch_reads_the_batch_partitions(tmp_path: Path) -> None:
    sink = WriteSpark("parquet", path=tmp_path / "out")
    sink.setup(SinkContext("pipe", "out", str(tmp_path)))
    assert sink.last_committed_batch() == 0  # no directory yet
    for name in ("_batch_id=7", "_batch_id=12", "_cdcflow_staging", "_batch_id=x"):
        (tmp_path / "out" / name).mkdir(parents=True)
    (tmp_path / "out" / "_batch_id=99").write_text("a file, not a partition")
    assert sink.last_committed_batch() == 12
    table = WriteSpark("parquet", table="t", staging=tmp_path / "stage")
    assert table.last_committed_batch() == 0  # a table: this sink does not know


def test_a_staging_storage_failure_is_a_sink_io_error(tmp_path: Path) -> None:
    sink = WriteSpark("json", path=tmp_path / "out")
    sink.setup(SinkContext("pipe", "out", str(tmp_path)))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "_cdcflow_staging").write_text("a file where a directory must go")
    writer = sink.open_writer(WriterContext("pipe", "out", 1, "a", 0, 10, "x"))
    with pytest.raises(SinkIOError, match=r"cannot write .*; free space") as info:
        writer.write({"id": 1})
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(SinkIOError):  # the writer stays failed: the task cannot succeed
        writer.close()
    fine = WriteSpark("json", path=tmp_path / "o2")
    fine.setup(SinkContext("pipe", "out", str(tmp_path)))
    writer = fine.open_writer(WriterContext("pipe", "out", 1, "a", 0, 10, "x"))
    with pytest.raises(SinkError, match="Map"):  # the element's fault stays a SinkError
        writer.write(object())
    writer.write({"id": 1})  # ... and the writer goes on
    message = writer.close()
    assert message is not None and message.rows == 1


def _order_row(record: Any) -> dict[str, Any]:
    mod = record.mods[0]
    return {"id": mod.keys["id"], "name": record.partition_token, "ts": record.commit_timestamp}


def test_a_pipeline_on_spark_writes_every_change_once(spark: Any, tmp_path: Path) -> None:
    s = 1_000_000_000
    t0 = 1_700_000_000 * s
    stream = ScriptedChangeStream("S", partitions=3, origin=t0)
    stream.split("p0", at=t0 + 4 * s, into=["a", "b"])
    for i in range(60):
        stream.write("T", i, "INSERT", {"v": i}, at=t0 + 1 + i * (9 * s // 60))
    pipeline = cf.Pipeline("write-spark")
    (
        pipeline
        | DetectPartitions(stream="S", start_at=t0, end_at=t0 + 10 * s - 1, client=stream)
        | ReadPartition(heartbeat="500ms")
        | Map(_order_row)
        | WriteSpark("parquet", path="orders", schema=SCHEMA)
    )
    store = open_store("memory://")
    options = RunOptions(batch_interval=0, max_batch_span=3.0, base_dir=str(tmp_path))
    Engine(pipeline, store, SparkRunner(), options).run()

    df = spark.read.parquet(str(tmp_path / "orders"))
    got = sorted((r["id"], r["name"]) for r in df.select("id", "name").collect())
    want = sorted((r.mods[0].keys["id"], r.partition_token) for r in stream.expected_records())
    assert got == want
    assert df.select("_batch_id").distinct().count() > 2
