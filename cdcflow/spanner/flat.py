"""Change records straight from serialized PartialResultSets, through protobuf's merge rules.

Reading a tree of protobuf ``Value`` messages from Python builds a wrapper object for every
node, and a GoogleSQL data change record is a tree of about sixty. Protobuf's own parsing
rules give a shortcut: when a *singular* message field occurs several times in the input,
the parser merges the occurrences, and a *repeated* scalar field collects the values of all
of them, in order. So the bytes of a PartialResultSet, parsed with message types of our
own that are wire-compatible with ``Value`` and ``ListValue`` but declare list elements as
one singular message, give in one C call the strings, the bools and (as bytes) the nested
lists of every record of the message, in wire order. What a record is made of then comes
from counting, checked against the documented STRUCT layouts (the result metadata must
list them exactly):

* GoogleSQL, a message holding only data change records: 9 strings (commit timestamp,
  record sequence, transaction id, table, mod type, value capture type, the two counts,
  the transaction tag), 2 bools and 2 lists (column types, mods) per record;
* only heartbeats: one string (the timestamp) per record;
* anything else (heartbeats between data records, child partitions): each ChangeRecord
  is kept apart and each of its three arrays merged on its own;
* a mods list: 3 strings (keys, new values, old values as JSON) per mod; a column types
  list: 3 strings (name, type, ordinal position) and a bool per column;
* PostgreSQL JSONB rows and MUTABLE_KEY_RANGE protos: one string per row.

A message that carries a chunk of a value (``chunked_value``, Spanner's way with large
rows), and the one after it, is decoded row by row: each whole row the same way, one at a
time; the chunked value, once whole, by the generic decoders of
:mod:`cdcflow.spanner.decode`. Counts that do not add up (a NULL where Spanner sends a
value, a layout a newer server sends) send the message, or the row, to those decoders
too. Both ways give the same records (tests decode every wire shape both ways).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from cdcflow.model import (
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
)
from cdcflow.spanner.decode import row_decoder, text_decoder
from cdcflow.spanner.records import (
    CHILD_LAYOUT,
    CHILD_PARTITIONS_LAYOUT,
    COLUMN_LAYOUT,
    DATA_LAYOUT,
    ENTRY_BYTES,
    HEARTBEAT_LAYOUT,
    MOD_LAYOUT,
    RECORD_BYTES,
    TOP_LAYOUT,
    DataBuilder,
)
from cdcflow.spanner.shape import RecordShaper
from cdcflow.spanner.transport import RowAssembler, merge_values
from cdcflow.spanner.values import parse_timestamp

__all__ = ["MessageDecoder", "decode_messages"]

_loads = orjson.loads
_CODE_ARRAY = 8
_CODE_STRUCT = 9


# --- the message types ----------------------------------------------------------------------

# google.protobuf.Value's fields: null_value 1, number_value 2, string_value 3, bool_value 4,
# struct_value 5, list_value 6; ListValue's: values 1; PartialResultSet's: metadata 1,
# values 2, chunked_value 3 (the others are skipped as unknown fields).
_LEAF = "Leaf"
_MESSAGES: list[tuple[str, list[tuple[str, int, str, str]]]] = [
    # every value of a merged list, by kind: nulls, numbers, strings, bools, structs and
    # lists (as their serialized bytes)
    (_LEAF, [("n", 1, "int32", "repeated"), ("d", 2, "double", "repeated"),
             ("s", 3, "string", "repeated"), ("b", 4, "bool", "repeated"),
             ("st", 5, "bytes", "repeated"), ("l", 6, "bytes", "repeated")]),
    # a mods list merged: its JSON texts as bytes (orjson parses bytes; no UTF-8 check)
    ("ModLeaf", [("n", 1, "int32", "repeated"), ("d", 2, "double", "repeated"),
                 ("s", 3, "bytes", "repeated"), ("b", 4, "bool", "repeated"),
                 ("st", 5, "bytes", "repeated"), ("l", 6, "bytes", "repeated")]),
    ("ModL0", [("values", 1, "ModLeaf", "optional")]),
    ("ModV1", [("list_value", 6, "ModL0", "optional")]),
    ("ModL1", [("values", 1, "ModV1", "optional")]),
    # merged all the way down: a STRUCT's fields, an ARRAY of STRUCTs, a ChangeRecord's
    # arrays, a row's ChangeRecords, a message's rows
    ("L0", [("values", 1, _LEAF, "optional")]),
    ("V1", [("list_value", 6, "L0", "optional")]),
    ("L1", [("values", 1, "V1", "optional")]),
    ("V2", [("list_value", 6, "L1", "optional")]),
    ("L2", [("values", 1, "V2", "optional")]),
    ("V3", [("list_value", 6, "L2", "optional")]),
    ("L3", [("values", 1, "V3", "optional")]),
    ("V4", [("list_value", 6, "L3", "optional")]),
    ("Merged", [("metadata", 1, "bytes", "optional"), ("values", 2, "V4", "optional"),
                ("chunked_value", 3, "bool", "optional")]),
    # rows and their ChangeRecords apart, each of a ChangeRecord's arrays merged
    ("SL2", [("values", 1, "V2", "repeated")]),
    ("SV3", [("list_value", 6, "SL2", "optional")]),
    ("SL3", [("values", 1, "SV3", "repeated")]),
    ("SV4", [("list_value", 6, "SL3", "optional")]),
    ("Split", [("metadata", 1, "bytes", "optional"), ("values", 2, "SV4", "repeated"),
               ("chunked_value", 3, "bool", "optional")]),
    # each row's value as its bytes
    ("Rows", [("metadata", 1, "bytes", "optional"), ("values", 2, "bytes", "repeated"),
              ("chunked_value", 3, "bool", "optional")]),
    # one string per row
    ("Scalars", [("metadata", 1, "bytes", "optional"), ("values", 2, _LEAF, "optional"),
                 ("chunked_value", 3, "bool", "optional")]),
]


class _Types:
    """The message classes above, and the standard ones for the fallback."""

    def __init__(self) -> None:
        from google.cloud.spanner_v1.types import PartialResultSet, ResultSetMetadata
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        field = descriptor_pb2.FieldDescriptorProto
        scalars = {"int32": field.TYPE_INT32, "double": field.TYPE_DOUBLE,
                   "string": field.TYPE_STRING, "bool": field.TYPE_BOOL,
                   "bytes": field.TYPE_BYTES}
        labels = {"optional": field.LABEL_OPTIONAL, "repeated": field.LABEL_REPEATED}
        package = "cdcflow.flat"
        proto = descriptor_pb2.FileDescriptorProto(
            name="cdcflow/flat.proto", package=package, syntax="proto3"
        )
        for name, fields in _MESSAGES:
            message = proto.message_type.add(name=name)
            for fname, number, kind, label in fields:
                f = message.field.add(name=fname, number=number, label=labels[label])
                if kind in scalars:
                    f.type = scalars[kind]
                else:
                    f.type = field.TYPE_MESSAGE
                    f.type_name = f".{package}.{kind}"
        pool = descriptor_pool.DescriptorPool()  # our own: nothing clashes with Google's
        pool.Add(proto)

        def cls(name: str) -> Any:
            return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))

        self.merged = cls("Merged").FromString
        self.split = cls("Split").FromString
        self.rows = cls("Rows").FromString
        self.row = cls("V4").FromString  # one row's value, merged
        self.split_row = cls("SV4").FromString  # one row's value, ChangeRecords apart
        self.scalars = cls("Scalars").FromString
        self.list = cls("L1").FromString  # a serialized ListValue of STRUCTs, merged
        self.mods = cls("ModL1").FromString  # the same, strings as bytes
        self.mod_texts_field = pool.FindMessageTypeByName(f"{package}.ModLeaf").fields_by_name["s"]
        self.partial_result_set = PartialResultSet.pb().FromString
        self.metadata = ResultSetMetadata.pb().FromString
        from google.protobuf.struct_pb2 import ListValue, Value

        self.list_value = ListValue.FromString
        self.value = Value.FromString


_TYPES: _Types | None = None
_types_lock = threading.Lock()


def _types() -> _Types:
    """The message types, built on first use (in every process that decodes)."""
    global _TYPES
    if _TYPES is None:
        with _types_lock:
            if _TYPES is None:
                _TYPES = _Types()
    return _TYPES


# --- decoding a stream ----------------------------------------------------------------------

Records = list[ChangeRecord]


class MessageDecoder:
    """Decodes the PartialResultSets of one query, in order, into records.

    A message may be a protobuf PartialResultSet or its serialized bytes (what
    :class:`~cdcflow.spanner.transport.GrpcTransport` yields). For the change stream
    shapes, messages take the fast paths of this module (a protobuf message is serialized
    first); a message that carries a chunk of a value is decoded row by row, the chunked
    row by the generic decoder once whole. Other results go through
    :class:`~cdcflow.spanner.transport.RowAssembler` and :func:`row_decoder`. Data change
    records are shaped by ``shaper``. ``rows_seen`` turns True once a message carried a
    value.
    """

    def __init__(self, shaper: RecordShaper, sizes: dict[int, int] | None = None) -> None:
        self._shaper = shaper
        self._assembler = RowAssembler()
        self._generic: Callable[[Any, str], Records] | None = None
        self._fast: _ScalarRows | _GoogleSqlRows | None = None
        self._column: Any = None
        self._pending: Any = None  # the start of a chunked value (a protobuf Value)
        self._typed = False  # whether the metadata was seen and decoders chosen
        self.rows_seen = False
        #: the sizes of the records the last :meth:`decode` gave that the decoder measured,
        #: by ``id()`` (see DataBuilder.run); the others are for the caller to measure
        self.sizes: dict[int, int] = {} if sizes is None else sizes

    def decode(self, message: bytes | Any, token: str) -> Records:
        """The records the message completes (a chunked value waits for the next one)."""
        types = _types()
        self.sizes.clear()
        if not self._typed:
            if isinstance(message, bytes):
                metadata = types.scalars(message).metadata  # field 1 in every shape
                if metadata:
                    self._choose(types.metadata(metadata).row_type)
            elif message.HasField("metadata"):
                self._choose(message.metadata.row_type)
        fast = self._fast
        if fast is None:
            if isinstance(message, bytes):
                message = types.partial_result_set(message)
            return self._assembled(self._assembler.add(message), token)
        if not isinstance(message, bytes):
            message = message.SerializeToString()
        if self._pending is None:
            records = fast.message(message, token)
            if records is not None:
                return records
        return self._by_row(message, token)

    def finish(self, token: str) -> Records:
        """The records of a last row the stream ended in the middle of (rare)."""
        self.sizes.clear()
        pending, self._pending = self._pending, None
        if pending is not None:
            assert self._generic is not None
            return self.measured(self._generic(pending, token), pending.ByteSize())
        return self._assembled(self._assembler.finish(), token)

    def measured(self, records: Records, wire: int) -> Records:
        """``records``, decoded from ``wire`` bytes (a row's value, or its text) by a path
        that does not measure them, with their sizes in :attr:`sizes`: as the merged path
        measures (:data:`RECORD_BYTES`, the row's bytes shared among its data records,
        :data:`ENTRY_BYTES` per key and value), so that no reader of a large record has to
        measure it again (``cdcflow.sizes.approx_size`` writes it out as JSON)."""
        data = [r for r in records if isinstance(r, DataChangeRecord)]
        if data:
            share = wire // len(data)
            sizes = self.sizes
            for r in data:
                entries = sum(len(m.keys) + len(m.new_values) + len(m.old_values)
                              for m in r.mods)
                sizes[id(r)] = RECORD_BYTES + share + ENTRY_BYTES * entries
        return records

    def _by_row(self, message: bytes, token: str) -> Records:
        """A message decoded row by row: its first value ends a chunked one, its last may
        begin one."""
        assert self._fast is not None and self._generic is not None
        types = _types()
        parsed = types.rows(message)
        values: list[Any] = list(parsed.values)
        if values:
            self.rows_seen = True
        if self._pending is not None and values:
            values[0] = merge_values(self._pending, types.value(values[0]), self._column)
            self._pending = None
        if parsed.chunked_value and values:
            last = values.pop()
            self._pending = types.value(last) if isinstance(last, bytes) else last
        out: Records = []
        for value in values:
            if isinstance(value, bytes):
                out.extend(self._fast.row(value, token))
            else:  # a chunked value made whole: the large rows
                out.extend(self.measured(self._generic(value, token), value.ByteSize()))
        return out

    def _assembled(self, rows: list[tuple[Any, list[Any]]], token: str) -> Records:
        out: Records = []
        for row_type, row in rows:
            self.rows_seen = True
            if not self._typed:
                self._choose(row_type)
            assert self._generic is not None
            out.extend(self.measured(self._generic(row[0], token), row[0].ByteSize()))
        return out

    def _choose(self, row_type: Any) -> None:
        self._typed = True
        self._assembler.start(row_type)
        column = self._column = row_type.fields[0].type_
        generic = self._generic = row_decoder(column, self._shaper)
        if len(row_type.fields) != 1:
            return
        text = text_decoder(column, self._shaper)
        if text is not None:
            self._fast = _ScalarRows(text, generic, self)
        elif _googlesql_layouts(column):
            self._fast = _GoogleSqlRows(self._shaper, generic, self, self.sizes)


def _names(struct_type: Any) -> tuple[str, ...]:
    return tuple(f.name for f in struct_type.fields)


def _struct_of(array_type: Any) -> Any:
    """The STRUCT type of an ``ARRAY<STRUCT>``, or None."""
    if array_type.code != _CODE_ARRAY or array_type.array_element_type.code != _CODE_STRUCT:
        return None
    return array_type.array_element_type.struct_type


def _googlesql_layouts(column: Any) -> bool:
    """Whether the ChangeRecord column has exactly the documented STRUCT layouts."""
    top = _struct_of(column)
    if top is None or _names(top) != TOP_LAYOUT:
        return False
    data, heartbeat, children = (_struct_of(f.type_) for f in top.fields)
    if data is None or heartbeat is None or children is None:
        return False
    fields = {f.name: f.type_ for f in data.fields}
    columns, mods = _struct_of(fields["column_types"]), _struct_of(fields["mods"])
    child = _struct_of(children.fields[2].type_) if len(children.fields) == 3 else None
    return (
        _names(data) == DATA_LAYOUT and _names(heartbeat) == HEARTBEAT_LAYOUT
        and _names(children) == CHILD_PARTITIONS_LAYOUT
        and columns is not None and _names(columns) == COLUMN_LAYOUT
        and mods is not None and _names(mods) == MOD_LAYOUT
        and child is not None and _names(child) == CHILD_LAYOUT
    )


class _ScalarRows:
    """One string per row: every row's string in one list (NULL rows hold no record)."""

    def __init__(self, text: Callable[[str, str], Records],
                 generic: Callable[[Any, str], Records], owner: MessageDecoder) -> None:
        self._text = text
        self._generic = generic
        self._owner = owner

    def message(self, message: bytes, token: str) -> Records | None:
        """The records of a whole message, or None when it carries a chunk."""
        parsed = _types().scalars(message)
        if parsed.chunked_value:
            return None
        leaf = parsed.values
        if leaf.d or leaf.b or leaf.st or leaf.l:
            return None
        texts = leaf.s
        if texts or leaf.n:
            self._owner.rows_seen = True
        text, measured = self._text, self._owner.measured
        out: Records = []
        for value in texts:
            out.extend(measured(text(value, token), len(value)))
        return out

    def row(self, value: bytes, token: str) -> Records:
        """The records of one serialized row value."""
        return self._owner.measured(self._generic(_types().value(value), token), len(value))


def _leaf(array: Any) -> Any:
    """The merged values of every STRUCT of a (merged) ARRAY value."""
    return array.list_value.values.list_value.values


def _plain(leaf: Any) -> bool:
    """No NULL, number or STRUCT among a leaf's values (only strings, bools, lists)."""
    return not (leaf.n or leaf.d or leaf.st)


class _GoogleSqlRows:
    """GoogleSQL ChangeRecord rows (see the module docstring)."""

    def __init__(self, shaper: RecordShaper, generic: Callable[[Any, str], Records],
                 owner: MessageDecoder, sizes: dict[int, int]) -> None:
        self._builder = DataBuilder(shaper)
        self._generic = generic
        self._owner = owner
        self._sizes = sizes

    def message(self, message: bytes, token: str) -> Records | None:
        """The records of a whole message, or None when it needs decoding row by row (it
        carries a chunk, or its counts do not add up)."""
        merged = _types().merged(message)
        if merged.chunked_value:
            return None
        leaf = _leaf(_leaf(merged.values))
        records = self._merged(leaf, token)
        if records is not None:
            if records:
                self._owner.rows_seen = True
            return records
        out: Records = []
        for row in _types().split(message).values:
            self._owner.rows_seen = True
            found = self._split(row, token)
            if found is None:
                return None
            out.extend(found)
        return out

    def row(self, value: bytes, token: str) -> Records:
        """The records of one serialized row value."""
        types = _types()
        records = self._merged(_leaf(_leaf(types.row(value))), token)
        if records is None:
            records = self._split(types.split_row(value), token)
        if records is None:
            records = self._owner.measured(self._generic(types.value(value), token), len(value))
        return records

    def _merged(self, leaf: Any, token: str) -> Records | None:
        """The records of a leaf merged over whole rows: data change records only, or
        heartbeats only; else None."""
        if not _plain(leaf):
            return None
        strings, bools, lists = leaf.s, leaf.b, leaf.l
        if not strings:
            return [] if not bools and not lists else None
        records = len(bools) // 2
        if records and len(strings) == 9 * records and len(lists) == len(bools) == 2 * records:
            return self._data(strings, bools, lists, token)
        if not bools and not lists:
            return [HeartbeatRecord(token, parse_timestamp(t)) for t in strings]
        return None

    def _split(self, row: Any, token: str) -> Records | None:
        """A row's ChangeRecords apart, each of their arrays merged: None when counts do
        not add up."""
        out: Records = []
        for change_record in row.list_value.values:
            arrays = change_record.list_value.values
            if len(arrays) != 3:
                return None
            data, heartbeats, children = arrays
            leaf = _leaf(data)
            strings, bools, lists = leaf.s, leaf.b, leaf.l
            records = len(bools) // 2
            if (not _plain(leaf) or len(strings) != 9 * records
                    or len(lists) != 2 * records or len(bools) != 2 * records):
                return None
            if records:
                out.extend(self._data(strings, bools, lists, token))
            leaf = _leaf(heartbeats)
            if not _plain(leaf) or leaf.b or leaf.l:
                return None
            out.extend(HeartbeatRecord(token, parse_timestamp(t)) for t in leaf.s)
            leaf = _leaf(children)
            strings, lists = leaf.s, leaf.l
            if not _plain(leaf) or leaf.b or len(strings) != 2 * len(lists):
                return None
            it = iter(strings)
            for (start, sequence), listed in zip(zip(it, it, strict=True), lists, strict=True):
                out.append(ChildPartitionsRecord(
                    token, parse_timestamp(start), sequence, _children(listed)
                ))
        return out

    def _data(self, strings: Any, bools: Any, lists: Any, token: str) -> Records:
        records = self._builder.merged(token, strings, bools, lists, _columns, self._sizes)
        if records is not None:
            return records
        s, b, li = iter(strings), iter(bools), iter(lists)
        return self._builder.run(token, zip(
            zip(s, s, s, s, s, s, s, s, s, strict=True), zip(b, b, strict=True),
            zip(li, li, strict=True), strict=True,
        ), _mod_texts, _columns, self._sizes)


def _mod_texts(raw: bytes) -> Any:
    """The JSON texts of a serialized mods list: keys, new values, old values of each mod
    in turn (empty for a NULL); bytes or str."""
    types = _TYPES or _types()
    kinds = types.mods(raw).values.list_value.values.ListFields()
    if len(kinds) == 1 and kinds[0][0] is types.mod_texts_field and len(kinds[0][1]) % 3 == 0:
        return kinds[0][1]
    if not kinds:
        return ()
    # a NULL among them: its place matters, read the list value by value
    return [v.string_value for m in types.list_value(raw).values for v in m.list_value.values]


def _columns(raw: bytes) -> list[ColumnType]:
    """The column types of a serialized column types list."""
    types = _types()
    leaf = types.list(raw).values.list_value.values
    strings, bools = leaf.s, leaf.b
    if not (leaf.n or leaf.d or leaf.st or leaf.l or len(strings) != 3 * len(bools)):
        s = iter(strings)
        return [
            ColumnType(name, _json_obj(type_), pk, int(position))
            for (name, type_, position), pk in zip(zip(s, s, s, strict=True), bools, strict=True)
        ]
    columns = []
    for column in types.list_value(raw).values:
        name, type_, pk, position = column.list_value.values
        columns.append(ColumnType(
            name.string_value, _json_obj(type_.string_value), pk.bool_value,
            int(position.string_value),
        ))
    return columns


def _json_obj(text: str) -> Any:
    # A NULL JSON value arrives as "" (an empty map for the model).
    return _loads(text) if text else {}


def _children(raw: bytes) -> list[ChildPartition]:
    """The child partitions of a serialized list (rare: read value by value)."""
    out = []
    for child in _types().list_value(raw).values:
        token, parents = child.list_value.values
        out.append(ChildPartition(
            token.string_value, tuple(p.string_value for p in parents.list_value.values)
        ))
    return out


def decode_messages(
    messages: Iterator[Any], token: str, shaper: RecordShaper
) -> Iterator[ChangeRecord]:
    """Every record of a stream of PartialResultSets (protobuf or serialized)."""
    decoder = MessageDecoder(shaper)
    for message in messages:
        yield from decoder.decode(message, token)
    yield from decoder.finish(token)
