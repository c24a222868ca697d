"""Progress of a run, as the CLI shows it: EngineListener implementations.

- :class:`LiveProgress`: on a terminal, one status line redrawn in place after every
  step (batches, records/s, low-watermark lag, partitions by state, splits and merges).
- :class:`LogProgress`: elsewhere (files, pipes, CI), one ``logging`` line per batch.

Both print a final summary (:func:`format_summary`) when the run stops.
:func:`make_progress` picks one for a stream; :func:`configure_logging` sets up the log
lines around it: plain text dated in UTC (:class:`PlainFormatter`), or one JSON object per
line for log shippers (:class:`JsonFormatter`).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TextIO

from cdcflow.engine.listener import BatchStats, EngineListener, RunSummary
from cdcflow.logformat import (
    LOG_FORMATS,
    JsonFormatter,
    LogFormat,
    PlainFormatter,
    pass_to_workers,
)
from cdcflow.model import MAX_NS, BatchPlan, PartitionState, Timestamp

__all__ = [
    "LOG_FORMATS",
    "JsonFormatter",
    "LiveProgress",
    "LogProgress",
    "PlainFormatter",
    "ProgressTally",
    "configure_logging",
    "format_duration",
    "format_partitions",
    "format_summary",
    "make_progress",
]

_STATE_ORDER = [s.value for s in (
    PartitionState.RUNNING, PartitionState.SCHEDULED, PartitionState.CREATED,
    PartitionState.FINISHED,
)]
_RATE_WINDOW_S = 10.0
_CLEAR_LINE = "\r\x1b[2K"

logger = logging.getLogger("cdcflow.progress")

def format_duration(seconds: float) -> str:
    """``"850ms"``, ``"4.2s"``, ``"3m05s"``, ``"2h03m"``."""
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        m, s = divmod(int(seconds), 60)
        return f"{m}m{s:02d}s"
    h, rest = divmod(int(seconds), 3600)
    return f"{h}h{rest // 60:02d}m"


def format_partitions(partitions: Mapping[str, int]) -> str:
    """``"3 running, 1 created, 12 finished"`` (zero counts left out; ``"none"`` if empty)."""
    names = [n for n in _STATE_ORDER if partitions.get(n)]
    names += sorted(n for n in partitions if n not in _STATE_ORDER and partitions[n])
    return ", ".join(f"{partitions[n]} {n.lower()}" for n in names) or "none"


def _all_finished(partitions: Mapping[str, int]) -> bool:
    return bool(partitions) and all(
        n == PartitionState.FINISHED.value for n, count in partitions.items() if count
    )


def _lag(low_watermark: int, now_ns: int, partitions: Mapping[str, int] | None = None) -> str:
    if low_watermark >= MAX_NS or (partitions is not None and _all_finished(partitions)):
        return "none (all partitions finished)"
    return format_duration(max(0, now_ns - low_watermark) / 1e9)


class ProgressTally:
    """Running totals of a run, fed by the listener callbacks (shared by both displays)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.started = clock()
        self.pipeline = ""
        self.runner = ""
        self.store_url = ""
        self.batches = 0
        self.replayed = 0
        self.records = 0
        self.bytes = 0
        self.splits = 0
        self.merges = 0
        self.new_partitions = 0
        self.last: BatchStats | None = None
        self.planned: BatchPlan | None = None
        self._window: deque[tuple[float, int]] = deque()

    def start(self, pipeline: str, runner: str, store_url: str) -> None:
        self.started = self._clock()
        self.pipeline, self.runner, self.store_url = pipeline, runner, store_url
        self._window.clear()
        self._window.append((self.started, 0))

    def add(self, stats: BatchStats) -> None:
        self.batches += 1
        self.replayed += int(stats.replayed)
        self.records += stats.records
        self.bytes += stats.bytes
        self.splits += stats.splits
        self.merges += stats.merges
        self.new_partitions += stats.new_partitions
        self.last = stats
        self.planned = None
        now = self._clock()
        self._window.append((now, self.records))
        while len(self._window) > 2 and now - self._window[1][0] >= _RATE_WINDOW_S:
            self._window.popleft()

    def elapsed(self) -> float:
        return self._clock() - self.started

    def rate(self) -> float:
        """Records per second over the last ~10 s of committed batches."""
        if len(self._window) < 2:
            return 0.0
        (t0, r0), (t1, r1) = self._window[0], self._window[-1]
        return (r1 - r0) / (t1 - t0) if t1 > t0 else 0.0

    def overall_rate(self) -> float:
        elapsed = self.elapsed()
        return self.records / elapsed if elapsed > 0 else 0.0


