"""The memory benchmark's harness runs and reports (no RSS asserts: ``make bench`` measures)."""

from __future__ import annotations

import pytest

from bench import bench_memory


def test_a_small_backlog_runs_in_a_child_and_reports(capsys: pytest.CaptureFixture[str]) -> None:
    bench_memory.main(["--mb", "8", "--quotas", "1"])
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.strip().splitlines()]
    [row] = [line for line in lines if line.startswith("1 MiB")]
    cells = row.split()
    assert cells[0:2] == ["1", "MiB"]  # the quota
    assert float(cells[2]) <= 1.0  # its peak of held bytes
    assert cells[11] == "128"  # every record reached the sink: 8 MiB of 64 KiB records
    # the sinks that keep elements: every record written or called, once
    for name, counted in (("WriteFiles (parquet), quota", " 128 in "),
                          ("WriteFiles (parquet), 8 tasks", " 128 in "),
                          ("WriteFiles (parquet), 16 tasks", " 128 in "),
                          ("Consume(max_inflight=16)", " 128 in "),
                          ("WriteTables", " 128 rows in ")):
        [line] = [line for line in lines if line.startswith(name)]
        assert counted in line and "peak RSS" in line, line
    assert "WRONG" not in out
