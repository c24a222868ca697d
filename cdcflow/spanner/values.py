"""Column values: Spanner's wire form to Python and back, one converter per column type.

A change record's mods hold each column value in Spanner's JSON wire form: INT64 and
NUMERIC as text, FLOAT32/FLOAT64 as numbers (``"NaN"``, ``"Infinity"``, ``"-Infinity"``
as text), BYTES as base64 text, DATE as ``YYYY-MM-DD``, TIMESTAMP as RFC 3339 text, JSON
as JSON text, ARRAY as a list of such values, NULL as None. :func:`decoder_for` gives the
converter from that form to Python for a column type (the ``type`` of a
:class:`~cdcflow.model.ColumnType`, e.g. ``{"code": "INT64"}``):

========================  ==============================================
type code                 Python value
========================  ==============================================
INT64 (PG_OID too), ENUM  int
FLOAT64, FLOAT32          float
NUMERIC (PG_NUMERIC too)  decimal.Decimal (``NaN`` included)
BOOL                      bool
STRING                    str
BYTES, PROTO              bytes
DATE                      datetime.date
TIMESTAMP (timestamptz)   :class:`~cdcflow.model.Timestamp` (UTC, nanoseconds kept)
JSON (PG_JSONB too)       the parsed value (dict, list, str, int, float, bool, None)
ARRAY<T>                  list of T's values (NULL elements stay None)
anything else             the wire value, unchanged (INTERVAL, UUID, future types)
========================  ==============================================

The PostgreSQL dialect reports the same codes, with a ``type_annotation`` (PG_NUMERIC,
PG_JSONB, PG_OID) that does not change the wire form. :func:`encoder_for` is the inverse
(Python or wire value to wire value), for wire encoders and in-memory twins. This module
imports nothing of google-cloud-spanner.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import orjson

from cdcflow.compiled import speedups
from cdcflow.model import ColumnType, JsonString, Timestamp
from cdcflow.serialize import json_dumps

__all__ = [
    "Converter",
    "convert_in_place",
    "converter_in_place",
    "decode_values",
    "decode_values_python",
    "decoder_for",
    "decoders",
    "encode_values",
    "encoder_for",
    "encoders",
    "parse_timestamp",
    "type_code",
]

#: Converts one non-NULL value of a column (never called with None).
Converter = Callable[[Any], Any]

# google.spanner.v1.TypeCode numbers, for type JSON that spells a code as a number.
_CODE_NAMES = {
    1: "BOOL", 2: "INT64", 3: "FLOAT64", 4: "TIMESTAMP", 5: "DATE", 6: "STRING", 7: "BYTES",
    8: "ARRAY", 9: "STRUCT", 10: "NUMERIC", 11: "JSON", 13: "PROTO", 14: "ENUM", 15: "FLOAT32",
    16: "INTERVAL", 17: "UUID",
}
_loads = orjson.loads


# --- timestamps -----------------------------------------------------------------------------

_CACHE_LIMIT = 4096
#: Recent timestamps by text. Small on purpose: values repeat close together (a
#: transaction's records, a column set to the commit timestamp), and a cached Timestamp
#: lives long enough to reach the collector's oldest generation, whose collections then
#: come often and cost milliseconds each (they walk every object of the process).
_TS_CACHE_LIMIT = 64
_ts_cache: dict[str, Timestamp] = {}
#: "YYYY-MM-DDTHH:MM:SS" -> (year, month, day, hour, minute, second, seconds since the epoch)
_second_cache: dict[str, tuple[int, int, int, int, int, int, int]] = {}
_datetime_new = datetime.__new__
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: What n fractional digits are worth in nanoseconds.
_SCALE = (0, 100_000_000, 10_000_000, 1_000_000, 100_000, 10_000, 1_000, 100, 10, 1)


def _second(head: str) -> tuple[int, int, int, int, int, int, int] | None:
    """``YYYY-MM-DDTHH:MM:SS`` as its fields and seconds since the epoch, or None."""
    if len(head) != 19 or head[4] != "-" or head[10] not in "Tt ":
        return None
    try:
        fields = (int(head[0:4]), int(head[5:7]), int(head[8:10]),
                  int(head[11:13]), int(head[14:16]), int(head[17:19]))
        delta = _datetime_new(datetime, *fields, 0, UTC) - _EPOCH
    except ValueError:
        return None  # Timestamp.parse says what is wrong
    found = (*fields, delta.days * 86_400 + delta.seconds)
    if len(_second_cache) >= _CACHE_LIMIT:
        _second_cache.clear()
    _second_cache[head] = found
    return found


def _parse_fast(text: str) -> Timestamp | None:
    """RFC 3339 in UTC (``Z`` or ``+00:00``) with 0..9 fractional digits, else None."""
    found = _second_cache.get(text[:19]) or _second(text[:19])
    if found is None:
        return None
    rest = text[19:]
    if rest[-1:] == "Z":
        digits = rest[1:-1]
    elif rest[-6:] == "+00:00":
        digits = rest[1:-6]
    else:
        return None
    if rest[0] != "." or not 0 < len(digits) <= 9 or not digits.isdecimal():
        if rest not in ("Z", "+00:00"):
            return None
        frac = 0
    else:
        frac = int(digits) * _SCALE[len(digits)]
    year, month, day, hour, minute, second, seconds = found
    # Timestamp's constructor validates keyword arguments in Python; this is the same
    # object built directly (a datetime plus the nanoseconds below the microsecond).
    ts: Timestamp = _datetime_new(
        Timestamp, year, month, day, hour, minute, second, frac // 1000, UTC
    )
    ts._nanosecond = frac % 1000
    ts._ns = seconds * 1_000_000_000 + frac
    # Spanner's usual form is already what rfc3339() writes (nine digits, Z)
    ts._text = text if len(digits) == 9 and rest[-1] == "Z" and text[10] == "T" else None
    return ts


def parse_timestamp(text: str) -> Timestamp:
    """RFC 3339 text (any number of fractional digits, ``Z`` or an offset) to a Timestamp.

    Many records share a commit timestamp (and a second), so recent values are cached.
    """
    ts = _ts_cache.get(text)
    if ts is not None:
        return ts
    ts = _parse_fast(text) or _parse(text)
    if len(_ts_cache) >= _TS_CACHE_LIMIT:
        _ts_cache.clear()
    _ts_cache[text] = ts
    return ts


def _parse(text: str) -> Timestamp:
    """Timestamp.parse, and a year before 1000 written with fewer than four digits, as the
    emulator sends it ("1-01-01T00:00:00Z" for 0001-01-01T00:00:00Z)."""
    try:
        return Timestamp.parse(text)
    except ValueError as exc:
        year, dash, rest = text.partition("-")
        if not (dash and year.isascii() and year.isdigit() and len(year) < 4):
            raise
        try:
            return Timestamp.parse(f"{year.rjust(4, '0')}-{rest}")
        except ValueError:
            raise exc from None


# --- wire -> Python -------------------------------------------------------------------------


def _numeric(value: Any) -> Decimal:
    # Decimal(float) would keep the binary expansion; the wire form is text anyway.
    return Decimal(value) if isinstance(value, str) else Decimal(str(value))


def _bytes(value: Any) -> bytes:
    return binascii.a2b_base64(value)


#: A run of digits that may be an integer past 64 bits, which orjson makes a float.
_LONG_DIGITS = re.compile(r"[0-9]{19}")


def _json(value: Any) -> Any:
    # JSON columns arrive as JSON text; a server that nests the value already parsed it.
    # A JSON string is marked as one (JsonString), apart from JSON text. Integers stay
    # exact at any size (PostgreSQL's jsonb keeps them), as Python's json module parses
    # them; other numbers are floats.
    if value.__class__ is str:
        parsed = _loads(value)  # strict: invalid JSON raises here
        if _LONG_DIGITS.search(value) is not None:
            parsed = json.loads(value)
    else:
        parsed = value
    return JsonString(parsed) if parsed.__class__ is str else parsed


_DECODERS: dict[str, Converter] = {
    "INT64": int,
    "ENUM": int,
    "FLOAT64": float,  # float() reads "NaN", "Infinity" and "-Infinity" too
    "FLOAT32": float,
    "NUMERIC": _numeric,
    "BYTES": _bytes,
    "PROTO": _bytes,
    "DATE": date.fromisoformat,
    "TIMESTAMP": parse_timestamp,
    "JSON": _json,
}


def type_code(column_type: Any) -> str | None:
    """The type code name of a column type (``{"code": "INT64"}`` -> ``"INT64"``)."""
    if not isinstance(column_type, Mapping):
        return None
    code = column_type.get("code")
    if isinstance(code, int):
        return _CODE_NAMES.get(code)
    return code if isinstance(code, str) else None


def _array_of(element: Converter) -> Converter:
    def convert(values: Any) -> list[Any]:
        return [None if v is None else element(v) for v in values]

    return convert


def decoder_for(column_type: Any) -> Converter | None:
    """The converter from the wire form for ``column_type``, or None when the wire value
    already is the Python value (BOOL, STRING, arrays of them, unknown codes)."""
    code = type_code(column_type)
    if code == "ARRAY":
        element = decoder_for(column_type.get("array_element_type"))
        return None if element is None else _array_of(element)
    return _DECODERS.get(code) if code is not None else None


def decoders(columns: Sequence[ColumnType]) -> dict[str, Converter]:
    """Column name -> converter, for the columns whose values need one."""
    out = {}
    for column in columns:
        convert = decoder_for(column.type)
        if convert is not None:
            out[column.name] = convert
    return out


def decode_values_python(values: Mapping[str, Any], converters: Mapping[str, Converter]
                         ) -> dict[str, Any]:
    """``values`` with every non-NULL value converted by its column's converter (columns
    without one keep their value): a new dict, or ``values`` itself (a plain dict) when
    there are no converters. Raises what a converter raises. The reference of
    :func:`decode_values`, which is compiled when cdcflow's compiled module is built."""
    if not converters:
        return values if type(values) is dict else dict(values)
    get = converters.get
    out = {}
    for name, value in values.items():
        if value is not None:
            convert = get(name)
            if convert is not None:
                value = convert(value)
        out[name] = value
    return out


