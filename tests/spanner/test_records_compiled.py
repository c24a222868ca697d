"""The compiled decoder (cdcflow._speedups, through cdcflow.spanner.records) against the
Python one: the same records, the same sizes and the same errors, for every column type and
any mods text."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from datetime import date
from decimal import Decimal
from typing import Any

import attrs
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcflow.errors import DecodeError
from cdcflow.model import (
    ChangeRecord,
    ColumnType,
    DataChangeRecord,
    JsonString,
    Mod,
    Timestamp,
)
from cdcflow.spanner import records as records_module
from cdcflow.spanner import wire
from cdcflow.spanner.flat import MessageDecoder
from cdcflow.spanner.shape import RecordShaper

TOKEN = "p"
T0 = Timestamp.parse("2024-05-01T12:00:00.123456789Z").ns
COMPILED = records_module._SPEEDUPS

pytestmark = pytest.mark.skipif(COMPILED is None, reason="the compiled decoder is not built")


def test_the_compiled_decoder_is_used_here() -> None:
    assert records_module.compiled_decoder()


class _Counting:
    """The compiled module, counting the runs it decoded (None: it declined)."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.decoded = self.declined = 0

    def decode(self, *args: Any) -> Any:
        out = self.compiled.decode(*args)
        if out is None:
            self.declined += 1
        else:
            self.decoded += 1
        return out


def _decode(messages: list[bytes], shaper: Callable[[], RecordShaper], compiled: Any
            ) -> tuple[list[ChangeRecord], list[int | None]] | BaseException:
    """The records of the messages, and each one's measured size; or the error."""
    saved = records_module._SPEEDUPS
    records_module._SPEEDUPS = compiled
    try:
        decoder = MessageDecoder(shaper())
        out: list[ChangeRecord] = []
        sizes: list[int | None] = []
        for message in messages:
            got = decoder.decode(message, TOKEN)
            out.extend(got)
            sizes.extend(decoder.sizes.get(id(r)) for r in got)
        return out, sizes
    except Exception as exc:
        return exc
    finally:
        records_module._SPEEDUPS = saved


def _norm(x: Any) -> Any:
    """A value with every type spelled out (bool vs int, JsonString vs str, float bits),
    NaN comparable, dict order kept."""
    if attrs.has(type(x)):
        return (type(x).__name__, tuple(_norm(getattr(x, f.name)) for f in attrs.fields(type(x))))
    if isinstance(x, Timestamp):
        return ("Timestamp", x.ns, x.nanosecond, x.tzinfo, x.timetuple()[:6], x.microsecond)
    if isinstance(x, dict):
        return ("dict", tuple((k, _norm(v)) for k, v in x.items()))
    if isinstance(x, list | tuple):
        return (type(x).__name__, tuple(_norm(v) for v in x))
    if isinstance(x, float):
        return ("float", "nan" if math.isnan(x) else x.hex())
    return (type(x).__name__, repr(x))


def _same(messages: list[bytes], shaper: Callable[[], RecordShaper]) -> _Counting:
    """Decode both ways; assert the same outcome. Returns the counting compiled module."""
    counting = _Counting(COMPILED)
    fast = _decode(messages, shaper, counting)
    slow = _decode(messages, shaper, None)
    if isinstance(slow, BaseException) or isinstance(fast, BaseException):
        assert type(fast) is type(slow), (fast, slow)
        assert str(fast) == str(slow)
    else:
        assert _norm(fast[0]) == _norm(slow[0])
        assert fast[1] == slow[1]  # the sizes the quota charges
    return counting


def _serialized(values: list[Any], per_message: int = 7) -> list[bytes]:
    messages = wire.partial_result_sets(
        wire.row_type(wire.googlesql_column_type()), values, rows_per_message=per_message
    )
    return [m.SerializeToString() for m in messages]


# --- records of every column type ---------------------------------------------------------

