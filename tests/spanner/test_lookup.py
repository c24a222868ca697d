"""LookupRows: full rows at each record's commit timestamp.

Unit tests cover the configuration and what pipeline validation tells LookupRows; the
emulator tests run ``ReadChangeStream | LookupRows | Collect`` over every value capture
type in both dialects and compare every looked-up row with a stale read the test makes
itself with the stock client at the record's commit timestamp (a row deleted later, a key
changed several times in one slice, a row deleted and inserted again), and count the reads:
one per table per bundle when the rows roll forward, one per (table, commit timestamp)
when they cannot (a generated column, a column the stream does not track, a Filter before
LookupRows).
"""

from __future__ import annotations

import json
import pickle
from collections import Counter
from typing import Any

import pytest
from google.protobuf.struct_pb2 import Value

import cdcflow as cf
from cdcflow.errors import ConfigurationError
from cdcflow.model import ColumnType, DataChangeRecord, Mod, ModType, Timestamp
from cdcflow.spanner._lookup_read import cached_reader
from cdcflow.spanner.decode import plain_value
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.lookup import DEFAULT_LOOKUP_RETRY, LookupRows, _LookupFn
from cdcflow.spanner.workload import (
    SHOP_COLUMNS,
    SHOP_KEY,
    SHOP_STREAM,
    SHOP_TABLE,
    Workload,
    create_shop_database,
)
from tests.e2e_helpers import unique

DB = "projects/p/instances/i/databases/shop"


def _record(mod_type: ModType, *mods: Mod) -> DataChangeRecord:
    return DataChangeRecord(
        partition_token="t", commit_timestamp=Timestamp.from_ns(1_700_000_000_123_456_000),
        record_sequence="00000001", server_transaction_id="tx",
        is_last_record_in_transaction_in_partition=True, table_name="Items",
        column_types=(ColumnType("Region", {"code": "STRING"}, True, 1),
                      ColumnType("Id", {"code": "INT64"}, True, 2),
                      ColumnType("Qty", {"code": "INT64"}, False, 4)),
        mods=mods, mod_type=mod_type, value_capture_type="NEW_VALUES",
        number_of_records_in_transaction=1, number_of_partitions_in_transaction=1,
    )


# -- unit --------------------------------------------------------------------------------


def test_plain_reads_protobuf_values_as_the_wire_form() -> None:
    assert plain_value(Value(string_value="42")) == "42"
    assert plain_value(Value(number_value=1.5)) == 1.5
    assert plain_value(Value(bool_value=False)) is False
    assert plain_value(Value(null_value=0)) is None
    nested = Value()
    nested.list_value.values.add(string_value="a")
    nested.list_value.values.add(number_value=2)
    assert plain_value(nested) == ["a", 2.0]


def test_a_delete_needs_no_read() -> None:
    deleted = _record("DELETE", Mod({"Region": "eu", "Id": "7"}))
    # A DELETE needs no read at all: the DoFn returns it without a client.
    fn = _LookupFn(DB, None, "MEDIUM", 1.0, DEFAULT_LOOKUP_RETRY)
    assert list(fn.process(deleted)) == [deleted]


def test_constructor_checks_and_the_facade() -> None:
    with pytest.raises(ConfigurationError, match="databases/DATABASE"):
        LookupRows("shop")
    with pytest.raises(ConfigurationError, match="list of column names"):
        LookupRows(DB, "Qty")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="LOW, MEDIUM, HIGH"):
        LookupRows(DB, priority="urgent")
    with pytest.raises(ConfigurationError, match="positive"):
        LookupRows(DB, call_timeout=0)
    step = LookupRows(DB, ["Qty"])
    assert step.default_label() == "LookupRows"
    assert step.describe_params() == f"database={DB} columns=Qty"
    assert cf.LookupRows is LookupRows
    assert "LookupRows" in cf.__all__


def test_the_dofn_travels_without_its_client() -> None:
    fn = _LookupFn(DB, ("Qty",), "MEDIUM", 5.0, DEFAULT_LOOKUP_RETRY)
    fn.setup()  # builds the process's reader; connects nothing yet
    assert fn._reader is not None
    copy = pickle.loads(pickle.dumps(fn))
    assert copy._reader is None and copy.columns == ("Qty",) and copy.database == DB
    copy.setup()
    assert copy._reader is fn._reader  # one reader per process and arguments


