"""Reading WriteTables output back as the README shows: ``table_schema`` over every schema
version and the date partitions with pyarrow.dataset, DuckDB's ``union_by_name`` and hive
partitioning; ``file_schema`` refuses what is not a schema file."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from cdcflow.transforms.tables import file_schema, table_schema
from tests.transforms.test_tables import STR, T0, S, _close_sinks, _commit, _record, _sink

__all__ = ["_close_sinks"]  # the autouse fixture that closes the sinks these tests set up


def test_every_version_and_hour_reads_back_with_pyarrow_and_duckdb(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), partition_by="hour", flush_interval="1h")
    _commit(sink, 1, [_record("T", 1, at=T0), _record("T", 2, at=T0 + 3600 * S)])
    _commit(sink, 2, [_record("T", 3, at=T0 + 3600 * S + 1, extra={"email": (STR, "x@y")})])
    sink.flush()
    schema = table_schema(str(tmp_path / "T"))
    assert schema.names[:3] == ["id", "name", "_op"] and schema.names[-3:] == [
        "email", "date", "hour"]
    table = ds.dataset(tmp_path / "T", schema=schema, partitioning="hive").to_table()
    rows = sorted(table.select(["id", "email", "date", "hour"]).to_pylist(),
                  key=lambda r: r["id"])
    assert rows == [{"id": 1, "email": None, "date": date(2023, 11, 14), "hour": 22},
                    {"id": 2, "email": None, "date": date(2023, 11, 14), "hour": 23},
                    {"id": 3, "email": "x@y", "date": date(2023, 11, 14), "hour": 23}]
    got = duckdb.connect().sql(
        f"SELECT id, email, hour FROM read_parquet('{tmp_path}/T/*/*/*.parquet', "
        "union_by_name = true, hive_partitioning = true) ORDER BY id").fetchall()
    assert got == [(1, None, 22), (2, None, 23), (3, "x@y", 23)]


def test_a_table_without_schema_files_or_a_foreign_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no schema files"):
        table_schema(str(tmp_path))
    with pytest.raises(ValueError, match="not a WriteTables schema file"):
        file_schema(b'{"table": "T"}')
    sink = _sink(str(tmp_path), flush_interval="1h")
    _commit(sink, 1, [_record("T", 1)])
    sink.flush()
    doc = json.loads((tmp_path / "T/_schema/v1.json").read_text())
    assert file_schema(doc).field("_commit_ts").type == pa.timestamp("ns", tz="UTC")
    doc["columns"][0]["type"] = {"code": "STRING"}  # the checksum no longer matches
    with pytest.raises(ValueError, match="checksum"):
        file_schema(doc)
