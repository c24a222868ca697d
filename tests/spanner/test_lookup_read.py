"""LookupRows' reads: what a change stream reports, from information_schema (in both
dialects, on the emulator), and stale reads' column types when no row is found."""

from __future__ import annotations

from typing import Any

import pytest

from cdcflow.model import Timestamp
from cdcflow.spanner import _lookup_read
from cdcflow.spanner._lookup_read import Reader, StreamColumns, cached_reader
from cdcflow.spanner._lookup_rows import TableColumns
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.lookup import DEFAULT_LOOKUP_RETRY
from tests.e2e_helpers import unique

ITEMS = TableColumns(("Id", "Name", "Qty", "Doubled"), ("Id",), frozenset({"Doubled"}))


def test_a_stream_for_all_tracks_every_column_but_generated_ones() -> None:
    s = StreamColumns.from_rows("Everything", [["stream", "EVERYTHING", "", "", "true"]])
    assert s.found and s.tracks("", "Items") is None
    assert s.exact_for("", "Items", ITEMS, ["Name", "Qty"]) == ""
    assert "generated columns (Doubled)" in s.exact_for("", "Items", ITEMS, ["Doubled"])


def test_tables_and_columns_a_stream_names() -> None:
    rows = [
        ["stream", "s", "", "", "NO"],  # PostgreSQL spells booleans YES/NO
        ["table", "s", "public", "Items", "NO"],
        ["column", "s", "public", "Items", "Name"],
        ["table", "s", "public", "Orders", "YES"],
        ["table", "other", "public", "Other", "YES"],
    ]
    s = StreamColumns.from_rows("S", rows)  # PostgreSQL folds unquoted names to lower case
    assert s.tracks("public", "Items") == {"Name"}
    assert s.tracks("public", "Orders") is None
    assert s.tracks("public", "Other") == frozenset()
    assert s.exact_for("public", "Items", ITEMS, ["Name"]) == ""
    assert s.exact_for("public", "Items", ITEMS, ["Name", "Qty"]) == (
        "the stream does not track Qty")
    assert not StreamColumns.from_rows("missing", rows).found


@pytest.mark.parametrize(
    ("option", "value", "lossy"),
    [
        ("allow_txn_exclusion", "true", "allow_txn_exclusion is true"),
        ("exclude_update", "TRUE", "exclude_update is true"),
        ("exclude_insert", "true", "exclude_insert is true"),
        ("partition_mode", "MUTABLE_KEY_RANGE", "MUTABLE_KEY_RANGE"),
        ("exclude_delete", "true", ""),  # an INSERT reports every column: nothing is lost
        ("exclude_update", "false", ""),
        ("value_capture_type", "NEW_ROW", ""),
    ],
)
def test_options_under_which_a_stream_misses_writes(option: str, value: str, lossy: str) -> None:
    s = StreamColumns.from_rows("S", [["stream", "S", "", "", "true"],
                                      ["option", "S", "", option, value]])
    assert (lossy in s.lossy) if lossy else s.lossy == ""
    assert bool(s.exact_for("", "Items", ITEMS, ["Name"])) == bool(lossy)


_DDL: dict[str, list[str]] = {
    "GOOGLE_STANDARD_SQL": [
        "CREATE TABLE Items (Id INT64 NOT NULL, Name STRING(MAX), Qty INT64, "
        "Doubled INT64 AS (Qty * 2) STORED) PRIMARY KEY (Id)",
        "CREATE TABLE Other (Id INT64 NOT NULL) PRIMARY KEY (Id)",
        "CREATE CHANGE STREAM Whole FOR Items",
        "CREATE CHANGE STREAM Part FOR Items(Name), Other",
        "CREATE CHANGE STREAM NoUpdates FOR Other OPTIONS (exclude_update = true)",
        "CREATE CHANGE STREAM Everything FOR ALL",
    ],
    "POSTGRESQL": [
        'CREATE TABLE "Items" ("Id" bigint NOT NULL PRIMARY KEY, "Name" varchar, '
        '"Qty" bigint, "Doubled" bigint GENERATED ALWAYS AS ("Qty" * 2) STORED)',
        'CREATE TABLE "Other" ("Id" bigint NOT NULL PRIMARY KEY)',
        'CREATE CHANGE STREAM Whole FOR "Items"',
        'CREATE CHANGE STREAM Part FOR "Items"("Name"), "Other"',
        'CREATE CHANGE STREAM NoUpdates FOR "Other" WITH (exclude_update = true)',
        "CREATE CHANGE STREAM Everything FOR ALL",
    ],
}


