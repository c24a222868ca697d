"""The initial snapshot of a table on the emulator: one task, or key ranges in parallel.

A Cloud Spanner emulator (started here) gets a table of ``--rows`` rows and a change stream
over it; then, side by side in this one process, a pipeline reads the snapshot (and a
stream window of 1 ns: nothing else) into a sink that counts the rows it is given:

* ``one task``: ``snapshot_rows_per_task`` above the table's size, the table read by a
  single task (a partitioned query whose partitions it reads in turn), 1 worker;
* ``ranges, 1 worker`` / ``ranges, 2 workers``: the table split into key ranges of
  ``--rows-per-task`` rows (a key scan first), the ranges read by tasks of their own,
  ``--tasks-per-batch`` per batch, on 1 and 2 threads of the in-memory runner.

Each is timed from the engine's start to its end (best of ``--repeat``), as rows/s and as a
ratio to ``one task``. The emulator has no key seeks: every query scans the whole table (the
last line measures it: a key range of one row against the whole table), so on it K ranges
cost K scans of the table and ``one task`` wins; what the ranges show here is how their
reads run in parallel (1 against 2 workers). On Spanner a key range is a seek.

Then what a crash costs: each way again, the run stopped by an error raised once the sinks
committed the snapshot's third batch (its store commit never happens; unsplit, the first
and only snapshot batch), and a second run to the end; printed: the rows each run read,
and how many were read twice. Unsplit, the table is one batch and is read again whole;
split, only the pending batch's ranges are read again.

``python -m bench.bench_snapshot [--rows N] [--rows-per-task N] [--tasks-per-batch N]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

from bench._args import positive_int
from cdcflow.engine.listener import EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import MemoryStore
from cdcflow.model import DataChangeRecord, Timestamp
from cdcflow.pipeline import Pipeline
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.spanner.emulator import Emulator
from cdcflow.transforms import ReadChangeStream
from cdcflow.transforms.base import Sink, SinkContext, WriterContext

__all__ = ["main"]

TABLE = "Snap"
STREAM = "SnapStream"


class _Counter:
    def __init__(self) -> None:
        self.rows = 0

    def write(self, record: DataChangeRecord) -> None:
        self.rows += len(record.mods) if record.is_snapshot else 0

    def close(self) -> int:
        return self.rows

    def abort(self) -> None:
        return None


class CountRows(Sink[DataChangeRecord, int]):
    """Counts the snapshot rows of the batches it commits."""

    def __init__(self) -> None:
        self.rows = 0

    def setup(self, ctx: SinkContext) -> None:
        return None

    def open_writer(self, ctx: WriterContext) -> _Counter:
        return _Counter()

    def commit(self, batch_id: int, messages: Sequence[int]) -> None:
        self.rows += sum(messages)


class _Crash(Exception):
    pass


class _CrashAfterSinks(EngineListener):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_sinks_committed(self, batch_id: int) -> None:
        if batch_id == self.batch:
            raise _Crash(batch_id)


def _load(emulator: Emulator, rows: int) -> tuple[str, int]:
    db = emulator.create_database("snapbench", [
        f"CREATE TABLE {TABLE} (Id INT64 NOT NULL, Customer STRING(MAX), Status STRING(16), "
        "Quantity INT64, Price FLOAT64) PRIMARY KEY (Id)",
        f"CREATE CHANGE STREAM {STREAM} FOR {TABLE}",
    ])
    columns = ("Id", "Customer", "Status", "Quantity", "Price")

    def commit(first: int) -> int:
        values = [(i, f"customer-{i % 997}", "NEW", i % 13, i * 0.25)
                  for i in range(first, min(rows, first + 5_000))]
        with db.batch() as batch:
            batch.insert(TABLE, columns, values)
        return Timestamp.from_datetime(batch.committed).ns

    # One commit at a time: the emulator aborts overlapping transactions.
    last = max(commit(first) for first in range(0, rows, 5_000))
    return emulator.database_path("snapbench"), max(last, Timestamp.now().ns) + 1_000


def _run(database: str, start: int, *, rows_per_task: int, tasks_per_batch: int, workers: int,
         store: Any = None, listener: EngineListener | None = None,
         sink: CountRows | None = None) -> tuple[float, int]:
    """Seconds from the engine's start to its end, and the snapshot rows its sink got."""
    sink = sink or CountRows()
    p = Pipeline("snapbench")
    (p
     | ReadChangeStream(database, STREAM, start_at=start, end_at=start, heartbeat="10s",
                        snapshot=True, snapshot_rows_per_task=rows_per_task,
                        snapshot_tasks_per_batch=tasks_per_batch)
     | sink)
    began = time.perf_counter()
    Engine(p, store or MemoryStore(), InMemoryRunner(workers=workers),
           RunOptions(batch_interval=0, batch_retries=0), listener).run()
    return time.perf_counter() - began, sink.rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_snapshot", description=__doc__)
    parser.add_argument("--rows", type=positive_int, default=60_000)
    parser.add_argument("--rows-per-task", type=positive_int, default=5_000)
    parser.add_argument("--tasks-per-batch", type=positive_int, default=4)
    parser.add_argument("--repeat", type=positive_int, default=3)
    args = parser.parse_args()
    with Emulator() as emulator:
        os.environ["SPANNER_EMULATOR_HOST"] = emulator.host
        database, start = _load(emulator, args.rows)
        ranges = -(-args.rows // args.rows_per_task)
        print(f"{args.rows} rows; ranges of {args.rows_per_task} rows: {ranges}, "
              f"{args.tasks_per_batch} per batch; load average {os.getloadavg()[0]:.2f}")
        ways = {
            "one task": dict(rows_per_task=args.rows + 1, workers=1),
            "ranges, 1 worker": dict(rows_per_task=args.rows_per_task, workers=1),
            "ranges, 2 workers": dict(rows_per_task=args.rows_per_task, workers=2),
        }
        best: dict[str, float] = {}
        for _ in range(args.repeat):
            for name, way in ways.items():
                seconds, rows = _run(database, start, tasks_per_batch=args.tasks_per_batch,
                                     **way)
                assert rows == args.rows, (name, rows)
                best[name] = min(best.get(name, seconds), seconds)
        for name, seconds in best.items():
            print(f"{name:<20} {seconds:6.2f} s  {args.rows / seconds:9,.0f} rows/s  "
                  f"{best['one task'] / seconds:5.2f}x")
        print("after a crash once the sinks committed batch 3 (the store did not):")
        for name, way in ways.items():
            if name == "ranges, 1 worker":
                continue
            store, first = MemoryStore(), CountRows()
            crash = 3 if way["rows_per_task"] <= args.rows else 1  # unsplit: one batch
            with contextlib.suppress(_Crash):
                _run(database, start, tasks_per_batch=args.tasks_per_batch, store=store,
                     listener=_CrashAfterSinks(crash), sink=first, **way)
            _, again = _run(database, start, tasks_per_batch=args.tasks_per_batch,
                            store=store, **way)
            print(f"{name:<20} before the crash {first.rows:,} rows, after it {again:,}: "
                  f"{first.rows + again - args.rows:,} of {args.rows:,} read twice")
        _emulator_scans(database, start)
        print(f"load average {os.getloadavg()[0]:.2f}")


def _emulator_scans(database: str, start: int) -> None:
    """What a key range costs on the emulator: it has no key seeks, every query scans the
    table, so a range of one row costs about what the whole table does."""
    from cdcflow.keyrange import KeyRange
    from cdcflow.spanner.client import SpannerChangeStreamClient

    client = SpannerChangeStreamClient(database)
    try:
        client.snapshot_tables(STREAM)
        timed = []
        for key_range in (None, KeyRange(0, ("1",), ("2",))):
            began = time.perf_counter()
            rows = sum(len(r.mods) for r in client.snapshot(STREAM, TABLE, start - 1, key_range))
            timed.append((rows, time.perf_counter() - began))
    finally:
        client.close()
    (whole, t_whole), (one, t_one) = timed
    print(f"emulator: the whole table ({whole:,} rows) in {t_whole:.2f} s, a key range of "
          f"{one} row in {t_one:.2f} s (each query scans the table: no key seeks)")


if __name__ == "__main__":
    main()
