"""The catch-up benchmark's harness runs on the emulator and counts every change (no speed
asserts: ``make bench`` measures)."""

from __future__ import annotations

import os

import pytest

from bench import bench_catchup

pytestmark = pytest.mark.emulator


def test_a_small_backlog_is_read_whole_by_the_stock_reader_and_cdcflow(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench_catchup.main(["--shapes", "300x20", "--no-spark", "--set", "max_batch_span=30s"])
    out = capsys.readouterr().out
    names = ("stock reader (1 thread)", "cdcflow run (in-memory)")
    rows: dict[str, list[list[str]]] = {name: [] for name in names}
    for line in out.splitlines():
        for name in names:
            if line.startswith(f"  {name} "):
                rows[name].append(line[len(name) + 2:].split())
    for cells in rows.values():
        # the side-by-side row, the breakdown, the reading-alone row, the CPU row
        assert len(cells) == 4, out
        own, emulator, floor, seconds = (float(x) for x in cells[3][:4])
        # each reader's CPU, and the emulator's for it: read in clock ticks (10 ms), which
        # the emulator's few milliseconds for this small backlog may not reach
        assert own > 0 and emulator >= 0
        cores = os.cpu_count() or 1
        assert floor == pytest.approx((own + emulator) / cores, abs=0.011)
        assert seconds > 0
        assert cells[0][0] == "300" and float(cells[0][2]) > 0  # changes, changes/s
    assert "no run on" in out and "the stock reader at most" in out
    assert "WRONG" not in out and "target >= 4x the stock reader" in out
    assert any(line.startswith(f"  {bench_catchup.CEILING} (") and " 300 " in line
               for line in out.splitlines()), out  # the emulator's ceiling, every change
    # where the time went: the phases add up to the run's seconds (launch to exit)
    stock, run = rows["stock reader (1 thread)"][1], rows["cdcflow run (in-memory)"][1]
    assert stock[0::2] == ["imports", "reading", "end"], stock
    assert run[0::2][:3] == ["imports", "connect+store+lease", "first-batch"], run
    assert run[-2] == "end"
    for cells, row in ((stock, rows["stock reader (1 thread)"][0]),
                       (run, rows["cdcflow run (in-memory)"][0])):
        assert all(float(x) >= 0 for x in cells[1::2])
        assert abs(sum(float(x) for x in cells[1::2]) - float(row[1])) < 0.1