def _stream_after(*upstream: Any, **source: Any) -> str | None:
    """The stream LookupRows learns from validation of ``source | *upstream | LookupRows``."""
    p = cf.Pipeline("check")
    pc = p | cf.ReadChangeStream(DB, "OrdersStream", **source)
    for step in upstream:
        pc = pc | step
    lookup = LookupRows(DB)
    pc | lookup | cf.Collect()
    p.validate()
    (label,) = [label for label, t in p.nodes() if isinstance(t, LookupRows)]
    fn = p.transform(label).fn
    assert isinstance(fn, _LookupFn)
    return fn.stream


def test_rows_roll_forward_only_when_lookup_sees_every_record_with_every_column() -> None:
    assert _stream_after() == "OrdersStream"
    assert _stream_after(tables=["Orders"], skip_unchanged=True) == "OrdersStream"
    assert _stream_after(cf.Filter(lambda r: True)) is None  # records may be missing
    assert _stream_after(columns={"Orders": ["Status"]}) is None  # columns are missing
    assert _stream_after(mod_types=["INSERT", "UPDATE"]) is None
    assert _stream_after(typed=False) is None  # the records' values are in another form


# -- the emulator -------------------------------------------------------------------------


def _stale(db: Any, table: str, columns: list[str], key: Any, ts: Timestamp
           ) -> dict[str, Any] | None:
    """The test's own stale read (the stock client, typed values) at ``ts``."""
    from google.cloud.spanner import KeySet

    with db.snapshot(read_timestamp=ts) as snap:
        rows = list(snap.read(table, columns, KeySet(keys=[[key]])))
    return dict(zip(columns, rows[0], strict=True)) if rows else None


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    """The shop's columns as the stock client types them (from typed or wire values)."""
    details = values["Details"]
    return {
        "Customer": values["Customer"], "Status": values["Status"],
        "Quantity": None if values["Quantity"] is None else int(values["Quantity"]),
        "Price": values["Price"],
        "Details": json.loads(details) if isinstance(details, str) else details,
    }


def _after(db: Any, batch: Any) -> int:
    return Timestamp.from_datetime(batch.committed).ns


def _run(path: str, stream: str, name: str, start: int, end: int, *upstream: Any,
         **lookup: Any) -> tuple[list[DataChangeRecord], list[DataChangeRecord], Counter[str]]:
    """Read [start, end] through LookupRows; (raw records, looked-up records, the reads it
    made by kind). One batch spans the window, so each partition is read in one slice (one
    bundle)."""
    raw: cf.Collect[DataChangeRecord] = cf.Collect()
    full: cf.Collect[DataChangeRecord] = cf.Collect()
    pipeline = cf.Pipeline(name)
    records = pipeline | cf.ReadChangeStream(
        path, stream, start_at=Timestamp.from_ns(start).rfc3339(),
        end_at=Timestamp.from_ns(end).rfc3339(), heartbeat="10s",
    )
    records | "raw" >> raw
    for step in upstream:
        records = records | step
    reader = cached_reader(path, "HIGH", 7.0, DEFAULT_LOOKUP_RETRY)  # the one LookupRows uses
    before = Counter(reader.reads)
    records | LookupRows(database=path, priority="HIGH", call_timeout=7.0, **lookup) | full
    summary = pipeline.run(metadata="memory://", batch_interval="100ms", max_batch_span="1h")
    assert summary.reason == "end reached"
    return raw.items, full.items, reader.reads - before


def _ident(r: DataChangeRecord) -> tuple[str, str, str]:
    return (r.server_transaction_id, r.record_sequence, r.partition_token)


