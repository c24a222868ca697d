"""ScriptedChangeStream's values are what Spanner's wire form decodes to, and its read
options (typed, filters) behave as the real reader's."""

from __future__ import annotations

import math
import pickle
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import cloudpickle
import pytest

from cdcflow.errors import PipelineDefinitionError
from cdcflow.model import ChangeRecord, DataChangeRecord, HeartbeatRecord, Timestamp
from cdcflow.spanner import wire
from cdcflow.spanner.decode import row_decoder
from cdcflow.spanner.shape import RecordShaper
from cdcflow.spanner.transport import assemble_rows
from cdcflow.stream import ChangeStreamQuery, RecordFilter
from cdcflow.testing import ScriptedChangeStream

T0 = 1_700_000_000 * 1_000_000_000
ROW: dict[str, Any] = {
    "qty": 3, "price": 2.5, "total": Decimal("7.50"), "paid": True, "note": "zoë",
    "blob": b"\x00\xff", "day": date(2024, 2, 29),
    "at": Timestamp.parse("2024-05-01T12:00:00.123456789Z"),
    "naive": datetime(2024, 5, 1, 12, 0),  # taken as UTC
    "doc": {"a": [1, None], "b": "x"}, "tags": ["a", None, "b"], "nums": [1, 2.5],
    "nested": [[1], {"k": 2}], "empty": [], "nothing": None, "inf": math.inf,
    "huge": {"n": 2**70, "m": [-(2**80)]},  # JSON integers past 64 bits stay exact
}
TYPES = {
    "id": {"code": "INT64"}, "qty": {"code": "INT64"}, "price": {"code": "FLOAT64"},
    "total": {"code": "NUMERIC"}, "paid": {"code": "BOOL"}, "note": {"code": "STRING"},
    "blob": {"code": "BYTES"}, "day": {"code": "DATE"}, "at": {"code": "TIMESTAMP"},
    "naive": {"code": "TIMESTAMP"}, "doc": {"code": "JSON"},
    "tags": {"code": "ARRAY", "array_element_type": {"code": "STRING"}},
    "nums": {"code": "ARRAY", "array_element_type": {"code": "FLOAT64"}},
    "nested": {"code": "JSON"},
    "empty": {"code": "ARRAY", "array_element_type": {"code": "STRING"}},
    "nothing": {"code": "STRING"}, "inf": {"code": "FLOAT64"}, "huge": {"code": "JSON"},
}


def _stream() -> ScriptedChangeStream:
    s = ScriptedChangeStream("S", origin=T0)
    s.write("Orders", 1, "INSERT", ROW, at=T0 + 10)
    s.write("Orders", 1, "UPDATE", {"qty": 4, "note": "zoë"}, at=T0 + 20,
            old_values={"qty": 3, "note": "zoë"})
    s.write("Orders", 1, "UPDATE", {"qty": 4}, at=T0 + 30, old_values={"qty": 4})
    s.write("Items", {"sku": "a", "n": 1}, "INSERT", {"qty": 1}, at=T0 + 40)
    s.write("Orders", 1, "DELETE", at=T0 + 50, old_values={"qty": 4})
    return s


def _read(client: Any, end: int = T0 + 100) -> list[ChangeRecord]:
    return list(client.read(ChangeStreamQuery("S", "p0", T0, end, heartbeat_millis=10_000)))


def _through_the_wire(record: DataChangeRecord, shaper: RecordShaper) -> DataChangeRecord:
    """What the real decoder makes of ``record`` sent by Spanner."""
    messages = wire.partial_result_sets(wire.row_type(wire.googlesql_column_type()),
                                        [wire.encode_googlesql([record])])
    ((row_type, row),) = list(assemble_rows(iter(messages)))
    (got,) = row_decoder(row_type.fields[0].type_, shaper)(row[0], record.partition_token)
    assert isinstance(got, DataChangeRecord)
    return got


