"""Rows: flat and Debezium rows of scripted records, in a run on every runner."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.errors import PipelineDefinitionError
from cdcflow.metadata import MemoryStore
from cdcflow.model import Timestamp
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import ReadChangeStream, Rows

T0 = 1_700_000_000 * 10**9
MS = 1_000_000


def _stream() -> ScriptedChangeStream:
    stream = ScriptedChangeStream("S", partitions=2, buckets=8, origin=T0,
                                  snapshot_rows={"Orders": [({"id": 9}, {"total": 90})]})
    stream.write("Orders", 1, "INSERT", {"total": 10, "price": Decimal("1.50"),
                                         "at": Timestamp.from_ns(T0 + 5)}, at=T0 + 1 * MS)
    stream.write("Orders", 1, "UPDATE", {"total": 11}, old_values={"total": 10},
                 at=T0 + 2 * MS)
    stream.write("Orders", 1, "DELETE", old_values={"total": 11, "price": Decimal("1.50")},
                 at=T0 + 3 * MS)
    return stream


def _rows(style: str, runner: Any, **source: Any) -> list[dict[str, Any]]:
    out = cf.Collect[dict[str, Any]]()
    p = cf.Pipeline(f"rows-{style}")
    (p | ReadChangeStream(stream="S", start_at=T0, end_at=T0 + 4 * MS, client=_stream(),
                          **source)
     | Rows(style) | out)  # type: ignore[arg-type]
    summary = Engine(p, MemoryStore(), runner, RunOptions(batch_interval=0)).run()
    assert summary.reason == "end reached"
    return out.items


def test_flat_rows_carry_the_columns_and_the_change(runner: Any) -> None:
    rows = _rows("flat", runner, snapshot=True)
    assert [(r["_op"], r["id"]) for r in rows] == [
        ("SNAPSHOT", 9), ("INSERT", 1), ("UPDATE", 1), ("DELETE", 1)]
    insert, update, delete = rows[1:]
    assert list(insert)[:4] == ["id", "total", "price", "at"]
    assert insert["total"] == 10 and type(insert["total"]) is int  # typed by the reader
    assert insert["price"] == Decimal("1.50") and insert["at"] == Timestamp.from_ns(T0 + 5)
    assert insert["_commit_ts"] == Timestamp.from_ns(T0 + 1 * MS)
    assert insert["_table"] == "Orders" and insert["_txn"] and insert["_seq"]
    assert update["total"] == 11 and "price" not in update  # the columns it wrote
    assert delete["total"] == 11 and delete["price"] == Decimal("1.50")  # old values


def test_debezium_rows_have_the_envelope(runner: Any) -> None:
    rows = _rows("debezium", runner)
    assert [r["op"] for r in rows] == ["c", "u", "d"]
    create, update, delete = rows
    assert create["before"] is None and create["after"]["total"] == 10
    assert create["after"]["id"] == 1
    assert update["before"] == {"id": 1, "total": 10} and update["after"] == {"id": 1, "total": 11}
    assert list(update["after"]) == ["id", "total"]  # keys first, as in the table
    assert delete["after"] is None and delete["before"]["total"] == 11
    source = update["source"]
    assert source["table"] == "Orders" and source["partition"].startswith("p")
    assert source["commit_timestamp"] == Timestamp.from_ns(T0 + 2 * MS)
    assert update["ts_ms"] == (T0 + 2 * MS) // MS


def test_wire_values_stay_wire_values_when_the_reader_does_not_type_them() -> None:
    from cdcflow.runners.in_memory import InMemoryRunner

    rows = _rows("flat", InMemoryRunner(workers=1), typed=False)
    assert rows[0]["total"] == "10" and rows[0]["price"] == "1.50"


def test_a_bad_style_or_element_is_refused() -> None:
    with pytest.raises(PipelineDefinitionError, match="use 'flat' or 'debezium'"):
        Rows("wide")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Rows takes DataChangeRecords, got str"):
        list(Rows().fn.process("x"))  # type: ignore[arg-type]