_TYPES: dict[str, Any] = {
    "b": {"code": "BOOL"}, "i": {"code": "INT64"}, "f": {"code": "FLOAT64"},
    "f32": {"code": "FLOAT32"}, "n": {"code": "NUMERIC"}, "s": {"code": "STRING"},
    "y": {"code": "BYTES"}, "d": {"code": "DATE"}, "t": {"code": "TIMESTAMP"},
    "j": {"code": "JSON"}, "ai": {"code": "ARRAY", "array_element_type": {"code": "INT64"}},
    "as": {"code": "ARRAY", "array_element_type": {"code": "STRING"}},
    "af": {"code": "ARRAY", "array_element_type": {"code": "FLOAT64"}},
    "aj": {"code": "ARRAY", "array_element_type": {"code": "JSON"}},
    "at": {"code": "ARRAY", "array_element_type": {"code": "TIMESTAMP"}},
}
_COLUMNS = (ColumnType("k", {"code": "INT64"}, True, 1),
            ColumnType("ks", {"code": "STRING"}, True, 2),
            *(ColumnType(name, t, False, i + 3) for i, (name, t) in enumerate(_TYPES.items())))

_text = st.text(max_size=12) | st.sampled_from(["", '"', "\\", "\n\t\r\x00\x1f", "é€😀", "\u2028"])
_ts = st.integers(Timestamp.parse("0001-01-01T00:00:00Z").ns,
                  Timestamp.parse("9999-12-31T23:59:59.999999999Z").ns).map(Timestamp.from_ns)
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | _text
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
).map(lambda v: JsonString(v) if type(v) is str else v)  # a str alone would be JSON text
_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "b": st.booleans(), "i": st.integers(-(2**63), 2**63 - 1),
    "f": st.floats(), "f32": st.floats(width=32),
    "n": st.decimals(min_value=Decimal("-1e29") + 1, max_value=Decimal("1e29") - 1, places=9,
                     allow_nan=False),
    "s": _text, "y": st.binary(max_size=12), "d": st.dates(min_value=date(1, 1, 1)),
    "t": _ts, "j": _json_value,
    "ai": st.lists(st.none() | st.integers(-(2**63), 2**63 - 1), max_size=3),
    "as": st.lists(st.none() | _text, max_size=3),
    "af": st.lists(st.none() | st.floats(), max_size=3),
    "aj": st.lists(st.none() | _json_value, max_size=2),
    "at": st.lists(st.none() | _ts, max_size=2),
}


@st.composite
def _row(draw: st.DrawFn) -> dict[str, Any]:
    names = draw(st.lists(st.sampled_from(sorted(_VALUES)), unique=True, max_size=len(_VALUES)))
    return {name: draw(st.none() | _VALUES[name]) for name in names}


@st.composite
def _record(draw: st.DrawFn, i: int = 0) -> DataChangeRecord:
    mods = [
        Mod({"k": draw(st.integers(-(2**63), 2**63 - 1)), "ks": draw(_text)},
            draw(_row()), draw(_row()))
        for _ in range(draw(st.integers(0, 3)))
    ]
    return DataChangeRecord(
        TOKEN, draw(_ts), draw(st.sampled_from(["00000000", "00000001"])), f"txn-{i}",
        draw(st.booleans()), draw(st.sampled_from(["T", "Ü"])), _COLUMNS, mods,
        draw(st.sampled_from(["INSERT", "UPDATE", "DELETE"])), "OLD_AND_NEW_VALUES",
        draw(st.integers(1, 10**6)), draw(st.integers(1, 9)), draw(_text),
        draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_record(), min_size=1, max_size=6), st.booleans())
def test_records_of_every_type_decode_the_same_both_ways(
    records: list[DataChangeRecord], typed: bool
) -> None:
    messages = _serialized([wire.encode_googlesql([r]) for r in records])
    counting = _same(messages, lambda: RecordShaper(typed=typed))
    assert counting.decoded >= 1 and counting.declined == 0  # Spanner's form: all compiled