def test_column_types_follow_the_python_values() -> None:
    (insert, *_) = _stream().expected_records()
    assert {c.name: c.type for c in insert.column_types} == TYPES
    assert [c.name for c in insert.column_types if c.is_primary_key] == ["id"]


def test_values_are_what_the_real_decoder_gives() -> None:
    records = _stream().expected_records()
    insert = records[0]
    values = dict(insert.mods[0].new_values)
    assert values["naive"] == Timestamp.parse("2024-05-01T12:00:00Z")
    assert type(values["naive"]) is Timestamp and values["at"].nanosecond == 789
    assert values["tags"] == ["a", None, "b"] and values["nums"] == [1.0, 2.5]
    assert values["empty"] == [] and values["nested"] == [[1], {"k": 2}]
    assert values["blob"] == b"\x00\xff" and values["total"] == Decimal("7.50")
    for record in records:
        assert _through_the_wire(record, RecordShaper()) == record


def test_typed_false_gives_the_wire_form() -> None:
    s = _stream()
    typed = s.expected_records()
    wire_form = s.with_options(typed=False).expected_records()
    new = wire_form[0].mods[0].new_values
    assert wire_form[0].mods[0].keys == {"id": "1"}
    assert new["qty"] == "3" and new["total"] == "7.50" and new["blob"] == "AP8="
    assert new["doc"] == '{"a":[1,null],"b":"x"}' and new["inf"] == "Infinity"
    assert new["at"] == "2024-05-01T12:00:00.123456789Z" and new["day"] == "2024-02-29"
    for t, w in zip(typed, wire_form, strict=True):
        assert _through_the_wire(t, RecordShaper(typed=False)) == w
        assert _through_the_wire(w, RecordShaper()) == t
    assert _read(s.with_options(typed=False)) == [
        *[r for r in wire_form if r.partition_token == "p0"]]


def test_values_of_types_that_do_not_mix_fail_at_commit() -> None:
    s = ScriptedChangeStream("S", origin=T0)
    with (pytest.raises(ValueError, match=r"column 'v' of 'T' gets a str value .* INT64"),
          s.transaction(at=T0 + 1) as tx):
        tx.write("T", 1, "INSERT", {"v": 1}).write("T", 2, "INSERT", {"v": "x"})
    with s.transaction(at=T0 + 2) as tx:  # ints widen to floats and to Decimals
        tx.write("T", 1, "INSERT", {"f": 1, "n": 1}).write("T", 2, "INSERT",
                                                            {"f": 1.5, "n": Decimal("2.5")})
    (record,) = s.expected_records()
    assert [c.type["code"] for c in record.column_types] == ["INT64", "FLOAT64", "NUMERIC"]
    assert record.mods[0].new_values == {"f": 1.0, "n": Decimal(1)}
    assert type(record.mods[0].new_values["f"]) is float


def test_a_null_keeps_the_type_the_column_had() -> None:
    """A transaction whose values of a column are all None (or empty lists) reports the
    type the column had in earlier transactions, as Spanner does; with none, STRING."""
    s = ScriptedChangeStream("S", origin=T0)
    s.write("T", 1, "INSERT", {"xs": [1.5], "at": Timestamp.from_ns(T0), "n": None}, at=T0 + 1)
    s.write("T", 2, "INSERT", {"xs": None, "at": None, "n": None}, at=T0 + 2)
    s.write("T", 3, "INSERT", {"xs": [], "at": None, "n": 7}, at=T0 + 3)
    s.write("U", 1, "INSERT", {"xs": None}, at=T0 + 4)  # another table: nothing known
    types = [{c.name: c.type["code"] for c in r.column_types} for r in s.expected_records()]
    floats = {"code": "ARRAY", "array_element_type": {"code": "FLOAT64"}}
    assert types == [{"id": "INT64", "xs": "ARRAY", "at": "TIMESTAMP", "n": "STRING"},
                     {"id": "INT64", "xs": "ARRAY", "at": "TIMESTAMP", "n": "STRING"},
                     {"id": "INT64", "xs": "ARRAY", "at": "TIMESTAMP", "n": "INT64"},
                     {"id": "INT64", "xs": "STRING"}]
    assert all(next(c.type for c in r.column_types if c.name == "xs") == floats
               for r in s.expected_records()[:3])


