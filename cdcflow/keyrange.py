"""Key ranges of a table, and the tokens of the snapshot partitions that read them.

A table too large for one snapshot task is read in ranges of its primary key: the task of
``snapshot/<table>`` reads the table's keys in key order at the snapshot's read timestamp
and cuts them into ranges of about ``rows_per_task`` rows (:func:`split_ranges`), one
partition each. A range is half-open, ``[lo, hi)`` in the table's own key order (DESC
columns descending, NULL where the dialect sorts it), with ``lo=None`` for "from the first
key" and ``hi=None`` for "past the last": the ranges of a split cover every key there is,
and no two share one.

A bound is a tuple of key values in Spanner's JSON wire form (INT64 and NUMERIC as text,
BYTES as base64 text, FLOAT64 as a number or ``"NaN"`` / ``"Infinity"``, TIMESTAMP and DATE
as text, BOOL as a bool, None for NULL), one per key column in key order. The range is
stored in its partition's token (:func:`range_token`), so the store keeps exactly which
ranges exist and which are FINISHED without a column of its own, and a replayed batch reads
the same ranges: ``snapshot/<table>/<index>/<JSON of [lo, hi]>``, e.g.
``snapshot/Orders/00002/[["1000"],["2000"]]``. Spanner's own query-partition tokens could
not be stored instead: they belong to one read-only transaction, which a crash loses.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TypeAlias

import attrs

from cdcflow.model import SNAPSHOT_TOKEN_PREFIX

__all__ = [
    "MAX_BOUND_CHARS",
    "Key",
    "KeyRange",
    "KeyValue",
    "range_token",
    "split_ranges",
    "token_range",
]

#: A key column's value in Spanner's JSON wire form (None is NULL).
KeyValue: TypeAlias = str | int | float | bool | None
#: A key (or a prefix of one): its columns' values in key order.
Key: TypeAlias = tuple[KeyValue, ...]

#: Longest JSON text of a bound: a key longer than this is not made a bound (the range
#: before it grows to the next key that is short enough), so a range token stays far below
#: the 8 KiB Spanner allows a metadata table's key.
MAX_BOUND_CHARS = 1024


def _key(value: object) -> Key | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        v is None or isinstance(v, str | int | float | bool) for v in value
    ):
        msg = f"a key range bound is a list of key values, not {value!r}"
        raise ValueError(msg)
    return tuple(value)


def _bound(value: Iterable[KeyValue] | None) -> Key | None:
    return None if value is None else tuple(value)


@attrs.frozen
class KeyRange:
    """The rows of a table whose primary key is in ``[lo, hi)`` in the table's key order;
    ``index`` is the range's place in its table's split (0 for the first)."""

    index: int
    lo: Key | None = attrs.field(default=None, converter=_bound)
    hi: Key | None = attrs.field(default=None, converter=_bound)

    def bounds_text(self) -> str:
        """``[lo, hi)`` as the compact JSON its token holds."""
        return _json([None if self.lo is None else list(self.lo),
                      None if self.hi is None else list(self.hi)])


def _json(value: object) -> str:
    # allow_nan=False: a wire FLOAT64 NaN is the text "NaN", never a float
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def range_token(table: str, key_range: KeyRange) -> str:
    """The token of the snapshot partition reading ``key_range`` of ``table``."""
    return f"{SNAPSHOT_TOKEN_PREFIX}{table}/{key_range.index:05d}/{key_range.bounds_text()}"


def token_range(token: str) -> KeyRange | None:
    """The key range a snapshot token reads: None for a whole table (``snapshot/<table>``).
    Raises ValueError for a token that is not a snapshot token or whose range is malformed."""
    if not token.startswith(SNAPSHOT_TOKEN_PREFIX):
        msg = f"{token!r} is not a snapshot token (those start {SNAPSHOT_TOKEN_PREFIX!r})"
        raise ValueError(msg)
    _, sep, rest = token[len(SNAPSHOT_TOKEN_PREFIX):].partition("/")
    if not sep:
        return None
    index, sep, bounds = rest.partition("/")
    try:
        lo, hi = json.loads(bounds) if sep else (None, None)
        if not sep or not index.isdigit():
            raise ValueError(token)
        return KeyRange(int(index), _key(lo), _key(hi))
    except (ValueError, TypeError):
        msg = f"snapshot token {token!r} has no valid key range (<table>/<index>/[lo, hi])"
        raise ValueError(msg) from None


def split_ranges(keys: Iterable[Key], rows_per_task: int) -> list[KeyRange]:
    """Cut a table's keys, in key order, into ranges of about ``rows_per_task`` keys.

    Returns [] when there are at most ``rows_per_task`` keys (one task reads the whole
    table). Otherwise the first range is ``[None, k)``, the last ``[k', None)``, and every
    bound is a key of the table: each range holds at least one key. A key whose bound text
    is longer than :data:`MAX_BOUND_CHARS` is passed over, so its range holds more keys.
    Only the bounds are kept, never all the keys.
    """
    if rows_per_task < 1:
        msg = f"rows_per_task={rows_per_task}: use 1 or more"
        raise ValueError(msg)
    bounds: list[Key] = []
    since = 0  # keys since the last bound (or the first key)
    for key in keys:
        if since >= rows_per_task and len(_json(list(key))) <= MAX_BOUND_CHARS:
            bounds.append(tuple(key))
            since = 0
        since += 1
    if not bounds:
        return []
    edges: list[Key | None] = [None, *bounds, None]
    return [KeyRange(i, edges[i], edges[i + 1]) for i in range(len(bounds) + 1)]