def test_typed_values_are_the_values_written() -> None:
    ts = Timestamp.parse("2262-04-11T23:47:16.854775808Z")
    record = DataChangeRecord(
        TOKEN, Timestamp.from_ns(T0), "00000000", "t", True, "T", _COLUMNS,
        [Mod({"k": -(2**63), "ks": 'q"\\é😀'},
             {"n": Decimal("-123456789.000000001"), "t": ts, "j": {"a": [1, "x", None]},
              "f": float("nan"), "y": b"\x00\xff", "d": date(9999, 12, 31), "as": ["a", None],
              "b": False, "at": [ts, None]},
             {"j": JsonString("text"), "f": float("-inf"), "i": 2**63 - 1})],
        "UPDATE", "OLD_AND_NEW_VALUES", 1, 1,
    )
    messages = _serialized([wire.encode_googlesql([record])])
    fast = _decode(messages, RecordShaper, COMPILED)
    assert not isinstance(fast, BaseException)
    (got,) = fast[0]
    assert isinstance(got, DataChangeRecord)
    mod = got.mods[0]
    assert mod.keys == {"k": -(2**63), "ks": 'q"\\é😀'}
    assert mod.new_values["n"] == Decimal("-123456789.000000001")
    assert mod.new_values["t"].ns == ts.ns and mod.new_values["t"].rfc3339() == ts.rfc3339()
    assert mod.new_values["j"] == {"a": [1, "x", None]} and mod.new_values["y"] == b"\x00\xff"
    assert math.isnan(mod.new_values["f"]) and mod.old_values["f"] == float("-inf")
    assert mod.old_values["j"] == "text" and type(mod.old_values["j"]).__name__ == "JsonString"
    assert got.commit_timestamp.ns == T0 and got.number_of_records_in_transaction == 1
    _same(messages, RecordShaper)


# --- any mods text ------------------------------------------------------------------------

_NUMBERS = ["0", "-0", "1", "-12", "0.5", "-0.0", "1e5", "1E+5", "2.5e-3", "1e-400", "1e400",
            "01", "1.", ".5", "-", "1e", "123456789012345678", "1234567890123456789",
            "18446744073709551616", "4.9e-324", "1.7976931348623157e308", "NaN", "Infinity"]
_STRINGS = ['"a"', '"\\u00e9"', '"\\ud83d\\ude00"', '"\\ud800"', '"\\udc00x"', '"\\u00"',
            '"\\x"', '"tab\\there"', '"raw\ttab"', '"\\/\\b\\f\\n\\r\\\\\\""', '"é"', '"\\u0000"',
            '"unterminated']
_SCALARS = _NUMBERS + _STRINGS + ["true", "false", "null", "tru", "nul", "[]", "[1,2]",
                                  "[1,]", '["a",[null,{"b":1}]]', '{"x":1}', "{}"]


@st.composite
def _object_text(draw: st.DrawFn) -> str:
    """A mod's JSON object text, mostly valid, with Spanner's keys and odd values,
    whitespace, duplicate keys, escapes in keys and trailing garbage."""
    keys = draw(st.lists(st.sampled_from(["k", "ks", "i", "f", "n", "s", "j", "t", "ai", "as",
                                          "k\\u0073", "i"]), max_size=5))
    ws = draw(st.sampled_from(["", " ", "\n\t "]))
    items = [f'{ws}"{k}"{ws}:{ws}{draw(st.sampled_from(_SCALARS))}{ws}' for k in keys]
    text = "{" + ",".join(items) + "}"
    return text + draw(st.sampled_from(["", "", "", " ", "x", ",", "}"]))


@st.composite
def _raw_record(draw: st.DrawFn) -> Any:
    """A GoogleSQL row value whose mods are arbitrary texts (or NULL)."""
    columns = [[c.name, orjson.dumps(c.type).decode(), c.is_primary_key, c.ordinal_position]
               for c in _COLUMNS]
    texts = st.none() | st.just("") | _object_text()
    mods = [[draw(texts), draw(texts), draw(texts)] for _ in range(draw(st.integers(1, 3)))]
    data = [Timestamp.from_ns(T0).rfc3339(), "00000000", "t", True, "T", columns, mods,
            "UPDATE", "OLD_AND_NEW_VALUES", 1, 1, "", False]
    return wire._v([[[data], [], []]])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_raw_record(), min_size=1, max_size=4), st.booleans())
