"""WriteTables(format="csv"): every Spanner type written as text and read back typed by
pyarrow.csv (with :func:`file_schema`) and DuckDB (with the schema file's ``csv_columns``),
equal to what the Parquet files of the same records hold; Debezium rows flattened; schema
versions; spilled files keep one header; files as near the target as whole batches allow;
a task's rows past ``spool_size`` travel in a local spool file (every format)."""

from __future__ import annotations

import base64
import json
import os
from datetime import date
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from cdcflow.model import ColumnType, DataChangeRecord, Mod, Timestamp
from cdcflow.transforms.base import WriterContext
from cdcflow.transforms.tables import TaskRows, file_schema
from tests.transforms.test_tables import STR, T0, _close_sinks, _commit, _record, _sink

__all__ = ["_close_sinks"]  # the autouse fixture that closes the sinks these tests set up

INT = {"code": "INT64"}
TYPES: dict[str, Any] = {
    "id": INT, "s": STR, "n": {"code": "NUMERIC"}, "t": {"code": "TIMESTAMP"},
    "d": {"code": "DATE"}, "b": {"code": "BYTES"}, "j": {"code": "JSON"},
    "a": {"code": "ARRAY", "array_element_type": {"code": "TIMESTAMP"}},
    "f": {"code": "FLOAT64"}, "ok": {"code": "BOOL"},
}
COLUMNS = tuple(ColumnType(n, t, n == "id", k + 1) for k, (n, t) in enumerate(TYPES.items()))
WHEN = "2024-01-02T03:04:05.123456789Z"


def _values(i: int, wire: bool) -> dict[str, Any]:
    if wire:  # the change stream's JSON forms (typed=False)
        return {"s": "" if i == 2 else f'a,"b"\n{i}', "n": "1.25", "t": WHEN,
                "d": "2024-01-02", "b": base64.b64encode(b"\x00hi").decode(),
                "j": {"k": [i, None]}, "a": [WHEN, None], "f": 1.5, "ok": True}
    return {"s": "" if i == 2 else f'a,"b"\n{i}', "n": Decimal("1.25"), "t": Timestamp.parse(WHEN),
            "d": date(2024, 1, 2), "b": b"\x00hi", "j": orjson.dumps({"k": [i, None]}).decode(),
            "a": [Timestamp.parse(WHEN), None], "f": 1.5, "ok": True}


def _records(wire: bool) -> list[DataChangeRecord]:
    out = []
    for i, op in enumerate(("INSERT", "INSERT", "INSERT", "UPDATE", "DELETE")):
        values = _values(i, wire)
        if op == "UPDATE":
            values = {"s": values["s"]}
        key = {"id": str(i % 3) if wire else i % 3}
        mod = Mod(key, {} if op == "DELETE" else values, values if op == "DELETE" else {})
        out.append(DataChangeRecord("p0", Timestamp.from_ns(T0 + i), f"{i}", f"tx{i}", True,
                                    "T", COLUMNS, [mod], op, "OLD_AND_NEW_VALUES", 1, 1))
    return out


def _write(out: Path, fmt: str, rows: str, records: list[DataChangeRecord]) -> Path:
    sink = _sink(str(out / fmt), format=fmt, rows=rows, flush_interval="1h")
    _commit(sink, 1, records)
    sink.flush()
    sink.close()
    (part,) = (out / fmt / "T").glob(f"part-*.{fmt}")
    return part


def _read_csv(part: Path) -> pa.Table:
    schema = file_schema((part.parent / "_schema" / "v1.json").read_bytes())
    return pacsv.read_csv(part, convert_options=pacsv.ConvertOptions(
        column_types=schema, strings_can_be_null=True, quoted_strings_can_be_null=False))


def _ns(table: pa.Table) -> list[dict[str, Any]]:
    """Rows with timestamps as integer nanoseconds (no pandas to make them datetimes)."""
    for i, field in enumerate(table.schema):
        if pa.types.is_timestamp(field.type):
            table = table.set_column(i, field.name, table.column(i).cast(pa.int64()))
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


@pytest.mark.parametrize("wire", [False, True])
def test_flat_csv_reads_back_typed_as_the_parquet_of_the_same_records(
    tmp_path: Path, wire: bool
) -> None:
    records = _records(wire)
    csv_rows = _ns(_read_csv(_write(tmp_path, "csv", "flat", records)))
    parquet = pq.read_table(_write(tmp_path, "parquet", "flat", records))
    assert [f.name for f in _read_csv(next((tmp_path / "csv/T").glob("*.csv"))).schema] == \
        parquet.schema.names
    for got, want in zip(csv_rows, _ns(parquet.drop_columns(["a"])), strict=True):
        # text where CSV has no type: BYTES as base64, ARRAY as JSON text of its JSON forms
        assert got.pop("b") == (None if want["b"] is None else
                                base64.b64encode(want.pop("b")).decode())
        assert got.pop("a") == (None if got["_op"] == "UPDATE" else
                                orjson.dumps([WHEN, None]).decode())
        want.pop("b", None)
        assert got == want
    assert csv_rows[0]["n"] == Decimal("1.25") and csv_rows[0]["t"] % 1000 == 789
    assert csv_rows[2]["s"] == ""  # an empty string is not NULL
    assert csv_rows[3]["n"] is None and csv_rows[3]["_op"] == "UPDATE"  # not written: NULL
    assert json.loads(csv_rows[0]["j"]) == {"k": [0, None]}