def format_summary(
    summary: RunSummary, tally: ProgressTally | None = None, now_ns: int | None = None
) -> str:
    """A few lines describing a finished run."""
    now = Timestamp.now().ns if now_ns is None else now_ns
    head = f"cdcflow: {summary.pipeline} stopped ({summary.reason})"
    if tally is not None:
        head += f" after {format_duration(tally.elapsed())}"
    batches = f"{summary.batches:,}"
    if tally is not None and tally.replayed:
        batches += f" ({tally.replayed} replayed)"
    records = f"{summary.records:,}"
    if tally is not None:
        records += f" ({tally.overall_rate():,.0f}/s)"
    if summary.low_watermark >= MAX_NS:
        watermark = "all partitions finished"
    elif _all_finished(summary.partitions):
        stamp = Timestamp.from_ns(summary.low_watermark).rfc3339()
        watermark = f"{stamp} (all partitions finished there)"
    else:
        stamp = Timestamp.from_ns(summary.low_watermark).rfc3339()
        watermark = f"{stamp} (lag {_lag(summary.low_watermark, now)})"
    rows = [
        ("batches", batches),
        ("records", records),
        ("watermark", watermark),
        ("partitions", format_partitions(summary.partitions)),
        ("splits", f"{summary.splits}, merges {summary.merges}"),
        ("elements", f"{summary.skipped:,} skipped, {summary.retried:,} retried, "
                     f"{summary.dead_lettered:,} dead-lettered"),
    ]
    return "\n".join([head, *(f"  {k:<11}{v}" for k, v in rows)])


def _status_line(tally: ProgressTally, now_ns: int) -> str:
    # Most useful first: a narrow terminal cuts the end of the line.
    last, planned = tally.last, tally.planned
    if planned is not None:
        parts = [f"batch {planned.batch_id} ({len(planned.slices)} slices)…"]
    else:
        parts = [f"batch {last.batch_id}" if last is not None else "starting"]
    parts.append(f"{tally.records:,} records ({tally.rate():,.0f}/s)")
    if last is not None:
        parts.append(f"lag {_lag(last.low_watermark, now_ns, last.partitions)}")
        parts.append(format_partitions(last.partitions))
    parts.append(f"splits {tally.splits} merges {tally.merges}")
    parts.append(format_duration(tally.elapsed()))
    return " | ".join(parts)


class LiveProgress(EngineListener):
    """A status line on a terminal, redrawn in place with ANSI escapes."""

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        now_ns: Callable[[], int] | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tally = ProgressTally(clock)
        self._now_ns = now_ns or (lambda: Timestamp.now().ns)
        self._drawn = False

    def _width(self) -> int:
        return max(20, shutil.get_terminal_size((120, 24)).columns - 1)

    def draw(self) -> None:
        line = _status_line(self.tally, self._now_ns())
        width = self._width()
        if len(line) > width:  # a wrapped line could not be redrawn in place
            line = line[: width - 1] + "…"
        self.stream.write(_CLEAR_LINE + line)
        self.stream.flush()
        self._drawn = True

    def clear(self) -> None:
        """Erase the status line (before something else writes to the terminal)."""
        if self._drawn:
            self.stream.write(_CLEAR_LINE)
            self.stream.flush()
            self._drawn = False

    def logging_handler(self, level: int = logging.WARNING) -> logging.Handler:
        """A handler that writes log records above the status line instead of through it."""
        return _AboveStatusHandler(self, level)

    def on_start(self, pipeline: str, runner: str, store_url: str) -> None:
        self.tally.start(pipeline, runner, store_url)
        self.stream.write(f"cdcflow: running {pipeline} on {runner}; progress in {store_url}\n")
        self.draw()

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        self.tally.planned = plan
        self.draw()

    def on_batch(self, stats: BatchStats) -> None:
        self.tally.add(stats)
        self.draw()

    def on_stop(self, summary: RunSummary) -> None:
        self.clear()
        self.stream.write(format_summary(summary, self.tally, self._now_ns()) + "\n")
        self.stream.flush()