def test_any_mods_text_decodes_the_same_or_fails_the_same(values: list[Any], typed: bool) -> None:
    _same(_serialized(values, per_message=2), lambda: RecordShaper(typed=typed))


@pytest.mark.parametrize("text", [
    '{"i":"12"}', '{"i":"x"}', '{"n":"1.5"}', '{"n":"abc"}', '{"t":"2024-13-01T00:00:00Z"}',
    '{"t":"2024-02-30T00:00:00.5Z"}', '{"t":"2024-05-01T12:00:00+01:00"}',
    '{"t":"2024-05-01 12:00:00Z"}', '{"t":"0001-01-01T00:00:00Z"}', '{"t":"2024-05-01T24:00:00Z"}',
    '{"j":"{bad"}', '{"j":"\\"s\\""}', '{"j":"[1,{\\"a\\":null}]"}', '{"f":"NaN"}',
    '{"f":"Infinity"}', '{"f":1}', '{"f":"x"}', '{"ai":["1",null,"x"]}', '{"y":"!!"}',
    '{"d":"2024-02-30"}', '{"k":"1","k":"2"}', '{"i":" 7 "}', '{"i":"1_000"}',
    # escapes orjson refuses: each must fail the same way, not decode to ""
    '{"s":"\\x"}', '{"s":"\\ud800"}', '{"as":["\\udc00x"]}', '{"s":"\\u00e"}',
    '{"s":"a\\ud83d\\u0041"}', '{"s":"\\ud83d\\ude00\\n\\u00e9"}', '{"s":"tab\there"}',
    # JSON column texts the compiled parser reads, or leaves to orjson
    '{"j":"{\\"a\\":1,\\"a\\":2}"}', '{"j":"{\\"k\\\\u0041\\":[1,{\\"x\\":null}]}"}',
    '{"j":" [1, 2.5e3, -0, true] "}', '{"j":"{\\"a\\":1} x"}', '{"j":"[[[[[[[[[[1]]]]]]]]]]"}',
    '{"j":"1e400"}', '{"j":"{}"}', '{"j":"\\"\\""}', '{"j":"{\\"a\\":{\\"b\\":{}}}"}',
    '{"aj":["{\\"a\\":[]}","3",null]}',
])
def test_odd_values_decode_the_same_or_fail_the_same(text: str) -> None:
    columns = [[c.name, orjson.dumps(c.type).decode(), c.is_primary_key, c.ordinal_position]
               for c in _COLUMNS]
    data = [Timestamp.from_ns(T0).rfc3339(), "00000000", "t", True, "T", columns,
            [['{"k":"1","ks":"a"}', text, None]], "UPDATE", "OLD_AND_NEW_VALUES", 1, 1, "", False]
    messages = _serialized([wire._v([[[data], [], []]])])
    for typed in (True, False):
        _same(messages, lambda typed=typed: RecordShaper(typed=typed))


def test_a_value_that_is_not_its_wire_form_names_the_column_from_either_decoder() -> None:
    columns = [[c.name, orjson.dumps(c.type).decode(), c.is_primary_key, c.ordinal_position]
               for c in _COLUMNS]
    data = [Timestamp.from_ns(T0).rfc3339(), "00000000", "t", True, "T", columns,
            [['{"k":"1","ks":"a"}', '{"n":"not a number"}', None]], "UPDATE",
            "OLD_AND_NEW_VALUES", 1, 1, "", False]
    got = _decode(_serialized([wire._v([[[data], [], []]])]), RecordShaper, COMPILED)
    assert isinstance(got, DecodeError) and "'n'" in str(got)


