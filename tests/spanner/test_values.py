"""Column value converters: Spanner's wire form (as the emulator and Spanner send it) to
Python, and Python back to the wire form."""

from __future__ import annotations

import math
from datetime import date
from decimal import Decimal
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcflow.model import ColumnType, JsonString, Timestamp
from cdcflow.spanner.values import (
    convert_in_place,
    decode_values,
    decode_values_python,
    decoder_for,
    decoders,
    encode_values,
    encoder_for,
    type_code,
)


def _t(code: str, annotation: str | None = None) -> dict[str, Any]:
    return {"code": code} if annotation is None else {"code": code, "type_annotation": annotation}


def _array(element: dict[str, Any]) -> dict[str, Any]:
    return {"array_element_type": element, "code": "ARRAY"}


# (column type, wire value, Python value): wire values as Spanner's JSON carries them.
CASES: list[tuple[dict[str, Any], Any, Any]] = [
    (_t("INT64"), "-9223372036854775808", -(2**63)),
    (_t("INT64"), "9223372036854775807", 2**63 - 1),
    (_t("INT64", "PG_OID"), "42", 42),
    (_t("ENUM"), "3", 3),
    (_t("FLOAT64"), 1.5, 1.5),
    (_t("FLOAT64"), 1, 1.0),  # an integral double may arrive as a JSON integer
    (_t("FLOAT64"), "Infinity", math.inf),
    (_t("FLOAT64"), "-Infinity", -math.inf),
    (_t("FLOAT32"), 0.5, 0.5),
    (_t("NUMERIC"), "12345678901234567890.123456789", Decimal("12345678901234567890.123456789")),
    (_t("NUMERIC"), "-0.5", Decimal("-0.5")),
    (_t("NUMERIC", "PG_NUMERIC"), "1.10", Decimal("1.10")),
    (_t("BOOL"), True, True),
    (_t("STRING"), "zoë ✓", "zoë ✓"),
    (_t("BYTES"), "AP8=", b"\x00\xff"),
    (_t("BYTES"), "", b""),
    (_t("PROTO"), "CgFh", b"\n\x01a"),
    (_t("DATE"), "2024-02-29", date(2024, 2, 29)),
    (_t("DATE"), "0001-01-01", date(1, 1, 1)),
    (_t("TIMESTAMP"), "2024-05-01T12:00:00.123456789Z",
     Timestamp.parse("2024-05-01T12:00:00.123456789Z")),
    (_t("TIMESTAMP"), "1970-01-01T00:00:00Z", Timestamp.from_ns(0)),
    (_t("JSON"), '{"a":[1,2.5,null],"b":"x"}', {"a": [1, 2.5, None], "b": "x"}),
    (_t("JSON"), '"s"', JsonString("s")),  # a JSON string: marked as one
    (_t("JSON"), "3", 3),
    (_t("JSON", "PG_JSONB"), '{"a": [1, 2.5, null], "b": "x"}', {"a": [1, 2.5, None], "b": "x"}),
    (_array(_t("INT64")), ["1", None, "3"], [1, None, 3]),
    (_array(_t("FLOAT64")), [1.5, "NaN", None], [1.5, "nan", None]),
    (_array(_t("NUMERIC", "PG_NUMERIC")), ["1.10", "NaN"], [Decimal("1.10"), "nan"]),
    (_array(_t("JSON")), ['{"k":1}', None], [{"k": 1}, None]),
    (_array(_t("TIMESTAMP")), ["2024-01-01T00:00:00Z"], [Timestamp.parse("2024-01-01T00:00:00Z")]),
    (_array(_t("DATE")), ["0001-01-01"], [date(1, 1, 1)]),
    (_array(_t("BYTES")), ["YWI="], [b"ab"]),
    (_array(_t("BOOL")), [True, None], [True, None]),
    (_array(_t("STRING")), ["a", None], ["a", None]),
    (_array(_t("INT64")), [], []),
]


def _same(got: Any, want: Any) -> bool:
    """Equality where the string "nan" stands for a NaN of the expected type."""
    if want == "nan":
        return isinstance(got, float | Decimal) and got != got
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            _same(g, w) for g, w in zip(got, want, strict=True)
        )
    return type(got) is type(want) and got == want


