"""Pushed-down filters: RecordFilter, the decoders applying it in every wire shape, and the
reader checking its names against what the stream tracks."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from google.cloud.spanner_v1.streamed import StreamedResultSet
from google.cloud.spanner_v1.types import PartialResultSet

from cdcflow.errors import PipelineDefinitionError
from cdcflow.model import (
    ChangeRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    Timestamp,
    record_position,
)
from cdcflow.spanner import wire
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.decode import records_from_stock_row, row_decoder
from cdcflow.spanner.flat import decode_messages
from cdcflow.spanner.retry import RetryPolicy
from cdcflow.spanner.shape import RecordShaper
from cdcflow.spanner.transport import assemble_rows
from cdcflow.stream import ChangeStreamQuery, RecordFilter
from cdcflow.testing import ScriptedTransport

TOKEN = "tok"
T = Timestamp.parse("2024-05-01T12:00:00Z").ns
ORDERS = (ColumnType("Id", {"code": "INT64"}, True, 1),
          ColumnType("Status", {"code": "STRING"}, False, 2),
          ColumnType("Total", {"code": "NUMERIC"}, False, 3))
ITEMS = (ColumnType("Sku", {"code": "STRING"}, True, 1),
         ColumnType("Qty", {"code": "INT64"}, False, 2))


def _rec(i: int, table: str, mod_type: str, mods: list[Mod], *, at: int | None = None,
         capture: str = "OLD_AND_NEW_VALUES") -> DataChangeRecord:
    return DataChangeRecord(
        TOKEN, T + (i if at is None else at), f"{i:08d}", f"txn-{i}", True, table,
        ORDERS if table == "Orders" else ITEMS, mods, mod_type,  # type: ignore[arg-type]
        capture, 1, 1,
    )


RECORDS: list[DataChangeRecord] = [
    _rec(0, "Orders", "INSERT", [Mod({"Id": "1"}, {"Status": "NEW", "Total": "5.00"})]),
    _rec(1, "Items", "INSERT", [Mod({"Sku": "a"}, {"Qty": "2"})]),
    _rec(2, "Orders", "UPDATE", [
        Mod({"Id": "1"}, {"Status": "PAID", "Total": "5.00"}, {"Status": "NEW", "Total": "5.00"}),
        Mod({"Id": "2"}, {"Status": "NEW"}, {"Status": "NEW"}),  # unchanged
    ]),
    _rec(3, "Orders", "UPDATE", [Mod({"Id": "2"}, {"Total": "1"}, {"Total": "1"})]),  # unchanged
    _rec(4, "Items", "DELETE", [Mod({"Sku": "a"}, {}, {"Qty": "2"})]),
    _rec(5, "Orders", "UPDATE", [Mod({"Id": "3"}, {"Total": "7"}, {})], capture="NEW_VALUES"),
]


def _decode(shape: str, shaper: RecordShaper, records: list[ChangeRecord] | None = None
            ) -> list[ChangeRecord]:
    records = list(RECORDS) if records is None else records
    column, values = wire.rows_of("googlesql" if shape == "stock" else shape, records)
    messages = wire.partial_result_sets(wire.row_type(column), values, rows_per_message=2)
    if shape == "stock":
        rows = StreamedResultSet(iter([PartialResultSet.wrap(m) for m in messages]))
        return [r for row in rows for r in records_from_stock_row(row, TOKEN, shaper)]
    out: list[ChangeRecord] = []
    decode = None
    for row_type, row in assemble_rows(iter(messages)):
        decode = decode or row_decoder(row_type.fields[0].type_, shaper)
        out.extend(decode(row[0], TOKEN))
    # the reader's path: serialized messages, the merged fast paths of spanner.flat
    serialized = [m.SerializeToString() for m in messages]
    fresh = RecordShaper(shaper.typed, shaper.filter)  # plans of its own
    assert list(decode_messages(iter(serialized), TOKEN, fresh)) == out
    return out


def _shaper(**options: Any) -> RecordShaper:
    return RecordShaper(filter=RecordFilter.build(**options))


def _kept(out: list[ChangeRecord]) -> list[tuple[str, str]]:
    return [(r.record_sequence[-1], r.table_name) for r in out if isinstance(r, DataChangeRecord)]


SHAPES = ["googlesql", "postgresql", "proto", "stock"]


@pytest.mark.parametrize("shape", SHAPES)
def test_tables_keep_only_those_tables_and_positions_still_advance(shape: str) -> None:
    out = _decode(shape, _shaper(tables=["Items"]))
    assert _kept(out) == [("1", "Items"), ("4", "Items")]
    # every dropped record left its position behind, as a heartbeat
    assert sorted({record_position(r) for r in out}) == [T + i for i in range(6)]
    assert all(isinstance(r, HeartbeatRecord) for r in out if record_position(r) in (T, T + 2))
    items = [r for r in out if isinstance(r, DataChangeRecord)]
    assert items[0].mods == (Mod({"Sku": "a"}, {"Qty": 2}, {}),)  # still typed


@pytest.mark.parametrize("shape", SHAPES)
def test_exclude_tables_and_mod_types(shape: str) -> None:
    assert _kept(_decode(shape, _shaper(exclude_tables=["Orders"]))) == [
        ("1", "Items"), ("4", "Items")]
    assert _kept(_decode(shape, _shaper(mod_types=["INSERT", "DELETE"]))) == [
        ("0", "Orders"), ("1", "Items"), ("4", "Items")]


@pytest.mark.parametrize("shape", SHAPES)
def test_columns_keep_keys_and_the_named_columns(shape: str) -> None:
    out = _decode(shape, _shaper(columns={"Orders": ["Total"]}))
    orders = [r for r in out if isinstance(r, DataChangeRecord) and r.table_name == "Orders"]
    assert [c.name for c in orders[0].column_types] == ["Id", "Total"]
    assert orders[0].mods[0].keys == {"Id": 1}
    assert orders[0].mods[0].new_values == {"Total": Decimal("5.00")}
    assert orders[1].mods[0].old_values == {"Total": Decimal("5.00")}
    items = [r for r in out if isinstance(r, DataChangeRecord) and r.table_name == "Items"]
    assert [c.name for c in items[0].column_types] == ["Sku", "Qty"]  # other tables whole


@pytest.mark.parametrize("shape", SHAPES)
def test_skip_unchanged_drops_updates_that_changed_nothing(shape: str) -> None:
    out = _decode(shape, _shaper(skip_unchanged=True))
    kept = {r.record_sequence[-1]: r for r in out if isinstance(r, DataChangeRecord)}
    assert sorted(kept) == ["0", "1", "2", "4", "5"]  # 3 changed nothing: dropped
    assert [m.keys for m in kept["2"].mods] == [{"Id": 1}]  # its unchanged mod is gone
    assert kept["5"].value_capture_type == "NEW_VALUES"  # no old values: kept
    assert HeartbeatRecord(TOKEN, Timestamp.from_ns(T + 3)) in out


@pytest.mark.parametrize("shape", SHAPES)
def test_skip_unchanged_with_columns_judges_the_kept_columns(shape: str) -> None:
    # record 2's first mod changed Status only: with only Total kept, nothing changed
    out = _decode(shape, _shaper(columns={"Orders": ["Total"]}, skip_unchanged=True))
    assert _kept(out) == [("0", "Orders"), ("1", "Items"), ("4", "Items"), ("5", "Orders")]


def test_stand_ins_are_yielded_once_per_position() -> None:
    same_time = [_rec(i, "Items", "INSERT", [Mod({"Sku": str(i)}, {"Qty": "1"})], at=0)
                 for i in range(4)]
    out = _decode("googlesql", _shaper(tables=["Orders"]), same_time)  # type: ignore[arg-type]
    assert out == [HeartbeatRecord(TOKEN, Timestamp.from_ns(T))]


def test_no_filter_and_typed_false_decodes_everything_as_sent() -> None:
    out = _decode("googlesql", RecordShaper(typed=False))
    assert out == RECORDS


# --- RecordFilter -----------------------------------------------------------------------


def test_build_returns_none_when_nothing_is_filtered() -> None:
    assert RecordFilter.build() is None
    assert RecordFilter.build(mod_types=["DELETE", "UPDATE", "INSERT"]) is None
    f = RecordFilter.build(tables=["A"], columns={"A": ["x"]}, mod_types=["INSERT"],
                           skip_unchanged=True)
    assert f is not None
    assert f.describe() == "tables=A columns[A]=x mod_types=INSERT skip_unchanged"
    assert hash(f) == hash(RecordFilter.build(tables=["A"], columns={"A": ("x",)},
                                              mod_types=["INSERT"], skip_unchanged=True))


@pytest.mark.parametrize(("options", "fragment"), [
    ({"tables": "Orders"}, "pass a list of names"),
    ({"tables": []}, "name at least one table"),
    ({"tables": ["A"], "exclude_tables": ["B"]}, "use one of them"),
    ({"tables": ["A"], "columns": {"B": ["x"]}}, r"table 'B' is not read \(tables=\['A'\]\)"),
    ({"exclude_tables": ["B"], "columns": {"B": ["x"]}},
     r"table 'B' is not read \(exclude_tables=\['B'\]\)"),
    ({"columns": {"A": "x"}}, "pass a list of names"),
    ({"mod_types": ["UPSERT"]}, "use some of INSERT, UPDATE, DELETE"),
    ({"mod_types": []}, "use some of"),
])
def test_build_refuses_contradictions(options: dict[str, Any], fragment: str) -> None:
    with pytest.raises(PipelineDefinitionError, match=fragment):
        RecordFilter.build(**options)


def test_check_lists_what_the_stream_tracks() -> None:
    f = RecordFilter.build(columns={"Orders": ["Totl"]})
    assert f is not None
    tracked = {"Orders": {"Id", "Total"}, "Items": {"Sku"}}
    with pytest.raises(PipelineDefinitionError, match=r"column 'Totl' of 'Orders' \(its "
                                                      r"columns: Id, Total\)"):
        f.check("S", tracked)
    g = RecordFilter.build(exclude_tables=["Ordrs"])
    assert g is not None
    with pytest.raises(PipelineDefinitionError, match=r"table 'Ordrs' \(its tables: Items, "
                                                      r"Orders\)"):
        g.check("S", tracked)
    ok = RecordFilter.build(tables=["Orders"], columns={"Orders": ["Id"]})
    assert ok is not None
    ok.check("S", tracked)


# --- the reader ---------------------------------------------------------------------------


DB = "projects/p/instances/i/databases/d"


def _client(transport: ScriptedTransport, **options: Any) -> SpannerChangeStreamClient:
    client = SpannerChangeStreamClient(
        DB, retry=RetryPolicy(attempts=3, sleep=lambda s: None),
        filter=RecordFilter.build(**options),
    )
    client.transport = transport
    return client


@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def test_describe_stream_checks_names_against_the_stream(dialect: str) -> None:
    transport = ScriptedTransport(RECORDS, stream="S", dialect=dialect)  # type: ignore[arg-type]
    assert _client(transport, tables=["Orders"]).describe_stream("S").name == "S"
    assert _client(transport, columns={"Orders": ["Id", "Total"]}).tracked_columns("S") == {
        "Orders": {"Id", "Status", "Total"}, "Items": {"Sku", "Qty"}}
    with pytest.raises(PipelineDefinitionError, match=r"does not track table 'Order' \(its "
                                                      r"tables: Items, Orders\)"):
        _client(transport, tables=["Order"]).describe_stream("S")
    with pytest.raises(PipelineDefinitionError, match="column 'Price' of 'Items'"):
        _client(transport, columns={"Items": ["Price"]}).read(
            ChangeStreamQuery("S", TOKEN, T, T + 10))


def test_names_match_the_stream_s_in_any_case_when_they_do_not_exactly() -> None:
    """Spanner's names are case-insensitive, and PostgreSQL folds unquoted ones to lower
    case: tables=["orders"] and columns={"ITEMS": ["qty"]} name Orders and Items.Qty;
    an exact name wins, and a name two tracked names match in case stays as given."""
    f = RecordFilter.build(tables=["orders", "ITEMS"], columns={"ITEMS": ["qty", "Sku"]})
    assert f is not None
    tracked = {"Orders": {"Id"}, "Items": {"Sku", "Qty"}}
    resolved = f.resolved(tracked)
    assert resolved.tables == {"Orders", "Items"}
    assert resolved.columns == (("Items", frozenset({"Qty", "Sku"})),)
    resolved.check("S", tracked)
    both = {"orders": {"id"}, "Orders": {"Id"}}
    g = RecordFilter.build(exclude_tables=["ORDERS", "orders"])
    assert g is not None and g.resolved(both).exclude_tables == {"ORDERS", "orders"}
    with pytest.raises(PipelineDefinitionError, match="does not track table 'ORDERS'"):
        g.resolved(both).check("S", both)


@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def test_a_filter_in_another_case_reads_what_the_exact_names_read(dialect: str) -> None:
    query = ChangeStreamQuery("S", TOKEN, T, T + 10)
    exact = list(_client(ScriptedTransport(RECORDS, stream="S", dialect=dialect),  # type: ignore[arg-type]
                         tables=["Items"], columns={"Items": ["Qty"]}).read(query))
    folded = list(_client(ScriptedTransport(RECORDS, stream="S", dialect=dialect),  # type: ignore[arg-type]
                          tables=["items"], columns={"ITEMS": ["qty"]}).read(query))
    assert folded == exact and any(isinstance(r, DataChangeRecord) for r in exact)


def test_a_filtered_read_resumes_after_a_reset_without_duplicates() -> None:
    transport = ScriptedTransport(RECORDS, stream="S", fail_after=[2])
    client = _client(transport, tables=["Items"])
    got = list(client.read(ChangeStreamQuery("S", TOKEN, T, T + 10)))
    assert [r.record_sequence for r in got if isinstance(r, DataChangeRecord)] == [
        "00000001", "00000004"]
    assert len(transport.queries) == 2
    positions = [record_position(r) for r in got]
    assert positions == sorted(positions)
    assert len({(type(r), record_position(r)) for r in got}) == len(got)
