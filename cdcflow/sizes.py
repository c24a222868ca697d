"""How many bytes a record holds in memory, estimated from its payload: the measure of the
byte quota (:mod:`cdcflow.engine.quota`) and of the sinks that spill by size."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date, datetime
from decimal import Decimal
from typing import Any

import orjson

from cdcflow.model import DataChangeRecord, Timestamp

__all__ = ["approx_size", "element_size", "payload_size"]


def approx_size(record: DataChangeRecord) -> int:
    """An estimate of a record's memory in bytes, for the byte quota: 256 for the record,
    plus the payload of its mods' keys and values (their JSON text, as orjson writes it in
    C: strings in UTF-8, JSON values and arrays whole; a bytes value's length; a value JSON
    cannot hold, such as a Timestamp or a Decimal, 4 bytes) and :data:`_PER_VALUE` for
    each key and each value around it. Linear in the record's values."""
    extra = 0

    def other(value: Any) -> Any:  # what orjson cannot write: counted here, written as null
        nonlocal extra
        if isinstance(value, bytes | bytearray | memoryview):
            extra += len(value)
        elif isinstance(value, Mapping):
            return dict(value)
        elif isinstance(value, set | frozenset):
            return list(value)
        return None

    values = [(m.keys, m.new_values, m.old_values) for m in record.mods]
    try:
        body = len(orjson.dumps(values, default=other))
    except (TypeError, orjson.JSONEncodeError):  # a key that is not a str, a huge int
        n = 256
        for mod in record.mods:
            for part in (mod.keys, mod.new_values, mod.old_values):
                n += _dict_size(part)
        return n
    entries = sum(len(k) + len(n) + len(o) for k, n, o in values)
    return 256 + body + extra + 2 * _PER_VALUE * entries


def payload_size(record: DataChangeRecord) -> int:
    """A cheaper estimate than :func:`approx_size`, for a hot path that measures every
    record (a writer that spills past a size): 256 for the record, the length of every
    ``str`` and ``bytes`` key or value (of UTF-8 text: its code points), and
    :data:`_PER_VALUE` for each key and value (a JSON object or array: its
    :func:`approx_size` measure). Large values are what it must not miss, and it does not."""
    n = 256
    for mod in record.mods:
        for part in (mod.keys, mod.new_values, mod.old_values):
            n += 2 * _PER_VALUE * len(part)
            for value in part.values():
                kind = value.__class__
                if kind is str or kind is bytes:
                    n += len(value)
                elif kind not in _FIXED:  # JSON, arrays, a str subclass (cf.JsonString)
                    n += _value_size(value) - _PER_VALUE
    return n


def element_size(element: Any) -> int:
    """An estimate of any element's memory in bytes, for a writer that keeps elements
    (Consume's queue): a record by :func:`payload_size`; text, bytes, dicts, lists and
    tuples by their payload; another object by its fields (``__dict__`` or ``__slots__``,
    one level: a field holding a record or a container is measured whole)."""
    if isinstance(element, DataChangeRecord):
        return payload_size(element)
    if isinstance(element, str | bytes | bytearray | dict | list | tuple):
        return _value_size(element)
    fields = getattr(element, "__dict__", None)
    if fields is None:
        names = getattr(type(element), "__slots__", ())
        fields = {n: getattr(element, n, None) for n in names if isinstance(n, str)}
    n = _PER_VALUE
    for value in fields.values():
        n += element_size(value) if isinstance(value, DataChangeRecord) else _value_size(value)
    return n


#: Values of a fixed size: counted at :data:`_PER_VALUE` by :func:`payload_size`.
_FIXED = frozenset({int, float, bool, type(None), Decimal, Timestamp, date, datetime})


#: What a key or value costs besides its payload (the object header and its reference).
_PER_VALUE = 48


def _dict_size(values: Mapping[str, Any]) -> int:
    # The hot path of approx_size (every key and value of every record): str keys and
    # str / number / None values are measured inline, anything else by _value_size; the
    # sum is the same as _value_size's over every key and value.
    n = 2 * _PER_VALUE * len(values)
    for key, value in values.items():
        if type(key) is str:
            n += len(key) if key.isascii() else len(key.encode())
        else:
            n += _value_size(key) - _PER_VALUE
        kind = type(value)
        if kind is str:
            n += len(value) if value.isascii() else len(value.encode())
        elif value is not None and kind is not int and kind is not float and kind is not bool:
            n += _value_size(value) - _PER_VALUE
    return n


def _value_size(value: Any) -> int:
    if isinstance(value, str):
        # isascii() is O(1) in CPython; only non-ASCII text pays for an encode
        return _PER_VALUE + (len(value) if value.isascii() else len(value.encode()))
    if isinstance(value, bytes | bytearray):
        return _PER_VALUE + len(value)
    if isinstance(value, dict):
        return _PER_VALUE + _dict_size(value)
    if isinstance(value, list | tuple):
        return _PER_VALUE + sum(_value_size(v) for v in value)
    return _PER_VALUE  # numbers, booleans, None, dates, timestamps, Decimals