@pytest.mark.parametrize(("column_type", "wire", "python"), CASES,
                         ids=[f"{type_code(c)}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_wire_values_decode_to_python(column_type: dict[str, Any], wire: Any, python: Any) -> None:
    convert = decoder_for(column_type)
    got = wire if convert is None else convert(wire)
    assert _same(got, python), (got, python)


def test_nan_forms() -> None:
    assert math.isnan(decoder_for(_t("FLOAT64"))("NaN"))  # type: ignore[misc]
    assert decoder_for(_t("NUMERIC", "PG_NUMERIC"))("NaN").is_nan()  # type: ignore[misc]
    assert encoder_for(_t("FLOAT64"))(math.nan) == "NaN"  # type: ignore[misc]
    assert encoder_for(_t("FLOAT32"))(-math.inf) == "-Infinity"  # type: ignore[misc]
    assert encoder_for(_t("NUMERIC"))(Decimal("NaN")) == "NaN"  # type: ignore[misc]


@pytest.mark.parametrize(("column_type", "wire", "python"),
                         [c for c in CASES if "nan" not in repr(c[2])
                          and not (type_code(c[0]) == "JSON" and c[2].__class__ is str)])
def test_python_values_encode_to_what_decodes_back(
    column_type: dict[str, Any], wire: Any, python: Any
) -> None:
    encode, decode = encoder_for(column_type), decoder_for(column_type)
    encoded = python if encode is None else encode(python)
    assert _same(python if decode is None else decode(encoded), python)
    # encoding is idempotent: wire text stays what it is (JSON text stays text)
    if encode is not None and isinstance(wire, str):
        assert encode(wire) == wire


@pytest.mark.parametrize("column_type", [
    _t("INTERVAL"), _t("UUID"), _t("SOMETHING_NEW"), {"code": 99}, {}, None, "INT64",
    _array(_t("SOMETHING_NEW")),
])
def test_unknown_types_keep_the_wire_value(column_type: Any) -> None:
    assert decoder_for(column_type) is None
    assert encoder_for(column_type) is None


def test_numeric_type_codes_are_understood() -> None:
    assert type_code({"code": 2}) == "INT64"
    assert decoder_for({"code": 2}) is int
    assert decoder_for({"code": 8, "array_element_type": {"code": 10}})(["1.5"]) == [  # type: ignore[misc]
        Decimal("1.5")
    ]


def test_decode_values_converts_only_typed_non_null_columns() -> None:
    columns = [ColumnType("Id", _t("INT64"), True, 1), ColumnType("Name", _t("STRING"), False, 2),
               ColumnType("At", _t("TIMESTAMP"), False, 3)]
    convs = decoders(columns)
    assert set(convs) == {"Id", "At"}
    values = {"Id": "7", "Name": "n", "At": None, "Other": "x"}
    got = decode_values(values, convs)
    assert got == {"Id": 7, "Name": "n", "At": None, "Other": "x"}
    assert values["Id"] == "7"  # a new dict: the input is not changed
    assert decode_values(values, {}) is values


@given(
    present=st.dictionaries(
        st.sampled_from(["Id", "Name", "At", "Amount", "Doc", "Other"]),
        st.sampled_from(["7", "n", None, "2024-05-01T12:00:00.123456789Z", "1.50",
                         '{"a": [1, null]}']),
    ),
    typed=st.sets(st.sampled_from(["Id", "At", "Amount", "Doc", "Name"])),
)
def test_convert_in_place_gives_what_decode_values_gives(
    present: dict[str, Any], typed: set[str]
) -> None:
    types = {"Id": _t("INT64"), "At": _t("TIMESTAMP"), "Amount": _t("NUMERIC"),
             "Doc": _t("JSON"), "Name": _t("STRING")}
    values = {  # each column's wire form, so every converter accepts it
        name: (None if value is None else {"Id": "7", "At": "2024-05-01T12:00:00.123456789Z",
                                           "Amount": "1.50", "Doc": '{"a": [1, null]}'}
               .get(name, value))
        for name, value in present.items()
    }
    convs = decoders([ColumnType(n, types[n], n == "Id", i) for i, n in enumerate(sorted(typed))])
    expected = decode_values(values, convs)
    mine = dict(values)
    got = convert_in_place(mine, convs, tuple(convs.items()))
    assert got is mine  # the same dict, converted in place
    assert got == expected
    assert list(got) == list(expected)  # and in the same order


@given(
    ints=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    floats=st.floats(allow_nan=False),
    numerics=st.decimals(allow_nan=False, allow_infinity=False, places=9,
                         min_value=Decimal("-1e20"), max_value=Decimal("1e20")),
    raw=st.binary(),
    ns=st.integers(min_value=0, max_value=253402300799 * 10**9),
    day=st.dates(),
    doc=st.recursive(st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(),
                     lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner)),
)
def test_every_type_round_trips(
    ints: int, floats: float, numerics: Decimal, raw: bytes, ns: int, day: date, doc: Any
) -> None:
    columns = [
        ColumnType("i", _t("INT64"), True, 1), ColumnType("f", _t("FLOAT64"), False, 2),
        ColumnType("n", _t("NUMERIC"), False, 3), ColumnType("b", _t("BYTES"), False, 4),
        ColumnType("t", _t("TIMESTAMP"), False, 5), ColumnType("d", _t("DATE"), False, 6),
        ColumnType("j", _t("JSON"), False, 7), ColumnType("a", _array(_t("INT64")), False, 8),
    ]
    values = {"i": ints, "f": floats, "n": numerics, "b": raw, "t": Timestamp.from_ns(ns),
              "d": day, "j": doc, "a": [ints, None]}
    if doc is None or isinstance(doc, str):
        values["j"] = {"s": doc}  # a bare str is taken as JSON text (see encoder_for)
    wire = encode_values(values, {c.name: encoder_for(c.type) for c in columns})  # type: ignore[misc]
    assert all(isinstance(wire[k], str) for k in "inbtdj")
    back = decode_values(wire, decoders(columns))
    assert back == values
    assert back["t"].ns == ns


def test_json_integers_stay_exact_at_any_size() -> None:
    # PostgreSQL's jsonb keeps integers of any size; orjson alone would make them floats.
    convert = decoder_for({"code": "JSON"})
    assert convert is not None
    text = ('{"big": 123456789012345678901234567890, "neg": -98765432109876543210, '
            '"fits": 9223372036854775807, "n": 0.5, "s": "12345678901234567890123"}')
    got = convert(text)
    assert got == {"big": 123456789012345678901234567890, "neg": -98765432109876543210,
                   "fits": 2**63 - 1, "n": 0.5, "s": "12345678901234567890123"}
    assert type(got["big"]) is int and type(got["neg"]) is int
    assert convert("12345678901234567890123") == 12345678901234567890123
    for not_json in ("[1e400]", "[NaN, 12345678901234567890]"):
        with pytest.raises(orjson.JSONDecodeError):  # strict JSON first, long digits or not
            convert(not_json)
    array = decoder_for({"code": "ARRAY", "array_element_type": {"code": "JSON"}})
    assert array is not None
    assert array(["99999999999999999999", None]) == [99999999999999999999, None]


_WIRE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=12),
    st.sampled_from(["7", "-12", "1_000", " 3 ", "1.50", "1e3", "NaN", "-Infinity", "abc", "",
                     "2024-05-01T12:00:00.123456789Z", "2024-05-01T12:00:00Z",
                     "2024-05-01 12:00:00+02:00", "2024-13-01T00:00:00Z", '{"a": [1, null]}',
                     '"text"', "[1, 2", "123456789012345678901234567890", "2024-05-01"]),
    st.lists(st.sampled_from(["1", None, "2.5"]), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_CODES = ["INT64", "FLOAT64", "FLOAT32", "NUMERIC", "TIMESTAMP", "JSON", "DATE", "BYTES",
          "STRING", "BOOL"]


def _outcome(fn: Any, values: Any, convs: Any) -> Any:
    try:
        got = fn(values, convs)
    except Exception as exc:
        return type(exc)
    return [(k, type(v), v if not isinstance(v, float) or not math.isnan(v) else "nan")
            for k, v in got.items()]


@pytest.mark.skipif(decode_values is decode_values_python, reason="not compiled")
@given(values=st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), _WIRE),
       codes=st.dictionaries(st.sampled_from(["a", "b", "c", "e"]), st.sampled_from(_CODES)),
       arrays=st.booleans())
def test_the_compiled_decode_values_gives_what_the_python_one_gives(
    values: dict[str, Any], codes: dict[str, str], arrays: bool
) -> None:
    """The same values, of the same types, in the same order, or the same error, with the
    compiled module configured (by the GoogleSQL decoder, when it loads: the converters
    it inlines then run without a Python call)."""
    from cdcflow.spanner import records

    assert records.compiled_decoder()
    convs = decoders([ColumnType(name, _array(_t(code)) if arrays else _t(code), False, i)
                      for i, (name, code) in enumerate(codes.items())])
    assert _outcome(decode_values, values, convs) == _outcome(decode_values_python, values,
                                                              convs)
    if not convs:
        assert decode_values(values, convs) is values


def test_decode_values_takes_any_mapping() -> None:
    from types import MappingProxyType

    convs = decoders([ColumnType("Id", _t("INT64"), True, 1)])
    for fn in (decode_values, decode_values_python):
        got = fn(MappingProxyType({"Id": "7", "Name": "n"}), convs)
        assert type(got) is dict and got == {"Id": 7, "Name": "n"}
        assert type(fn(MappingProxyType({"x": 1}), {})) is dict
