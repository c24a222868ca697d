"""LookupRows: full rows at each record's commit timestamp.

Unit tests cover the key and column logic without a server; the emulator tests run
``ReadChangeStream | LookupRows | Collect`` over NEW_VALUES and OLD_AND_NEW_VALUES streams
in both dialects and compare every looked-up row with a stale read the test makes itself
with the stock client (including a row deleted after it was changed).
"""

from __future__ import annotations

import json
import pickle
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest
from google.protobuf.struct_pb2 import Value

import cdcflow as cf
from cdcflow.errors import ChangeStreamError, ConfigurationError
from cdcflow.model import ColumnType, DataChangeRecord, Mod, ModType, Timestamp
from cdcflow.spanner.decode import plain_value
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.lookup import (
    DEFAULT_LOOKUP_RETRY,
    LookupRows,
    _key_tuple,
    _looked_up,
    _LookupFn,
    _TableColumns,
    _wire_value,
)
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
TABLE = _TableColumns(("Region", "Id", "Name", "Qty"), ("Region", "Id"))


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


# -- unit: keys, columns, rows ------------------------------------------------------------


def test_select_puts_the_key_first_and_names_each_column_once() -> None:
    assert TABLE.select(None, "Items") == ("Region", "Id", "Name", "Qty")
    assert TABLE.select(["Qty", "Id"], "Items") == ("Region", "Id", "Qty")
    with pytest.raises(ConfigurationError, match=r"'Nope' not in table 'Items'.*Region, Id"):
        TABLE.select(["Qty", "Nope"], "Items")


def test_keys_are_in_primary_key_order_and_wire_form() -> None:
    assert _key_tuple({"Id": "7", "Region": "eu"}, TABLE.key) == ("eu", "7")
    assert _key_tuple({"Id": 7, "Region": "eu"}, TABLE.key) == ("eu", "7")  # typed reads alike
    with pytest.raises(ChangeStreamError, match=r"lack the primary key column\(s\) \['Region'\]"):
        _key_tuple({"Id": "7"}, TABLE.key)


def test_wire_value_matches_what_spanner_sends() -> None:
    ts = Timestamp.from_ns(1_700_000_000_123_456_789)
    assert _wire_value(42) == "42"
    assert _wire_value(True) is True
    assert _wire_value(Decimal("1.50")) == "1.50"
    assert _wire_value(b"\x00\xff") == "AP8="
    assert _wire_value(ts) == "2023-11-14T22:13:20.123456789Z"
    assert _wire_value(datetime(2024, 1, 2, tzinfo=UTC)) == "2024-01-02T00:00:00.000000000Z"
    assert _wire_value(date(2024, 1, 2)) == "2024-01-02"
    assert _wire_value(float("inf")) == "Infinity"
    assert _wire_value(None) is None
    with pytest.raises(TypeError, match="cannot be looked up"):
        _wire_value(object())


def test_plain_reads_protobuf_values_as_the_wire_form() -> None:
    assert plain_value(Value(string_value="42")) == "42"
    assert plain_value(Value(number_value=1.5)) == 1.5
    assert plain_value(Value(bool_value=False)) is False
    assert plain_value(Value(null_value=0)) is None
    nested = Value()
    nested.list_value.values.add(string_value="a")
    nested.list_value.values.add(number_value=2)
    assert plain_value(nested) == ["a", 2.0]


def test_looked_up_replaces_new_values_keeps_keys_and_old_values() -> None:
    rec = _record("UPDATE", Mod({"Region": "eu", "Id": "7"}, {"Qty": "3"}, {"Qty": "2"}),
                  Mod({"Region": "us", "Id": "1"}, {"Qty": "9"}, {}))
    rows = {("eu", "7"): {"Region": "eu", "Id": "7", "Name": "bolt", "Qty": "3"},
            ("us", "1"): {"Region": "us", "Id": "1", "Name": None, "Qty": "9"}}
    types = {"Region": {"code": "STRING"}, "Id": {"code": "INT64"},
             "Name": {"code": "STRING"}, "Qty": {"code": "INT64"}}
    ordinals = {"Region": 1, "Id": 2, "Name": 3, "Qty": 4}
    out = _looked_up(rec, TABLE, TABLE.select(None, "Items"), rows, types, ordinals)
    assert [m.new_values for m in out.mods] == [{"Name": "bolt", "Qty": "3"},
                                                {"Name": None, "Qty": "9"}]
    assert [m.keys for m in out.mods] == [m.keys for m in rec.mods]
    assert [m.old_values for m in out.mods] == [{"Qty": "2"}, {}]
    assert [(c.name, c.is_primary_key, c.ordinal_position) for c in out.column_types] == [
        ("Region", True, 1), ("Id", True, 2), ("Name", False, 3), ("Qty", False, 4)]
    assert out.commit_timestamp == rec.commit_timestamp and out.mod_type == "UPDATE"


