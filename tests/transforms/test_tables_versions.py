"""WriteTables schema versions from column sets: a dropped column starts a version only when
a record carrying every tracked column (an INSERT) lacks it and is newer than the version;
a replayed batch from before a change does not start one."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.transforms.test_tables import INT, STR, T0, _close_sinks, _commit, _record, _sink

__all__ = ["_close_sinks"]  # the autouse fixture that closes the sinks these tests set up

EMAIL = {"email": (STR, "x@y")}


def _versions(out: Path) -> list[list[str]]:
    docs = [json.loads(p.read_text()) for p in sorted((out / "T" / "_schema").glob("v*.json"))]
    return [[c["name"] for c in d["columns"]] for d in docs]


def _names(out: Path) -> list[str]:
    return sorted((p.name for p in (out / "T").glob("part-*")),
                  key=lambda n: int(n.split("-")[1]))


def test_an_insert_without_a_column_drops_it_an_update_does_not(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), flush_interval="1h")
    _commit(sink, 1, [_record("T", 1, extra=EMAIL)])
    _commit(sink, 2, [_record("T", 1, "UPDATE")])  # an update lists the columns it wrote
    _commit(sink, 3, [_record("T", 1, "DELETE", extra=EMAIL)])
    assert _versions(tmp_path) == [["id", "name", "email"]]
    _commit(sink, 4, [_record("T", 5)])  # an INSERT lists every column: email was dropped
    _commit(sink, 5, [_record("T", 6, "UPDATE")])
    sink.flush()
    assert _versions(tmp_path) == [["id", "name", "email"], ["id", "name"]]
    assert _names(tmp_path) == ["part-1-3-1.parquet", "part-4-5-2.parquet"]


def test_an_older_insert_read_late_is_no_drop(tmp_path: Path) -> None:
    # a split partition read on in the next batch: its INSERT predates the new column
    sink = _sink(str(tmp_path), flush_interval="1h")
    _commit(sink, 1, [_record("T", 1, at=T0)])
    _commit(sink, 2, [_record("T", 2, at=T0 + 2000, extra=EMAIL)])
    _commit(sink, 3, [_record("T", 3, at=T0 + 1000)])
    _commit(sink, 4, [_record("T", 4, at=T0 + 3000, extra=EMAIL)])
    sink.flush()
    assert _versions(tmp_path) == [["id", "name"], ["id", "name", "email"]]


def test_a_batch_with_both_shapes_keeps_the_column_until_no_row_carries_it(
    tmp_path: Path
) -> None:
    sink = _sink(str(tmp_path), flush_interval="1h")
    _commit(sink, 1, [_record("T", 1, at=T0, extra=EMAIL)])
    _commit(sink, 2, [_record("T", 2, at=T0 + 1000, extra=EMAIL),
                      _record("T", 3, at=T0 + 2000)])
    assert _versions(tmp_path) == [["id", "name", "email"]]
    _commit(sink, 3, [_record("T", 4, at=T0 + 3000)])
    assert _versions(tmp_path) == [["id", "name", "email"], ["id", "name"]]


def test_a_replayed_batch_from_before_a_drop_adds_no_version(tmp_path: Path) -> None:
    sink = _sink(str(tmp_path), flush_interval="1h")
    first = [_record("T", 1, at=T0, extra=EMAIL), _record("U", 9, at=T0)]
    _commit(sink, 1, first)
    _commit(sink, 2, [_record("T", 2, at=T0 + 1000)])  # drops email: T's batch 1 is written
    sink.drain()
    assert sink.durable_batch() == 0  # U's open file holds batch 1
    sink.close()  # a crash: the run replays from batch 1
    again = _sink(str(tmp_path), flush_interval="1h")
    _commit(again, 1, first)
    _commit(again, 2, [_record("T", 2, at=T0 + 1000)])
    again.flush()
    assert _versions(tmp_path) == [["id", "name", "email"], ["id", "name"]]
    assert _names(tmp_path) == ["part-1-1-1.parquet", "part-2-2-2.parquet"]


def test_a_column_retyped_within_a_batch_takes_its_newest_type(tmp_path: Path) -> None:
    # ALTER COLUMN (or a drop and an add with another type) between two writes that one
    # batch reads: the batch's version has the new type and its earlier rows are cast to it
    sink = _sink(str(tmp_path), flush_interval="1h")
    _commit(sink, 1, [_record("T", 1, at=T0, extra={"q": (INT, 1)})])
    _commit(sink, 2, [_record("T", 2, at=T0 + 1000, extra={"q": (INT, 2)}),
                      _record("T", 3, at=T0 + 2000, extra={"q": (STR, "x3")})])
    sink.flush()
    docs = [json.loads(p.read_text()) for p in sorted((tmp_path / "T" / "_schema").glob("v*"))]
    assert [[(c["name"], c["type"]["code"]) for c in d["columns"]] for d in docs] == [
        [("id", "INT64"), ("name", "STRING"), ("q", "INT64")],
        [("id", "INT64"), ("name", "STRING"), ("q", "STRING")]]
    assert docs[1]["since"] == T0 + 2000  # the first record of the new type
    assert _names(tmp_path) == ["part-1-1-1.parquet", "part-2-2-2.parquet"]
    rows = pq.read_table(tmp_path / "T" / "part-2-2-2.parquet").to_pylist()
    assert sorted((r["id"], r["q"]) for r in rows) == [(2, "2"), (3, "x3")]


BYT = {"code": "BYTES"}
RETYPED = {  # (old type, row 2's value), (new type, row 3's value), what row 2 reads as
    "STRING->BYTES": ((STR, "h\u00e9 +/="), (BYT, b"\x00\xff"), "h\u00e9 +/=".encode()),
    "BYTES->STRING": ((BYT, "h\u00e9".encode()), (STR, "x3"), "h\u00e9"),
    "INT64->STRING": ((INT, 2), (STR, "x3"), "2"),
}


def _read_q(path: Path, fmt: str, rows: str, new: dict[str, str]) -> dict[int, object]:
    """Each row's q as the file's schema version says to read it (BYTES: base64 in text)."""
    if fmt == "parquet":
        table = pq.read_table(path).to_pylist()
        got = [(r["id"], r["q"]) if rows == "flat" else (r["after"]["id"], r["after"]["q"])
               for r in table]
    else:
        if fmt == "jsonl":
            lines = [json.loads(line) for line in path.read_text().splitlines()]
            pairs = [(r["id"], r["q"]) if rows == "flat" else (r["after"]["id"], r["after"]["q"])
                     for r in lines]
        else:
            import csv
            prefix = "" if rows == "flat" else "after."
            pairs = [(int(r[f"{prefix}id"]), r[f"{prefix}q"])
                     for r in csv.DictReader(path.read_text().splitlines())]
        got = [(int(i), base64.b64decode(q) if new == BYT else q) for i, q in pairs]
    return dict(got)


@pytest.mark.parametrize("rows", ["flat", "debezium"])
@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
@pytest.mark.parametrize("change", sorted(RETYPED))
def test_rows_cast_to_a_columns_new_type_read_the_same_in_every_format(
    tmp_path: Path, fmt: str, rows: str, change: str
) -> None:
    """A batch's rows from before the column's new type are cast to it alike in every
    format: text files write the cast value's own form (BYTES as the base64 of the text's
    UTF-8, a STRING from BYTES as the decoded text), not the old form under the new type."""
    (old, before), (new, after), expected = RETYPED[change]
    sink = _sink(str(tmp_path), format=fmt, rows=rows, flush_interval="1h")
    _commit(sink, 1, [_record("T", 2, at=T0 + 1000, extra={"q": (old, before)}),
                      _record("T", 3, at=T0 + 2000, extra={"q": (new, after)})])
    sink.flush()
    (path,) = (tmp_path / "T").glob("part-*")
    assert _read_q(path, fmt, rows, new) == {2: expected, 3: after}
