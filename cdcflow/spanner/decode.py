"""Change-stream rows to model records, fast.

A change stream query returns one column per row, in one of three shapes:

* GoogleSQL, IMMUTABLE_KEY_RANGE: ``ARRAY<STRUCT<data_change_record ARRAY<STRUCT<...>>,
  heartbeat_record ARRAY<...>, child_partitions_record ARRAY<...>>>``;
* PostgreSQL: one JSONB object per row, keyed by the record type;
* MUTABLE_KEY_RANGE: a ``google.spanner.v1.ChangeStreamRecord`` protobuf message.

The decoders here read the protobuf ``Value`` of that column directly (the values the
stock client yields with ``lazy_decode=True``) and build model records from plain Python
values, parsing every JSON text with orjson. Struct fields are found by name from the
result metadata, so added fields do not break decoding. Identical ``column_types`` are
decoded once and shared (records are immutable), which is most of the work saved on
tables with many columns.

:func:`records_from_stock_row` converts a row the stock client decoded (the slow path)
into the same records; tests and the benchmark compare both.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
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

__all__ = [
    "DecodeError",
    "RowDecoder",
    "decode_json_record",
    "decode_proto_record",
    "parse_timestamp",
    "records_from_stock_row",
    "row_decoder",
]

#: Decodes the first column of one result row (a protobuf ``Value``) into records.
RowDecoder = Callable[[Any], list[ChangeRecord]]

_CACHE_LIMIT = 4096
_ts_cache: dict[str, Timestamp] = {}
_second_cache: dict[str, tuple[int, int, int, int, int, int]] = {}
_datetime_new = datetime.__new__
_column_cache: dict[bytes, tuple[ColumnType, ...]] = {}
_loads = orjson.loads


def _parse_fast(text: str) -> Timestamp | None:
    """RFC 3339 in UTC (``Z`` or ``+00:00``) with 0..9 fractional digits, else None."""
    n = len(text)
    if text[-1] == "Z":
        end = n - 1
    elif text.endswith("+00:00"):
        end = n - 6
    else:
        return None
    if end == 19:
        frac = "000000000"
    elif end > 20 and text[19] == "." and end - 20 <= 9:
        frac = text[20:end]
        if len(frac) < 9:
            frac = (frac + "000000000")[:9]
    else:
        return None
    head = _second_cache.get(text[:19])
    if head is None:
        if n < 20 or text[4] != "-" or text[10] not in "Tt ":
            return None
        head = (
            int(text[0:4]), int(text[5:7]), int(text[8:10]),
            int(text[11:13]), int(text[14:16]), int(text[17:19]),
        )
        if len(_second_cache) >= _CACHE_LIMIT:
            _second_cache.clear()
        _second_cache[text[:19]] = head
    # Timestamp's constructor validates keyword arguments in Python; this is the same
    # object built directly (a datetime plus the nanoseconds below the microsecond).
    ts: Timestamp = _datetime_new(Timestamp, *head, int(frac[:6]), UTC)
    ts._nanosecond = int(frac[6:])
    return ts


def parse_timestamp(text: str) -> Timestamp:
    """RFC 3339 text (any number of fractional digits, ``Z`` or an offset) to a Timestamp.

    Many records share a commit timestamp (and a second), so recent values are cached.
    """
    ts = _ts_cache.get(text)
    if ts is not None:
        return ts
    ts = (_parse_fast(text) if len(text) >= 20 else None) or Timestamp.parse(text)
    if len(_ts_cache) >= _CACHE_LIMIT:
        _ts_cache.clear()
    _ts_cache[text] = ts
    return ts


def _json_obj(text: str) -> Any:
    # A NULL JSON value arrives as a Value whose string_value is "".
    return _loads(text) if text else {}


def _field_index(struct_type: Any) -> dict[str, int]:
    return {f.name: i for i, f in enumerate(struct_type.fields)}


def _element_struct(array_type: Any) -> Any:
    return array_type.array_element_type.struct_type


# --- GoogleSQL STRUCT rows ------------------------------------------------------------------


_DATA_LAYOUT = (
    "commit_timestamp", "record_sequence", "server_transaction_id",
    "is_last_record_in_transaction_in_partition", "table_name", "column_types", "mods",
    "mod_type", "value_capture_type", "number_of_records_in_transaction",
    "number_of_partitions_in_transaction", "transaction_tag", "is_system_transaction",
)
_TOP_LAYOUT = ("data_change_record", "heartbeat_record", "child_partitions_record")
_MOD_LAYOUT = ("keys", "new_values", "old_values")


def _names(struct_type: Any) -> tuple[str, ...]:
    return tuple(f.name for f in struct_type.fields)


class _StructDecoder:
    """Decodes the GoogleSQL ChangeRecord column for one result set's metadata.

    Reading a protobuf field builds a Python wrapper object, which dominates the cost,
    so when the metadata has the documented field order the fields are unpacked in one
    step; any other order (fields added by a newer server) goes through name lookups.
    """

    def __init__(self, column_type: Any) -> None:
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
                    out.append(self._data(rec.list_value.values, token))
            if heartbeats is not None:
                for rec in heartbeats.list_value.values:
                    ts = parse_timestamp(rec.list_value.values[0].string_value)
                    out.append(HeartbeatRecord(token, ts))
            if children is not None:
                for rec in children.list_value.values:
                    out.append(self._child_partitions(rec.list_value.values, token))
        return out

    def _columns(self, value: Any) -> tuple[ColumnType, ...]:
        key = value.SerializeToString()
        cols = _column_cache.get(key)
        if cols is None:
            name_i, type_i, pk_i, pos_i = self._col
            built = []
            for col in value.list_value.values:
                f = col.list_value.values
                built.append(ColumnType(
                    f[name_i].string_value, _json_obj(f[type_i].string_value),
                    f[pk_i].bool_value, int(f[pos_i].string_value),
                ))
            cols = tuple(built)
            if len(_column_cache) >= _CACHE_LIMIT:
                _column_cache.clear()
            _column_cache[key] = cols
        return cols

    def _mods(self, value: Any) -> list[Mod]:
        loads = _loads
        mods = []
        if self._fast_mods:
            for mod in value.list_value.values:
                k, n, o = mod.list_value.values
                # NULL JSON arrives as string_value "" (an empty map for the model).
                mods.append(Mod(
                    loads(k.string_value or "{}"), loads(n.string_value or "{}"),
                    loads(o.string_value or "{}"),
                ))
            return mods
        ki, ni, oi = self._mod_keys, self._mod_new, self._mod_old
        for mod in value.list_value.values:
            m = mod.list_value.values
            mods.append(Mod(
                _json_obj(m[ki].string_value),
                _json_obj(m[ni].string_value) if ni >= 0 else {},
                _json_obj(m[oi].string_value) if oi >= 0 else {},
            ))
        return mods

    def _data(self, f: Any, token: str) -> DataChangeRecord:
        if self._fast_data:
            (ts, seq, txn, last, table, cols, mods, mod_type, vct, n_rec, n_part, tag,
             system) = f
            return DataChangeRecord(
                token, parse_timestamp(ts.string_value), seq.string_value, txn.string_value,
                last.bool_value, table.string_value, self._columns(cols), self._mods(mods),
                mod_type.string_value, vct.string_value,
                int(n_rec.string_value), int(n_part.string_value), tag.string_value,
                system.bool_value,
            )
        d = self._d
        tag_i = d.get("transaction_tag", -1)
        sys_i = d.get("is_system_transaction", -1)
        return DataChangeRecord(
            partition_token=token,
            commit_timestamp=parse_timestamp(f[d["commit_timestamp"]].string_value),
            record_sequence=f[d["record_sequence"]].string_value,
            server_transaction_id=f[d["server_transaction_id"]].string_value,
            is_last_record_in_transaction_in_partition=f[
                d["is_last_record_in_transaction_in_partition"]
            ].bool_value,
            table_name=f[d["table_name"]].string_value,
            column_types=self._columns(f[d["column_types"]]),
            mods=self._mods(f[d["mods"]]),
            mod_type=f[d["mod_type"]].string_value,
            value_capture_type=f[d["value_capture_type"]].string_value,
            number_of_records_in_transaction=int(
                f[d["number_of_records_in_transaction"]].string_value
            ),
            number_of_partitions_in_transaction=int(
                f[d["number_of_partitions_in_transaction"]].string_value
            ),
            transaction_tag=f[tag_i].string_value if tag_i >= 0 else "",
            is_system_transaction=f[sys_i].bool_value if sys_i >= 0 else False,
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


def _data_from_json(r: Mapping[str, Any], token: str) -> DataChangeRecord:
    return DataChangeRecord(
        partition_token=token,
        commit_timestamp=parse_timestamp(r["commit_timestamp"]),
        record_sequence=r["record_sequence"],
        server_transaction_id=r["server_transaction_id"],
        is_last_record_in_transaction_in_partition=bool(
            r["is_last_record_in_transaction_in_partition"]
        ),
        table_name=r["table_name"],
        column_types=_columns_from_json(r["column_types"]),
        mods=[
            Mod(m.get("keys") or {}, m.get("new_values") or {}, m.get("old_values") or {})
            for m in r["mods"]
        ],
        mod_type=r["mod_type"],
        value_capture_type=r["value_capture_type"],
        number_of_records_in_transaction=int(r["number_of_records_in_transaction"]),
        number_of_partitions_in_transaction=int(r["number_of_partitions_in_transaction"]),
        transaction_tag=r.get("transaction_tag") or "",
        is_system_transaction=bool(r.get("is_system_transaction", False)),
    )


def decode_json_record(obj: Mapping[str, Any], token: str) -> list[ChangeRecord]:
    """One PostgreSQL change record (the parsed JSONB object) to model records.

    Keys are the GoogleSQL record names (``data_change_record``, ``heartbeat_record``,
    ``child_partitions_record``; and for MUTABLE_KEY_RANGE ``partition_start_record``,
    ``partition_end_record``, ``partition_event_record``); an object may hold several.
    """
    out: list[ChangeRecord] = []
    r = obj.get("data_change_record")
    if r:
        out.append(_data_from_json(r, token))
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


def _decode_jsonb(value: Any, token: str) -> list[ChangeRecord]:
    text = value.string_value
    return decode_json_record(_loads(text), token) if text else []


# --- MUTABLE_KEY_RANGE protobuf records -----------------------------------------------------


def _proto_ts(ts: Any) -> Timestamp:
    return Timestamp.from_ns(ts.seconds * 1_000_000_000 + ts.nanos)


def _plain(value: Any) -> Any:
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
        return [_plain(v) for v in value.list_value.values]
    return {k: _plain(v) for k, v in value.struct_value.fields.items()}


def _type_json(type_pb: Any) -> Any:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(type_pb, preserving_proto_field_name=True)


def _proto_columns(columns: Any) -> tuple[ColumnType, ...]:
    return tuple(
        ColumnType(c.name, _type_json(c.type_), c.is_primary_key, c.ordinal_position)
        for c in columns
    )


def _mod_values(values: Any, columns: tuple[ColumnType, ...]) -> dict[str, Any]:
    return {columns[v.column_metadata_index].name: _plain(v.value) for v in values}


def decode_proto_record(record: Any, token: str) -> ChangeRecord:
    """A ``google.spanner.v1.ChangeStreamRecord`` (raw protobuf or proto-plus) to a record."""
    pb = getattr(type(record), "pb", None)
    if pb is not None and not hasattr(record, "WhichOneof"):
        record = pb(record)
    kind = record.WhichOneof("record")
    if kind == "data_change_record":
        r = record.data_change_record
        columns = _proto_columns(r.column_metadata)
        desc = r.DESCRIPTOR
        mod_type = desc.fields_by_name["mod_type"].enum_type.values_by_number[r.mod_type].name
        vct = desc.fields_by_name["value_capture_type"].enum_type.values_by_number[
            r.value_capture_type
        ].name
        return DataChangeRecord(
            partition_token=token,
            commit_timestamp=_proto_ts(r.commit_timestamp),
            record_sequence=r.record_sequence,
            server_transaction_id=r.server_transaction_id,
            is_last_record_in_transaction_in_partition=r.is_last_record_in_transaction_in_partition,
            table_name=r.table,
            column_types=columns,
            mods=[
                Mod(
                    _mod_values(m.keys, columns),
                    _mod_values(m.new_values, columns),
                    _mod_values(m.old_values, columns),
                )
                for m in r.mods
            ],
            mod_type=mod_type,
            value_capture_type=vct,
            number_of_records_in_transaction=r.number_of_records_in_transaction,
            number_of_partitions_in_transaction=r.number_of_partitions_in_transaction,
            transaction_tag=r.transaction_tag,
            is_system_transaction=r.is_system_transaction,
        )
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


def _decode_proto_value(value: Any, token: str) -> list[ChangeRecord]:
    if value.WhichOneof("kind") != "string_value":
        return []
    raw = base64.b64decode(value.string_value)
    return [decode_proto_record(_proto_message_class().FromString(raw), token)]


# --- choosing a decoder ---------------------------------------------------------------------

_CODE_ARRAY = 8
_CODE_STRUCT = 9
_CODE_JSON = 11
_CODE_PROTO = 13
_CODE_BYTES = 7


def row_decoder(column_type: Any) -> Callable[[Any, str], list[ChangeRecord]]:
    """The decoder for a result set's ChangeRecord column, given its ``Type`` (protobuf).

    The returned callable takes the column's ``Value`` and the partition token.
    """
    code = column_type.code
    if code == _CODE_ARRAY and column_type.array_element_type.code == _CODE_STRUCT:
        return _StructDecoder(column_type)
    if code == _CODE_JSON:
        return _decode_jsonb
    if code in (_CODE_PROTO, _CODE_BYTES):
        return _decode_proto_value
    msg = f"unexpected change stream column type {column_type}; upgrade cdcflow"
    raise DecodeError(msg)


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


def records_from_stock_row(row: list[Any], token: str) -> list[ChangeRecord]:
    """Records from a row the stock client decoded (``snapshot.execute_sql`` defaults).

    GoogleSQL rows are nested lists in metadata order; PostgreSQL rows hold a JsonObject.
    This is the reference the fast decoders are tested against.
    """
    value = row[0]
    if not isinstance(value, list):
        obj = _plain_json(value)
        return decode_json_record(obj, token) if obj else []
    out: list[ChangeRecord] = []
    for data, heartbeats, children in value:
        for d in data:
            out.append(DataChangeRecord(
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
            ))
        for h in heartbeats:
            out.append(HeartbeatRecord(token, _stock_ts(h[0])))
        for c in children:
            out.append(ChildPartitionsRecord(
                token, _stock_ts(c[0]), c[1],
                [ChildPartition(p[0], tuple(p[1])) for p in c[2]],
            ))
    return out
