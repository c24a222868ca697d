"""The demo's exactly-once check and output reading (the full demo is `make demo`)."""

from __future__ import annotations

import json
from pathlib import Path

from cdcflow.demo import _splits_and_merges, check_exactly_once, read_output
from cdcflow.model import Timestamp

A = ("Orders", (("OrderId", "1"),), "INSERT", 100)
B = ("Orders", (("OrderId", "2"),), "UPDATE", 200)
C = ("Orders", (("OrderId", "3"),), "DELETE", 300)


def test_exactly_once_passes() -> None:
    # C is past the watermark: it may or may not have been read yet.
    assert check_exactly_once([A, B, C], [B, A], watermark=250) == []
    assert check_exactly_once([A, B, C], [A, B, C], watermark=250) == []


def test_missing_duplicate_and_unknown_changes_are_reported() -> None:
    problems = check_exactly_once([A, B, C], [A, A, C, ("X", (), "INSERT", 1)], watermark=250)
    assert len(problems) == 3
    assert problems[0].startswith("1 changes missing")
    assert problems[1].startswith("1 changes read twice or more")
    assert problems[2].startswith("1 changes read but never committed")


def test_read_output(tmp_path: Path) -> None:
    row = {"table": "Orders", "op": "INSERT", "keys": {"OrderId": "7"},
           "commit_timestamp": Timestamp.from_ns(1_700_000_000_123_456_789).rfc3339()}
    (tmp_path / "part-0000000012-abcdef0123456789.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / ".part-0000000013-x.tmp").write_text("ignored")
    (tmp_path / "_watermark.json").write_text(json.dumps({"ns": 42}))
    rows, watermark = read_output(tmp_path)
    assert rows == [(12, ("Orders", (("OrderId", "7"),), "INSERT", 1_700_000_000_123_456_789))]
    assert watermark == 42


def test_splits_and_merges_ignore_the_root() -> None:
    parents = {"a": ("Parent0",), "b": ("Parent0",), "a1": ("a",), "a2": ("a",),
               "m": ("a2", "b")}
    assert _splits_and_merges(parents) == (1, 1)


def test_shop_sql_matches_the_workload_schema() -> None:
    from cdcflow.cli import read_ddl
    from cdcflow.spanner.workload import shop_ddl

    path = Path(__file__).resolve().parents[1] / "examples" / "shop.sql"
    assert read_ddl(path) == shop_ddl()
