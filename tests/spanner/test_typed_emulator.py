"""Typed values and pushed-down filters against the Cloud Spanner emulator, in both
dialects: a table with a column of every type is written with DML and read back through
the real client.

The emulator crashes on a NULL element inside an ARRAY in a change stream, reports NaN
and infinite floats as NULL and TIMESTAMP values without their fraction of a second, so
those values are covered by the wire-level tests (tests/spanner/test_decode.py) instead.
It writes a TIMESTAMP's year before 1000 with fewer digits ("1-01-01T00:00:00Z"), which the
decoder takes.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import time
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from cdcflow.errors import PipelineDefinitionError
from cdcflow.model import (
    ChangeRecord,
    ChildPartitionsRecord,
    DataChangeRecord,
    HeartbeatRecord,
    Timestamp,
    record_position,
)
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.retry import RetryPolicy
from cdcflow.stream import ChangeStreamQuery, RecordFilter

pytestmark = pytest.mark.emulator

GOOGLESQL = [
    "CREATE TABLE AllTypes (Id INT64 NOT NULL, I INT64, F64 FLOAT64, F32 FLOAT32, N NUMERIC, "
    "B BOOL, S STRING(MAX), Bt BYTES(MAX), D DATE, T TIMESTAMP, J JSON, AI ARRAY<INT64>, "
    "AF ARRAY<FLOAT64>, AN ARRAY<NUMERIC>, AJ ARRAY<JSON>, ATs ARRAY<TIMESTAMP>, "
    "AD ARRAY<DATE>, AB ARRAY<BYTES(MAX)>, ABo ARRAY<BOOL>, AStr ARRAY<STRING(MAX)>) "
    "PRIMARY KEY (Id)",
    "CREATE TABLE Other (K STRING(10) NOT NULL, V INT64, W STRING(MAX)) PRIMARY KEY (K)",
    "CREATE CHANGE STREAM TypesStream FOR AllTypes, Other(V) "
    "OPTIONS (value_capture_type = 'OLD_AND_NEW_VALUES')",
    "CREATE CHANGE STREAM EverythingStream FOR ALL",
]
POSTGRESQL = [
    "CREATE TABLE alltypes (id bigint NOT NULL PRIMARY KEY, i bigint, f64 float8, f32 float4, "
    "n numeric, b bool, s varchar, bt bytea, d date, t timestamptz, j jsonb, ai bigint[], "
    "af float8[], an numeric[], aj jsonb[], ats timestamptz[], ad date[], ab bytea[], "
    "abo bool[], astr varchar[])",
    "CREATE TABLE other (k varchar(10) NOT NULL PRIMARY KEY, v bigint, w varchar)",
    "CREATE CHANGE STREAM typesstream FOR alltypes, other(v) "
    "WITH (value_capture_type = 'OLD_AND_NEW_VALUES')",
    "CREATE CHANGE STREAM everythingstream FOR ALL",
]
COLUMNS = ["Id", "I", "F64", "F32", "N", "B", "S", "Bt", "D", "T", "J", "AI", "AF", "AN", "AJ",
           "ATs", "AD", "AB", "ABo", "AStr"]
GOOGLESQL_ROW = (
    "1, -9223372036854775808, 1.5, CAST(0.5 AS FLOAT32), "
    "NUMERIC '12345678901234567890.123456789', true, 'zoë', b'\\x00\\xff', DATE '2024-02-29', "
    "TIMESTAMP '2024-05-01T12:00:00.123456789Z', JSON '{\"a\":[1,2.5,null],\"b\":\"x\"}', "
    "[1, 3], [1.5, 2], [NUMERIC '1.10'], [JSON '{\"k\":1}'], "
    "[TIMESTAMP '2024-01-01T00:00:00Z', TIMESTAMP '0001-01-01T00:00:00Z', "
    "TIMESTAMP '0999-12-31T23:59:59Z'], "
    "[DATE '0001-01-01'], [b'ab'], [true], ['a']"
)

def _postgresql_row() -> list[Any]:
    """Row 1 for a mutation: the emulator's PostgreSQL DML cannot write array literals."""
    from google.cloud.spanner_v1 import JsonObject

    return [
        1, -(2**63), 1.5, 0.5, Decimal("12345678901234567890.123456789"), True, "zoë",
        base64.b64encode(b"\x00\xff"), date(2024, 2, 29),
        datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC),
        JsonObject({"a": [1, 2.5, None], "b": "x"}), [1, 3], [1.5, 2.0], [Decimal("1.10")],
        [JsonObject({"k": 1})],
        [datetime(2024, 1, 1, tzinfo=UTC), datetime(1, 1, 1, tzinfo=UTC),
         datetime(999, 12, 31, 23, 59, 59, tzinfo=UTC)], [date(1, 1, 1)],
        [base64.b64encode(b"ab")], [True], ["a"],
    ]