def _compiled_decode_values() -> Callable[[Mapping[str, Any], dict[str, Converter]],
                                          dict[str, Any]] | None:
    module = speedups()
    return None if module is None else module.decode_values


#: :func:`decode_values_python`, compiled when built (the same result and errors; its
#: converters of the types the decoders inline run without a Python call each; the
#: converters must be a dict, as :func:`decoders` gives).
decode_values: Callable[[Mapping[str, Any], dict[str, Converter]], dict[str, Any]] = (
    _compiled_decode_values() or decode_values_python
)


def convert_in_place(
    values: dict[str, Any], converters: Mapping[str, Converter],
    items: tuple[tuple[str, Converter], ...],
) -> dict[str, Any]:
    """What :func:`decode_values` gives, made in ``values`` itself (a dict the caller owns,
    e.g. fresh from a JSON parser): no second dict. ``items`` is ``converters.items()`` as
    a tuple; the shorter of the two is walked. Returns ``values``. Raises what a converter
    raises, leaving ``values`` partly converted (re-parse it to report the error)."""
    if len(values) <= len(items):
        get = converters.get
        for name, value in values.items():  # replacing values keeps the dict's size
            if value is not None:
                convert = get(name)
                if convert is not None:
                    values[name] = convert(value)
    else:
        for name, convert in items:
            value = values.get(name)
            if value is not None:
                values[name] = convert(value)
    return values


