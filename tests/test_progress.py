"""Progress listeners: the live terminal line, plain log lines and the final summary."""

from __future__ import annotations

import io
import logging
import re

import pytest

from cdcflow.engine.listener import BatchStats, RunSummary
from cdcflow.model import MAX_NS, BatchPlan, Slice
from cdcflow.progress import (
    LiveProgress,
    LogProgress,
    ProgressTally,
    format_duration,
    format_partitions,
    format_summary,
    make_progress,
)

S = 1_000_000_000
NOW = 1_700_000_100 * S


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def stats(batch_id: int, records: int, low: int = NOW - 2 * S, **kw: object) -> BatchStats:
    return BatchStats(
        batch_id=batch_id, end=NOW, slices=3, records=records, bytes=records * 100,
        seconds=0.25, low_watermark=low, partitions={"RUNNING": 3, "FINISHED": 4}, **kw,  # type: ignore[arg-type]
    )


def summary(**kw: object) -> RunSummary:
    base: dict[str, object] = dict(
        pipeline="orders", batches=2, records=300, reason="end reached",
        low_watermark=NOW - 2 * S, partitions={"RUNNING": 3, "FINISHED": 4}, splits=1, merges=2,
    )
    base.update(kw)
    return RunSummary(**base)  # type: ignore[arg-type]


def test_format_duration() -> None:
    assert format_duration(0.25) == "250ms"
    assert format_duration(4.25) == "4.2s"
    assert format_duration(185) == "3m05s"
    assert format_duration(7380) == "2h03m"


def test_format_partitions_orders_states_and_skips_zero() -> None:
    text = format_partitions({"FINISHED": 12, "CREATED": 1, "RUNNING": 3, "SCHEDULED": 0})
    assert text == "3 running, 1 created, 12 finished"
    assert format_partitions({}) == "none"


def test_tally_rate_uses_recent_window() -> None:
    clock = Clock()
    tally = ProgressTally(clock)
    tally.start("p", "memory", "memory://")
    clock.t += 2
    tally.add(stats(1, 200))
    assert tally.rate() == pytest.approx(100.0)
    clock.t += 30  # an idle stretch longer than the window
    tally.add(stats(2, 0))
    clock.t += 1
    tally.add(stats(3, 50))
    assert tally.rate() == pytest.approx(50 / 31)
    clock.t += 20
    tally.add(stats(4, 0))
    assert tally.records == 250 and tally.batches == 4


def test_live_progress_redraws_one_line_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # the line is cut to the terminal's width
    out, clock = TTY(), Clock()
    live = LiveProgress(out, clock=clock, now_ns=lambda: NOW)
    live.on_start("orders", "memory", "sqlite:////tmp/s.db")
    live.on_planned(BatchPlan(1, NOW, [Slice("t1", 0, NOW), Slice("t2", 0, NOW)]), False)
    clock.t += 1
    live.on_batch(stats(1, 120, splits=1))
    clock.t += 1
    live.on_batch(stats(2, 80, merges=1))
    text = out.getvalue()
    head, _, drawn = text.partition("\n")
    assert head == "cdcflow: running orders on memory; progress in sqlite:////tmp/s.db"
    assert "\n" not in drawn  # every refresh rewrites the same line
    frames = drawn.split("\r\x1b[2K")[1:]
    assert len(frames) == 4
    assert frames[0].startswith("starting | 0 records (0/s) | splits 0 merges 0")
    assert frames[1].startswith("batch 1 (2 slices)… | 0 records")
    assert frames[-1] == (
        "batch 2 | 200 records (100/s) | lag 2.0s | 3 running, 4 finished | "
        "splits 1 merges 1 | 2.0s"
    )


def test_live_progress_summary_replaces_the_line() -> None:
    out = TTY()
    live = LiveProgress(out, clock=Clock(), now_ns=lambda: NOW)
    live.on_start("orders", "memory", "memory://")
    live.on_batch(stats(1, 300))
    live.on_stop(summary())
    text = out.getvalue()
    assert text.endswith("\n")
    final = text.rpartition("\r\x1b[2K")[2]
    assert final.startswith("cdcflow: orders stopped (end reached)")
    assert "records    300" in final
    assert "splits     1, merges 2" in final


def test_live_progress_log_records_go_above_the_line() -> None:
    out = TTY()
    live = LiveProgress(out, clock=Clock(), now_ns=lambda: NOW)
    log = logging.getLogger("test.progress.above")
    log.propagate = False
    handler = live.logging_handler()
    log.addHandler(handler)
    try:
        live.on_start("orders", "memory", "memory://")
        log.warning("slow sink")
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    # cleared, the message on its own (dated) line, then the status line drawn again
    assert re.search(
        r"0ms\r\x1b\[2K\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z WARNING test.progress.above: "
        r"slow sink\n\r\x1b\[2Kstarting", text)


def test_live_line_fits_the_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    out = TTY()
    live = LiveProgress(out, clock=Clock(), now_ns=lambda: NOW)
    live.on_start("orders", "memory", "memory://")
    live.on_batch(stats(1, 10))
    frame = out.getvalue().rpartition("\r\x1b[2K")[2]
    assert len(frame) <= 39
    assert frame.endswith("…")


def test_log_progress_one_line_per_batch(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="cdcflow.progress")
    progress = LogProgress(clock=Clock(), now_ns=lambda: NOW)
    progress.on_start("orders", "spark", "memory://")
    progress.on_planned(BatchPlan(7, NOW, [Slice("t", 0, NOW)]), True)
    progress.on_batch(stats(7, 42, replayed=True))
    progress.on_stop(summary(batches=1, records=42))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "running orders on spark; progress in memory://"
    assert messages[1] == "replaying batch 7 (1 slices) planned by an earlier run"
    assert messages[2].startswith("batch 7: 3 slices, 42 records in 250ms; lag 2.0s;")
    assert messages[3].startswith("cdcflow: orders stopped (end reached)")
    assert "batches    1 (1 replayed)" in messages


def test_summary_when_every_partition_finished() -> None:
    text = format_summary(summary(low_watermark=MAX_NS, partitions={"FINISHED": 5}), None, NOW)
    assert "watermark  all partitions finished" in text
    assert "partitions 5 finished" in text


def test_summary_when_the_run_reached_its_end() -> None:
    text = format_summary(summary(partitions={"FINISHED": 5}), None, NOW)
    assert "watermark  2023-11-14T22:14:58.000000000Z (all partitions finished there)" in text


def test_summary_shows_watermark_and_lag() -> None:
    text = format_summary(summary(), None, NOW)
    assert "watermark  2023-11-14T22:14:58.000000000Z (lag 2.0s)" in text


def test_make_progress_picks_by_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert isinstance(make_progress(TTY()), LiveProgress)
    assert isinstance(make_progress(io.StringIO()), LogProgress)
    assert isinstance(make_progress(TTY(), live=False), LogProgress)
    monkeypatch.setenv("TERM", "dumb")
    assert isinstance(make_progress(TTY()), LogProgress)
