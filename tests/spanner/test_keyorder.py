"""Key ranges against the emulator: ORDER BY the key and the range predicate agree, in both
dialects, over composite keys of every key type with NULLs, NaN, infinities, extremes and
DESC columns.

A table of each dialect holds ~300 rows whose keys are drawn from small pools of tricky
values (so rows share long key prefixes). Its keys read in key order are the reference
list; a key range's rows must be exactly a contiguous run of it, for bounds that are keys
and prefixes of keys, through the real read path (partitioned query, typed parameters).
"""

from __future__ import annotations

import base64
import itertools
import math
import random
import time
from datetime import date
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcflow.keyrange import Key, KeyRange
from cdcflow.model import Timestamp
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.keyorder import KeyColumn, KeyOrder, order_by
from cdcflow.spanner.retry import RetryPolicy

pytestmark = pytest.mark.emulator

# name, GoogleSQL type, DESC, PostgreSQL type, pool of values (None: NULL, GoogleSQL only)
_TS = Timestamp.parse
COLUMNS: list[tuple[str, str, bool, str, list[Any]]] = [
    ("a", "INT64", False, "bigint", [None, -(2**63), -1, 0, 2**63 - 1]),
    ("b", "STRING(MAX)", True, "varchar", [None, "", "a", "a\x01", "é", "\U0001f600"]),
    ("c", "FLOAT64", False, "float8",
     [None, math.nan, -math.inf, -1.5, 0.0, 2.5e300, math.inf]),
    ("d", "BYTES(MAX)", True, "bytea", [None, b"", b"\x00", b"\x00\x00", b"\xff", b"a"]),
    ("e", "BOOL", False, "bool", [None, False, True]),
    ("f", "TIMESTAMP", True, "timestamptz",
     [None, _TS("0001-01-01T00:00:00Z"), _TS("1970-01-01T00:00:00.000001Z"),
      _TS("9999-12-31T23:59:59.999999Z")]),
    ("g", "DATE", False, "date", [None, date(1, 1, 1), date(2024, 2, 29), date(9999, 12, 31)]),
    ("h", "FLOAT32", True, "real", [None, math.nan, -math.inf, -0.5, 1.0, math.inf]),
    ("n", "NUMERIC", True, "", [None, Decimal("-99999999999999999999999999999.999999999"),
                                Decimal("-0.5"), Decimal(0), Decimal("1e-9")]),
]
ROWS = 300
NOT_NULL = "g"  # GoogleSQL's one NOT NULL key column


def _cell(value: Any) -> Any:
    if isinstance(value, bytes):  # the stock client takes BYTES base64-encoded
        return base64.b64encode(value)
    if isinstance(value, Timestamp):
        return value.rfc3339()
    return value