@pytest.mark.emulator
@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def test_the_emulator_information_schema(
    spanner_emulator: Emulator, dialect: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = unique("lkread")
    db = spanner_emulator.create_database(name, _DDL[dialect], dialect=dialect)
    reader: Reader = cached_reader(spanner_emulator.database_path(name), "MEDIUM", 10.0,
                                   DEFAULT_LOOKUP_RETRY)
    schema, table = reader.schema_and_name("Items")
    assert (schema, table) == (("public", "Items") if dialect == "POSTGRESQL" else ("", "Items"))
    info = reader.table_columns("Items")
    assert info == TableColumns(("Id", "Name", "Qty", "Doubled"), ("Id",),
                                frozenset({"Doubled"}))
    whole, part, no_updates, everything = (
        reader.stream_columns(s) for s in ("Whole", "Part", "NoUpdates", "Everything"))
    assert whole.exact_for(schema, table, info, ["Name", "Qty"]) == ""
    assert everything.exact_for(schema, table, info, ["Name", "Qty"]) == ""
    assert part.tracks(schema, table) == {"Name"} and part.tracks(schema, "Other") is None
    assert part.exact_for(schema, table, info, ["Qty"]) == "the stream does not track Qty"
    assert "generated" in whole.exact_for(schema, table, info, ["Doubled"])
    assert not reader.stream_columns("Missing").found
    # The emulator accepts exclude_update (and honours it) but lists only value_capture_type
    # and retention_period in change_stream_options, so there the option goes unseen; it
    # refuses allow_txn_exclusion altogether. Cloud Spanner lists every option set.
    assert no_updates.found and no_updates.lossy == ""
    # A read that finds no row still reports every column's type.
    rows, types = reader.read_at("Items", ["Id", "Name", "Doubled"], [], _now(), "bundle")
    assert rows == [] and types["Name"] == {"code": "STRING"} and types["Doubled"] == {
        "code": "INT64"}
    # Many keys are read in several calls.
    with db.batch() as batch:
        batch.insert("Items", ["Id", "Name", "Qty"], [[i, f"n{i}", i] for i in range(5)])
    monkeypatch.setattr(_lookup_read, "MAX_KEYS_PER_READ", 2)
    before = reader.reads["commit"]
    rows, _ = reader.read_at("Items", ["Id", "Doubled"], [(str(i),) for i in range(6)],
                             Timestamp.from_datetime(batch.committed).ns, "commit")
    assert sorted(rows) == sorted([[str(i), str(2 * i)] for i in range(5)])
    assert reader.reads["commit"] - before == 3


def _now() -> int:
    return Timestamp.now().ns


def test_a_replaced_connection_is_logged_as_lookuprows_not_as_the_reader(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from google.api_core.exceptions import DeadlineExceeded

    database = "projects/p/instances/i/databases/d"
    reader = Reader(database, "MEDIUM", 5.0, DEFAULT_LOOKUP_RETRY)
    connection = reader.transport._connection
    api = object()
    connection._api = api  # as if a call had gone out on it
    with caplog.at_level("INFO", logger="cdcflow.spanner"):
        connection.failed(api, DeadlineExceeded("no answer"))
    [line] = [r.getMessage() for r in caplog.records if "new connection" in r.getMessage()]
    assert line.startswith(f"LookupRows reading rows of {database}: a call passed its deadline")
