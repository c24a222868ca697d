"""WriteTables writes every value Spanner allows as it was: a JSON value that is a string
stays a JSON string (apart from one that is a number), PostgreSQL JSONB is JSON text, and
a TIMESTAMP outside what 64-bit nanoseconds hold (years 1..1677 and 2262..9999) is RFC
3339 text in JSON lines, microseconds in Parquet with timestamp_unit="us", and one line
naming the fix in nanosecond Parquet and CSV; NaN and the infinities are never null."""

from __future__ import annotations

import csv
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

import cdcflow as cf
import cdcflow.testing
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner
from cdcflow.errors import SinkError, SparkTaskError
from cdcflow.metadata import MemoryStore
from cdcflow.model import JsonString, Timestamp
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms._tablerows import convert
from cdcflow.transforms.tables import table_schema

S = 1_000_000_000
T0 = 1_700_000_000 * S
DOCS = [JsonString("42"), {"n": 42}, JsonString("str"), {"a": 1}, [1, "x"], None]
TEXTS = ['"42"', '{"n":42}', '"str"', '{"a":1}', '[1,"x"]', None]


def _run(runner: Runner, stream: ScriptedChangeStream, out: Path, fmt: str,
         **options: Any) -> None:
    p = cf.Pipeline(f"values-{fmt}")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + S, client=stream)
     | cf.ReadPartition()
     | cf.WriteTables(str(out), format=fmt, **options))  # type: ignore[arg-type]
    Engine(p, MemoryStore(), runner, RunOptions(batch_interval=0)).run()


def _rows(out: Path, fmt: str) -> list[dict[str, object]]:
    (path,) = out.glob(f"E/part-*.{fmt}")
    if fmt == "parquet":
        rows = pq.read_table(path).to_pylist()
    elif fmt == "jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines()]
    else:
        with path.open(newline="") as f:
            rows = [{k: (v or None) for k, v in r.items()} for r in csv.DictReader(f)]
    return sorted(rows, key=lambda r: int(str(r["Id"])))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_json_values_are_written_as_their_json_text(
    runner: Runner, tmp_path: Path, fmt: str
) -> None:
    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    for i, doc in enumerate(DOCS):
        stream.write("E", {"Id": i}, "INSERT", {"Doc": doc}, at=T0 + (i + 1) * 1000)
    _run(runner, stream, tmp_path / "out", fmt)
    assert [r["Doc"] for r in _rows(tmp_path / "out", fmt)] == TEXTS


def test_a_json_string_reads_as_a_string_marked_as_one() -> None:
    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    stream.write("E", {"Id": 1}, "INSERT", {"Doc": JsonString("str")}, at=T0 + 1000)
    out = cf.Collect()
    p = cf.Pipeline("json-read")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + S, client=stream)
     | cf.ReadPartition() | out)
    cf.testing.run(p)
    (record,) = out.items
    value = record.mods[0].new_values["Doc"]
    assert value == "str" and value.__class__ is JsonString  # the string, typed
    # a wire value (JSON text) is written as it is; PostgreSQL JSONB as JSON text too
    assert convert('"str"', {"code": "JSON"}) == '"str"'
    jsonb = {"code": "JSON", "type_annotation": "PG_JSONB"}
    assert convert({"a": [1]}, jsonb) == '{"a":[1]}' and convert(value, jsonb) == '"str"'


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv"])
def test_timestamps_beyond_nanoseconds(runner: Runner, tmp_path: Path, fmt: str) -> None:
    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    values = ["9999-12-31T23:59:59.999999999Z", "2024-01-01T00:00:00.123456789Z",
              "0001-01-01T00:00:00Z"]
    for i, text in enumerate(values):
        stream.write("E", {"Id": i}, "INSERT", {"Until": Timestamp.parse(text)},
                     at=T0 + (i + 1) * 1000)
    if fmt == "jsonl":
        _run(runner, stream, tmp_path / "out", fmt)
        assert [r["Until"] for r in _rows(tmp_path / "out", fmt)] == [
            Timestamp.parse(t).rfc3339() for t in values]
        return
    # (on Spark, after Spark's own task attempts, as the task's error)
    outside = (r"E\.Until: 9999-12-31T23:59:59\.999999999Z is outside what a timestamp in "
               r"nanoseconds holds .*format='jsonl'")
    with pytest.raises((SinkError, SparkTaskError), match=outside):
        _run(runner, stream, tmp_path / "out", fmt)
    assert not list((tmp_path / "out").glob("E/part-*"))  # nothing of the batch written