def test_timestamps_at_the_ends_of_the_range_and_every_precision() -> None:
    texts = ["0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999999999Z", "1969-12-31T23:59:59.9Z",
             "1970-01-01T00:00:00.000000001Z", "2000-02-29T12:34:56.123Z",
             "2024-05-01T12:00:00.12345678Z", "2262-04-11T23:47:16.854775807Z",
             "2262-04-11T23:47:16.854775808Z", "1677-09-21T00:12:43.145224191Z"]
    for text in texts:
        ts = Timestamp.parse(text)
        record = DataChangeRecord(TOKEN, ts, "0", "t", True, "T", _COLUMNS,
                                  [Mod({"k": 1, "ks": "a"}, {"t": ts, "at": [ts]}, {})],
                                  "INSERT", "NEW_ROW", 1, 1)
        messages = _serialized([wire.encode_googlesql([record])])
        fast = _decode(messages, RecordShaper, COMPILED)
        assert not isinstance(fast, BaseException)
        got = fast[0][0]
        assert isinstance(got, DataChangeRecord)
        for value in (got.commit_timestamp, got.mods[0].new_values["t"]):
            assert value == ts and value.ns == ts.ns and value.rfc3339() == ts.rfc3339()
            assert hash(value) == hash(ts) and value.nanosecond == ts.nanosecond
        _same(messages, RecordShaper)


def test_records_decoded_in_many_threads_at_once() -> None:
    # The compiled decoder's caches (column names, the last timestamp) are shared by every
    # thread of a worker (a memory runner's pool): any interleaving gives the same records.
    from concurrent.futures import ThreadPoolExecutor

    def batch(n: int) -> list[DataChangeRecord]:
        return [DataChangeRecord(
            TOKEN, Timestamp.from_ns(T0 + n * 1000 + i), "0", f"t{n}-{i}", True, f"T{n % 3}",
            _COLUMNS, [Mod({"k": i, "ks": f"{n}"}, {"t": Timestamp.from_ns(T0 + i), "s": "x" * i,
                                                    "n": Decimal(i) / 8}, {})],
            "INSERT", "NEW_ROW", 1, 1) for i in range(40)]

    inputs = {n: batch(n) for n in range(16)}
    messages = {n: _serialized([wire.encode_googlesql([r]) for r in rs], per_message=10)
                for n, rs in inputs.items()}

    def run(n: int) -> Iterator[bool]:
        for _ in range(20):
            got = _decode_compiled(messages[n])
            yield got == inputs[n]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda n: all(run(n)), range(16)))
    assert all(results)


def _decode_compiled(messages: list[bytes]) -> list[ChangeRecord]:
    decoder = MessageDecoder(RecordShaper())
    out: list[ChangeRecord] = []
    for message in messages:
        out.extend(decoder.decode(message, TOKEN))
    return out


def test_json_integers_past_64_bits_stay_exact_both_ways() -> None:
    columns = [[c.name, orjson.dumps(c.type).decode(), c.is_primary_key, c.ordinal_position]
               for c in _COLUMNS]
    texts = ['{"j":"123456789012345678901234567890","aj":["-99999999999999999999",null]}',
             '{"j":"{\\"n\\":12345678901234567890123,\\"f\\":0.5}"}']
    data = [Timestamp.from_ns(T0).rfc3339(), "00000000", "t", True, "T", columns,
            [['{"k":"1","ks":"a"}', text, None] for text in texts], "UPDATE",
            "OLD_AND_NEW_VALUES", 1, 1, "", False]
    messages = _serialized([wire._v([[[data], [], []]])])
    fast = _decode(messages, RecordShaper, COMPILED)
    assert not isinstance(fast, BaseException)
    (record,) = fast[0]
    assert isinstance(record, DataChangeRecord)
    first, second = (m.new_values for m in record.mods)
    assert first == {"j": 123456789012345678901234567890, "aj": [-99999999999999999999, None]}
    assert second == {"j": {"n": 12345678901234567890123, "f": 0.5}}
    _same(messages, RecordShaper)