@pytest.mark.emulator
@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
@pytest.mark.parametrize(
    "capture", ["NEW_VALUES", "OLD_AND_NEW_VALUES", "NEW_ROW", "NEW_ROW_AND_OLD_VALUES"]
)
def test_every_looked_up_row_is_the_row_at_its_commit_timestamp(
    spanner_emulator: Emulator, dialect: str, capture: str
) -> None:
    from google.cloud.spanner import KeySet

    name = unique("lookup")
    db = create_shop_database(spanner_emulator, name, dialect, capture)  # type: ignore[arg-type]
    before = Workload(db, rate=None, seed=4, multi_row_share=0.5)
    before.run(count=12)  # rows that exist before the window: their first change needs a read
    start = max(Timestamp.now().ns, max(c.commit_ns for c in before.changes)) + 1_000
    workload = Workload(db, rate=None, seed=5, multi_row_share=0.5)
    workload.run(count=20)
    often, again, doomed = sorted(workload.live_keys)[:3]
    columns = [SHOP_KEY, "Status", "Quantity"]
    for status, quantity in (("A", 1), ("B", 2), ("C", 3)):  # one key changed many times
        with db.batch() as batch:
            batch.update(SHOP_TABLE, [SHOP_KEY, "Status"], [[often, status]])
        with db.batch() as batch:
            batch.update(SHOP_TABLE, [SHOP_KEY, "Quantity"], [[often, quantity]])
    with db.batch() as batch:  # deleted, inserted again with part of the row, then updated
        batch.delete(SHOP_TABLE, KeySet(keys=[[again]]))
    with db.batch() as batch:
        batch.insert(SHOP_TABLE, columns, [[again, "NEW", 5]])
    with db.batch() as batch:
        batch.update(SHOP_TABLE, [SHOP_KEY, "Customer"], [[again, "ada"]])
    with db.batch() as batch:
        batch.update(SHOP_TABLE, [SHOP_KEY, "Status"], [[doomed, "LAST"]])
    with db.batch() as batch:  # deleted after its changes: a stale read still finds it
        batch.delete(SHOP_TABLE, KeySet(keys=[[doomed]]))
    end = max(Timestamp.now().ns, _after(db, batch)) + 1_000

    path = spanner_emulator.database_path(name)
    raw, full, reads = _run(path, SHOP_STREAM, name, start, end)
    originals = {_ident(r): r for r in raw}
    assert len(full) == len(raw) > 20
    checked = 0
    seen: set[int] = set()
    for record in full:
        original = originals[_ident(record)]
        assert [m.keys for m in record.mods] == [m.keys for m in original.mods]
        assert [m.old_values for m in record.mods] == [m.old_values for m in original.mods]
        if record.mod_type == "DELETE":
            assert record == original
            continue
        assert {c.name for c in record.column_types} == {SHOP_KEY, *SHOP_COLUMNS}
        for mod, mine in zip(record.mods, original.mods, strict=True):
            key = int(mod.keys[SHOP_KEY])
            assert set(mod.new_values) == set(SHOP_COLUMNS)
            # The stream's own values are in the same (typed) form as the looked-up ones.
            assert {c: mod.new_values[c] for c in mine.new_values} == dict(mine.new_values)
            expected = _stale(db, SHOP_TABLE, [SHOP_KEY, *SHOP_COLUMNS], key,
                              record.commit_timestamp)
            assert expected is not None
            assert _typed(dict(mod.new_values)) == {c: expected[c] for c in SHOP_COLUMNS}
            checked += 1
            seen.add(key)
    assert checked > 20 and {often, again, doomed} <= seen
    assert _stale(db, SHOP_TABLE, [SHOP_KEY], doomed, Timestamp.from_ns(end)) is None

    # Reads: none at a commit timestamp, at most one per bundle (a partition's slice), where
    # a read per record would have made one per INSERT or UPDATE record.
    bundles = {r.partition_token for r in raw if r.mod_type != "DELETE"}
    per_record = sum(r.mod_type != "DELETE" for r in raw)
    assert reads["commit"] == 0
    assert reads["bundle"] <= len(bundles) < per_record
    if capture in ("NEW_VALUES", "OLD_AND_NEW_VALUES"):
        assert reads["bundle"] >= 1  # updates of rows from before the window


_ITEMS_DDL = [
    "CREATE TABLE Items (Id INT64 NOT NULL, Name STRING(MAX), Qty INT64, "
    "Doubled INT64 AS (Qty * 2) STORED, "
    "Touched TIMESTAMP OPTIONS (allow_commit_timestamp = true)) PRIMARY KEY (Id)",
    "CREATE CHANGE STREAM Every FOR Items OPTIONS (value_capture_type = 'NEW_VALUES')",
    "CREATE CHANGE STREAM NamesOnly FOR Items(Name) OPTIONS (value_capture_type = 'NEW_VALUES')",
]
_ITEMS = ["Id", "Name", "Qty", "Doubled", "Touched"]


@pytest.fixture(scope="module")
def items_window(spanner_emulator: Emulator) -> tuple[Any, str, int, int]:
    """Items with 6 rows before a window in which they change (the database, its path,
    the window's start and end)."""
    from google.cloud.spanner import COMMIT_TIMESTAMP

    name = unique("items")
    db = spanner_emulator.create_database(name, _ITEMS_DDL)
    with db.batch() as batch:
        batch.insert("Items", ["Id", "Name", "Qty"], [[i, f"n{i}", i] for i in range(6)])
    start = max(Timestamp.now().ns, _after(db, batch)) + 1_000
    for i in range(6):
        with db.batch() as batch:
            batch.update("Items", ["Id", "Qty"], [[i % 3, 10 + i]])
        with db.batch() as batch:
            batch.update("Items", ["Id", "Name"], [[3 + i % 3, f"m{i}"]])
    with db.batch() as batch:  # the emulator reports the commit-timestamp placeholder
        batch.update("Items", ["Id", "Touched"], [[1, COMMIT_TIMESTAMP]])
    with db.batch() as batch:
        batch.update("Items", ["Id", "Qty"], [[1, 99]])
    end = max(Timestamp.now().ns, _after(db, batch)) + 1_000
    return db, spanner_emulator.database_path(name), start, end


