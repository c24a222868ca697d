"""Change-stream rows to model records, fast.

A change stream query returns one column per row, in one of three shapes:

* GoogleSQL, IMMUTABLE_KEY_RANGE: ``ARRAY<STRUCT<data_change_record ARRAY<STRUCT<...>>,
  heartbeat_record ARRAY<...>, child_partitions_record ARRAY<...>>>``;
* PostgreSQL: one JSONB object per row, keyed by the record type;
* MUTABLE_KEY_RANGE: a ``google.spanner.v1.ChangeStreamRecord`` protobuf message.

The decoders here read the protobuf ``Value`` of that column directly (the values the
stock client yields with ``lazy_decode=True``) and build model records from plain Python
values, parsing every JSON text with orjson. Struct fields are found by name from the
result metadata, so added fields do not break decoding.

Mods are shaped by a :class:`~cdcflow.spanner.shape.RecordShaper` (by default: values
typed from the column types, nothing filtered). Identical ``column_types`` of a table are
decoded once into a plan (the shared column types and one converter per column), which is
most of the work saved on tables with many columns. The table name and mod type are read
before anything else of a record: a record the shaper's filter does not want is never
decoded further, and becomes a HeartbeatRecord at its commit timestamp (so a reader's
position still advances past it; the GoogleSQL decoder yields one per position for a run
of dropped records, which share the commit timestamp of their transaction).

:func:`records_from_stock_row` converts a row the stock client decoded (the slow path)
into the same records; tests and the benchmark compare both.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

import orjson

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
from cdcflow.spanner.records import DATA_LAYOUT, MOD_LAYOUT, TOP_LAYOUT, DataBuilder
from cdcflow.spanner.shape import RecordShaper, default_shaper
from cdcflow.spanner.values import parse_timestamp

__all__ = [
    "DecodeError",
    "RowDecoder",
    "decode_json_record",
    "decode_proto_record",
    "parse_timestamp",
    "plain_value",
    "records_from_stock_row",
    "row_decoder",
    "text_decoder",
]

#: Decodes the first column of one result row (a protobuf ``Value``) into records.
RowDecoder = Callable[[Any], list[ChangeRecord]]

_loads = orjson.loads


def _json_obj(text: str) -> Any:
    # A NULL JSON value arrives as a Value whose string_value is "".
    return _loads(text) if text else {}


def _field_index(struct_type: Any) -> dict[str, int]:
    return {f.name: i for i, f in enumerate(struct_type.fields)}


def _element_struct(array_type: Any) -> Any:
    return array_type.array_element_type.struct_type


# --- GoogleSQL STRUCT rows ------------------------------------------------------------------


_DATA_LAYOUT = DATA_LAYOUT
_TOP_LAYOUT = TOP_LAYOUT
_MOD_LAYOUT = MOD_LAYOUT


def _names(struct_type: Any) -> tuple[str, ...]:
    return tuple(f.name for f in struct_type.fields)


class _StructDecoder:
    """Decodes the GoogleSQL ChangeRecord column for one result set's metadata.

    Reading a protobuf field builds a Python wrapper object, which dominates the cost,
    so when the metadata has the documented field order the fields are unpacked in one
    step; any other order (fields added by a newer server) goes through name lookups.
    The record itself is made by a :class:`~cdcflow.spanner.records.DataBuilder`.
    """

    def __init__(self, column_type: Any, shaper: RecordShaper = default_shaper) -> None:
        self._builder = DataBuilder(shaper)
        outer = _element_struct(column_type)
        top = _field_index(outer)
        types = {f.name: f.type_ for f in outer.fields}
        self._data_i = top.get("data_change_record", -1)
        self._hb_i = top.get("heartbeat_record", -1)
        self._cp_i = top.get("child_partitions_record", -1)
        self._fast_top = _names(outer) == _TOP_LAYOUT
        self._fast_data = False
        self._fast_mods = False
        self._d: dict[str, int] = {}
        if self._data_i >= 0:
            data_struct = _element_struct(types["data_change_record"])
            self._d = _field_index(data_struct)
            dtype = {f.name: f.type_ for f in data_struct.fields}
            mod_struct = _element_struct(dtype["mods"])
            m = _field_index(mod_struct)
            self._mod_keys = m["keys"]
            self._mod_new = m.get("new_values", -1)
            self._mod_old = m.get("old_values", -1)
            c = _field_index(_element_struct(dtype["column_types"]))
            self._col = (c["name"], c["type"], c["is_primary_key"], c["ordinal_position"])
            self._fast_data = _names(data_struct) == _DATA_LAYOUT
            self._fast_mods = _names(mod_struct) == _MOD_LAYOUT
        if self._cp_i >= 0:
            cp_struct = _element_struct(types["child_partitions_record"])
            self._cp = _field_index(cp_struct)
            inner = {f.name: f.type_ for f in cp_struct.fields}
            self._child = _field_index(_element_struct(inner["child_partitions"]))

    def __call__(self, value: Any, token: str) -> list[ChangeRecord]:
        out: list[ChangeRecord] = []
        data_i, hb_i, cp_i = self._data_i, self._hb_i, self._cp_i
        for change_record in value.list_value.values:
            if self._fast_top:
                data, heartbeats, children = change_record.list_value.values
            else:
                fields = change_record.list_value.values
                data = fields[data_i] if data_i >= 0 else None
                heartbeats = fields[hb_i] if hb_i >= 0 else None
                children = fields[cp_i] if cp_i >= 0 else None
            if data is not None:
                for rec in data.list_value.values:
                    decoded = self._data(rec.list_value.values, token)
                    if decoded is not None:
                        out.append(decoded)
            if heartbeats is not None:
                for rec in heartbeats.list_value.values:
                    ts = parse_timestamp(rec.list_value.values[0].string_value)
                    out.append(HeartbeatRecord(token, ts))
            if children is not None:
                for rec in children.list_value.values:
                    out.append(self._child_partitions(rec.list_value.values, token))
        return out

    def _columns(self, raw: bytes) -> list[ColumnType]:
        """The column types of their serialized ``ListValue``."""
        from google.protobuf.struct_pb2 import ListValue

        name_i, type_i, pk_i, pos_i = self._col
        columns = []
        for col in ListValue.FromString(raw).values:
            f = col.list_value.values
            columns.append(ColumnType(
                f[name_i].string_value, _json_obj(f[type_i].string_value),
                f[pk_i].bool_value, int(f[pos_i].string_value),
            ))
        return columns

    def _mod_texts(self, value: Any) -> list[str]:
        """The mods' JSON texts: keys, new values, old values of each in turn ("" for
        NULL)."""
        if self._fast_mods:
            return [v.string_value for m in value.list_value.values for v in m.list_value.values]
        ki, ni, oi = self._mod_keys, self._mod_new, self._mod_old
        texts = []
        for mod in value.list_value.values:
            m = mod.list_value.values
            texts.append(m[ki].string_value)
            texts.append(m[ni].string_value if ni >= 0 else "")
            texts.append(m[oi].string_value if oi >= 0 else "")
        return texts

    def _data(self, f: Any, token: str) -> DataChangeRecord | HeartbeatRecord | None:
        builder = self._builder
        d = self._d
        # The table name and mod type first: a record the filter drops costs only these.
        table_name = f[d["table_name"]].string_value
        mod_type_name = f[d["mod_type"]].string_value
        if not builder.shaper.wants(table_name, mod_type_name):
            return builder.stand_in(token, f[d["commit_timestamp"]].string_value)
        if self._fast_data:
            (ts, seq, txn, last, _, cols, mods, _, vct, n_rec, n_part, tag, system) = f
        else:
            ts, seq, txn, last, _, cols, mods, _, vct, n_rec, n_part = (
                f[d[name]] for name in _DATA_LAYOUT[:11]
            )
            tag_i = d.get("transaction_tag", -1)
            sys_i = d.get("is_system_transaction", -1)
            tag = f[tag_i] if tag_i >= 0 else None
            system = f[sys_i] if sys_i >= 0 else None
        capture = vct.string_value
        plan = builder.plan(table_name, cols.list_value.SerializeToString(), self._columns)
        shaped = builder.mods(plan, self._mod_texts(mods), mod_type_name, capture)
        return builder.record(
            token, ts.string_value, seq.string_value, txn.string_value, last.bool_value,
            table_name, plan, shaped, mod_type_name, capture, n_rec.string_value,
            n_part.string_value, tag.string_value if tag is not None else "",
            system.bool_value if system is not None else False,
        )

    def _child_partitions(self, f: Any, token: str) -> ChildPartitionsRecord:
        cp, ch = self._cp, self._child
        tok_i, parents_i = ch["token"], ch["parent_partition_tokens"]
        children = []
        for child in f[cp["child_partitions"]].list_value.values:
            c = child.list_value.values
            parents = tuple(p.string_value for p in c[parents_i].list_value.values)
            children.append(ChildPartition(c[tok_i].string_value, parents))
        return ChildPartitionsRecord(
            token,
            parse_timestamp(f[cp["start_timestamp"]].string_value),
            f[cp["record_sequence"]].string_value,
            children,
        )


# --- PostgreSQL JSONB rows ------------------------------------------------------------------


def _columns_from_json(items: Iterable[Mapping[str, Any]]) -> tuple[ColumnType, ...]:
    return tuple(
        ColumnType(c["name"], c["type"], bool(c["is_primary_key"]), int(c["ordinal_position"]))
        for c in items
    )


def _data_from_json(
    r: Mapping[str, Any], token: str, shaper: RecordShaper
) -> DataChangeRecord | HeartbeatRecord:
    table = r["table_name"]
    mod_type = r["mod_type"]
    ts = parse_timestamp(r["commit_timestamp"])
    if not shaper.wants(table, mod_type):
        return HeartbeatRecord(token, ts)
    raw_columns = r["column_types"]
    key = ("json", table, orjson.dumps(raw_columns))
    plan = shaper.cached(key) or shaper.plan(key, table, _columns_from_json(raw_columns))
    capture = r["value_capture_type"]
    mods = shaper.mods(
        plan,
        ((m.get("keys") or {}, m.get("new_values") or {}, m.get("old_values") or {})
         for m in r["mods"]),
        mod_type, capture,
    )
    if shaper.dropped(mods):
        return HeartbeatRecord(token, ts)
    return DataChangeRecord(
        partition_token=token,
        commit_timestamp=ts,
        record_sequence=r["record_sequence"],
        server_transaction_id=r["server_transaction_id"],
        is_last_record_in_transaction_in_partition=bool(
            r["is_last_record_in_transaction_in_partition"]
        ),
        table_name=table,
        column_types=plan.columns,
        mods=mods,
        mod_type=mod_type,
        value_capture_type=capture,
        number_of_records_in_transaction=int(r["number_of_records_in_transaction"]),
        number_of_partitions_in_transaction=int(r["number_of_partitions_in_transaction"]),
        transaction_tag=r.get("transaction_tag") or "",
        is_system_transaction=bool(r.get("is_system_transaction", False)),
    )


def decode_json_record(
    obj: Mapping[str, Any], token: str, shaper: RecordShaper = default_shaper
) -> list[ChangeRecord]:
    """One PostgreSQL change record (the parsed JSONB object) to model records.

    Keys are the GoogleSQL record names (``data_change_record``, ``heartbeat_record``,
    ``child_partitions_record``; and for MUTABLE_KEY_RANGE ``partition_start_record``,
    ``partition_end_record``, ``partition_event_record``); an object may hold several.
    Data change records are shaped by ``shaper`` (default: typed values, no filter).
    """
    out: list[ChangeRecord] = []
    r = obj.get("data_change_record")
    if r:
        out.append(_data_from_json(r, token, shaper))
    r = obj.get("heartbeat_record")
    if r:
        out.append(HeartbeatRecord(token, parse_timestamp(r["timestamp"])))
    r = obj.get("child_partitions_record")
    if r:
        out.append(ChildPartitionsRecord(
            token, parse_timestamp(r["start_timestamp"]), r["record_sequence"],
            [ChildPartition(c["token"], tuple(c.get("parent_partition_tokens") or ()))
             for c in r["child_partitions"]],
        ))
    r = obj.get("partition_start_record")
    if r:
        out.append(PartitionStartRecord(
            token, parse_timestamp(r["start_timestamp"]), r["record_sequence"],
            tuple(r["partition_tokens"]),
        ))
    r = obj.get("partition_end_record")
    if r:
        out.append(PartitionEndRecord(
            token, parse_timestamp(r["end_timestamp"]), r["record_sequence"]
        ))
    r = obj.get("partition_event_record")
    if r:
        out.append(PartitionEventRecord(
            token, parse_timestamp(r["commit_timestamp"]), r["record_sequence"],
            [MoveInEvent(e["source_partition_token"]) for e in r.get("move_in_events") or ()],
            [MoveOutEvent(e["destination_partition_token"])
             for e in r.get("move_out_events") or ()],
        ))
    return out


def _jsonb_text(shaper: RecordShaper) -> Callable[[str, str], list[ChangeRecord]]:
    def decode(text: str, token: str) -> list[ChangeRecord]:
        return decode_json_record(_loads(text), token, shaper) if text else []

    return decode


def _jsonb_decoder(shaper: RecordShaper) -> Callable[[Any, str], list[ChangeRecord]]:
    text_decode = _jsonb_text(shaper)

    def decode(value: Any, token: str) -> list[ChangeRecord]:
        return text_decode(value.string_value, token)

    return decode


# --- MUTABLE_KEY_RANGE protobuf records -----------------------------------------------------


def _proto_ts(ts: Any) -> Timestamp:
    return Timestamp.from_ns(ts.seconds * 1_000_000_000 + ts.nanos)


def plain_value(value: Any) -> Any:
    """A protobuf ``Value`` as plain Python (Spanner's JSON encoding of a column value)."""
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "null_value" or kind is None:
        return None
    if kind == "bool_value":
        return value.bool_value
    if kind == "number_value":
        return value.number_value
    if kind == "list_value":
        return [plain_value(v) for v in value.list_value.values]
    return {k: plain_value(v) for k, v in value.struct_value.fields.items()}


def _type_json(type_pb: Any) -> Any:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(type_pb, preserving_proto_field_name=True)


def _proto_columns(columns: Any) -> tuple[ColumnType, ...]:
    return tuple(
        ColumnType(c.name, _type_json(c.type_), c.is_primary_key, c.ordinal_position)
        for c in columns
    )


def _mod_values(values: Any, names: tuple[str, ...]) -> dict[str, Any]:
    return {names[v.column_metadata_index]: plain_value(v.value) for v in values}


def _enum_name(message: Any, field: str) -> Any:
    enum = message.DESCRIPTOR.fields_by_name[field].enum_type
    return enum.values_by_number[getattr(message, field)].name


def _proto_data(r: Any, token: str, shaper: RecordShaper) -> DataChangeRecord | HeartbeatRecord:
    mod_type = _enum_name(r, "mod_type")
    if not shaper.wants(r.table, mod_type):
        return HeartbeatRecord(token, _proto_ts(r.commit_timestamp))
    key = ("proto", r.table, b"".join(c.SerializeToString() for c in r.column_metadata))
    plan = shaper.cached(key) or shaper.plan(key, r.table, _proto_columns(r.column_metadata))
    names = plan.names
    capture = _enum_name(r, "value_capture_type")
    mods = shaper.mods(
        plan,
        ((_mod_values(m.keys, names), _mod_values(m.new_values, names),
          _mod_values(m.old_values, names)) for m in r.mods),
        mod_type, capture,
    )
    if shaper.dropped(mods):
        return HeartbeatRecord(token, _proto_ts(r.commit_timestamp))
    return DataChangeRecord(
        partition_token=token,
        commit_timestamp=_proto_ts(r.commit_timestamp),
        record_sequence=r.record_sequence,
        server_transaction_id=r.server_transaction_id,
        is_last_record_in_transaction_in_partition=r.is_last_record_in_transaction_in_partition,
        table_name=r.table,
        column_types=plan.columns,
        mods=mods,
        mod_type=mod_type,
        value_capture_type=capture,
        number_of_records_in_transaction=r.number_of_records_in_transaction,
        number_of_partitions_in_transaction=r.number_of_partitions_in_transaction,
        transaction_tag=r.transaction_tag,
        is_system_transaction=r.is_system_transaction,
    )


def decode_proto_record(
    record: Any, token: str, shaper: RecordShaper = default_shaper
) -> ChangeRecord:
    """A ``google.spanner.v1.ChangeStreamRecord`` (raw protobuf or proto-plus) to a record;
    a data change record is shaped by ``shaper`` (default: typed values, no filter)."""
    pb = getattr(type(record), "pb", None)
    if pb is not None and not hasattr(record, "WhichOneof"):
        record = pb(record)
    kind = record.WhichOneof("record")
    if kind == "data_change_record":
        return _proto_data(record.data_change_record, token, shaper)
    if kind == "heartbeat_record":
        return HeartbeatRecord(token, _proto_ts(record.heartbeat_record.timestamp))
    if kind == "partition_start_record":
        s = record.partition_start_record
        return PartitionStartRecord(
            token, _proto_ts(s.start_timestamp), s.record_sequence, tuple(s.partition_tokens)
        )
    if kind == "partition_end_record":
        e = record.partition_end_record
        return PartitionEndRecord(token, _proto_ts(e.end_timestamp), e.record_sequence)
    if kind == "partition_event_record":
        v = record.partition_event_record
        return PartitionEventRecord(
            token, _proto_ts(v.commit_timestamp), v.record_sequence,
            [MoveInEvent(e.source_partition_token) for e in v.move_in_events],
            [MoveOutEvent(e.destination_partition_token) for e in v.move_out_events],
        )
    msg = f"a ChangeStreamRecord with no known record set ({kind!r}); upgrade cdcflow"
    raise DecodeError(msg)


def _proto_message_class() -> Any:
    from google.cloud.spanner_v1.types import ChangeStreamRecord

    return ChangeStreamRecord.pb()


def _proto_text(shaper: RecordShaper) -> Callable[[str, str], list[ChangeRecord]]:
    def decode(text: str, token: str) -> list[ChangeRecord]:
        raw = base64.b64decode(text)
        return [decode_proto_record(_proto_message_class().FromString(raw), token, shaper)]

    return decode


def _proto_decoder(shaper: RecordShaper) -> Callable[[Any, str], list[ChangeRecord]]:
    text_decode = _proto_text(shaper)

    def decode(value: Any, token: str) -> list[ChangeRecord]:
        if value.WhichOneof("kind") != "string_value":
            return []
        return text_decode(value.string_value, token)

    return decode


# --- choosing a decoder ---------------------------------------------------------------------

_CODE_ARRAY = 8
_CODE_STRUCT = 9
_CODE_JSON = 11
_CODE_PROTO = 13
_CODE_BYTES = 7


def row_decoder(
    column_type: Any, shaper: RecordShaper = default_shaper
) -> Callable[[Any, str], list[ChangeRecord]]:
    """The decoder for a result set's ChangeRecord column, given its ``Type`` (protobuf).

    The returned callable takes the column's ``Value`` and the partition token; data
    change records are shaped by ``shaper`` (default: typed values, no filter).
    """
    code = column_type.code
    if code == _CODE_ARRAY and column_type.array_element_type.code == _CODE_STRUCT:
        return _StructDecoder(column_type, shaper)
    if code == _CODE_JSON:
        return _jsonb_decoder(shaper)
    if code in (_CODE_PROTO, _CODE_BYTES):
        return _proto_decoder(shaper)
    msg = f"unexpected change stream column type {column_type}; upgrade cdcflow"
    raise DecodeError(msg)


def text_decoder(
    column_type: Any, shaper: RecordShaper = default_shaper
) -> Callable[[str, str], list[ChangeRecord]] | None:
    """For a ChangeRecord column that holds one string per row (PostgreSQL JSONB, and
    MUTABLE_KEY_RANGE ChangeStreamRecord protos as base64): the decoder of that string and
    the partition token, as :func:`row_decoder`'s decodes a row whose value is that string
    (a NULL row holds no record). None for any other column type."""
    code = column_type.code
    if code == _CODE_JSON:
        return _jsonb_text(shaper)
    if code in (_CODE_PROTO, _CODE_BYTES):
        return _proto_text(shaper)
    return None


# --- the stock client's decoded rows (reference path) ---------------------------------------


def _plain_json(value: Any) -> Any:
    """The stock client's JsonObject (a dict subclass, or a wrapper of a list/scalar)."""
    if value is None:
        return None
    serialized = getattr(value, "serialize", None)
    if serialized is not None:
        text = serialized()
        return None if text is None else orjson.loads(text)
    return value


def _stock_ts(value: datetime | str) -> Timestamp:
    if isinstance(value, str):
        return parse_timestamp(value)
    return Timestamp.from_datetime(value)


def records_from_stock_row(
    row: list[Any], token: str, shaper: RecordShaper = default_shaper
) -> list[ChangeRecord]:
    """Records from a row the stock client decoded (``snapshot.execute_sql`` defaults).

    GoogleSQL rows are nested lists in metadata order; PostgreSQL rows hold a JsonObject.
    Data change records are shaped by ``shaper`` (default: typed values, no filter). This
    is the reference the fast decoders are tested against.
    """
    value = row[0]
    if not isinstance(value, list):
        obj = _plain_json(value)
        return decode_json_record(obj, token, shaper) if obj else []
    out: list[ChangeRecord] = []
    for data, heartbeats, children in value:
        for d in data:
            out.append(shaper.shape(DataChangeRecord(
                partition_token=token,
                commit_timestamp=_stock_ts(d[0]),
                record_sequence=d[1],
                server_transaction_id=d[2],
                is_last_record_in_transaction_in_partition=d[3],
                table_name=d[4],
                column_types=[ColumnType(c[0], _plain_json(c[1]), c[2], c[3]) for c in d[5]],
                mods=[
                    Mod(_plain_json(m[0]) or {}, _plain_json(m[1]) or {},
                        _plain_json(m[2]) or {})
                    for m in d[6]
                ],
                mod_type=d[7],
                value_capture_type=d[8],
                number_of_records_in_transaction=d[9],
                number_of_partitions_in_transaction=d[10],
                transaction_tag=d[11] if len(d) > 11 else "",
                is_system_transaction=d[12] if len(d) > 12 else False,
            )))
        for h in heartbeats:
            out.append(HeartbeatRecord(token, _stock_ts(h[0])))
        for c in children:
            out.append(ChildPartitionsRecord(
                token, _stock_ts(c[0]), c[1],
                [ChildPartition(p[0], tuple(p[1])) for p in c[2]],
            ))
    return out
