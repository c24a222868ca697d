"""Which tables and columns a change stream tracks, from information_schema.

Both dialects spell the views and their columns the same way in lower case; GoogleSQL
answers BOOL where PostgreSQL answers 'YES' / 'NO'. A stream ``FOR ALL`` lists no tables
in ``change_stream_tables``; a table tracked with all its columns lists none in
``change_stream_columns``; key columns are always tracked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["tracked_columns"]

#: Runs one metadata query; returns its rows of protobuf ``Value``.
Rows = Callable[[str], list[list[Any]]]

_SYSTEM_SCHEMAS = frozenset({"information_schema", "spanner_sys", "pg_catalog",
                             "spanner_catalog"})


def _table(schema: Any, table: Any) -> str:
    """A table's name as change records spell it (qualified outside the default schema)."""
    s, t = schema.string_value, table.string_value
    return t if s in ("", "public") else f"{s}.{t}"


def _yes(value: Any) -> bool:
    if value.WhichOneof("kind") == "bool_value":
        return bool(value.bool_value)
    return str(value.string_value).upper() in ("YES", "TRUE")


def tracked_columns(rows: Rows, stream: str, dialect: str) -> dict[str, set[str]]:
    """Table -> the columns (keys included) that ``stream`` (its name as the database
    spells it, an identifier) tracks."""
    where = f"WHERE change_stream_name = '{stream}'"
    tables = {
        _table(r[0], r[1]): _yes(r[2]) for r in rows(
            "SELECT table_schema, table_name, all_columns "
            f"FROM information_schema.change_stream_tables {where}"
        )
    }
    if not tables:
        quoted = '"all"' if dialect == "POSTGRESQL" else "`ALL`"
        found = rows(f"SELECT {quoted} FROM information_schema.change_streams {where}")
        if found and _yes(found[0][0]):
            tables = {
                _table(r[0], r[1]): True for r in rows(
                    "SELECT table_schema, table_name FROM information_schema.tables "
                    "WHERE table_type = 'BASE TABLE'"
                ) if r[0].string_value.lower() not in _SYSTEM_SCHEMAS
            }
    tracked: dict[str, set[str]] = {t: set() for t in tables}

    def add(sql: str, all_columns_only: bool) -> None:
        for r in rows(sql):
            table = _table(r[0], r[1])
            if table in tracked and (tables[table] or not all_columns_only):
                tracked[table].add(r[2].string_value)

    add("SELECT table_schema, table_name, column_name FROM information_schema.columns", True)
    add("SELECT table_schema, table_name, column_name FROM information_schema.index_columns "
        "WHERE index_type = 'PRIMARY_KEY'", False)
    add("SELECT table_schema, table_name, column_name "
        f"FROM information_schema.change_stream_columns {where}", False)
    return tracked