TYPED = {
    "I": -(2**63), "F64": 1.5, "F32": 0.5, "N": Decimal("12345678901234567890.123456789"),
    "B": True, "S": "zoë", "Bt": b"\x00\xff", "D": date(2024, 2, 29),
    "J": {"a": [1, 2.5, None], "b": "x"}, "AI": [1, 3], "AF": [1.5, 2.0],
    "AN": [Decimal("1.10")], "AJ": [{"k": 1}],
    # years before 1000: the emulator writes them with fewer digits ("1-01-01T00:00:00Z")
    "ATs": [Timestamp.parse("2024-01-01T00:00:00Z"), Timestamp.parse("0001-01-01T00:00:00Z"),
            Timestamp.parse("0999-12-31T23:59:59Z")],
    "AD": [date(1, 1, 1)], "AB": [b"ab"], "ABo": [True], "AStr": ["a"],
}


def _name(column: str, dialect: str) -> str:
    return column if dialect == "GOOGLE_STANDARD_SQL" else column.lower()


def _dml(db: Any, *statements: str) -> None:
    def work(tx: Any) -> None:
        for sql in statements:
            tx.execute_update(sql)

    db.run_in_transaction(work)


class _Written:
    """A database of ``dialect`` whose streams saw the changes of :func:`_write`."""

    def __init__(self, emulator: Emulator, dialect: str) -> None:
        self.dialect = dialect
        name = "typed_gsql" if dialect == "GOOGLE_STANDARD_SQL" else "typed_pg"
        ddl = GOOGLESQL if dialect == "GOOGLE_STANDARD_SQL" else POSTGRESQL
        db = emulator.create_database(name, ddl, dialect=dialect)  # type: ignore[arg-type]
        self.path = emulator.database_path(name)
        self.stream = "TypesStream" if dialect == "GOOGLE_STANDARD_SQL" else "typesstream"
        t, o = ("AllTypes", "Other") if dialect == "GOOGLE_STANDARD_SQL" else ("alltypes",
                                                                              "other")
        self.table, self.other = t, o
        cols = ", ".join(_name(c, dialect) for c in COLUMNS)
        k, i, s = (_name(c, dialect) for c in ("Id", "I", "S"))
        self.start = Timestamp.now().ns
        if dialect == "GOOGLE_STANDARD_SQL":
            _dml(db, f"INSERT INTO {t} ({cols}) VALUES ({GOOGLESQL_ROW})",
                 f"INSERT INTO {t} ({k}) VALUES (2)")
        else:
            with db.batch() as batch:
                batch.insert(t, [c.lower() for c in COLUMNS],
                             [_postgresql_row(), [2] + [None] * (len(COLUMNS) - 1)])
        _dml(db, f"UPDATE {t} SET {i} = {i} WHERE {k} = 1")  # changes nothing
        _dml(db, f"UPDATE {t} SET {s} = 'changed' WHERE {k} = 1")
        _dml(db, f"INSERT INTO {o} ({_name('K', dialect)}, {_name('V', dialect)}, "
                 f"{_name('W', dialect)}) VALUES ('a', 1, 'w')")
        _dml(db, f"DELETE FROM {t} WHERE {k} = 2")
        time.sleep(0.3)  # the emulator's commit timestamps may run a little ahead
        self.end = Timestamp.now().ns

    def client(self, **options: Any) -> SpannerChangeStreamClient:
        typed = options.pop("typed", True)
        return SpannerChangeStreamClient(
            self.path, retry=RetryPolicy(sleep=lambda s: None), typed=typed,
            filter=RecordFilter.build(**options),
        )

    def read(self, **options: Any) -> tuple[list[DataChangeRecord], list[ChangeRecord]]:
        """Data records (in commit order) and everything read, following every partition."""
        client = self.client(**options)
        everything: list[ChangeRecord] = []
        queue: list[tuple[str | None, int]] = [(None, self.start)]
        seen: set[str] = set()
        try:
            while queue:
                token, begin = queue.pop(0)
                query = ChangeStreamQuery(self.stream, token, begin, self.end, 500)
                for r in client.read(query):
                    everything.append(r)
                    if isinstance(r, ChildPartitionsRecord):
                        for child in r.child_partitions:
                            if child.token not in seen:
                                seen.add(child.token)
                                queue.append((child.token, r.start_timestamp.ns))
        finally:
            client.close()
        data = [r for r in everything if isinstance(r, DataChangeRecord)]
        data.sort(key=lambda r: (r.commit_timestamp.ns, r.table_name, r.record_sequence))
        return data, everything


