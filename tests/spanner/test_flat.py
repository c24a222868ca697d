"""The reader's decoding of serialized messages (spanner.flat) where its counting cannot
work: every such message must decode exactly as the protobuf rows path decodes it."""

from __future__ import annotations

from typing import Any

import pytest

from cdcflow.model import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    Timestamp,
)
from cdcflow.spanner import wire
from cdcflow.spanner.decode import row_decoder
from cdcflow.spanner.flat import MessageDecoder, decode_messages
from cdcflow.spanner.shape import RecordShaper, default_shaper
from cdcflow.spanner.transport import assemble_rows
from cdcflow.stream import RecordFilter

TOKEN = "p"
TS = Timestamp.parse("2024-05-01T12:00:00.5Z")
COLUMNS = (ColumnType("Id", {"code": "INT64"}, True, 1),
           ColumnType("Name", {"code": "STRING"}, False, 2))


def _data(i: int, **changes: Any) -> DataChangeRecord:
    fields: dict[str, Any] = dict(
        partition_token=TOKEN, commit_timestamp=Timestamp.from_ns(TS.ns + i),
        record_sequence=f"{i:08d}", server_transaction_id=f"t{i}",
        is_last_record_in_transaction_in_partition=True, table_name="T", column_types=COLUMNS,
        mods=[Mod({"Id": i}, {"Name": f"n{i}"}, {})], mod_type="INSERT",
        value_capture_type="NEW_ROW", number_of_records_in_transaction=1,
        number_of_partitions_in_transaction=1,
    )
    fields.update(changes)
    return DataChangeRecord(**fields)


def _messages(values: list[Any], per_message: int = 10) -> list[Any]:
    return wire.partial_result_sets(
        wire.row_type(wire.googlesql_column_type()), values, rows_per_message=per_message
    )


def _both(messages: list[Any], shaper: RecordShaper = default_shaper) -> list[ChangeRecord]:
    rows: list[ChangeRecord] = []
    decode = None
    for row_type, row in assemble_rows(iter(messages)):
        decode = decode or row_decoder(row_type.fields[0].type_, shaper)
        rows.extend(decode(row[0], TOKEN))
    serialized = [m.SerializeToString() for m in messages]
    # a shaper of its own: plans the rows path cached are not used
    fresh = RecordShaper(shaper.typed, shaper.filter)
    assert list(decode_messages(iter(serialized), TOKEN, fresh)) == rows
    return rows


def _field(value: Any, index: int) -> Any:
    """Field ``index`` of the one data change record of a row value."""
    return value.list_value.values[0].list_value.values[0].list_value.values[0].list_value.values[
        index
    ]


def test_a_null_record_field_decodes_by_the_rows_path() -> None:
    values = [wire.encode_googlesql([_data(i)]) for i in range(3)]
    _field(values[1], 11).null_value = 0  # transaction_tag: NULL instead of ""
    got = _both(_messages(values))
    assert [r.transaction_tag for r in got] == ["", "", ""]  # type: ignore[union-attr]


def test_a_null_column_type_decodes_by_the_rows_path() -> None:
    value = wire.encode_googlesql([_data(0)])
    column = _field(value, 5).list_value.values[1]
    column.list_value.values[1].null_value = 0  # the Name column's type: NULL
    (got,) = _both(_messages([value]))
    assert isinstance(got, DataChangeRecord)
    assert got.column_types[1].type == {}


def test_records_without_mods_and_empty_messages() -> None:
    values = [wire.encode_googlesql([_data(0, mods=[])])]
    messages = _messages(values)
    messages.append(type(messages[0])())  # a message with no values
    (got,) = _both(messages)
    assert isinstance(got, DataChangeRecord) and got.mods == ()


def test_heartbeats_between_data_records_and_child_partitions() -> None:
    records: list[ChangeRecord] = [
        _data(0), HeartbeatRecord(TOKEN, Timestamp.from_ns(TS.ns + 1)), _data(2),
        ChildPartitionsRecord(TOKEN, Timestamp.from_ns(TS.ns + 3), "00000009",
                              [ChildPartition("c", (TOKEN,))]),
    ]
    values = [wire.encode_googlesql([r]) for r in records]
    assert _both(_messages(values)) == records
    assert _both(_messages(values, per_message=1)) == records
    only_heartbeats = [wire.encode_googlesql([r]) for r in records if isinstance(
        r, HeartbeatRecord)]
    assert _both(_messages(only_heartbeats)) == [records[1]]


def test_a_filter_drops_records_in_every_path() -> None:
    shaper = RecordShaper(filter=RecordFilter.build(tables=["Other"]))
    records = [_data(0), _data(1), HeartbeatRecord(TOKEN, Timestamp.from_ns(TS.ns + 2))]
    values = [wire.encode_googlesql([r]) for r in records]
    got = _both(_messages(values), shaper)
    assert all(isinstance(r, HeartbeatRecord) for r in got) and len(got) == 3


