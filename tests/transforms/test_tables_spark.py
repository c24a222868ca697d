"""WriteTables on the Spark runner (tasks on Spark, the spool and uploads on the driver):
exactly once through a crash and a replay, with a column added and dropped mid-stream, and
the dataset read back by Spark.

Spark (4.x) refuses Parquet's TIMESTAMP(NANOS) ("Illegal Parquet type"), which WriteTables
writes to keep Spanner's nanoseconds; with ``spark.sql.legacy.parquet.nanosAsLong=true`` it
reads them as integer nanoseconds since the epoch.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import SQLiteStore
from cdcflow.spark.runner import SparkRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms.tables import WriteTables
from tests.transforms.test_tables import T0, CrashingTables, S, _Crash

pytestmark = pytest.mark.spark

ROWS = 180


def _stream() -> ScriptedChangeStream:
    """Inserts into A and B; A gains ``note`` at row 60 and loses it at row 120."""
    s = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(ROWS):
        values: dict[str, Any] = {"v": i, "price": Decimal(i) / 100}
        if 60 <= i < 120:
            values["note"] = f"n{i}"
        s.write("A" if i % 3 else "B", i, "INSERT", values, at=T0 + (i + 1) * S // 15)
    return s


def _run(store_path: Path, sink: WriteTables) -> Any:
    p = cf.Pipeline("tables-spark")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 13 * S, client=_stream())
     | cf.ReadPartition() | sink)
    store = SQLiteStore(store_path)
    try:
        # SparkRunner() finds the session of the spark_runner fixture and leaves it running
        return Engine(p, store, SparkRunner(),
                      RunOptions(batch_interval=0, max_batch_span=1.0)).run()
    finally:
        store.close()


@pytest.fixture
def spark(spark_runner: SparkRunner) -> Iterator[Any]:
    session = spark_runner.session
    key = "spark.sql.legacy.parquet.nanosAsLong"
    before = session.conf.get(key, "false")
    session.conf.set(key, "true")
    try:
        yield session
    finally:
        session.conf.set(key, before)


def test_write_tables_on_spark_crash_replay_and_spark_read_back_every_row_once(
    spark: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(_Crash):
        _run(tmp_path / "s.db", CrashingTables(str(out), file_size="2KiB",
                                               flush_interval="1h", crash_at=("stage", 6)))
    # the same class: a sink's label (its class name by default) keys its durable mark
    summary = _run(tmp_path / "s.db", CrashingTables(str(out), file_size="2KiB",
                                                     flush_interval="1h"))
    assert summary.reason == "end reached"
    versions = [json.loads(p.read_text())
                for p in sorted((out / "A" / "_schema").glob("v*.json"))]
    assert [[c["name"] for c in v["columns"]] for v in versions] == [
        ["id", "v", "price"], ["id", "v", "price", "note"], ["id", "v", "price"]]
    assert len(list((out / "A").glob("part-*.parquet"))) > 3
    df = spark.read.option("mergeSchema", "true").parquet(str(out / "A"), str(out / "B"))
    types = dict(df.dtypes)
    assert types["v"] == "bigint" and types["price"] == "decimal(38,9)"
    assert types["_commit_ts"] == "bigint"  # nanoseconds, see the module docstring
    rows = df.select("v", "price", "note", "_table", "_commit_ts").collect()
    assert sorted(r["v"] for r in rows) == list(range(ROWS))
    for r in rows:
        assert r["price"] == Decimal(r["v"]) / 100
        assert r["note"] == (f"n{r['v']}" if 60 <= r["v"] < 120 else None)
        assert r["_table"] == ("A" if r["v"] % 3 else "B")
        assert r["_commit_ts"] == T0 + (r["v"] + 1) * S // 15


def test_microsecond_timestamps_read_typed_in_spark_without_settings(
    spark_runner: SparkRunner, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    summary = _run(tmp_path / "s.db", WriteTables(str(out), timestamp_unit="us"))
    assert summary.reason == "end reached"
    df = spark_runner.session.read.option("mergeSchema", "true").parquet(str(out / "A"))
    assert dict(df.dtypes)["_commit_ts"] == "timestamp"
    got = {r["v"]: r["_commit_ts"] for r in df.select("v", "_commit_ts").collect()}
    assert sorted(got) == [i for i in range(ROWS) if i % 3]
    for v, ts in got.items():  # Spark gives local naive datetimes: compare as instants
        want_us = (T0 + (v + 1) * S // 15) // 1000
        assert int(ts.timestamp() * 1_000_000) == pytest.approx(want_us, abs=1)
