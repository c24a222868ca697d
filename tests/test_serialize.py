"""to_json_dict / dumps_line: records, attrs, dataclasses and dicts as JSON."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import attrs
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcflow import serialize
from cdcflow.errors import SinkError
from cdcflow.model import (
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    JsonString,
    Mod,
    Timestamp,
)
from cdcflow.serialize import dumps_line, to_json_dict, to_json_value


def _record() -> DataChangeRecord:
    return DataChangeRecord(
        partition_token="tok",
        commit_timestamp=Timestamp.parse("2024-05-01T12:00:00.123456789Z"),
        record_sequence="00000001",
        server_transaction_id="tx1",
        is_last_record_in_transaction_in_partition=True,
        table_name="Orders",
        column_types=[
            ColumnType("OrderId", {"code": "INT64"}, True, 1),
            ColumnType("Total", {"code": "NUMERIC"}, False, 2),
        ],
        mods=[Mod(keys={"OrderId": "7"}, new_values={"Total": "9.50", "Tags": ["a", "b"]})],
        mod_type="INSERT",
        value_capture_type="OLD_AND_NEW_VALUES",
        number_of_records_in_transaction=1,
        number_of_partitions_in_transaction=1,
    )


def test_data_change_record_field_for_field() -> None:
    d = to_json_dict(_record())
    assert d["commit_timestamp"] == "2024-05-01T12:00:00.123456789Z"
    assert d["column_types"][0] == {
        "name": "OrderId",
        "type": {"code": "INT64"},
        "is_primary_key": True,
        "ordinal_position": 1,
    }
    assert d["mods"] == [
        {
            "keys": {"OrderId": "7"},
            "new_values": {"Total": "9.50", "Tags": ["a", "b"]},
            "old_values": {},
        }
    ]
    assert d["transaction_tag"] == "" and d["is_system_transaction"] is False
    assert list(d) == [f.name for f in attrs.fields(DataChangeRecord)]


def test_dumps_line_round_trips() -> None:
    line = dumps_line(_record())
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert orjson.loads(line) == to_json_dict(_record())
    hb = orjson.loads(dumps_line(HeartbeatRecord("p", Timestamp.from_ns(1_000_000_001))))
    assert hb == {"partition_token": "p", "timestamp": "1970-01-01T00:00:01.000000001Z"}


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Row:
    id: int
    when: datetime
    tags: frozenset[str]


def test_plain_values_and_dataclasses() -> None:
    row = Row(1, datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=UTC), frozenset({"b", "a"}))
    assert to_json_dict(row) == {
        "id": 1,
        "when": "2024-01-02T03:04:05.000006000Z",
        "tags": ["a", "b"],
    }
    assert to_json_dict({1: Decimal("1.10"), "b": b"\x00\xff", "c": Color.RED}) == {
        "1": "1.10",
        "b": "AP8=",
        "c": "red",
    }
    assert to_json_value(date(2024, 2, 29)) == "2024-02-29"
    assert to_json_value((1, (2, None))) == [1, [2, None]]


def test_unsupported_values_name_the_fix() -> None:
    with pytest.raises(SinkError, match="Map first"):
        to_json_dict({"x": object()})
    with pytest.raises(SinkError, match="to a dict with Map first"):
        to_json_dict("just text")
    with pytest.raises(SinkError, match="str keys"):
        to_json_dict({(1, 2): 3})
    assert dumps_line({"big": 1 << 70}) == b'{"big":1180591620717411303424}\n'  # JSON allows it


def test_typed_mod_values_of_every_spanner_type() -> None:
    """What the decoder makes of Spanner's wire form serializes back to that form's text
    (numbers stay numbers, non-finite floats become Spanner's text for them)."""
    from cdcflow.spanner import wire
    from cdcflow.spanner.decode import row_decoder
    from cdcflow.spanner.transport import assemble_rows

    columns = [ColumnType(name, {"code": code}, name == "I", i) for i, (name, code) in enumerate(
        [("I", "INT64"), ("F", "FLOAT64"), ("G", "FLOAT64"), ("N", "NUMERIC"), ("B", "BYTES"),
         ("D", "DATE"), ("T", "TIMESTAMP"), ("J", "JSON")], 1)]
    wire_values = {"F": "NaN", "G": "-Infinity", "N": "12345678901234567890.123456789",
                   "B": "AP8=", "D": "2024-02-29", "T": "2024-05-01T12:00:00.123456789Z",
                   "J": '{"a":[1,null]}'}
    record = attrs.evolve(_record(), column_types=columns,
                          mods=[Mod({"I": "-9223372036854775808"}, wire_values)])
    messages = wire.partial_result_sets(wire.row_type(wire.googlesql_column_type()),
                                        [wire.encode_googlesql([record])])
    ((row_type, row),) = list(assemble_rows(iter(messages)))
    (typed,) = row_decoder(row_type.fields[0].type_)(row[0], "tok")
    assert isinstance(typed, DataChangeRecord)
    assert typed.mods[0].new_values["J"] == {"a": [1, None]}  # typed, not wire text
    line = orjson.loads(dumps_line(typed))
    assert line["mods"][0]["keys"] == {"I": -(2**63)}
    assert line["mods"][0]["new_values"] == {**wire_values, "J": {"a": [1, None]}}
    assert to_json_value(float("inf")) == "Infinity" and to_json_value(1.5) == 1.5


class _Color(enum.Enum):
    RED = "red"
    PRICE = Decimal("1.5")


@dataclasses.dataclass
class _Point:
    x: float
    at: datetime


@pytest.mark.parametrize("element", [
    {"nan": float("nan"), "inf": [1.0, float("inf")], "neg": {"x": float("-inf")}, "n": None},
    {"none": None, "ok": 1.5, "nested": {"deep": [None, (2.5, None)]}},
    {"ts": Timestamp.parse("2024-05-01T12:00:00.000000001Z"), "naive": datetime(2024, 5, 1),
     "aware": datetime(2024, 5, 1, tzinfo=UTC), "day": date(2024, 2, 29)},
    {"d": Decimal("12345678901234567890.123456789"), "nan": Decimal("NaN"), "b": b"\x00\xff",
     "tiny": Decimal("-1E-9"), "sci": Decimal("1.5E+3"),
     "ba": bytearray(b"ab"), "set": {3, 1, 2}, "tuple": (1, "a"), "enum": _Color.RED,
     "enum2": _Color.PRICE},
    {"point": _Point(float("nan"), datetime(2024, 1, 1, tzinfo=UTC)), "key": {1: "int key"}},
    {"big": 2**70},
    _record(),
    HeartbeatRecord("p", Timestamp.parse("2024-05-01T12:00:00Z")),
    {"record": _record(), "mods": _record().mods},
])
def test_dumps_line_writes_what_the_rules_say(element: object) -> None:
    """dumps_line lets orjson walk the element; the line is the rules' own, byte for byte:
    json_dumps(to_json_dict(element)) (or the same SinkError)."""
    from cdcflow.serialize import json_dumps

    try:
        expected = json_dumps(to_json_dict(element)) + b"\n"
    except (SinkError, orjson.JSONEncodeError):
        with pytest.raises(SinkError):
            dumps_line(element)
        return
    assert dumps_line(element) == expected


def test_decimals_are_positional_text_as_spanner_writes_numeric() -> None:
    values = {"tiny": Decimal("-1E-9"), "small": Decimal("1E-7"), "sci": Decimal("1.5E+3"),
              "scale": Decimal("1.50"), "nan": Decimal("NaN")}
    expected = {"tiny": "-0.000000001", "small": "0.0000001", "sci": "1500",
                "scale": "1.50", "nan": "NaN"}
    assert to_json_dict(values) == expected
    assert orjson.loads(dumps_line(values)) == expected  # the compiled default too


@settings(max_examples=2000, deadline=None)
@given(st.decimals(allow_nan=True, allow_infinity=True)
       | st.builds(Decimal, st.from_regex(r"-?[0-9]{1,30}(\.[0-9]{0,30})?([eE][-+]?[0-9]{1,3})?",
                                          fullmatch=True)))
def test_decimal_text_is_positional_whatever_the_exponent(value: Decimal) -> None:
    """The text is format(d, "f") (str(d) where that is the same text, which is cheaper),
    by the Python rules and by the compiled default alike, under either exponent letter."""
    import decimal

    from cdcflow.serialize import decimal_text

    expected = format(value, "f")
    assert decimal_text(value) == expected
    compiled = serialize._compiled_default()
    if compiled is not None:
        assert compiled(value) == expected
    with decimal.localcontext() as ctx:
        ctx.capitals = 0  # str() then writes 1.5e+3
        assert decimal_text(value) == expected
        if compiled is not None:
            assert compiled(value) == expected


# --- the non-finite check, compiled and in Python ----------------------------------------


@attrs.frozen
class _Pair:
    a: Any
    b: Any


class _Map(Mapping[str, Any]):
    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class _Float(float):
    pass


_leaf = (st.none() | st.booleans() | st.integers() | st.text(max_size=3) | st.floats()
         | st.floats().map(_Float) | st.decimals(allow_nan=True) | st.binary(max_size=3)
         | st.just(Timestamp.from_ns(5)) | st.just(date(2024, 1, 1)))
_values = st.recursive(
    _leaf,
    lambda inner: (st.lists(inner, max_size=3) | st.lists(inner, max_size=3).map(tuple)
                   | st.dictionaries(st.text(max_size=2), inner, max_size=3)
                   | st.dictionaries(st.text(max_size=2), inner, max_size=2).map(_Map)
                   | st.builds(_Pair, inner, inner)),
    max_leaves=12,
)


@pytest.mark.skipif(serialize._compiled_walk() is None, reason="not compiled")
@settings(max_examples=500, deadline=None)
@given(_values)
def test_the_compiled_non_finite_check_agrees_with_python(value: Any) -> None:
    compiled = serialize._compiled_walk()
    assert compiled is not None
    assert compiled(value) == serialize._non_finite_python(value)


@pytest.mark.skipif(serialize._compiled_walk() is None, reason="not compiled")
def test_the_compiled_non_finite_check_deep_and_wide() -> None:
    compiled = serialize._compiled_walk()
    assert compiled is not None
    deep: Any = float("nan")
    for _ in range(500):  # deeper than the compiled walk goes: Python takes over
        deep = [{"x": (deep,)}]
    assert compiled(deep) and serialize._non_finite_python(deep)
    wide = {f"k{i}": [1.5, None, "x", Decimal("NaN")] for i in range(1000)}
    assert not compiled(wide)
    wide["k999"].append(float("-inf"))
    assert compiled(wide)
    line = dumps_line({"row": wide})
    assert b'"-Infinity"' in line


@pytest.mark.skipif(serialize._compiled_default() is None, reason="not compiled")
def test_the_compiled_json_default_writes_what_python_writes() -> None:
    compiled = serialize._compiled_default()
    assert compiled is not None
    fresh = Timestamp.from_ns(1_700_000_000_123_456_789)  # no cached text yet
    parsed = Timestamp.parse("2024-05-01T12:00:00.123456789Z")
    values = [fresh, parsed, Decimal("-1.50"), Decimal("NaN"), b"\x00", {1, 2},
              Mod({"k": 1}, {"t": fresh}, {}), date(2024, 1, 1), datetime(2024, 1, 1, tzinfo=UTC)]
    for value in values:
        assert compiled(value) == serialize._default_python(value)
    assert dumps_line({"t": fresh, "n": Decimal("2.5")}) == (
        b'{"t":"2023-11-14T22:13:20.123456789Z","n":"2.5"}\n')


def test_integers_past_64_bits_are_written_exactly() -> None:
    """JSON has no bound on integers and PostgreSQL's jsonb keeps them: the decoder gives
    them exactly, so every writer must too (orjson alone refuses them)."""
    from cdcflow.serialize import json_dumps

    value = {"b": 2**70, "a": [-(2**80), 1.5, float("nan"), "zoë"]}
    assert json_dumps(value) == (
        '{"b":1180591620717411303424,"a":[-1208925819614629174706176,1.5,null,"zoë"]}'.encode())
    assert json_dumps(value, sort_keys=True).startswith(b'{"a":')
    assert json_dumps({"n": 2**63}) == orjson.dumps({"n": 2**63})  # orjson's own range
    with pytest.raises(TypeError):
        json_dumps({"x": object()})
    line = dumps_line({"js": {"big": 2**70}, "at": Timestamp.from_ns(1)})
    assert orjson.loads(line)["at"] == "1970-01-01T00:00:00.000000001Z"
    assert b'"big":1180591620717411303424' in line and line.endswith(b"\n")


# --- the compiled line --------------------------------------------------------------------


class _Int(int):
    pass


#: What the compiled pass writes itself (ints within 64 bits, finite floats, ...).
_written_leaf = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                 | st.integers(-300, 300) | st.sampled_from([-1, 0, 1, -10, 10, -(2**63) + 1])
                 | st.text() | st.text(st.characters(max_codepoint=0x7F))
                 | st.text(st.characters(codec="utf-8")).map(JsonString)
                 | st.floats(allow_nan=False, allow_infinity=False)
                 | st.floats(width=32, allow_nan=False, allow_infinity=False)
                 | st.decimals(allow_nan=True) | st.binary(max_size=3)
                 | st.just(Timestamp.from_ns(5))
                 | st.just(Timestamp.parse("2024-05-01T12:00:00.123456789Z"))
                 | st.just(date(2024, 1, 1)) | st.just(datetime(2024, 1, 1, tzinfo=UTC))
                 | st.frozensets(st.integers(0, 9)))
