"""LookupRows' pure part: keys in wire form, rows into records, and rolling rows forward
through a run of records (no server)."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import pytest

from cdcflow.errors import ChangeStreamError, ConfigurationError
from cdcflow.model import ColumnType, DataChangeRecord, Mod, ModType, Timestamp
from cdcflow.spanner._lookup_rows import (
    TableColumns,
    key_tuple,
    keys_to_read,
    looked_up,
    roll_forward,
    wire_value,
)

TABLE = TableColumns(("Region", "Id", "Name", "Qty"), ("Region", "Id"))
VALUES = ("Name", "Qty")
T0 = 1_700_000_000_123_456_000


def _record(mod_type: ModType, *mods: Mod, at: int = T0) -> DataChangeRecord:
    return DataChangeRecord(
        partition_token="t", commit_timestamp=Timestamp.from_ns(at),
        record_sequence="00000001", server_transaction_id=f"tx{at}",
        is_last_record_in_transaction_in_partition=True, table_name="Items",
        column_types=(ColumnType("Region", {"code": "STRING"}, True, 1),
                      ColumnType("Id", {"code": "INT64"}, True, 2),
                      ColumnType("Qty", {"code": "INT64"}, False, 4)),
        mods=mods, mod_type=mod_type, value_capture_type="NEW_VALUES",
        number_of_records_in_transaction=1, number_of_partitions_in_transaction=1,
    )


def _mod(key: int, **values: Any) -> Mod:
    return Mod({"Region": "eu", "Id": key}, values)


def _key(key: int) -> tuple[str, str]:
    return ("eu", str(key))


# -- keys, columns, rows ----------------------------------------------------------------------


def test_select_puts_the_key_first_and_names_each_column_once() -> None:
    assert TABLE.select(None, "Items") == ("Region", "Id", "Name", "Qty")
    assert TABLE.select(["Qty", "Id"], "Items") == ("Region", "Id", "Qty")
    with pytest.raises(ConfigurationError, match=r"'Nope' not in table 'Items'.*Region, Id"):
        TABLE.select(["Qty", "Nope"], "Items")


def test_keys_are_in_primary_key_order_and_wire_form() -> None:
    assert key_tuple({"Id": "7", "Region": "eu"}, TABLE.key) == ("eu", "7")
    assert key_tuple({"Id": 7, "Region": "eu"}, TABLE.key) == ("eu", "7")  # typed reads alike
    with pytest.raises(ChangeStreamError, match=r"lack the primary key column\(s\) \['Region'\]"):
        key_tuple({"Id": "7"}, TABLE.key)


def test_wire_value_matches_what_spanner_sends() -> None:
    ts = Timestamp.from_ns(1_700_000_000_123_456_789)
    assert wire_value(42) == "42"
    assert wire_value(True) is True
    assert wire_value(Decimal("1.50")) == "1.50"
    assert wire_value(b"\x00\xff") == "AP8="
    assert wire_value(ts) == "2023-11-14T22:13:20.123456789Z"
    assert wire_value(datetime(2024, 1, 2, tzinfo=UTC)) == "2024-01-02T00:00:00.000000000Z"
    assert wire_value(date(2024, 1, 2)) == "2024-01-02"
    assert wire_value(float("inf")) == "Infinity"
    assert wire_value(None) is None
    with pytest.raises(TypeError, match="cannot be looked up"):
        wire_value(object())


def test_looked_up_replaces_new_values_keeps_keys_and_old_values() -> None:
    rec = _record("UPDATE", Mod({"Region": "eu", "Id": "7"}, {"Qty": "3"}, {"Qty": "2"}),
                  Mod({"Region": "us", "Id": "1"}, {"Qty": "9"}, {}))
    rows = {("eu", "7"): {"Region": "eu", "Id": "7", "Name": "bolt", "Qty": "3"},
            ("us", "1"): {"Region": "us", "Id": "1", "Name": None, "Qty": "9"}}
    types = {"Region": {"code": "STRING"}, "Id": {"code": "INT64"},
             "Name": {"code": "STRING"}, "Qty": {"code": "INT64"}}
    out = looked_up(rec, TABLE, TABLE.select(None, "Items"), rows, types)
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
        looked_up(rec, TABLE, TABLE.key, {}, {})
    deleted = _record("DELETE", Mod({"Region": "eu", "Id": "7"}))
    assert looked_up(deleted, TABLE, TABLE.key, {}, {}) is deleted


# -- rolling forward -----------------------------------------------------------------------


def test_only_keys_whose_first_change_writes_part_of_the_row_are_read() -> None:
    records = [
        _record("UPDATE", _mod(1, Qty=2), _mod(2, Name="a", Qty=1), at=T0),
        _record("INSERT", _mod(3, Name="b", Qty=5), at=T0 + 1),
        _record("DELETE", _mod(4), at=T0 + 2),
        _record("UPDATE", _mod(3, Qty=6), _mod(4, Qty=1), _mod(5, Name="c"), at=T0 + 3),
    ]
    # 1: a partial UPDATE first; 2 and 3: whole rows first; 4: deleted first; 5: partial.
    assert keys_to_read(records, TABLE.key, VALUES) == [_key(1), _key(5)]


def test_a_key_changed_many_times_rolls_forward_from_the_read() -> None:
    base = {_key(1): {"Name": "bolt", "Qty": 1}}
    records = [
        _record("UPDATE", _mod(1, Qty=2), at=T0),
        _record("UPDATE", _mod(1, Name="nut"), at=T0 + 1),
        _record("DELETE", _mod(1), at=T0 + 2),
        _record("INSERT", _mod(1, Name="pin", Qty=None), at=T0 + 3),
        _record("UPDATE", _mod(1, Qty=9), at=T0 + 4),
    ]
    assert roll_forward(records, TABLE.key, VALUES, base) == [
        {_key(1): {"Name": "bolt", "Qty": 2}},
        {_key(1): {"Name": "nut", "Qty": 2}},
        {},
        {_key(1): {"Name": "pin", "Qty": None}},
        {_key(1): {"Name": "pin", "Qty": 9}},
    ]


def test_the_read_at_the_first_commit_already_holding_its_change_gives_the_same_rows() -> None:
    # The read is at the first record's commit timestamp, so it includes that record's own
    # change (and any earlier record of the same timestamp in the previous bundle): the
    # mod's new values are the values after it, so applying them again changes nothing.
    records = [_record("UPDATE", _mod(1, Qty=2), at=T0),
               _record("UPDATE", _mod(1, Name="nut"), at=T0 + 1)]
    before = roll_forward(records, TABLE.key, VALUES, {_key(1): {"Name": "bolt", "Qty": 1}})
    after = roll_forward(records, TABLE.key, VALUES, {_key(1): {"Name": "bolt", "Qty": 2}})
    assert before == after


def test_rows_the_records_cannot_settle_are_left_to_a_read_at_their_commit() -> None:
    placeholder = Timestamp.parse("9999-12-31T23:59:59Z")
    records = [
        _record("UPDATE", _mod(1, Qty=2), at=T0),  # no row before it: unknown
        _record("UPDATE", _mod(1, Name="x"), _mod(2, Qty=3), at=T0 + 1),  # 1 still unknown
        _record("INSERT", _mod(1, Name="y", Qty=4), at=T0 + 2),  # a whole row again
        _record("UPDATE", _mod(2, Name=placeholder), at=T0 + 3),  # the emulator's placeholder
        _record("UPDATE", _mod(2, Name="9999-12-31T23:59:59Z"), at=T0 + 4),  # (wire form)
    ]
    base = {_key(2): {"Name": "a", "Qty": 0}}
    assert keys_to_read(records, TABLE.key, VALUES) == [_key(1), _key(2)]
    assert roll_forward(records, TABLE.key, VALUES, base) == [
        None, None, {_key(1): {"Name": "y", "Qty": 4}}, None, None,
    ]