class _Table:
    """A keyed table of ``dialect`` with rows of tricky keys, and its keys in key order."""

    def __init__(self, emulator: Emulator, dialect: str) -> None:
        self.dialect = dialect
        google = dialect == "GOOGLE_STANDARD_SQL"
        cols = [c for c in COLUMNS if google or c[3]]
        self.keys = [
            KeyColumn(name, {"code": _code(kind if google else pg)}, desc and google,
                      google and name != NOT_NULL)
            for name, kind, desc, pg, _ in cols
        ]
        if google:
            ddl = ["CREATE TABLE K ({}, v INT64 NOT NULL) PRIMARY KEY ({})".format(
                ", ".join(f"{n} {t}" + (" NOT NULL" if n == NOT_NULL else "")
                          for n, t, _, _, _ in cols),
                ", ".join(n + (" DESC" if d else "") for n, _, d, _, _ in cols)),
                "CREATE CHANGE STREAM S FOR ALL"]
        else:
            ddl = ["CREATE TABLE k ({}, v bigint NOT NULL, PRIMARY KEY ({}))".format(
                ", ".join(f"{n} {t}" for n, _, _, t, _ in cols),
                ", ".join(n for n, *_ in cols)),
                "CREATE CHANGE STREAM s FOR ALL"]
        name = "keyorder_gsql" if google else "keyorder_pg"
        self.db = emulator.create_database(name, ddl, dialect=dialect)  # type: ignore[arg-type]
        self.path = emulator.database_path(name)
        self.table, self.stream = ("K", "S") if google else ("k", "s")
        rng = random.Random(7)
        rows: dict[tuple[Any, ...], int] = {}
        while len(rows) < ROWS:
            # Leading columns from few values, so rows share long prefixes.
            key = tuple(
                rng.choice(pool[: 2 + i] if i < 3 else pool)
                for i, (_, _, _, _, pool) in enumerate(cols)
            )
            key = tuple(  # NOT NULL columns: all of PostgreSQL's, one of GoogleSQL's
                v if v is not None or (google and c[0] != NOT_NULL)
                else next(p for p in c[4] if p is not None)
                for v, c in zip(key, cols, strict=True)
            )
            rows.setdefault(tuple(_cell(v) for v in key), len(rows))
        with self.db.batch() as batch:
            batch.insert(self.table, [n for n, *_ in cols] + ["v"],
                         [[*key, v] for key, v in rows.items()])
        time.sleep(0.3)  # the emulator's commit timestamps may run a little ahead
        self.at = Timestamp.now().ns
        self.client = SpannerChangeStreamClient(self.path, retry=RetryPolicy(sleep=lambda s: 0))
        self.ordered = self._ordered()

    def _ordered(self) -> list[tuple[Key, int]]:
        """(key in the wire form, v) of every row, in ORDER BY key order."""
        names = ", ".join(f'"{c.name}"' if self.dialect == "POSTGRESQL" else c.name
                          for c in self.keys)
        sql = f"SELECT {names}, v FROM {self.table} {order_by(self.keys, self.dialect)}"  # type: ignore[arg-type]
        with self.db.snapshot(read_timestamp=Timestamp.from_ns(self.at)) as snap:
            rows = list(snap.execute_sql(sql))
        return [(tuple(_wire(v) for v in row[:-1]), int(row[-1])) for row in rows]

    def read(self, key_range: KeyRange) -> list[int]:
        return [
            int(m.new_values["v"])
            for r in self.client.snapshot(self.stream, self.table, self.at, key_range)
            for m in r.mods
        ]


def _wire(value: Any) -> Any:
    """A value the stock client read, in the change stream's wire form (as a key scan
    gives it)."""
    from cdcflow.spanner.values import encoder_for

    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return encoder_for({"code": "FLOAT64"})(value)  # type: ignore[misc]
    if isinstance(value, bytes):  # the stock client gives BYTES base64-encoded
        return value.decode()
    if isinstance(value, Decimal):
        return encoder_for({"code": "NUMERIC"})(value)  # type: ignore[misc]
    if isinstance(value, date) and not hasattr(value, "hour"):
        return value.isoformat()
    return Timestamp.from_datetime(value).rfc3339()