class _AboveStatusHandler(logging.StreamHandler):  # type: ignore[type-arg]
    def __init__(self, progress: LiveProgress, level: int) -> None:
        super().__init__(progress.stream)
        self.progress = progress
        self.setLevel(level)
        self.setFormatter(PlainFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        redraw = self.progress._drawn
        self.progress.clear()
        super().emit(record)
        if redraw:
            self.progress.draw()


class LogProgress(EngineListener):
    """One INFO log line per committed batch, and the summary at the end."""

    def __init__(
        self,
        log: logging.Logger | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        now_ns: Callable[[], int] | None = None,
    ) -> None:
        self.log = log or logger
        self.tally = ProgressTally(clock)
        self._now_ns = now_ns or (lambda: Timestamp.now().ns)

    def on_start(self, pipeline: str, runner: str, store_url: str) -> None:
        self.tally.start(pipeline, runner, store_url)
        self.log.info("running %s on %s; progress in %s", pipeline, runner, store_url)

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        if replay:
            self.log.info(
                "replaying batch %d (%d slices) planned by an earlier run",
                plan.batch_id, len(plan.slices),
            )

    def on_batch(self, stats: BatchStats) -> None:
        self.tally.add(stats)
        self.log.info(
            "batch %d: %d slices, %d records in %s; lag %s; partitions %s; splits %d merges %d",
            stats.batch_id, stats.slices, stats.records, format_duration(stats.seconds),
            _lag(stats.low_watermark, self._now_ns(), stats.partitions),
            format_partitions(stats.partitions),
            self.tally.splits, self.tally.merges,
        )

    def on_stop(self, summary: RunSummary) -> None:
        for line in format_summary(summary, self.tally, self._now_ns()).splitlines():
            self.log.info("%s", line.strip())


def make_progress(stream: TextIO | None = None, *, live: bool | None = None) -> EngineListener:
    """LiveProgress when ``stream`` (default stderr) is a terminal, else LogProgress.

    ``live`` forces the choice. ``TERM=dumb`` and ``NO_COLOR`` also select plain logs.
    """
    stream = stream if stream is not None else sys.stderr
    if live is None:
        live = (
            stream.isatty()
            and os.environ.get("TERM", "") != "dumb"
            and "NO_COLOR" not in os.environ
        )
    return LiveProgress(stream) if live else LogProgress()


def configure_logging(
    *,
    debug: bool = False,
    progress: EngineListener | None = None,
    format: LogFormat = "plain",
    pipeline: str | None = None,
    stream: TextIO | None = None,
) -> logging.Handler:
    """Send log records to ``stream`` (default stderr) the way the CLI does; return the
    handler, which replaces every handler on the root logger.

    ``format`` ``"plain"``: :class:`PlainFormatter` lines; with a :class:`LiveProgress`
    they go above its status line and only warnings show unless ``debug``. ``"json"``:
    :class:`JsonFormatter` lines naming ``pipeline``. cdcflow's own loggers log from INFO
    (DEBUG with ``debug``); other libraries' from WARNING.
    """
    if format not in LOG_FORMATS:
        msg = f"unknown log format {format!r}: use one of {', '.join(LOG_FORMATS)}"
        raise ValueError(msg)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    handler: logging.Handler
    if isinstance(progress, LiveProgress) and format == "plain":
        handler = progress.logging_handler(logging.DEBUG if debug else logging.WARNING)
    else:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
        handler.setFormatter(JsonFormatter(pipeline) if format == "json" else PlainFormatter())
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.WARNING)
    logging.getLogger("cdcflow").setLevel(logging.DEBUG if debug else logging.INFO)
    # Worker processes (Spark's Python workers inherit the environment; the Spark runner
    # passes it to a cluster's executors) log the same way: see configure_worker_logging.
    pass_to_workers(format, pipeline)
    return handler