@pytest.mark.parametrize("rows", ["flat", "debezium"])
def test_microsecond_parquet_holds_every_year_spanner_does(
    runner: Runner, tmp_path: Path, rows: str
) -> None:
    """timestamp_unit="us": values past 2262 (alone and in arrays) are written, below a
    microsecond dropped, and the table's schema reads the files back typed."""
    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    texts = ["9999-12-31T23:59:59.999999999Z", "2024-01-01T00:00:00.123456789Z",
             "0001-01-01T00:00:00Z"]
    for i, text in enumerate(texts):
        stream.write("E", {"Id": i}, "INSERT",
                     {"Until": Timestamp.parse(text), "Marks": [Timestamp.parse(text), None]},
                     at=T0 + (i + 1) * 1000)
    out = tmp_path / "out"
    _run(runner, stream, out, "parquet", timestamp_unit="us", rows=rows)
    schema = table_schema(str(out / "E"))
    got = ds.dataset(str(out / "E"), schema=schema, format="parquet").to_table().to_pylist()
    got.sort(key=lambda r: int(str((r["after"] if rows == "debezium" else r)["Id"])))
    want = [datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
            datetime(2024, 1, 1, 0, 0, 0, 123456, tzinfo=UTC), datetime(1, 1, 1, tzinfo=UTC)]
    values = [r["after"] if rows == "debezium" else r for r in got]
    assert [v["Until"] for v in values] == want
    assert [v["Marks"] for v in values] == [[w, None] for w in want]
    commit = [r["source"]["commit_timestamp"] if rows == "debezium" else r["_commit_ts"]
              for r in got]
    epoch = datetime.fromtimestamp(T0 // S, UTC)
    assert commit == [epoch + timedelta(microseconds=i + 1) for i in range(3)]
    fields = schema.field("after").type if rows == "debezium" else schema
    assert fields.field("Until").type == pa.timestamp("us", tz="UTC")
    (path,) = out.glob("E/part-*.parquet")
    assert pq.read_schema(path).equals(schema, check_metadata=False)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_floats_that_are_not_finite_stay_apart_from_null(
    runner: Runner, tmp_path: Path, fmt: str
) -> None:
    """NaN and the infinities, alone and in arrays: Parquet holds them as floats; JSON lines
    (and CSV's arrays, which are JSON text) as Spanner's JSON texts them, never null."""
    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    nan, inf = float("nan"), float("inf")
    rows = [(inf, [nan, -inf, 1.0]), (-inf, None), (nan, [None, 2.5]), (None, [inf])]
    for i, (price, prices) in enumerate(rows):
        stream.write("E", {"Id": i}, "INSERT", {"Price": price, "Prices": prices},
                     at=T0 + (i + 1) * 1000)
    _run(runner, stream, tmp_path / "out", fmt)
    got = [(r["Price"], r["Prices"]) for r in _rows(tmp_path / "out", fmt)]
    if fmt == "parquet":
        assert [repr(v) for v in got] == [repr(v) for v in rows]  # repr: nan == nan
        return
    texts = [("Infinity", ["NaN", "-Infinity", 1.0]), ("-Infinity", None),
             ("NaN", [None, 2.5]), (None, ["Infinity"])]
    if fmt == "csv":  # a scalar is CSV's float text ("inf", "nan"), an array JSON text
        got = [(p, None if a is None else json.loads(str(a))) for p, a in got]
        texts = [(p and {"Infinity": "inf", "-Infinity": "-inf", "NaN": "nan"}[p], a)
                 for p, a in texts]
    assert got == texts
