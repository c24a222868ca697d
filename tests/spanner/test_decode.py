"""The fast decoders against the stock client's decoding of the same wire messages, and
typed values from every column type in all three wire shapes.

Records are written with Python values; the wire encoders put them in Spanner's wire form
(INT64 as text, JSON as JSON text, ...) and the decoders type them back."""

from __future__ import annotations

import base64
import math
import re
from datetime import date
from decimal import Decimal
from typing import Any

import attrs
import orjson
import pytest
from google.cloud.spanner_v1.streamed import StreamedResultSet
from google.cloud.spanner_v1.types import ChangeStreamRecord, PartialResultSet
from hypothesis import given
from hypothesis import strategies as st

from cdcflow.errors import DecodeError
from cdcflow.model import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    MoveInEvent,
    MoveOutEvent,
    PartitionEndRecord,
    PartitionEventRecord,
    PartitionStartRecord,
    Timestamp,
)
from cdcflow.spanner import wire
from cdcflow.spanner.decode import (
    decode_json_record,
    decode_proto_record,
    parse_timestamp,
    records_from_stock_row,
    row_decoder,
)
from cdcflow.spanner.flat import decode_messages
from cdcflow.spanner.shape import RecordShaper, default_shaper
from cdcflow.spanner.transport import assemble_rows

TOKEN = "partition-7"
TS = Timestamp.parse("2024-05-01T12:00:00.123456789Z")

COLUMNS = (
    ColumnType("Id", {"code": "INT64"}, True, 1),
    ColumnType("Name", {"code": "STRING"}, False, 2),
    ColumnType("Tags", {"code": "ARRAY", "array_element_type": {"code": "STRING"}}, False, 3),
    ColumnType("Doc", {"code": "JSON"}, False, 4),
)


def _data(i: int, ts: Timestamp = TS, **changes: Any) -> DataChangeRecord:
    fields: dict[str, Any] = dict(
        partition_token=TOKEN, commit_timestamp=ts, record_sequence=f"{i:08d}",
        server_transaction_id=f"txn-{i}", is_last_record_in_transaction_in_partition=i % 2 == 0,
        table_name="Orders", column_types=COLUMNS,
        mods=[
            Mod({"Id": i}, {"Name": "Zoë ✓", "Tags": ["a", None], "Doc": {"k": [1, 2]}},
                {"Name": None}),
            Mod({"Id": i + 1}, {}, {}),
            Mod({"Id": i + 2}, {"Name": ""}, {"Name": "x", "Tags": [], "Doc": [None, "s"]}),
        ],
        mod_type="UPDATE", value_capture_type="OLD_AND_NEW_VALUES",
        number_of_records_in_transaction=3, number_of_partitions_in_transaction=2,
        transaction_tag="app=shop", is_system_transaction=False,
    )
    fields.update(changes)
    return DataChangeRecord(**fields)


RECORDS: list[ChangeRecord] = [
    _data(0),
    _data(1, Timestamp.parse("2024-05-01T12:00:00Z"), mod_type="INSERT", transaction_tag=""),
    _data(2, Timestamp.parse("2024-05-01T12:00:01.000000001Z"), mod_type="DELETE",
          is_system_transaction=True),
    HeartbeatRecord(TOKEN, Timestamp.parse("2024-05-01T12:00:02.999999999Z")),
    ChildPartitionsRecord(TOKEN, TS, "00000009", [
        ChildPartition("child-a", (TOKEN,)), ChildPartition("child-b", (TOKEN, "other")),
    ]),
]


def _rows(messages: list[Any], shaper: RecordShaper) -> list[ChangeRecord]:
    out: list[ChangeRecord] = []
    decode = None
    for row_type, row in assemble_rows(iter(messages)):
        if decode is None:
            decode = row_decoder(row_type.fields[0].type_, shaper)
        out.extend(decode(row[0], TOKEN))
    return out


def _serialized(messages: list[Any], shaper: RecordShaper) -> list[ChangeRecord]:
    """The reader's path: the messages as the server sends them (spanner.flat)."""
    fresh = RecordShaper(shaper.typed, shaper.filter)  # plans of its own
    return list(decode_messages(iter(m.SerializeToString() for m in messages), TOKEN, fresh))


