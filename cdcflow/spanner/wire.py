"""Model records in the wire shapes a change stream query returns.

The inverse of :mod:`cdcflow.spanner.decode`, for tests, benchmarks and fake servers:
GoogleSQL ``ChangeRecord`` STRUCT rows, PostgreSQL JSONB rows, MUTABLE_KEY_RANGE
``ChangeStreamRecord`` protos, and the ``PartialResultSet`` messages that carry them
(optionally split into chunks, as Spanner does with large values).

Mod values may be Python values or wire values: each is put in Spanner's wire form for its
column's type first (see :func:`cdcflow.spanner.values.encoder_for`; a str for a JSON column
is taken as JSON text), so a typed record round-trips through an encoder and the decoder.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from cdcflow.model import (
    ChangeRecord,
    ChildPartitionsRecord,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    PartitionEndRecord,
    PartitionEventRecord,
    PartitionStartRecord,
    Timestamp,
)
from cdcflow.serialize import json_dumps
from cdcflow.spanner.values import encode_values, encoders

__all__ = [
    "encode_googlesql",
    "encode_postgresql",
    "encode_proto",
    "googlesql_column_type",
    "partial_result_sets",
    "postgresql_column_type",
    "proto_column_type",
    "proto_value",
    "row_type",
    "rows_of",
    "service_unavailable",
    "string_rows",
]

_DATA_FIELDS: list[tuple[str, Any]] = [
    ("commit_timestamp", "TIMESTAMP"),
    ("record_sequence", "STRING"),
    ("server_transaction_id", "STRING"),
    ("is_last_record_in_transaction_in_partition", "BOOL"),
    ("table_name", "STRING"),
    ("column_types", [("name", "STRING"), ("type", "JSON"), ("is_primary_key", "BOOL"),
                      ("ordinal_position", "INT64")]),
    ("mods", [("keys", "JSON"), ("new_values", "JSON"), ("old_values", "JSON")]),
    ("mod_type", "STRING"),
    ("value_capture_type", "STRING"),
    ("number_of_records_in_transaction", "INT64"),
    ("number_of_partitions_in_transaction", "INT64"),
    ("transaction_tag", "STRING"),
    ("is_system_transaction", "BOOL"),
]
_RECORD_FIELDS: list[tuple[str, Any]] = [
    ("data_change_record", _DATA_FIELDS),
    ("heartbeat_record", [("timestamp", "TIMESTAMP")]),
    ("child_partitions_record", [
        ("start_timestamp", "TIMESTAMP"),
        ("record_sequence", "STRING"),
        ("child_partitions", [("token", "STRING"), ("parent_partition_tokens", ["STRING"])]),
    ]),
]


def _type(spec: Any) -> Any:
    """A spanner Type proto: "CODE", [(name, spec), ...] (ARRAY<STRUCT>), ["CODE"] (ARRAY)."""
    from google.cloud.spanner_v1.types import StructType, Type, TypeCode

    if isinstance(spec, str):
        return Type(code=getattr(TypeCode, spec))
    if len(spec) == 1 and isinstance(spec[0], str):
        return Type(code=TypeCode.ARRAY, array_element_type=Type(code=getattr(TypeCode, spec[0])))
    fields = [StructType.Field(name=name, type_=_type(sub)) for name, sub in spec]
    return Type(
        code=TypeCode.ARRAY,
        array_element_type=Type(code=TypeCode.STRUCT, struct_type=StructType(fields=fields)),
    )


def googlesql_column_type() -> Any:
    """The ``ChangeRecord`` column type of a GoogleSQL IMMUTABLE_KEY_RANGE stream (protobuf)."""
    from google.cloud.spanner_v1.types import Type

    return Type.pb(_type(_RECORD_FIELDS))


def postgresql_column_type() -> Any:
    from google.cloud.spanner_v1.types import Type, TypeAnnotationCode, TypeCode

    return Type.pb(Type(code=TypeCode.JSON, type_annotation=TypeAnnotationCode.PG_JSONB))


def proto_column_type() -> Any:
    from google.cloud.spanner_v1.types import Type, TypeCode

    return Type.pb(Type(code=TypeCode.PROTO, proto_type_fqn="google.spanner.v1.ChangeStreamRecord"))


def row_type(column_type: Any, name: str = "ChangeRecord") -> Any:
    """A one-column ``StructType`` (protobuf) for result set metadata."""
    from google.cloud.spanner_v1.types import StructType

    pb = StructType.pb(StructType())
    field = pb.fields.add()
    field.name = name
    field.type_.CopyFrom(column_type)
    return pb


# --- values ---------------------------------------------------------------------------------


def _v(x: Any) -> Any:
    """A protobuf Value holding ``x`` (str/bool/None/list of those)."""
    from google.protobuf.struct_pb2 import NULL_VALUE, Value

    v = Value()
    if x is None:
        v.null_value = NULL_VALUE
    elif isinstance(x, bool):
        v.bool_value = x
    elif isinstance(x, str):
        v.string_value = x
    elif isinstance(x, int):
        v.string_value = str(x)
    elif isinstance(x, list | tuple):
        v.list_value.values.extend(_v(i) for i in x)
    else:
        msg = f"cannot encode {x!r}"
        raise TypeError(msg)
    return v


def _json(x: Any) -> str:
    return json_dumps(x, sort_keys=True).decode()


def _wire_mods(record: DataChangeRecord) -> list[Mod]:
    """The record's mods with every value in the wire form of its column's type."""
    convs = encoders(record.column_types)
    return [
        Mod(encode_values(m.keys, convs), encode_values(m.new_values, convs),
            encode_values(m.old_values, convs))
        for m in record.mods
    ]


def _struct_of(record: ChangeRecord) -> list[Any]:
    """The STRUCT<data, heartbeat, child> for one record, as nested Python lists."""
    if isinstance(record, DataChangeRecord):
        data = [
            record.commit_timestamp.rfc3339(),
            record.record_sequence,
            record.server_transaction_id,
            record.is_last_record_in_transaction_in_partition,
            record.table_name,
            [[c.name, _json(c.type), c.is_primary_key, c.ordinal_position]
             for c in record.column_types],
            [[_json(m.keys), _json(m.new_values), _json(m.old_values)]
             for m in _wire_mods(record)],
            record.mod_type,
            record.value_capture_type,
            record.number_of_records_in_transaction,
            record.number_of_partitions_in_transaction,
            record.transaction_tag,
            record.is_system_transaction,
        ]
        return [[data], [], []]
    if isinstance(record, HeartbeatRecord):
        return [[], [[record.timestamp.rfc3339()]], []]
    if isinstance(record, ChildPartitionsRecord):
        child = [
            record.start_timestamp.rfc3339(),
            record.record_sequence,
            [[c.token, list(c.parent_partition_tokens)] for c in record.child_partitions],
        ]
        return [[], [], [child]]
    msg = f"{type(record).__name__} has no GoogleSQL STRUCT form (MUTABLE_KEY_RANGE uses protos)"
    raise TypeError(msg)


def encode_googlesql(records: Sequence[ChangeRecord]) -> Any:
    """One GoogleSQL row value: ``ARRAY<STRUCT<...>>`` with one STRUCT per record."""
    return _v([_struct_of(r) for r in records])


def _json_of(record: ChangeRecord) -> dict[str, Any]:
    if isinstance(record, DataChangeRecord):
        return {"data_change_record": {
            "commit_timestamp": record.commit_timestamp.rfc3339(),
            "record_sequence": record.record_sequence,
            "server_transaction_id": record.server_transaction_id,
            "is_last_record_in_transaction_in_partition":
                record.is_last_record_in_transaction_in_partition,
            "table_name": record.table_name,
            "column_types": [
                {"name": c.name, "type": c.type, "is_primary_key": c.is_primary_key,
                 "ordinal_position": c.ordinal_position}
                for c in record.column_types
            ],
            "mods": [
                {"keys": m.keys, "new_values": m.new_values, "old_values": m.old_values}
                for m in _wire_mods(record)
            ],
            "mod_type": record.mod_type,
            "value_capture_type": record.value_capture_type,
            "number_of_records_in_transaction": record.number_of_records_in_transaction,
            "number_of_partitions_in_transaction": record.number_of_partitions_in_transaction,
            "transaction_tag": record.transaction_tag,
            "is_system_transaction": record.is_system_transaction,
        }}
    if isinstance(record, HeartbeatRecord):
        return {"heartbeat_record": {"timestamp": record.timestamp.rfc3339()}}
    if isinstance(record, ChildPartitionsRecord):
        return {"child_partitions_record": {
            "start_timestamp": record.start_timestamp.rfc3339(),
            "record_sequence": record.record_sequence,
            "child_partitions": [
                {"token": c.token, "parent_partition_tokens": list(c.parent_partition_tokens)}
                for c in record.child_partitions
            ],
        }}
    if isinstance(record, PartitionStartRecord):
        return {"partition_start_record": {
            "start_timestamp": record.start_timestamp.rfc3339(),
            "record_sequence": record.record_sequence,
            "partition_tokens": list(record.partition_tokens),
        }}
    if isinstance(record, PartitionEndRecord):
        return {"partition_end_record": {
            "end_timestamp": record.end_timestamp.rfc3339(),
            "record_sequence": record.record_sequence,
            "partition_token": record.partition_token,
        }}
    return {"partition_event_record": {
        "commit_timestamp": record.commit_timestamp.rfc3339(),
        "record_sequence": record.record_sequence,
        "partition_token": record.partition_token,
        "move_in_events": [{"source_partition_token": e.source_partition_token}
                           for e in record.move_in_events],
        "move_out_events": [{"destination_partition_token": e.destination_partition_token}
                            for e in record.move_out_events],
    }}


def encode_postgresql(record: ChangeRecord) -> Any:
    """One PostgreSQL row value: the record as JSONB text."""
    return _v(_json(_json_of(record)))


# --- MUTABLE_KEY_RANGE protos ---------------------------------------------------------------


def _pb_ts(target: Any, ts: Timestamp) -> None:
    seconds, nanos = divmod(ts.ns, 1_000_000_000)
    target.seconds = seconds
    target.nanos = nanos


def _pb_value(target: Any, x: Any) -> None:
    from google.protobuf.struct_pb2 import NULL_VALUE

    if x is None:
        target.null_value = NULL_VALUE
    elif isinstance(x, bool):
        target.bool_value = x
    elif isinstance(x, str):
        target.string_value = x
    elif isinstance(x, int | float):
        target.number_value = float(x)
    elif isinstance(x, list | tuple):
        for item in x:
            _pb_value(target.list_value.values.add(), item)
    elif isinstance(x, dict):
        for k, item in x.items():
            _pb_value(target.struct_value.fields[k], item)
    else:
        msg = f"cannot encode {x!r}"
        raise TypeError(msg)


def encode_proto(record: ChangeRecord) -> Any:
    """The record as a raw protobuf ``google.spanner.v1.ChangeStreamRecord``."""
    from google.cloud.spanner_v1.types import ChangeStreamRecord
    from google.protobuf.json_format import ParseDict

    pb = ChangeStreamRecord.pb()()
    if isinstance(record, DataChangeRecord):
        r = pb.data_change_record
        _pb_ts(r.commit_timestamp, record.commit_timestamp)
        r.record_sequence = record.record_sequence
        r.server_transaction_id = record.server_transaction_id
        r.is_last_record_in_transaction_in_partition = (
            record.is_last_record_in_transaction_in_partition
        )
        r.table = record.table_name
        index = {}
        for i, c in enumerate(record.column_types):
            col = r.column_metadata.add()
            col.name = c.name
            ParseDict(c.type, col.type_)
            col.is_primary_key = c.is_primary_key
            col.ordinal_position = c.ordinal_position
            index[c.name] = i
        for m in _wire_mods(record):
            mod = r.mods.add()
            for target, values in (
                (mod.keys, m.keys), (mod.new_values, m.new_values), (mod.old_values, m.old_values)
            ):
                for name, value in values.items():
                    mv = target.add()
                    mv.column_metadata_index = index[name]
                    _pb_value(mv.value, value)
        r.mod_type = type(r).ModType.Value(record.mod_type)
        r.value_capture_type = type(r).ValueCaptureType.Value(record.value_capture_type)
        r.number_of_records_in_transaction = record.number_of_records_in_transaction
        r.number_of_partitions_in_transaction = record.number_of_partitions_in_transaction
        r.transaction_tag = record.transaction_tag
        r.is_system_transaction = record.is_system_transaction
    elif isinstance(record, HeartbeatRecord):
        _pb_ts(pb.heartbeat_record.timestamp, record.timestamp)
    elif isinstance(record, PartitionStartRecord):
        s = pb.partition_start_record
        _pb_ts(s.start_timestamp, record.start_timestamp)
        s.record_sequence = record.record_sequence
        s.partition_tokens.extend(record.partition_tokens)
    elif isinstance(record, PartitionEndRecord):
        e = pb.partition_end_record
        _pb_ts(e.end_timestamp, record.end_timestamp)
        e.record_sequence = record.record_sequence
        e.partition_token = record.partition_token
    elif isinstance(record, PartitionEventRecord):
        v = pb.partition_event_record
        _pb_ts(v.commit_timestamp, record.commit_timestamp)
        v.record_sequence = record.record_sequence
        v.partition_token = record.partition_token
        for ev in record.move_in_events:
            v.move_in_events.add().source_partition_token = ev.source_partition_token
        for out in record.move_out_events:
            v.move_out_events.add().destination_partition_token = out.destination_partition_token
    else:
        msg = f"{type(record).__name__} has no ChangeStreamRecord form"
        raise TypeError(msg)
    return pb


def proto_value(record: ChangeRecord) -> Any:
    """A row value for a PROTO column: the serialized ChangeStreamRecord, base64 text."""
    return _v(base64.b64encode(encode_proto(record).SerializeToString()).decode())


def rows_of(shape: str, records: Sequence[ChangeRecord]) -> tuple[Any, list[Any]]:
    """The ChangeRecord column's type and one row value per record, as a result set of
    ``shape`` holds them: ``"googlesql"`` (one ChangeRecord STRUCT array a row),
    ``"postgresql"`` (JSONB text) or ``"proto"`` (MUTABLE_KEY_RANGE protos)."""
    if shape == "googlesql":
        return googlesql_column_type(), [encode_googlesql([r]) for r in records]
    if shape == "postgresql":
        return postgresql_column_type(), [encode_postgresql(r) for r in records]
    if shape == "proto":
        return proto_column_type(), [proto_value(r) for r in records]
    msg = f"rows_of({shape!r}): use 'googlesql', 'postgresql' or 'proto'"
    raise ValueError(msg)


# --- partial result sets --------------------------------------------------------------------


def _split(value: Any) -> tuple[Any, Any] | None:
    """Split a value in two chunks that Spanner's merge rules join back, or None.

    Strings split in the middle; lists split inside one element (the last element of the
    first chunk and the first of the second are merged again), never at a BOOL or NULL.
    """
    from google.protobuf.struct_pb2 import Value

    kind = value.WhichOneof("kind")
    if kind == "string_value" and len(value.string_value) >= 2:
        text = value.string_value
        half = len(text) // 2
        return Value(string_value=text[:half]), Value(string_value=text[half:])
    if kind == "list_value":
        items = list(value.list_value.values)
        order = sorted(range(len(items)), key=lambda i: abs(i - len(items) // 2))
        for i in order:
            parts = _split(items[i])
            if parts is not None:
                left, right = Value(), Value()
                left.list_value.values.extend([*items[:i], parts[0]])
                right.list_value.values.extend([parts[1], *items[i + 1:]])
                return left, right
    return None


def partial_result_sets(
    row_type_pb: Any,
    values: Iterable[Any],
    *,
    rows_per_message: int = 1,
    chunk: bool = False,
) -> list[Any]:
    """PartialResultSet protos (raw) for one-column rows; metadata rides on the first.

    With ``chunk=True`` every row is split across two messages (``chunked_value``).
    """
    from google.cloud.spanner_v1.types import PartialResultSet

    cls = PartialResultSet.pb()
    out: list[Any] = []
    batch: list[Any] = []

    def flush(chunked: bool = False) -> None:
        prs = cls()
        if not out:
            prs.metadata.row_type.CopyFrom(row_type_pb)
        prs.values.extend(batch)
        prs.chunked_value = chunked
        out.append(prs)
        batch.clear()

    for value in values:
        if chunk:
            parts = _split(value)
            if parts is not None:
                batch.append(parts[0])
                flush(chunked=True)
                batch.append(parts[1])
                flush()
                continue
        batch.append(value)
        if len(batch) >= rows_per_message:
            flush()
    if batch or not out:
        flush()
    return out


def string_rows(columns: Sequence[str], rows: Sequence[Sequence[str | None]]) -> list[Any]:
    """PartialResultSet protos (raw) for a result of STRING columns, e.g. an
    information_schema query a fake server answers."""
    from google.cloud.spanner_v1.types import StructType, Type, TypeCode

    string = Type.pb(Type(code=TypeCode.STRING))
    struct = StructType.pb(StructType())
    for name in columns:
        field = struct.fields.add()
        field.name = name
        field.type_.CopyFrom(string)
    values = [_v(v) for row in rows for v in row]
    return partial_result_sets(struct, values, rows_per_message=max(1, len(values)))


def service_unavailable(message: str = "connection reset") -> BaseException:
    """The client library's UNAVAILABLE error (what a reset connection raises), which the
    reader retries: for test transports that inject faults."""
    from google.api_core import exceptions

    unavailable: Callable[[str], BaseException] = exceptions.ServiceUnavailable
    return unavailable(message)
