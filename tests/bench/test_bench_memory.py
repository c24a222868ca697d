"""The memory benchmark's harness runs and reports (no RSS asserts: ``make bench`` measures)."""

from __future__ import annotations

import pytest

from bench import bench_memory


def test_a_small_backlog_runs_in_a_child_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    bench_memory.main(["--mb", "8", "--quotas", "1"])
    out = capsys.readouterr().out
    *_, row, tables = out.strip().splitlines()
    cells = row.split()
    assert cells[0:2] == ["1", "MiB"]  # the quota
    assert float(cells[2]) <= 1.0  # its peak of held bytes
    assert cells[11] == "128"  # every record reached the sink: 8 MiB of 64 KiB records
    assert tables.strip().startswith("WriteTables") and " 128 rows in " in tables
    assert "WRONG" not in out