@pytest.fixture(scope="module", params=["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def table(request: pytest.FixtureRequest, spanner_emulator: Emulator) -> _Table:
    t = _Table(spanner_emulator, request.param)
    request.addfinalizer(t.client.close)
    return t


def _class_rank(value: Any, google: bool) -> tuple[Any, ...]:
    """The modelled order of one column's wire value, ascending (see keyorder's docs)."""
    if value is None:
        return (0,) if google else (3,)
    if value == "NaN":
        return (1,) if google else (2, math.inf, 1)
    if value in ("Infinity", "-Infinity"):
        return (2, math.inf if value == "Infinity" else -math.inf, 0)
    if isinstance(value, bool | float):
        return (2, value, 0)
    return (2, value)


def test_order_by_is_the_modelled_key_order(table: _Table) -> None:
    """NULL first in GoogleSQL, then NaN; in PostgreSQL NaN is the largest value; DESC
    columns reversed. (The values here sort as their wire text sorts, or as numbers.)"""
    google = table.dialect == "GOOGLE_STANDARD_SQL"
    types = [c[1] if google else c[3] for c in COLUMNS if google or c[3]]

    def sort_value(v: Any, kind: str) -> Any:
        if v is None or v == "NaN" or isinstance(v, bool | float) or "Infinity" in str(v):
            return v
        if kind.startswith(("INT64", "bigint")):
            return int(v)
        if kind.startswith(("BYTES", "bytea")):
            return base64.b64decode(v)
        if kind.startswith("NUMERIC"):
            return Decimal(v)
        if kind.startswith(("TIMESTAMP", "timestamptz")):
            return Timestamp.parse(v).ns
        return v  # STRING (code points), DATE (ISO text)

    def rank(key: Key) -> tuple[Any, ...]:
        out = []
        for v, column, kind in zip(key, table.keys, types, strict=True):
            r = _class_rank(sort_value(v, kind), google)
            out.append(_Reversed(r) if column.descending else r)
        return tuple(out)

    keys = [k for k, _ in table.ordered]
    assert len(keys) == ROWS
    assert keys == sorted(keys, key=rank)


class _Reversed:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __lt__(self, other: _Reversed) -> bool:
        return bool(other.value < self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Reversed) and self.value == other.value


def _first_with(ordered: list[tuple[Key, int]], prefix: Key) -> int:
    return next(i for i, (k, _) in enumerate(ordered) if k[: len(prefix)] == prefix)


bound = st.tuples(st.integers(0, ROWS - 1), st.integers(1, len(COLUMNS)))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lo=st.one_of(st.none(), bound), hi=st.one_of(st.none(), bound))
def test_a_key_range_reads_exactly_its_run_of_the_key_order(
    table: _Table, lo: tuple[int, int] | None, hi: tuple[int, int] | None
) -> None:
    ordered = table.ordered

    def at(b: tuple[int, int] | None) -> Key | None:
        return None if b is None else ordered[b[0]][0][: b[1]]

    lo_key, hi_key = at(lo), at(hi)
    start = 0 if lo_key is None else _first_with(ordered, lo_key)
    stop = len(ordered) if hi_key is None else _first_with(ordered, hi_key)
    want = sorted(v for _, v in ordered[start:stop])
    assert sorted(table.read(KeyRange(0, lo_key, hi_key))) == want


def test_consecutive_ranges_read_every_row_once(table: _Table) -> None:
    ordered = table.ordered
    cuts = [None, *(ordered[i][0] for i in (1, 57, 58, 150, 299)), None]
    got: list[int] = []
    for i, (lo, hi) in enumerate(itertools.pairwise(cuts)):
        got += table.read(KeyRange(i, lo, hi))
    assert sorted(got) == sorted(v for _, v in ordered)
    # the split reads the same keys in the same order
    ranges = table.client.snapshot_split(table.stream, table.table, table.at, 40)
    assert len(ranges) == -(-ROWS // 40)
    for i, r in enumerate(ranges):
        assert sorted(table.read(r)) == sorted(v for _, v in ordered[40 * i: 40 * (i + 1)])


def test_rows_strictly_after_a_key(table: _Table) -> None:
    """The ``after`` bound (a key scan resumed past the last key it read)."""
    order = KeyOrder(table.keys, table.dialect)  # type: ignore[arg-type]
    for i in (0, 1, 150, ROWS - 1):
        condition, params = order.where(after=table.ordered[i][0])
        got = _query(table, f"SELECT v FROM {table.table} WHERE {condition}", params)
        assert sorted(got) == sorted(v for _, v in table.ordered[i + 1:]), i


def _code(kind: str) -> str:
    for prefix, code in (("INT64", "INT64"), ("bigint", "INT64"), ("STRING", "STRING"),
                         ("varchar", "STRING"), ("FLOAT64", "FLOAT64"), ("float8", "FLOAT64"),
                         ("FLOAT32", "FLOAT32"), ("real", "FLOAT32"), ("BYTES", "BYTES"),
                         ("bytea", "BYTES"), ("BOOL", "BOOL"), ("bool", "BOOL"),
                         ("TIMESTAMP", "TIMESTAMP"), ("timestamptz", "TIMESTAMP"),
                         ("DATE", "DATE"), ("date", "DATE"), ("NUMERIC", "NUMERIC")):
        if kind.startswith(prefix):
            return code
    raise AssertionError(kind)


def _query(table: _Table, sql: str, params: dict[str, Any]) -> list[int]:
    from google.cloud.spanner_v1.types import ExecuteSqlRequest

    from cdcflow.spanner.snapshot import _params

    transport = table.client._grpc()
    api = transport._spanner_api()
    session = api.create_session(request={"database": transport.database},
                                 metadata=[("google-cloud-resource-prefix", transport.database)])
    try:
        request = ExecuteSqlRequest(session=session.name, sql=sql, **_params(params))
        answer = api.execute_sql(request=request, metadata=[
            ("google-cloud-resource-prefix", transport.database)])
        return [int(row[0]) for row in answer.rows]
    finally:
        api.delete_session(name=session.name, metadata=[
            ("google-cloud-resource-prefix", transport.database)])



def test_a_key_scan_failing_midway_resumes_after_its_last_key(
    table: _Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cdcflow.spanner.snapshot as snapshot
    from cdcflow.errors import TransientError

    real = snapshot.stream_rows
    queries: list[str] = []

    def flaky(*args: Any, **kwargs: Any) -> Any:
        queries.append(args[3]["sql"])
        for n, row in enumerate(real(*args, **kwargs), 1):
            yield row
            if len(queries) <= 2 and n == 70:  # the first two queries fail after 70 keys
                raise TransientError("injected")

    monkeypatch.setattr(snapshot, "stream_rows", flaky)
    ranges = table.client.snapshot_split(table.stream, table.table, table.at, 40)
    assert len(queries) == 3
    assert "WHERE" not in queries[0] and all("WHERE" in q for q in queries[1:])
    ordered = table.ordered
    assert len(ranges) == -(-ROWS // 40)
    for i, r in enumerate(ranges):
        assert sorted(table.read(r)) == sorted(v for _, v in ordered[40 * i: 40 * (i + 1)])


def test_where_without_bounds_and_bounds_that_select_nothing() -> None:
    google = KeyOrder([KeyColumn("a", {"code": "INT64"}), KeyColumn("b", {"code": "FLOAT64"})],
                      "GOOGLE_STANDARD_SQL")
    assert google.where() == ("TRUE", {})
    assert google.where(hi=(None,)) == ("FALSE", {})  # nothing sorts before NULL there
    condition, params = google.where(lo=("5", "NaN"), hi=("5", 1.5))
    assert params == {"lo0": ({"code": "INT64"}, "5"), "hi0": ({"code": "INT64"}, "5"),
                      "hi1": ({"code": "FLOAT64"}, 1.5)}  # NaN is IS_NAN, no parameter
    assert "(`a` = @lo0 AND `b` IS NOT NULL)" in condition  # b at or after NaN: not NULL
    pg = KeyOrder([KeyColumn("a", {"code": "INT64"}, nullable=False)], "POSTGRESQL")
    assert pg.where(lo=("1",), hi=("9",)) == (
        '("a" >= $1 AND "a" < $2)', {"p1": ({"code": "INT64"}, "1"),
                                     "p2": ({"code": "INT64"}, "9")})
    with pytest.raises(ValueError, match="more values than the key has columns"):
        pg.where(lo=("1", "2"))
    with pytest.raises(ValueError, match="key columns"):
        KeyOrder([], "POSTGRESQL")
    assert order_by([KeyColumn("a"), KeyColumn("b", descending=True)],
                    "GOOGLE_STANDARD_SQL") == "ORDER BY `a`, `b` DESC"
    not_null = KeyOrder([KeyColumn("a", {"code": "INT64"}, nullable=False)],
                        "GOOGLE_STANDARD_SQL")
    assert not_null.where(lo=("1",), hi=("9",))[0] == "(`a` >= @lo0 AND `a` < @hi0)"
    with pytest.raises(ValueError, match="NOT NULL"):
        not_null.where(lo=(None,))