#: And what it leaves to the Python path.
_left_leaf = (st.floats().filter(lambda f: f != f or f in (float("inf"), float("-inf")))
              | st.integers(2**64, 2**70) | st.integers(-(2**70), -(2**63) - 1)
              | st.just(_Color.RED) | st.integers().map(_Int))


def _nested(leaf: st.SearchStrategy[Any], keys: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaf,
        lambda inner: (st.lists(inner, max_size=4) | st.lists(inner, max_size=3).map(tuple)
                       | st.dictionaries(keys, inner, max_size=4)
                       | st.builds(_Pair, inner, inner)),
        max_leaves=16,
    )


_written = _nested(_written_leaf, st.text(max_size=3))
_any = _nested(_written_leaf | _left_leaf, st.text(max_size=3) | st.integers(0, 3))


@pytest.mark.skipif(serialize._compiled_line() is None, reason="not compiled")
@settings(max_examples=1500, deadline=None)
@given(st.dictionaries(st.text(max_size=4), _written, max_size=5)
       | st.builds(_Pair, _written, _written))
def test_the_compiled_line_is_the_python_line_byte_for_byte(element: Any) -> None:
    """The compiled pass writes what orjson and the default write."""
    compiled = serialize._compiled_line()
    assert compiled is not None
    expected = serialize._dumps_line(element)
    assert compiled(element) == expected
    assert dumps_line(element) == expected