def _check_items(db: Any, full: list[DataChangeRecord], columns: list[str]) -> int:
    checked = 0
    for record in full:
        for mod in record.mods:
            expected = _stale(db, "Items", columns, int(mod.keys["Id"]), record.commit_timestamp)
            assert expected is not None
            assert dict(mod.new_values) == {c: expected[c] for c in columns if c != "Id"}
            checked += 1
    return checked


@pytest.mark.emulator
@pytest.mark.parametrize(
    ("case", "stream", "columns", "filtered"),
    [
        ("rolled", "Every", ["Name", "Qty", "Touched"], False),
        ("generated", "Every", None, False),
        ("untracked", "NamesOnly", ["Name", "Qty"], False),
        ("filtered", "Every", ["Name", "Qty"], True),
    ],
)
def test_rows_the_stream_cannot_give_are_read_at_each_commit_timestamp(
    items_window: tuple[Any, str, int, int], case: str, stream: str,
    columns: list[str] | None, filtered: bool,
) -> None:
    db, path, start, end = items_window
    upstream = [cf.Filter(lambda r: True)] if filtered else []
    raw, full, reads = _run(path, stream, unique(case), start, end, *upstream,
                             columns=columns)
    read = ["Id", *(columns or _ITEMS[1:])]
    assert len(full) == len(raw) and _check_items(db, full, read) == len(raw)
    if case == "rolled":
        # One read for the bundle, one at the commit of the placeholder, one after it (the
        # row stays unknown until a mod writes every column).
        assert len(raw) == 14
        assert (reads["bundle"], reads["commit"]) == (1, 2)
    else:
        assert reads["bundle"] == 0
        assert reads["commit"] == len({r.commit_timestamp for r in raw})


@pytest.mark.emulator
@pytest.mark.parametrize(("dialect", "capture"), [
    ("GOOGLE_STANDARD_SQL", "NEW_VALUES"), ("GOOGLE_STANDARD_SQL", "OLD_AND_NEW_VALUES"),
    ("POSTGRESQL", "NEW_VALUES"),
])
def test_rows_from_before_an_added_column_are_read_with_the_columns_of_their_time(
    spanner_emulator: Emulator, dialect: str, capture: str
) -> None:
    # A change committed before ALTER TABLE ... ADD COLUMN and looked up after it: a read
    # naming the new column as of the older commit fails (NOT_FOUND), every time the batch
    # is replayed. The row then had no such column: it comes out without it.
    name = unique("alter")
    pg = dialect == "POSTGRESQL"
    ddl = [
        "CREATE TABLE t (id bigint NOT NULL, v bigint, PRIMARY KEY (id))",
        f"CREATE CHANGE STREAM s FOR t WITH (value_capture_type = '{capture}')",
    ] if pg else [
        "CREATE TABLE t (id INT64 NOT NULL, v INT64) PRIMARY KEY (id)",
        f"CREATE CHANGE STREAM s FOR t OPTIONS (value_capture_type = '{capture}')",
    ]
    db = spanner_emulator.create_database(name, ddl, dialect=dialect)  # type: ignore[arg-type]
    with db.batch() as batch:
        batch.insert("t", ["id", "v"], [[1, 10], [2, 20]])
    start = max(Timestamp.now().ns, _after(db, batch)) + 1_000
    with db.batch() as batch:
        batch.update("t", ["id", "v"], [[1, 11]])
    db.update_ddl([f"ALTER TABLE t ADD COLUMN w {'varchar' if pg else 'STRING(MAX)'}"]
                  ).result(120)
    with db.batch() as batch:
        batch.update("t", ["id", "w"], [[2, "w"]])
    end = max(Timestamp.now().ns, _after(db, batch)) + 1_000
    raw, full, _ = _run(spanner_emulator.database_path(name), "s", name, start, end)
    assert len(full) == len(raw) == 2
    rows = {int(r.mods[0].keys["id"]): dict(r.mods[0].new_values) for r in full}
    assert rows == {1: {"v": 11}, 2: {"v": 20, "w": "w"}}
