"""Elements as JSON: change records, attrs and dataclass instances, and dicts.

:func:`to_json_dict` turns an element into a dict of plain JSON values; :func:`dumps_line`
makes one JSONL line of it. Conversions: :class:`~cdcflow.model.Timestamp` and other
datetimes -> RFC 3339 text with nine fractional digits (UTC); ``date``/``time`` -> ISO text;
``Decimal`` -> positional text, never an exponent (``0.000000001``, as Spanner writes
NUMERIC: it keeps its precision); ``bytes`` -> base64 text (as
Spanner's JSON does for BYTES); floats that are not finite -> ``"NaN"``, ``"Infinity"``,
``"-Infinity"`` (Spanner's JSON for them; JSON has no such numbers); enums -> their
value; tuples and lists -> lists; sets -> sorted lists; attrs/dataclass instances and
mappings -> dicts. Anything else raises
SinkError: map it to a dict with ``Map`` first.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import math
from collections.abc import Callable, Mapping
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

import attrs
import orjson

from cdcflow.compiled import speedups
from cdcflow.errors import SinkError
from cdcflow.model import Timestamp

__all__ = ["dumps_line", "json_dumps", "to_json_dict", "to_json_value"]

_SCALARS = (str, int, float, bool, type(None))


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        if attrs.has(cls):
            names = tuple(f.name for f in attrs.fields(cls))
        else:
            names = tuple(f.name for f in dataclasses.fields(cls))
        _FIELD_NAMES[cls] = names
    return names


def _is_struct(value: Any) -> bool:
    cls = type(value)
    return attrs.has(cls) or (dataclasses.is_dataclass(value) and not isinstance(value, type))


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    if isinstance(key, int | float | bool) or key is None:
        return str(key)
    msg = (
        f"cannot use {key!r} ({type(key).__name__}) as a JSON object key; map it to a dict "
        "with str keys with Map first"
    )
    raise SinkError(msg)


def _struct_dict(value: Any) -> dict[str, Any]:
    return {name: to_json_value(getattr(value, name)) for name in _field_names(type(value))}


def decimal_text(value: Any) -> str:
    """A Decimal as Spanner writes NUMERIC: positional notation (``0.000000001``), never an
    exponent (``str(Decimal)`` gives ``1E-9``)."""
    text = str(value)
    if isinstance(value, Decimal) and ("E" in text or "e" in text):
        # format(value, "f") is the same text when str() has no exponent, at 4x the cost
        return format(value, "f")
    return text


def to_json_value(value: Any) -> Any:
    """Convert ``value`` to plain JSON values (see the module docstring for the rules)."""
    if isinstance(value, _SCALARS) and not isinstance(value, enum.Enum):
        if isinstance(value, float) and not math.isfinite(value):
            return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
        return value
    if isinstance(value, datetime):
        return Timestamp.from_datetime(value).rfc3339()
    if isinstance(value, enum.Enum):
        return to_json_value(value.value)
    if isinstance(value, Mapping):
        return {_key(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json_value(v) for v in value]
    if _is_struct(value):
        return _struct_dict(value)
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, Decimal):
        return decimal_text(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, set | frozenset):
        items = [to_json_value(v) for v in value]
        try:
            return sorted(items)
        except TypeError:
            return sorted(items, key=lambda v: orjson.dumps(v))
    msg = (
        f"cannot write {type(value).__name__} value {value!r:.80} as JSON; map it to a dict "
        "of plain values (str, numbers, lists, dicts) with Map first"
    )
    raise SinkError(msg)


def to_json_dict(element: Any) -> dict[str, Any]:
    """A record, attrs or dataclass instance, or mapping, as a dict of plain JSON values.

    Records keep their field names (``DataChangeRecord`` -> ``{"partition_token": ...,
    "commit_timestamp": "2024-05-01T12:00:00.123456789Z", "mods": [{"keys": ...}], ...}``).
    Raises SinkError for any other element: map it to a dict with ``Map`` first.
    """
    if isinstance(element, Mapping):
        return {_key(k): to_json_value(v) for k, v in element.items()}
    if _is_struct(element):
        return _struct_dict(element)
    msg = (
        f"cannot write a {type(element).__name__} ({element!r:.80}) as a JSON object; map "
        "each element to a dict with Map first"
    )
    raise SinkError(msg)


#: What orjson writes differently (datetimes, with nine digits), or not at all (Decimal,
#: bytes, sets, attrs instances, ...): converted by :func:`_default` with the rules above.
_OPTIONS = (orjson.OPT_APPEND_NEWLINE | orjson.OPT_PASSTHROUGH_DATETIME
            | orjson.OPT_PASSTHROUGH_DATACLASS)


def _default_python(value: Any) -> Any:
    kind = type(value)
    # The two that every change record holds, first and without a call each: a
    # Timestamp's text is usually cached already (decoders set it from the wire)
    if kind is Timestamp:
        return value._text or value.rfc3339()
    if kind is Decimal:
        return decimal_text(value)
    if attrs.has(kind):
        # its fields as they are: orjson writes them, calling back here for what it cannot
        return {name: getattr(value, name) for name in _field_names(kind)}
    return to_json_value(value)


#: Types whose values hold no float (checked by identity: the fast path of
#: _non_finite_python).
_NO_FLOAT: frozenset[type] = frozenset(
    {str, int, bool, type(None), Timestamp, Decimal, datetime, date, bytes}
)


def _non_finite_python(value: Any) -> bool:
    """Whether a float that is not finite hides in ``value``, its dicts, lists, tuples and
    attrs instances (orjson writes one as null; the rules say "NaN", "Infinity",
    "-Infinity")."""
    kind = type(value)
    if kind is dict:
        return _non_finite_in(value.values())
    if kind is list or kind is tuple:
        return _non_finite_in(value)
    return _non_finite_other(value)


def _non_finite_in(
    items: Any, no_float: frozenset[type] = _NO_FLOAT, dict_: type = dict,
    float_: type = float, list_: type = list, tuple_: type = tuple,
) -> bool:
    # The hot loop (every value of every line with a null): names bound as defaults, and
    # nested dicts and lists walked from a stack, not by a call each
    stack = [items]
    while stack:
        for item in stack.pop():
            kind = type(item)
            if kind in no_float:
                continue
            if kind is dict_:
                stack.append(item.values())
            elif kind is float_:
                if item - item:  # NaN and the infinities: x - x is NaN, else 0.0
                    return True
            elif kind is list_ or kind is tuple_:
                stack.append(item)
            elif _non_finite_other(item):
                return True
    return False


def _non_finite_other(value: Any) -> bool:
    """:func:`_non_finite_python` of what is not a plain dict, list or tuple."""
    if isinstance(value, Mapping):
        return _non_finite_in(value.values())
    if isinstance(value, list | tuple):
        return _non_finite_in(value)
    if attrs.has(type(value)):
        return _non_finite_in([getattr(value, name) for name in _field_names(type(value))])
    if isinstance(value, float):
        return bool(value - value)
    return False


def _configured() -> Any:
    """The compiled module (:mod:`cdcflow.compiled`) set up for this module, or None."""
    module = speedups()
    if module is not None:
        module.configure_walk(tuple(_NO_FLOAT), _non_finite_other, _default_python, Timestamp,
                              Decimal, "_text", orjson.dumps)
    return module


_COMPILED = _configured()


def _compiled_walk() -> Callable[[Any], bool] | None:
    """:func:`_non_finite_python` compiled, or None."""
    walk: Callable[[Any], bool] | None = None if _COMPILED is None else _COMPILED.non_finite
    return walk


def _compiled_default() -> Callable[[Any], Any] | None:
    """:func:`_default_python` compiled for Timestamps and Decimals, or None."""
    default: Callable[[Any], Any] | None = (
        None if _COMPILED is None else _COMPILED.json_default
    )
    return default


#: Whether a float that is not finite hides in a value (compiled when built).
_non_finite: Callable[[Any], bool] = _compiled_walk() or _non_finite_python
#: orjson's default for what it does not write the rules' way (compiled when built).
_default: Callable[[Any], Any] = _compiled_default() or _default_python


def _compiled_line() -> Callable[[Any], bytes | None] | None:
    """:func:`dumps_line`'s orjson path in one compiled pass, or None: the line, or None
    for what it leaves to that path (a float that is not finite, an int past 64 bits, ...)."""
    line: Callable[[Any], bytes | None] | None = (
        None if _COMPILED is None else _COMPILED.json_line
    )
    return line


_line = _compiled_line()


def json_dumps(
    value: Any, *, default: Callable[[Any], Any] | None = None, sort_keys: bool = False
) -> bytes:
    """``orjson.dumps(value)`` (compact, UTF-8), and the same text for a value holding an
    integer past 64 bits, which orjson refuses: JSON has no bound, PostgreSQL's jsonb keeps
    such integers, and the decoder gives them exactly. Other errors propagate."""
    try:
        return orjson.dumps(value, default=default,
                            option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    except orjson.JSONEncodeError as exc:
        if "64-bit" not in str(exc):
            raise
    # orjson writes a float that is not finite as null; Python's json module would not
    text = json.dumps(_finite(value), default=default, sort_keys=sort_keys,
                      separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode()


def _finite(value: Any) -> Any:
    if value.__class__ is float:
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def dumps_line(element: Any) -> bytes:
    """One JSONL line (UTF-8, ending in a newline) for ``element`` (see :func:`to_json_dict`)."""
    if _line is not None:  # the usual row, in one compiled pass
        line = _line(element) if type(element) is dict or attrs.has(type(element)) else None
        if line is not None:
            return line
    return _dumps_line(element)


def _dumps_line(element: Any) -> bytes:
    """:func:`dumps_line` without the compiled pass: orjson, or the rules' own way."""
    if isinstance(element, dict) or attrs.has(type(element)):
        # orjson walks the element in C, calling _default only for what it cannot write
        # the way the rules say; a null in the line may be a float that is not finite
        try:
            line = orjson.dumps(element, default=_default, option=_OPTIONS)
        except (orjson.JSONEncodeError, SinkError):
            pass  # a key that is not a str, a huge int: the rules' own way says what
        else:
            if b"null" not in line or not _non_finite(element):
                return line
    try:
        return json_dumps(to_json_dict(element)) + b"\n"
    except (orjson.JSONEncodeError, TypeError, ValueError) as exc:  # e.g. a key not a str
        msg = f"cannot encode {element!r:.80} as JSON ({exc}); map it to plain values with Map"
        raise SinkError(msg) from exc