def test_duckdb_reads_csv_typed_with_the_schema_file_columns(tmp_path: Path) -> None:
    part = _write(tmp_path, "csv", "flat", _records(wire=False))
    doc = json.loads((part.parent / "_schema" / "v1.json").read_text())
    types = {c["name"]: c["duckdb"] for c in doc["csv_columns"]}
    assert types["t"] == "TIMESTAMPTZ_NS" and types["n"] == "DECIMAL(38, 9)"
    con = duckdb.connect()
    rel = con.sql(f"SELECT * FROM read_csv('{part}', types = {types}, "
                  "allow_quoted_nulls = false)")
    kinds = dict(zip(rel.columns, map(str, rel.types), strict=True))
    assert kinds["id"] == "BIGINT" and kinds["ok"] == "BOOLEAN" and kinds["d"] == "DATE"
    rows = con.sql(f"SELECT id, s, n, epoch_ns(t) AS t, _op FROM read_csv('{part}', "
                   f"types = {types}, allow_quoted_nulls = false) ORDER BY _commit_ts").fetchall()
    assert rows[0] == (0, 'a,"b"\n0', Decimal("1.25"), Timestamp.parse(WHEN).ns, "INSERT")
    assert rows[2][1] == "" and rows[3][2] is None


def test_debezium_csv_is_the_envelope_flattened(tmp_path: Path) -> None:
    records = _records(wire=False)
    part = _write(tmp_path, "csv", "debezium", records)
    got = _ns(_read_csv(part))
    parquet = pq.read_table(_write(tmp_path, "parquet", "debezium", records)).flatten()
    want = _ns(parquet.drop_columns(["before.a", "after.a"]))
    header = part.read_text().splitlines()[0].replace('"', "").split(",")
    assert header[:2] == ["before.id", "before.s"] and "after.ok" in header
    assert header[-7:] == ["op", "source.table", "source.commit_timestamp",
                           "source.transaction_id", "source.record_sequence",
                           "source.partition", "ts_ms"]
    for g, w in zip(got, want, strict=True):
        for side in ("before", "after"):
            g.pop(f"{side}.b"), g.pop(f"{side}.a"), w.pop(f"{side}.b")
        assert g == w
    assert [r["op"] for r in got] == ["c", "c", "c", "u", "d"]
    assert got[0]["before.id"] is None and got[4]["after.id"] is None


def test_schema_versions_and_spilled_files_keep_one_header(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), format="csv", flush_interval="1h", spool_memory=1)
    for b in range(1, 4):  # every commit spills the open file to local disk
        _commit(sink, b, [_record("T", b * 10 + j) for j in range(3)])
    _commit(sink, 4, [_record("T", 40, extra={"email": (STR, "x@y")})])
    sink.flush()
    names = sorted(p.name for p in (tmp_path / "T").glob("part-*"))
    assert names == ["part-1-3-1.csv", "part-4-4-2.csv"]
    lines = (tmp_path / "T" / "part-1-3-1.csv").read_text().splitlines()
    assert len(lines) == 10 and lines[0].startswith('"id","name","_op"')
    con = duckdb.connect()
    rows = con.sql(f"SELECT id, email FROM read_csv('{tmp_path}/T/part-*.csv', "
                   "union_by_name = true) ORDER BY id").fetchall()
    assert rows[-1] == (40, "x@y") and rows[0] == (10, None) and len(rows) == 10


def test_files_come_as_near_the_target_as_whole_batches_allow(tmp_path: Path) -> None:
    target = 64 * 1024
    sink = _sink(str(tmp_path), format="csv", file_size=target, flush_interval="1h")
    long = {"name": (STR, "x" * 500)}
    for b in range(1, 13):  # each batch about 0.8 of the target: one batch per file
        _commit(sink, b, [_record("T", b * 1000 + j, extra=long) for j in range(95)])
    sink.flush()
    sizes = [p.stat().st_size for p in sorted((tmp_path / "T").glob("part-*.csv"))]
    assert len(sizes) == 12, sizes  # not files of two batches, 1.6 times the target
    assert all(0.7 * target < s < target for s in sizes), sizes


@pytest.mark.parametrize("fmt", ["csv", "parquet", "jsonl"])
def test_a_task_past_spool_size_spools_its_rows_to_a_local_file(tmp_path: Path, fmt: str) -> None:
    sink = _sink(str(tmp_path / fmt), format=fmt, flush_interval="1h", spool_size="2KiB")
    writer = sink.open_writer(WriterContext("p", "WriteTables", 1, "p0", 0, 1, "a"))
    for i in range(100):
        writer.write(_record("T", i))
    message = writer.close()
    assert isinstance(message, TaskRows) and message.spool is not None
    assert not message.groups and os.path.exists(message.spool)
    sink.commit(1, [message])
    assert not os.path.exists(message.spool)  # taken by the commit
    sink.flush()
    con = duckdb.connect()
    reader = {"csv": "read_csv", "parquet": "read_parquet", "jsonl": "read_json"}[fmt]
    ids = con.sql(f"SELECT id FROM {reader}('{tmp_path / fmt}/T/part-*') ORDER BY id").fetchall()
    assert [i for (i,) in ids] == list(range(100))

