"""Snapshot rows in WriteTables: Debezium's read op ("r") and ``_op`` SNAPSHOT in flat rows,
end to end through a pipeline that snapshots a scripted table and then streams it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

import cdcflow as cf
import cdcflow.testing
from cdcflow.model import Timestamp
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import ReadChangeStream, WriteTables

S = 1_000_000_000
T0 = 1_700_000_000 * S


def _rows(root: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for path in sorted(root.rglob("*.jsonl"))
        for line in path.read_bytes().splitlines()
    ]


@pytest.mark.parametrize("style", ["flat", "debezium"])
def test_snapshot_rows_are_marked_in_both_row_styles(tmp_path: Path, style: str) -> None:
    stream = ScriptedChangeStream(
        "S", origin=T0, snapshot_rows={"T": [(1, {"v": "a"}), (2, {"v": "b"})]}
    )
    stream.write("T", 3, "INSERT", {"v": "c"}, at=T0 + 3 * S)
    stream.write("T", 1, "DELETE", at=T0 + 4 * S)
    p = cf.Pipeline("tables")
    (p
     | ReadChangeStream(stream="S", start_at=T0 + 2 * S, end_at=T0 + 5 * S, client=stream,
                        snapshot=True)
     | WriteTables(tmp_path, format="jsonl", rows=style))  # type: ignore[arg-type]
    cdcflow.testing.run(p)
    rows = _rows(tmp_path)
    if style == "flat":
        got = sorted((r["id"], r["_op"], r["_txn"]) for r in rows)
        assert got == [(1, "DELETE", "txn-00000001"), (1, "SNAPSHOT", "snapshot"),
                       (2, "SNAPSHOT", "snapshot"), (3, "INSERT", "txn-00000000")]
        snapshot_ts = {r["_commit_ts"] for r in rows if r["_op"] == "SNAPSHOT"}
        assert snapshot_ts == {Timestamp.from_ns(T0 + 2 * S - 1).rfc3339()}  # start - 1 ns
    else:
        got = sorted((r["op"], (r["after"] or r["before"])["id"]) for r in rows)
        assert got == [("c", 3), ("d", 1), ("r", 1), ("r", 2)]
        read = next(r for r in rows if r["op"] == "r")
        assert read["before"] is None and read["after"]["v"] in ("a", "b")
        assert read["source"]["partition"] == "snapshot/T"