#: Converters written inline by :func:`converter_in_place` (the same result, without a call).
_INLINE: dict[Converter, str] = {
    int: "int(v)",
    float: "float(v)",
    _numeric: "(Decimal(v) if v.__class__ is str else numeric(v))",
    parse_timestamp: "parse_timestamp(v)",
}
#: Above this many converters a dict smaller than a quarter of them is walked instead.
_UNROLL = 8


def converter_in_place(
    converters: Mapping[str, Converter],
) -> Callable[[dict[str, Any]], None] | None:
    """A function doing ``convert_in_place(values, converters, ...)`` for these converters
    (None when there are none), written out for them: one ``get`` and one inline conversion
    per column, no loop. For many columns, a dict much smaller than the list (a mod's keys,
    an update of one column) is walked instead. Raises what a converter raises, leaving the
    dict partly converted."""
    items = tuple(converters.items())
    if not items:
        return None
    env: dict[str, Any] = {
        "Decimal": Decimal, "numeric": _numeric, "loads": _loads, "JsonString": JsonString,
        "parse_timestamp": parse_timestamp, "convert_in_place": convert_in_place,
        "converters": dict(converters), "items": items,
    }
    lines = ["def convert(d):"]
    if len(items) > _UNROLL:
        lines += [
            f"    if len(d) * 4 < {len(items)}:",
            "        convert_in_place(d, converters, items)",
            "        return",
        ]
    for i, (name, convert) in enumerate(items):
        expression = _INLINE.get(convert)
        if expression is None:
            env[f"c{i}"] = convert
            expression = f"c{i}(v)"
        # repr() of a str is a Python literal of it: any column name is safe here
        lines += [
            f"    v = d.get({name!r})",
            "    if v is not None:",
            f"        d[{name!r}] = {expression}",
        ]
    exec("\n".join(lines), env)  # the source holds literals and names of env only
    function: Callable[[dict[str, Any]], None] = env["convert"]
    return function


