"""A table's primary-key order in SQL: ORDER BY the key, and the predicate of a key range.

A snapshot split (:mod:`cdcflow.keyrange`) reads a table's keys with :func:`order_by` and
cuts them into ranges ``[lo, hi)``; each range is then read with
:meth:`KeyOrder.where`. The two must agree on one total order, or rows fall between two
ranges or into both. They follow the table's own key order, so both are key-range scans
for Spanner, and model it column by column:

- A key column is ascending or DESC (GoogleSQL allows ``PRIMARY KEY (a, b DESC)``; the
  PostgreSQL dialect has no DESC key columns). DESC reverses everything below.
- Values fall in classes ordered before comparison: in GoogleSQL NULL sorts first, then
  NaN (FLOAT64 and FLOAT32), then the values; in PostgreSQL the values (NaN the largest of
  them, as PostgreSQL compares it) then NULL. That is each dialect's ORDER BY default in
  both directions (NULL is the smallest value in GoogleSQL and the largest in
  PostgreSQL), so :func:`order_by` needs no NULLS FIRST / LAST, which GoogleSQL lacks.
  A NOT NULL column has no NULL class (PostgreSQL's key columns are all NOT NULL), so its
  predicates carry no ``IS NULL`` tests.
- Within the values class, ``<``, ``=`` and ``>`` compare as ORDER BY sorts (GoogleSQL's
  comparisons are false for NaN, which is a class of its own there).

A tuple bound is compared lexicographically: ``key >= lo`` is "some column after lo's
while every column before it equals lo's, or all equal", written with only AND and OR over
atoms that are TRUE exactly when they hold (``IS NULL``, ``IS_NAN``, comparisons, which are
NULL, never TRUE, for a NULL or NaN operand), so SQL's three-valued logic cannot let a row
through that should not be. A bound may be a prefix of a key: it sorts before every key
it begins. Parameters carry the values (typed from the columns: a range's values are
never spliced into the SQL).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from cdcflow.keyrange import Key, KeyValue

__all__ = ["Dialect", "KeyColumn", "KeyOrder", "Params", "order_by", "quote"]

Dialect = Literal["GOOGLE_STANDARD_SQL", "POSTGRESQL"]
#: Query parameters: name -> (Spanner type as JSON, e.g. ``{"code": "INT64"}``, wire value).
Params = dict[str, tuple[Mapping[str, Any], KeyValue]]

_NULL, _NAN, _VALUE = "null", "nan", "value"
_FALSE, _TRUE = "FALSE", "TRUE"
_FLOATS = frozenset({"FLOAT64", "FLOAT32"})


def quote(name: str, dialect: Dialect) -> str:
    """``name`` quoted as an identifier of ``dialect`` (names come from
    information_schema)."""
    if dialect == "POSTGRESQL":
        return '"' + name.replace('"', '""') + '"'
    return "`" + name + "`"  # GoogleSQL names hold no backquote


@attrs.frozen
class KeyColumn:
    """A primary key column: its name, Spanner type (as JSON, ``{"code": "INT64"}``, the
    form of a result's metadata; empty while unknown), direction, and whether it holds
    NULL (a NOT NULL column's predicates leave the NULL tests out)."""

    name: str
    type: Mapping[str, Any] = attrs.field(factory=dict)
    descending: bool = False
    nullable: bool = True


def order_by(columns: Sequence[KeyColumn], dialect: Dialect) -> str:
    """``ORDER BY`` the key ``columns`` (in key order): the table's key order, NULL and NaN
    placed as :class:`KeyOrder` places them (each dialect's default)."""
    return "ORDER BY " + ", ".join(
        quote(c.name, dialect) + (" DESC" if c.descending else "") for c in columns
    )


def _or(terms: Sequence[str]) -> str:
    if _TRUE in terms:
        return _TRUE
    terms = [t for t in terms if t != _FALSE]
    if not terms:
        return _FALSE
    return terms[0] if len(terms) == 1 else "(" + " OR ".join(terms) + ")"


def _and(terms: Sequence[str]) -> str:
    if _FALSE in terms:
        return _FALSE
    terms = [t for t in terms if t != _TRUE]
    if not terms:
        return _TRUE
    return terms[0] if len(terms) == 1 else "(" + " AND ".join(terms) + ")"


class _Column:
    """One key column's order: its classes in order, and the SQL of its atoms."""

    def __init__(self, column: KeyColumn, dialect: Dialect) -> None:
        self.sql = quote(column.name, dialect)
        self.type = column.type
        self.descending = column.descending
        google = dialect == "GOOGLE_STANDARD_SQL"
        self.nan = google and column.type.get("code") in _FLOATS
        ascending = ([_NULL, _NAN, _VALUE] if self.nan else [_NULL, _VALUE]) if google else [
            _VALUE, _NULL]
        if not column.nullable:
            ascending.remove(_NULL)
        self.classes = ascending[::-1] if column.descending else ascending
        self.name = column.name

    def kind(self, value: KeyValue) -> str:
        if value is None:
            if _NULL not in self.classes:
                msg = f"a key bound has NULL for {self.name!r}, a NOT NULL key column"
                raise ValueError(msg)
            return _NULL
        return _NAN if self.nan and value == "NaN" else _VALUE

    def member(self, kind: str) -> str:
        if kind == _NULL:
            return f"{self.sql} IS NULL"
        if kind == _NAN:
            return f"IS_NAN({self.sql})"
        if self.nan:
            return f"({self.sql} IS NOT NULL AND NOT IS_NAN({self.sql}))"
        return f"{self.sql} IS NOT NULL"

    def classes_sql(self, kinds: Sequence[str]) -> str:
        if not kinds:
            return _FALSE
        if set(kinds) == set(self.classes):
            return _TRUE
        if _NULL in self.classes and set(kinds) == set(self.classes) - {_NULL}:
            return f"{self.sql} IS NOT NULL"
        return _or([self.member(k) for k in kinds])

    def equal(self, value: KeyValue, param: str) -> str:
        kind = self.kind(value)
        return self.member(kind) if kind != _VALUE else f"{self.sql} = {param}"

    def beyond(self, value: KeyValue, param: str, later: bool, inclusive: bool = False) -> str:
        """Values strictly after (``later``) or before ``value`` in this column's order,
        and ``value`` itself when ``inclusive``."""
        kind = self.kind(value)
        at = self.classes.index(kind)
        kinds = self.classes[at + 1:] if later else self.classes[:at]
        if inclusive and kind != _VALUE:
            kinds = self.classes[at:] if later else self.classes[:at + 1]
        terms = [self.classes_sql(kinds)]
        if kind == _VALUE:
            op = ">" if later != self.descending else "<"
            terms.append(f"{self.sql} {op}{'=' if inclusive else ''} {param}")
        return _or(terms)


class KeyOrder:
    """The key order of one table in one dialect (see the module docstring): the
    predicates of key ranges over ``columns``, the primary key in key order."""

    def __init__(self, columns: Sequence[KeyColumn], dialect: Dialect) -> None:
        if not columns:
            msg = "a key order needs the table's key columns; is the table name right?"
            raise ValueError(msg)
        self.dialect = dialect
        self._columns = [_Column(c, dialect) for c in columns]

    def where(
        self, lo: Key | None = None, hi: Key | None = None, *, after: Key | None = None
    ) -> tuple[str, Params]:
        """The condition that a row's key is at or after ``lo``, strictly after ``after``
        and before ``hi`` (each None: no such bound), and its parameters. A bound is a key
        or a prefix of one, in the wire form; "TRUE" when there is no bound."""
        params: Params = {}
        terms: list[str] = []
        for name, bound, later, inclusive in (
            ("lo", lo, True, True), ("after", after, True, False), ("hi", hi, False, False),
        ):
            if bound is None:
                continue
            if len(bound) > len(self._columns):
                msg = f"the key bound {bound!r} has more values than the key has columns"
                raise ValueError(msg)
            names = [self._param(params, name, i, v) for i, v in enumerate(bound)]
            if len(bound) > 1:
                # Implied by the full test; a leading-column range Spanner can seek with.
                terms.append(self._columns[0].beyond(bound[0], names[0], later, inclusive=True))
            terms.append(self._compare(bound, names, later, inclusive))
        return _and(terms), params

    def _compare(self, bound: Key, names: Sequence[str], later: bool, inclusive: bool) -> str:
        """Keys after (``later``) or before ``bound``, or equal to it when ``inclusive``."""
        if not bound:  # the empty prefix: before every key
            return _TRUE if later and inclusive else _FALSE
        cols, last = self._columns, len(bound) - 1
        return _or([
            _and([*(cols[j].equal(bound[j], names[j]) for j in range(i)),
                  cols[i].beyond(bound[i], names[i], later, inclusive and i == last)])
            for i in range(len(bound))
        ])

    def _param(self, params: Params, side: str, i: int, value: KeyValue) -> str:
        """The placeholder of the ``i``-th value of a bound (unused for NULL and NaN)."""
        column = self._columns[i]
        if column.kind(value) != _VALUE:
            return ""
        if self.dialect == "POSTGRESQL":
            name = f"p{len(params) + 1}"
            placeholder = f"${len(params) + 1}"
        else:
            name = f"{side}{i}"
            placeholder = f"@{name}"
        params[name] = (column.type, value)
        return placeholder