def test_filters_drop_records_but_leave_their_positions() -> None:
    s = _stream()
    view = s.with_options(filter=RecordFilter.build(tables=["Orders"],
                                                    mod_types=["INSERT", "UPDATE"],
                                                    skip_unchanged=True))
    got = _read(view)
    data = [r for r in got if isinstance(r, DataChangeRecord)]
    assert [r.commit_timestamp.ns - T0 for r in data] == [10, 20]
    stand_ins = [r for r in got if isinstance(r, HeartbeatRecord)]
    assert [h.timestamp.ns - T0 for h in stand_ins] == [30, 40, 50]
    assert data == view.expected_records()
    assert data[1].mods[0].new_values == {"qty": 4, "note": "zoë"}


def test_columns_filter_prunes_values_and_column_types() -> None:
    view = _stream().with_options(filter=RecordFilter.build(columns={"Orders": ["qty"]}))
    insert = view.expected_records()[0]
    assert [c.name for c in insert.column_types] == ["id", "qty"]
    assert insert.mods[0].keys == {"id": 1} and insert.mods[0].new_values == {"qty": 3}
    items = [r for r in view.expected_records() if r.table_name == "Items"]
    assert items[0].mods[0].keys == {"sku": "a", "n": 1}


def test_the_view_checks_names_against_what_was_written() -> None:
    s = _stream()
    s.with_options(filter=RecordFilter.build(columns={"Items": ["qty", "sku"]})) \
        .describe_stream("S")
    with pytest.raises(PipelineDefinitionError,
                       match=r"does not track table 'Order' \(its tables: Items, Orders\)"):
        s.with_options(filter=RecordFilter.build(tables=["Order"])).describe_stream("S")
    with pytest.raises(PipelineDefinitionError, match=r"column 'price' of 'Items' \(its "
                                                      r"columns: n, qty, sku\)"):
        s.with_options(filter=RecordFilter.build(columns={"Items": ["price"]})) \
            .describe_stream("S")


def test_the_view_shares_the_script_and_travels() -> None:
    s = ScriptedChangeStream("S", origin=T0)
    view = s.with_options(filter=RecordFilter.build(tables=["B"]))
    s.write("A", 1, "INSERT", {"v": 1}, at=T0 + 1).write("B", 1, "INSERT", {"v": 2}, at=T0 + 2)
    assert [r.table_name for r in _read(view) if isinstance(r, DataChangeRecord)] == ["B"]
    assert view.stream == "S" and view.reads == 1  # the stream's attributes
    for copy in (pickle.loads(pickle.dumps(view)), cloudpickle.loads(cloudpickle.dumps(view))):
        assert _read(copy) == _read(view)
    assert view.with_options(typed=False).expected_records()[0].mods[0].new_values == {
        "v": "1"}
    assert "with_options(typed=True" in repr(view)


def test_unfiltered_stream_reads_are_unchanged_by_views() -> None:
    s = _stream()
    s.with_options(typed=False, filter=RecordFilter.build(tables=["Items"]))
    assert [r for r in _read(s) if isinstance(r, DataChangeRecord)] == [
        r for r in s.expected_records() if r.partition_token == "p0"]
    assert s.expected_records()[0].mods[0].keys == {"id": 1}
    assert s.expected_changes()[0].new_values == ROW  # the ground truth keeps what was written
    assert isinstance(ROW["naive"], datetime) and ROW["naive"].tzinfo is None
    assert s.expected_records()[0].mods[0].new_values["naive"].tzinfo is UTC