@pytest.mark.skipif(serialize._compiled_line() is None, reason="not compiled")
@settings(max_examples=1000, deadline=None)
@given(st.dictionaries(st.text(max_size=4), _any, max_size=5) | st.builds(_Pair, _any, _any))
def test_the_compiled_line_writes_or_declines(element: Any) -> None:
    """What the compiled pass declines (a float that is not finite, an int past 64 bits,
    an enum, a key that is not a str, ...), the Python path writes: the line is the same
    whichever writes it, or the same SinkError."""
    compiled = serialize._compiled_line()
    assert compiled is not None
    line = compiled(element)
    try:
        expected = serialize._dumps_line(element)
    except SinkError:
        assert line is None
        with pytest.raises(SinkError):
            dumps_line(element)
        return
    if line is not None:
        assert line == expected
    assert dumps_line(element) == expected


@pytest.mark.skipif(serialize._compiled_line() is None, reason="not compiled")
def test_the_compiled_line_declines_what_python_writes_otherwise() -> None:
    compiled = serialize._compiled_line()
    assert compiled is not None
    for value in (float("nan"), float("-inf"), 2**64, -(2**63) - 1, _Int(3), _Color.RED,
                  {1: "int key"}):
        assert compiled({"v": value}) is None, value
        assert dumps_line({"v": value}) == json_dumps_rules({"v": value})
    for lone in ("\ud800", "x\udbff", "\udc00y", "\udfff"):
        assert compiled({"v": lone}) is None
        with pytest.raises(SinkError, match="surrogates not allowed"):
            dumps_line({"v": lone})
    assert compiled({"a": 2**64 - 1, "b": -(2**63), "c": JsonString("x")}) == (
        b'{"a":18446744073709551615,"b":-9223372036854775808,"c":"x"}\n')
    deep: Any = 1
    for _ in range(80):  # 160 levels: deeper than the compiled pass goes, not orjson
        deep = {"d": [deep]}
    assert compiled(deep) is None and dumps_line(deep) == json_dumps_rules(deep)