@pytest.mark.parametrize("shape", ["postgresql", "proto"])
def test_string_rows_with_a_null_row(shape: str) -> None:
    records = [_data(0), _data(1)]
    if shape == "postgresql":
        column = wire.postgresql_column_type()
        values = [wire.encode_postgresql(r) for r in records]
    else:
        column = wire.proto_column_type()
        values = [wire.proto_value(r) for r in records]
    values.insert(1, wire._v(None))
    messages = wire.partial_result_sets(wire.row_type(column), values, rows_per_message=3)
    assert _both(messages) == records


def test_metadata_read_from_the_first_serialized_message_serves_later_chunks() -> None:
    """A fast first message, then a chunked value: the rows path needs the row type."""
    values = [wire.encode_googlesql([_data(i)]) for i in range(3)]
    head = wire.partial_result_sets(wire.row_type(wire.googlesql_column_type()), values[:1])
    tail = wire.partial_result_sets(wire.row_type(wire.googlesql_column_type()), values[1:],
                                    chunk=True)
    for message in tail:
        message.ClearField("metadata")
    decoder = MessageDecoder(default_shaper)
    got: list[ChangeRecord] = []
    for message in [*head, *tail]:
        got.extend(decoder.decode(message.SerializeToString(), TOKEN))
    got.extend(decoder.finish(TOKEN))
    assert got == [_data(i) for i in range(3)]


def _chunked_in_the_middle(column: Any, values: list[Any]) -> list[Any]:
    """Two messages: values 0, 1 and the first half of 2; the rest of 2, then 3 and 4."""
    head, tail = wire._split(values[2])  # type: ignore[misc]
    (first,) = wire.partial_result_sets(wire.row_type(column), [values[0]])
    first.values.extend([values[1], head])
    first.chunked_value = True
    second = type(first)()
    second.values.extend([tail, *values[3:]])
    return [first, second]


@pytest.mark.parametrize("shape", ["googlesql", "postgresql", "proto"])
def test_rows_around_a_chunked_value(shape: str) -> None:
    records = [_data(i) for i in range(5)]
    column, values = wire.rows_of(shape, records)
    messages = _chunked_in_the_middle(column, values)
    assert _both(messages) == records
    # protobuf messages take the same way (serialized first)
    assert list(decode_messages(iter(messages), TOKEN, RecordShaper())) == records


@pytest.mark.parametrize("shape", ["googlesql", "postgresql", "proto"])
def test_every_data_record_comes_measured_a_chunked_large_one_too(shape: str) -> None:
    """Whatever path decodes a record (merged messages, a row at a time, a chunked value
    made whole, a PostgreSQL or proto string), the decoder says its size, near what
    approx_size counts, so that a task never measures a large record again (approx_size
    writes it out as JSON, a copy of the record's size or more)."""
    from cdcflow.engine.quota import approx_size

    records = [_data(i, mods=[Mod({"Id": i}, {"Name": ("x" if i != 2 else "y") * 200_000}, {})])
               for i in range(5)]
    column, values = wire.rows_of(shape, records)
    decoder = MessageDecoder(RecordShaper())
    sizes = []
    for message in _chunked_in_the_middle(column, values):
        for record in decoder.decode(message.SerializeToString(), TOKEN):
            sizes.append((record, decoder.sizes.get(id(record))))
    assert [r for r, _ in sizes] == records
    for record, size in sizes:
        assert size is not None, record.record_sequence
        # the wire's text: the values' (or the whole record's) JSON, a few hundred bytes
        # of names, quotes and braces more; a proto's base64 text, a third more
        most = approx_size(record) * (4 if shape == "proto" else 3) // 3 + 1500
        assert approx_size(record) <= size <= most


def test_a_stream_ending_in_a_chunk_does_not_drop_it_silently() -> None:
    """The rows before come out; the unfinished value is decoded at the end, as the rows
    path does, and half a record fails instead of vanishing."""
    values = [wire.encode_googlesql([_data(i)]) for i in range(2)]
    head, _ = wire._split(values[1])  # type: ignore[misc]
    (message,) = wire.partial_result_sets(wire.row_type(wire.googlesql_column_type()),
                                          [values[0]])
    message.values.append(head)
    message.chunked_value = True
    decoder = MessageDecoder(default_shaper)
    got = decoder.decode(message.SerializeToString(), TOKEN)
    assert got == [_data(0)]
    with pytest.raises(ValueError):  # half a record is not a record
        decoder.finish(TOKEN)


def test_the_decoder_measures_data_records_as_approx_size_does() -> None:
    from cdcflow.engine.quota import approx_size

    records = [_data(i, mods=[Mod({"Id": i}, {"Name": "x" * (100 * i)}, {"Name": None})])
               for i in range(4)]
    messages = _messages([wire.encode_googlesql([r]) for r in records])
    decoder = MessageDecoder(RecordShaper())
    got = decoder.decode(messages[0].SerializeToString(), TOKEN)
    assert got == records
    sizes = [decoder.sizes[id(r)] for r in got]
    for record, size in zip(got, sizes, strict=True):
        # the same measure from the wire: JSON text instead of values (a few bytes of
        # quotes and braces more)
        assert approx_size(record) <= size <= approx_size(record) + 64
    assert sizes[3] - sizes[0] >= 300  # the payload counts