# --- Python -> wire -------------------------------------------------------------------------


def _enc_int(value: Any) -> Any:
    return value if isinstance(value, str) else str(int(value))


def _enc_float(value: Any) -> Any:
    if isinstance(value, str):
        return value
    f = float(value)
    if f != f:
        return "NaN"
    if f in (float("inf"), float("-inf")):
        return "Infinity" if f > 0 else "-Infinity"
    return f


def _enc_numeric(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, Decimal):
        return format(value, "f")
    return str(value)


def _enc_bytes(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    return value


def _enc_date(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.date().isoformat()
    return value.isoformat() if isinstance(value, date) else value


def _enc_timestamp(value: Any) -> Any:
    if isinstance(value, datetime):
        return Timestamp.from_datetime(value).rfc3339()
    if isinstance(value, int) and not isinstance(value, bool):
        return Timestamp.from_ns(value).rfc3339()
    return value


def _enc_json(value: Any) -> Any:
    # A str is taken as JSON text already (the wire form); to send a JSON string value,
    # pass its JSON text ('"abc"') or a JsonString (what the decoder gives for one).
    if value.__class__ is str:
        return value
    return json_dumps(value, sort_keys=True).decode()


_ENCODERS: dict[str, Converter] = {
    "INT64": _enc_int,
    "ENUM": _enc_int,
    "FLOAT64": _enc_float,
    "FLOAT32": _enc_float,
    "NUMERIC": _enc_numeric,
    "BYTES": _enc_bytes,
    "PROTO": _enc_bytes,
    "DATE": _enc_date,
    "TIMESTAMP": _enc_timestamp,
    "JSON": _enc_json,
}


def encoder_for(column_type: Any) -> Converter | None:
    """The converter to the wire form for ``column_type`` (None: values pass unchanged).

    It takes Python values and wire values alike (``5`` and ``"5"`` both give ``"5"`` for
    INT64), so encoding is idempotent; a str for a JSON column is taken as JSON text.
    """
    code = type_code(column_type)
    if code == "ARRAY":
        element = encoder_for(column_type.get("array_element_type"))
        return None if element is None else _array_of(element)
    return _ENCODERS.get(code) if code is not None else None


def encoders(columns: Sequence[ColumnType]) -> dict[str, Converter]:
    """Column name -> converter to the wire form, for the columns that need one."""
    out = {}
    for column in columns:
        convert = encoder_for(column.type)
        if convert is not None:
            out[column.name] = convert
    return out


def encode_values(values: Mapping[str, Any], converters: Mapping[str, Converter]
                  ) -> dict[str, Any]:
    """``values`` in the wire form (see :func:`encoder_for`), as a new dict."""
    return decode_values_python(values, converters) if converters else dict(values)