def _fast(messages: list[Any], shaper: RecordShaper = default_shaper) -> list[ChangeRecord]:
    """Decoded from protobuf rows and from the serialized messages: both the same (or the
    same error)."""
    try:
        out = _rows(messages, shaper)
    except Exception as exc:
        with pytest.raises(type(exc), match=re.escape(str(exc))):
            _serialized(messages, shaper)
        raise
    # repr: the same values, NaNs included (a NaN equals nothing, itself neither)
    assert repr(_serialized(messages, shaper)) == repr(out)
    return out


def _stock(messages: list[Any], shaper: RecordShaper = default_shaper) -> list[ChangeRecord]:
    rows = StreamedResultSet(iter([PartialResultSet.wrap(m) for m in messages]))
    return [r for row in rows for r in records_from_stock_row(row, TOKEN, shaper)]


def _assert_same(got: list[ChangeRecord], want: list[ChangeRecord]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert type(g) is type(w)
        for field in attrs.fields(type(w)):
            assert getattr(g, field.name) == getattr(w, field.name), field.name
        if isinstance(g, DataChangeRecord):
            assert g.commit_timestamp.ns == w.commit_timestamp.ns  # type: ignore[union-attr]
            for mod in g.mods:
                for part in (mod.keys, mod.new_values, mod.old_values):
                    assert type(part) is dict  # plain Python, never the client's JsonObject
            for col in g.column_types:
                assert type(col.type) is dict


@pytest.mark.parametrize("chunk", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("per_message", [1, 3])
def test_googlesql_rows_match_stock_decoding(chunk: bool, per_message: int) -> None:
    values = [wire.encode_googlesql([r]) for r in RECORDS]
    messages = wire.partial_result_sets(
        wire.row_type(wire.googlesql_column_type()), values,
        rows_per_message=per_message, chunk=chunk,
    )
    if chunk:
        assert any(m.chunked_value for m in messages)
    _assert_same(_stock(messages), RECORDS)
    _assert_same(_fast(messages), RECORDS)


def test_one_row_may_hold_several_records() -> None:
    value = wire.encode_googlesql(RECORDS)
    messages = wire.partial_result_sets(wire.row_type(wire.googlesql_column_type()), [value])
    _assert_same(_fast(messages), RECORDS)
    _assert_same(_stock(messages), RECORDS)


def test_struct_fields_are_found_by_name_in_any_order() -> None:
    """A server that orders or extends the STRUCT differently still decodes."""
    column = wire.googlesql_column_type()
    data_type = column.array_element_type.struct_type.fields[0].type_
    fields = data_type.array_element_type.struct_type.fields
    reordered = list(reversed(list(fields)))
    del fields[:]
    fields.extend(reordered)
    value = wire.encode_googlesql([RECORDS[0]])
    data = value.list_value.values[0].list_value.values[0].list_value.values[0]
    items = list(data.list_value.values)
    del data.list_value.values[:]
    data.list_value.values.extend(reversed(items))
    messages = wire.partial_result_sets(wire.row_type(column), [value])
    _assert_same(_fast(messages), [RECORDS[0]])


def test_null_json_mods_become_empty_maps() -> None:
    value = wire.encode_googlesql([RECORDS[0]])
    data = value.list_value.values[0].list_value.values[0].list_value.values[0]
    old_values = data.list_value.values[6].list_value.values[0].list_value.values[2]
    old_values.null_value = 0
    messages = wire.partial_result_sets(wire.row_type(wire.googlesql_column_type()), [value])
    (got,) = _fast(messages)
    assert isinstance(got, DataChangeRecord)
    assert got.mods[0].old_values == {}
    assert _stock(messages) == [got]


PG_RECORDS: list[ChangeRecord] = [
    *RECORDS,
    PartitionStartRecord(TOKEN, TS, "00000001", ("p1", "p2")),
    PartitionEndRecord(TOKEN, TS, "00000002"),
    PartitionEventRecord(TOKEN, TS, "00000003", [MoveInEvent("src")], [MoveOutEvent("dst")]),
]


def test_postgresql_jsonb_rows_match_stock_decoding() -> None:
    values = [wire.encode_postgresql(r) for r in PG_RECORDS]
    messages = wire.partial_result_sets(
        wire.row_type(wire.postgresql_column_type(), "read_json_orders"), values, chunk=True
    )
    _assert_same(_fast(messages), PG_RECORDS)
    _assert_same(_stock(messages), PG_RECORDS)


def test_postgresql_timestamps_with_offsets() -> None:
    obj = {"heartbeat_record": {"timestamp": "2026-11-21T21:43:57.714077+00:00"}}
    (hb,) = decode_json_record(obj, TOKEN)
    assert hb == HeartbeatRecord(TOKEN, Timestamp.parse("2026-11-21T21:43:57.714077Z"))


PROTO_RECORDS: list[ChangeRecord] = [
    _data(4, mods=[Mod({"Id": 4}, {"Name": "n", "Tags": ["x", None], "Doc": None}, {})]),
    HeartbeatRecord(TOKEN, TS),
    PartitionStartRecord(TOKEN, TS, "00000001", ("p1", "p2")),
    PartitionEndRecord(TOKEN, Timestamp.parse("2024-05-01T12:00:05.000000007Z"), "00000002"),
    PartitionEventRecord(TOKEN, TS, "00000003", [MoveInEvent("a"), MoveInEvent("b")],
                         [MoveOutEvent("c")]),
    PartitionEventRecord(TOKEN, TS, "00000004"),
]


@pytest.mark.parametrize("record", PROTO_RECORDS, ids=lambda r: type(r).__name__)
def test_mutable_key_range_protos(record: ChangeRecord) -> None:
    pb = wire.encode_proto(record)
    _assert_same([decode_proto_record(pb, TOKEN)], [record])
    # proto-plus messages (what the GAPIC layer hands out) decode the same way
    _assert_same([decode_proto_record(ChangeStreamRecord.wrap(pb), TOKEN)], [record])


def test_mutable_key_range_proto_column() -> None:
    """A PROTO column carries the serialized ChangeStreamRecord, base64 on the wire."""
    values = [wire.proto_value(r) for r in PROTO_RECORDS]
    messages = wire.partial_result_sets(wire.row_type(wire.proto_column_type()), values)
    _assert_same(_fast(messages), PROTO_RECORDS)
    raw = base64.b64decode(values[0].string_value)
    assert ChangeStreamRecord.deserialize(raw).data_change_record.table == "Orders"


def test_proto_data_record_values_and_types() -> None:
    record = PROTO_RECORDS[0]
    got = decode_proto_record(wire.encode_proto(record), TOKEN)
    assert isinstance(got, DataChangeRecord)
    assert got.column_types[2].type == {"code": "ARRAY", "array_element_type": {"code": "STRING"}}
    assert got.mods[0].new_values == {"Name": "n", "Tags": ["x", None], "Doc": None}
    assert got.mod_type == "UPDATE"
    assert got.value_capture_type == "OLD_AND_NEW_VALUES"


@pytest.mark.parametrize("text", [
    "2024-05-01T12:00:00Z", "2024-05-01T12:00:00.1Z", "2024-05-01T12:00:00.123456Z",
    "2024-05-01T12:00:00.123456789Z", "2024-05-01T12:00:00.123456789+00:00",
    "2024-05-01T14:00:00.5+02:00", "1970-01-01T00:00:00.000000001Z", "2024-05-01t12:00:00z",
])
def test_parse_timestamp_matches_model(text: str) -> None:
    got = parse_timestamp(text)
    assert type(got) is Timestamp
    assert got.ns == Timestamp.parse(text).ns
    assert got.utcoffset() is not None and got.utcoffset().total_seconds() == 0  # type: ignore[union-attr]


def test_parse_timestamp_takes_the_emulator_s_short_years() -> None:
    """The emulator writes a year before 1000 with fewer digits ("1-01-01T00:00:00Z"): a
    typed read of such a TIMESTAMP ended the run with a DecodeError."""
    for short, full in (("1-01-01T00:00:00Z", "0001-01-01T00:00:00Z"),
                        ("99-12-31T23:59:59.5Z", "0099-12-31T23:59:59.5Z"),
                        ("999-01-01T00:00:00+00:00", "0999-01-01T00:00:00Z")):
        assert parse_timestamp(short).ns == Timestamp.parse(full).ns
    for bad in ("-1-01-01T00:00:00Z", "12345-01-01T00:00:00Z", "1-1-01T00:00:00Z",
                "٣-01-01T00:00:00Z"):
        with pytest.raises(ValueError, match=f"not an RFC 3339 timestamp: '{bad}'"):
            parse_timestamp(bad)
    with pytest.raises(ValueError, match="RFC 3339"):
        Timestamp.parse("1-01-01T00:00:00Z")  # a user's own text stays RFC 3339's


def test_parse_timestamp_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="RFC 3339"):
        parse_timestamp("2024-05-01T12:00:00.1234567891Z")
    with pytest.raises(ValueError, match="RFC 3339"):
        parse_timestamp("yesterday at noon, roughly")


@given(st.integers(min_value=0, max_value=(1 << 62)))
def test_parse_timestamp_round_trips_nanoseconds(ns: int) -> None:
    ts = Timestamp.from_ns(ns)
    parsed = parse_timestamp(ts.rfc3339())
    assert parsed.ns == ns
    assert parsed == ts
    assert hash(parsed) == hash(ts)


def test_column_types_are_shared_between_records() -> None:
    values = [wire.encode_googlesql([_data(i)]) for i in range(3)]
    messages = wire.partial_result_sets(wire.row_type(wire.googlesql_column_type()), values)
    got = _fast(messages)
    assert all(isinstance(r, DataChangeRecord) for r in got)
    first = got[0].column_types  # type: ignore[union-attr]
    assert all(r.column_types is first for r in got)  # type: ignore[union-attr]
    assert orjson.loads(orjson.dumps([c.type for c in first])) == [c.type for c in COLUMNS]


# --- every column type, typed, in every wire shape ------------------------------------------


def _t(code: str, annotation: str | None = None, element: dict[str, Any] | None = None
       ) -> dict[str, Any]:
    t: dict[str, Any] = {"code": code}
    if annotation is not None:
        t["type_annotation"] = annotation
    if element is not None:
        t["array_element_type"] = element
    return t


# Column types as the emulator reports them (GoogleSQL; the PostgreSQL dialect annotates
# NUMERIC and JSON, and INT64 for oid), with each column's value in the wire form the
# stream sends and the Python value it decodes to.
ALL_TYPES: list[tuple[str, dict[str, Any], dict[str, Any], Any, Any]] = [
    # name, GoogleSQL type, PostgreSQL type, wire value, Python value
    ("I", _t("INT64"), _t("INT64"), "-9223372036854775808", -(2**63)),
    ("O", _t("INT64"), _t("INT64", "PG_OID"), "4294967295", 2**32 - 1),
    ("F64", _t("FLOAT64"), _t("FLOAT64"), "-Infinity", float("-inf")),
    ("F32", _t("FLOAT32"), _t("FLOAT32"), 0.5, 0.5),
    ("N", _t("NUMERIC"), _t("NUMERIC", "PG_NUMERIC"), "12345678901234567890.123456789",
     Decimal("12345678901234567890.123456789")),
    ("B", _t("BOOL"), _t("BOOL"), True, True),
    ("S", _t("STRING"), _t("STRING"), "zoë", "zoë"),
    ("Bt", _t("BYTES"), _t("BYTES"), "AP8=", b"\x00\xff"),
    ("D", _t("DATE"), _t("DATE"), "2024-02-29", date(2024, 2, 29)),
    ("T", _t("TIMESTAMP"), _t("TIMESTAMP"), "2024-05-01T12:00:00.123456789Z",
     Timestamp.parse("2024-05-01T12:00:00.123456789Z")),
    ("J", _t("JSON"), _t("JSON", "PG_JSONB"), '{"a": [1, 2.5, null], "b": "x"}',
     {"a": [1, 2.5, None], "b": "x"}),
    ("AI", _t("ARRAY", element=_t("INT64")), _t("ARRAY", element=_t("INT64")), ["1", None, "3"],
     [1, None, 3]),
    ("AF", _t("ARRAY", element=_t("FLOAT64")), _t("ARRAY", element=_t("FLOAT64")),
     [1.5, "Infinity", None], [1.5, float("inf"), None]),
    ("AN", _t("ARRAY", element=_t("NUMERIC")),
     _t("ARRAY", element=_t("NUMERIC", "PG_NUMERIC")), ["1.10", "NaN"], None),
    ("AJ", _t("ARRAY", element=_t("JSON")), _t("ARRAY", element=_t("JSON", "PG_JSONB")),
     ['{"k": 1}', None], [{"k": 1}, None]),
    ("AT", _t("ARRAY", element=_t("TIMESTAMP")), _t("ARRAY", element=_t("TIMESTAMP")),
     ["2024-01-01T00:00:00Z"], [Timestamp.parse("2024-01-01T00:00:00Z")]),
    ("AD", _t("ARRAY", element=_t("DATE")), _t("ARRAY", element=_t("DATE")), ["0001-01-01"],
     [date(1, 1, 1)]),
    ("AB", _t("ARRAY", element=_t("BYTES")), _t("ARRAY", element=_t("BYTES")), ["YWI="],
     [b"ab"]),
    ("ABo", _t("ARRAY", element=_t("BOOL")), _t("ARRAY", element=_t("BOOL")), [True, None],
     [True, None]),
    ("AS", _t("ARRAY", element=_t("STRING")), _t("ARRAY", element=_t("STRING")), ["a", None],
     ["a", None]),
    # a type code this version does not know (a number, so protobuf encodes it too)
    ("X", {"code": 99}, {"code": 99}, "kept as sent", "kept as sent"),
    ("Null", _t("INT64"), _t("INT64"), None, None),
]
WIRE_ROW = {name: wire_value for name, _, _, wire_value, _ in ALL_TYPES}


def _all_types_record(dialect: str) -> DataChangeRecord:
    column = 1 if dialect == "GOOGLE_STANDARD_SQL" else 2
    columns = [ColumnType("Id", {"code": "INT64"}, True, 1)] + [
        ColumnType(row[0], row[column], False, i) for i, row in enumerate(ALL_TYPES, 2)
    ]
    return _data(9, column_types=columns, mods=[
        Mod({"Id": "9"}, dict(WIRE_ROW), {"I": "1", "F64": "NaN", "N": "NaN", "J": "null"}),
    ])


def _check_typed(got: DataChangeRecord) -> None:
    (mod,) = got.mods
    assert mod.keys == {"Id": 9}
    for name, _, _, _, python in ALL_TYPES:
        value = mod.new_values[name]
        if name == "AN":
            assert value[0] == Decimal("1.10") and value[1].is_nan()
            continue
        assert value == python, name
        assert type(value) is type(python), name
    assert mod.new_values["T"].nanosecond == 789
    assert mod.old_values["I"] == 1
    assert math.isnan(mod.old_values["F64"]) and mod.old_values["N"].is_nan()
    assert mod.old_values["J"] is None  # JSON null


def _messages(shape: str, records: list[ChangeRecord]) -> list[Any]:
    if shape == "postgresql":
        return wire.partial_result_sets(wire.row_type(wire.postgresql_column_type()),
                                        [wire.encode_postgresql(r) for r in records])
    if shape == "proto":
        return wire.partial_result_sets(wire.row_type(wire.proto_column_type()),
                                        [wire.proto_value(r) for r in records])
    return wire.partial_result_sets(wire.row_type(wire.googlesql_column_type()),
                                    [wire.encode_googlesql([r]) for r in records])


@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
@pytest.mark.parametrize("shape", ["googlesql", "postgresql", "proto", "stock"])
def test_every_type_is_typed(shape: str, dialect: str) -> None:
    record = _all_types_record(dialect)
    messages = _messages("googlesql" if shape == "stock" else shape, [record])
    (got,) = _stock(messages) if shape == "stock" else _fast(messages)
    assert isinstance(got, DataChangeRecord)
    assert got.column_types == record.column_types
    _check_typed(got)


@pytest.mark.parametrize("shape", ["googlesql", "postgresql", "proto", "stock"])
def test_typed_false_keeps_the_wire_form(shape: str) -> None:
    record = _all_types_record("POSTGRESQL")
    messages = _messages("googlesql" if shape == "stock" else shape, [record])
    wire_shaper = RecordShaper(typed=False)
    (got,) = _stock(messages, wire_shaper) if shape == "stock" else _fast(messages, wire_shaper)
    assert isinstance(got, DataChangeRecord)
    assert got.mods[0].keys == {"Id": "9"}
    assert got.mods[0].new_values == WIRE_ROW
    assert got.mods[0].new_values["J"] == '{"a": [1, 2.5, null], "b": "x"}'  # JSON text
    assert got == record


def test_a_value_that_is_not_its_wire_form_names_the_column() -> None:
    record = _data(1, mods=[Mod({"Id": "one"}, {"Name": "n"}, {})])
    messages = _messages("googlesql", [record])
    with pytest.raises(DecodeError, match=r"column 'Id' of 'Orders' \(INT64\).*'one'.*typed=False"):
        _fast(messages)
    assert _fast(messages, RecordShaper(typed=False))[0] == record


def test_typed_records_round_trip_through_every_encoder() -> None:
    typed = _fast(_messages("googlesql", [_all_types_record("POSTGRESQL")]))
    for shape in ("googlesql", "postgresql", "proto"):
        again = _fast(_messages(shape, typed))
        assert len(again) == 1
        _check_typed(again[0])  # type: ignore[arg-type]
