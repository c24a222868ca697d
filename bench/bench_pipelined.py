"""Pipelined batches: catch-up batches/s with a slow-reading task and a slow-committing sink.

A ScriptedChangeStream with a backlog (the run lags the clock and catches up, batches back
to back) on the in-memory runner with a SQLite store. Every task takes ``--read`` seconds
(its sink writer's close sleeps: a slow read) and the sink's commit ``--commit`` seconds on
the driver (a slow commit). Side by side, in one run:

* ``pipelined=False``: a batch is read, then committed, then the next is planned;
* ``pipelined=True`` (the default): batch N+1 is planned and read while N commits.

With reads and commits of 100 ms each the ideal is 2x.
``python -m bench.bench_pipelined [--batches N] [--read S] [--commit S]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cdcflow as cf
from bench._args import non_negative_float, positive_int
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import SQLiteStore
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms.base import Sink, SinkWriter, WriterContext

_S = 1_000_000_000


class _SlowWriter:
    def __init__(self, read: float) -> None:
        self.read, self.count = read, 0

    def write(self, element: Any) -> None:
        self.count += 1

    def close(self) -> int:
        time.sleep(self.read)
        return self.count

    def abort(self) -> None:
        return None


class _SlowSink(Sink[Any, int]):
    """Counts elements; each task's writer takes ``read`` s, each commit ``commit`` s."""

    def __init__(self, read: float, commit: float) -> None:
        self.read, self.commit_seconds = read, commit
        self.committed: dict[int, int] = {}

    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, int]:
        return _SlowWriter(self.read)

    def commit(self, batch_id: int, messages: Sequence[int]) -> None:
        time.sleep(self.commit_seconds)
        self.committed[batch_id] = sum(messages)


def _measure(batches: int, read: float, commit: float, pipelined: bool) -> tuple[float, int]:
    """(batches per second, records) of a catch-up run of ``batches`` 1 s batches."""
    origin = 1_700_000_000 * _S
    stream = ScriptedChangeStream("S", partitions=2, buckets=8, origin=origin)
    for i in range(batches * 20):
        with stream.transaction(at=origin + i * _S // 20) as tx:
            tx.write("T", i % 50, "UPDATE", {"i": i})
    sink = _SlowSink(read, commit)
    p = cf.Pipeline("pipelined")
    (p | cf.DetectPartitions(stream="S", start_at=origin, end_at=origin + batches * _S - 1,
                             client=stream)
     | cf.ReadPartition(heartbeat="1s") | sink)
    with tempfile.TemporaryDirectory() as tmp:
        store = SQLiteStore(Path(tmp) / "state.db")
        opts = RunOptions(batch_interval=0.0, max_batch_span=1.0, pipelined=pipelined)
        began = time.monotonic()
        summary = Engine(p, store, InMemoryRunner(workers=2), opts).run()
        seconds = time.monotonic() - began
        store.close()
    assert summary.reason == "end reached", summary
    assert sum(sink.committed.values()) == summary.records  # exactly once, both ways
    return summary.batches / seconds, summary.records


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_pipelined",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=positive_int, default=30)
    parser.add_argument("--read", type=non_negative_float, default=0.1,
                        help="seconds per task (0: none)")
    parser.add_argument("--commit", type=non_negative_float, default=0.1,
                        help="seconds per sink commit (0: none)")
    args = parser.parse_args()
    print(f"catch-up, {args.batches} batches, task read {args.read * 1000:.0f} ms, "
          f"sink commit {args.commit * 1000:.0f} ms (memory runner, SQLite)")
    rates = {}
    for pipelined in (False, True):
        rate, records = _measure(args.batches, args.read, args.commit, pipelined)
        rates[pipelined] = rate
        print(f"  pipelined={pipelined!s:<5}  {rate:6.2f} batches/s  ({records} records)")
    print(f"  speed-up: {rates[True] / rates[False]:.2f}x")


if __name__ == "__main__":
    main()