@pytest.fixture(scope="module", params=["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def written(request: pytest.FixtureRequest, spanner_emulator: Emulator) -> _Written:
    return _Written(spanner_emulator, request.param)


def test_every_type_reads_back_typed(written: _Written) -> None:
    data, _ = written.read()
    assert [(r.table_name, r.mod_type) for r in data] == [
        (written.table, "INSERT"), (written.table, "UPDATE"), (written.table, "UPDATE"),
        (written.other, "INSERT"), (written.table, "DELETE"),
    ]
    insert = data[0]
    first = next(m for m in insert.mods if m.keys == {_name("Id", written.dialect): 1})
    values = {c: first.new_values[_name(c, written.dialect)] for c in COLUMNS[1:]}
    timestamp = values.pop("T")
    for column, want in TYPED.items():
        assert values[column] == want, column
        assert type(values[column]) is type(want), column
    pg = written.dialect == "POSTGRESQL"
    assert type(timestamp) is Timestamp
    # The emulator renders TIMESTAMP values in a stream without their fraction of a second
    # (nanoseconds are kept from Spanner's wire form: see tests/spanner/test_decode.py).
    assert timestamp.rfc3339()[:19] == "2024-05-01T12:00:00"
    (empty,) = [m for m in insert.mods if m is not first]
    assert set(empty.new_values.values()) == {None}
    types = {c.name: c.type for c in insert.column_types}
    assert types[_name("N", written.dialect)] == (
        {"code": "NUMERIC", "type_annotation": "PG_NUMERIC"} if pg else {"code": "NUMERIC"})
    changed = data[2].mods[0]
    assert changed.new_values[_name("S", written.dialect)] == "changed"
    assert changed.old_values[_name("S", written.dialect)] == "zoë"


def test_typed_false_reads_the_wire_form(written: _Written) -> None:
    data, _ = written.read(typed=False)
    first = next(m for m in data[0].mods if m.keys == {_name("Id", written.dialect): "1"})
    values = {c: first.new_values[_name(c, written.dialect)] for c in COLUMNS[1:]}
    assert values["I"] == "-9223372036854775808"
    assert values["N"] == "12345678901234567890.123456789"
    assert values["Bt"] == "AP8=" and values["D"] == "2024-02-29"
    assert isinstance(values["J"], str) and '"b"' in values["J"]
    assert values["AI"] == ["1", "3"] and values["AB"] == ["YWI="]


def test_filters_through_the_emulator(written: _Written) -> None:
    t, o = written.table, written.other
    data, everything = written.read(tables=[o])
    assert [(r.table_name, r.mod_type) for r in data] == [(o, "INSERT")]
    # the dropped records' positions were still read
    dropped = {r.commit_timestamp.ns for r in written.read()[0]} - {
        r.commit_timestamp.ns for r in data}
    heartbeats = {record_position(r) for r in everything if isinstance(r, HeartbeatRecord)}
    assert len(dropped) == 4 and dropped <= heartbeats

    data, _ = written.read(exclude_tables=[o], mod_types=["UPDATE", "DELETE"],
                           skip_unchanged=True)
    assert [r.mod_type for r in data] == ["UPDATE", "DELETE"]  # SET I = I is gone
    s = _name("S", written.dialect)
    assert data[0].mods[0].new_values[s] == "changed"

    data, _ = written.read(columns={t: [s]})
    kept = {c.name for c in data[0].column_types}
    assert kept == {_name("Id", written.dialect), s}
    assert all(set(m.new_values) <= {s} for r in data if r.table_name == t for m in r.mods)
    assert {k for m in data[0].mods for k in m.keys} == {_name("Id", written.dialect)}


def test_unknown_names_are_refused_listing_what_the_stream_tracks(written: _Written) -> None:
    t, o = written.table, written.other
    client = written.client(tables=["Nope"])
    with pytest.raises(PipelineDefinitionError,
                       match=rf"does not track table 'Nope' \(its tables: {sorted([t, o])[0]}, "
                             rf"{sorted([t, o])[1]}\)"):
        client.describe_stream(written.stream)
    k, v = _name("K", written.dialect), _name("V", written.dialect)
    w = _name("W", written.dialect)
    # the stream tracks only V of the other table (and its key)
    with pytest.raises(PipelineDefinitionError,
                       match=rf"column '{w}' of '{o}' \(its columns: {k}, {v}\)"):
        written.client(columns={o: [w]}).describe_stream(written.stream)
    every = "EverythingStream" if written.dialect == "GOOGLE_STANDARD_SQL" else (
        "everythingstream")
    tracked = written.client(columns={o: [w]}).tracked_columns(every)
    assert tracked[o] == {k, v, w} and len(tracked[t]) == len(COLUMNS)
    written.client(columns={o: [w]}).describe_stream(every)


def test_unknown_names_through_the_cli(tmp_path: Path, written: _Written) -> None:
    """The engine's check at start builds the reader with the filter, which checks it."""
    path = tmp_path / "pipe.py"
    path.write_text(
        "import cdcflow as cf\n"
        "pipeline = cf.Pipeline('typo')\n"
        f"pipeline | cf.ReadChangeStream({written.path!r}, {written.stream!r}, "
        "tables=['Nope']) | cf.Print()\n"
    )
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("CDCFLOW_DEBUG", None)
    result = subprocess.run(
        [sys.executable, "-m", "cdcflow", "run", str(path)], capture_output=True, text=True,
        timeout=120, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    tables = ", ".join(sorted([written.table, written.other]))
    assert result.stderr.splitlines()[-1] == (
        f"cdcflow: error: change stream {written.stream!r} does not track table 'Nope' (its "
        f"tables: {tables}); fix tables=/exclude_tables=/columns= of the source"
    )