@pytest.mark.skipif(serialize._compiled_line() is None, reason="not compiled")
def test_the_compiled_line_writes_long_and_escaped_text() -> None:
    compiled = serialize._compiled_line()
    assert compiled is not None
    every = "".join(chr(c) for c in range(0x20000) if not 0xD800 <= c <= 0xDFFF)
    texts = ["x" * 100_000, "é" * 50_000 + '"', "\x00\x1f\"\\\n" * 10_000, "😀" * 3000,
             "ab\x7fc\u2028", "12345678\n" * 3, every, every[:3000], chr(0x10FFFF),
             "".join(chr(c) for c in range(128))]
    for text in texts:
        element = {"t": text, "k": [text, {"n": 1.5}]}
        assert compiled(element) == orjson.dumps(element, option=orjson.OPT_APPEND_NEWLINE)
    record = _record()
    assert compiled(record) == serialize._dumps_line(record)


def json_dumps_rules(element: Any) -> bytes:
    """The line by the rules' own way (what every path must write)."""
    from cdcflow.serialize import json_dumps

    return json_dumps(to_json_dict(element)) + b"\n"


@pytest.mark.skipif(serialize._compiled_line() is None, reason="not compiled")
@settings(max_examples=3000, deadline=None)
@given(st.booleans(), st.integers(0, 10**60) | st.sampled_from([0, 10**19 - 1, 10**19, 10**38]),
       st.integers(-45, 4))
def test_the_compiled_line_writes_decimals_from_their_digits(
    negative: bool, coefficient: int, exponent: int,
) -> None:
    """A Decimal is written from its own digits (no str() made): the text of the Python
    path for every coefficient (one limb of 19 digits or several) and exponent (a positive
    one the compiled pass leaves to the default)."""
    from cdcflow import _speedups

    assert _speedups.decimal_digits()  # the layout checked out on this interpreter
    value = Decimal(f"{'-' if negative else ''}{coefficient}E{exponent}")
    element = {"d": value, "ds": [value, Decimal("-0.00"), Decimal("Infinity")]}
    compiled = serialize._compiled_line()
    assert compiled is not None
    assert compiled(element) == serialize._dumps_line(element)
    assert orjson.loads(compiled(element) or b"")["d"] == format(value, "f")
