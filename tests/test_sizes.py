"""approx_size: a record's memory, counted from its payload."""

from __future__ import annotations

from typing import Any

import cdcflow as cf
from cdcflow.model import ColumnType, DataChangeRecord, Mod
from cdcflow.sizes import approx_size

S = 1_000_000_000
T0 = 1_700_000_000 * S


def _record(values: dict[str, Any]) -> DataChangeRecord:
    return DataChangeRecord(
        partition_token="p", commit_timestamp=T0, record_sequence="0",
        server_transaction_id="t", is_last_record_in_transaction_in_partition=True,
        table_name="T", column_types=(ColumnType("id", {"code": "INT64"}, True, 1),),
        mods=(Mod({"id": 1}, values),), mod_type="INSERT",
        value_capture_type="OLD_AND_NEW_VALUES", number_of_records_in_transaction=1,
        number_of_partitions_in_transaction=1,
    )


def test_approx_size_counts_payload_bytes() -> None:
    base = approx_size(_record({}))
    assert approx_size(_record({"s": "x" * 10_000})) - base >= 10_000
    assert approx_size(_record({"b": b"\0" * 10_000})) - base >= 10_000
    assert approx_size(_record({"u": "é" * 5_000})) - base >= 10_000  # UTF-8: 2 bytes each
    nested = {"j": {"a": ["y" * 4_000, {"b": "z" * 6_000}], "n": 1}}
    assert approx_size(_record(nested)) - base >= 10_000  # a JSON value, recursively
    assert approx_size(_record({"n": 1})) - base < 200


def test_payload_size_counts_what_approx_size_counts_without_encoding() -> None:
    from cdcflow.sizes import payload_size

    base = payload_size(_record({}))
    assert payload_size(_record({"s": "x" * 10_000})) - base >= 10_000
    assert payload_size(_record({"b": b"\0" * 10_000})) - base >= 10_000
    nested = {"j": {"a": ["y" * 4_000, {"b": "z" * 6_000}], "n": 1}}
    assert payload_size(_record(nested)) - base >= 10_000
    assert payload_size(_record({"j": cf.JsonString("q" * 10_000)})) - base >= 10_000
    assert payload_size(_record({"n": 1})) - base < 200
    for values in ({"s": "x" * 10_000}, nested, {"n": 1, "t": "short"}):
        record = _record(values)
        assert 0.5 < payload_size(record) / approx_size(record) < 2


def test_element_size_measures_what_a_map_may_hand_a_sink() -> None:
    import attrs

    from cdcflow.sizes import element_size, payload_size

    record = _record({"s": "x" * 10_000})
    assert element_size(record) == payload_size(record)
    assert element_size({"id": 1, "body": "x" * 10_000}) >= 10_000
    assert element_size(["y" * 4_000, b"\0" * 6_000]) >= 10_000
    assert element_size("z" * 10_000) >= 10_000

    @attrs.define
    class Row:
        id: int
        body: str

    @attrs.frozen(slots=True)
    class Wrapped:
        record: DataChangeRecord

    class Plain:
        def __init__(self) -> None:
            self.body = "w" * 10_000

    assert element_size(Row(1, "x" * 10_000)) >= 10_000  # attrs' default: __slots__
    assert element_size(Wrapped(record)) >= 10_000
    assert element_size(Plain()) >= 10_000
    assert element_size(1) < 200 and element_size(None) < 200