def test_looked_up_refuses_a_missing_row_and_passes_deletes() -> None:
    rec = _record("INSERT", Mod({"Region": "eu", "Id": "7"}, {"Qty": "3"}))
    with pytest.raises(ChangeStreamError, match="not found at its commit timestamp"):
        _looked_up(rec, TABLE, TABLE.key, {}, {}, {})
    deleted = _record("DELETE", Mod({"Region": "eu", "Id": "7"}))
    assert _looked_up(deleted, TABLE, TABLE.key, {}, {}, {}) is deleted
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


# -- the emulator -------------------------------------------------------------------------


def _stale_row(db: Any, key: int, ts: Timestamp) -> dict[str, Any] | None:
    """The test's own stale read (the stock client, typed values) at ``ts``."""
    from google.cloud.spanner import KeySet

    columns = [SHOP_KEY, *SHOP_COLUMNS]
    with db.snapshot(read_timestamp=ts) as snap:
        rows = list(snap.read(SHOP_TABLE, columns, KeySet(keys=[[key]])))
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


@pytest.mark.emulator
@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
@pytest.mark.parametrize("capture", ["NEW_VALUES", "OLD_AND_NEW_VALUES"])
def test_every_looked_up_row_is_the_row_at_its_commit_timestamp(
    spanner_emulator: Emulator, dialect: str, capture: str
) -> None:
    name = unique("lookup")
    db = create_shop_database(spanner_emulator, name, dialect, capture)  # type: ignore[arg-type]
    start = Timestamp.now()
    workload = Workload(db, rate=None, seed=5, multi_row_share=0.5)
    workload.run(count=25)
    live = sorted(workload.live_keys)
    assert live, "the workload left no row to delete later"
    doomed = live[0]
    from google.cloud.spanner import KeySet

    with db.batch() as batch:  # deleted after its changes: a stale read still finds it
        batch.delete(SHOP_TABLE, KeySet(keys=[[doomed]]))
    last = Timestamp.from_datetime(batch.committed).ns

    path = spanner_emulator.database_path(name)
    raw: cf.Collect[DataChangeRecord] = cf.Collect()
    full: cf.Collect[DataChangeRecord] = cf.Collect()
    pipeline = cf.Pipeline(name)
    records = pipeline | cf.ReadChangeStream(
        path, SHOP_STREAM, start_at=start.rfc3339(),
        end_at=Timestamp.from_ns(last + 1_000).rfc3339(), heartbeat="250ms",
    )
    records | "raw" >> raw
    records | LookupRows(database=path) | "full" >> full
    summary = pipeline.run(metadata="memory://", batch_interval="100ms", max_batch_span="2s")
    assert summary.reason == "end reached"

    def ident(r: DataChangeRecord) -> tuple[str, str, str]:
        return (r.server_transaction_id, r.record_sequence, r.partition_token)

    originals = {ident(r): r for r in raw.items}
    assert len(full.items) == len(raw.items) > 20
    checked = updates = 0
    doomed_seen = False
    for record in full.items:
        original = originals[ident(record)]
        assert [m.keys for m in record.mods] == [m.keys for m in original.mods]
        assert [m.old_values for m in record.mods] == [m.old_values for m in original.mods]
        if record.mod_type == "DELETE":
            assert record == original
            continue
        assert {c.name for c in record.column_types} == {SHOP_KEY, *SHOP_COLUMNS}
        for mod, before in zip(record.mods, original.mods, strict=True):
            key = int(mod.keys[SHOP_KEY])
            assert set(mod.new_values) == set(SHOP_COLUMNS)
            # The stream's own values are in the same (typed) form as the looked-up ones.
            assert {c: mod.new_values[c] for c in before.new_values} == dict(before.new_values)
            expected = _stale_row(db, key, record.commit_timestamp)
            assert expected is not None
            assert _typed(dict(mod.new_values)) == {c: expected[c] for c in SHOP_COLUMNS}
            checked += 1
            updates += record.mod_type == "UPDATE"
            doomed_seen |= key == doomed
    assert checked > 10 and updates > 0
    assert doomed_seen, "the row deleted later was never looked up"
    assert _stale_row(db, doomed, Timestamp.from_ns(last + 1_000)) is None  # it is gone now
