"""What Spark costs and what it buys: per-batch overhead and scaling with executors.

Two measurements, printed side by side in one run:

* **idle batch**: wall time of a batch (plan -> tasks -> sink and store commit) over a
  ScriptedChangeStream with 4 partitions and no data, on the in-memory runner and on
  Spark ``local[2]``: the fixed cost Spark adds to every batch (a job, task shipping,
  Python workers, results back). Median and p90 over the measured batches.
* **throughput**: the same pipeline with data (8+ partitions, a JSON-building Map and a
  JSONL WriteFiles sink) on Spark with one task slot and with two (``local[1]`` vs
  ``local[2]``), and with one and two separate executors (``local-cluster[1,1,1024]`` vs
  ``local-cluster[2,1,1024]``: executor JVMs of their own, each with its own Python
  workers, as on a cluster; each such run starts its JVMs first, about 15 s, which is not
  counted). Steady state: the first data batch (where every Python worker unpickles the
  program and the scripted stream compiles its records) is not counted.

``python -m bench.bench_spark [--idle-batches N] [--records N] [--partitions N]``.
Targets: idle batch <= 150 ms median; two executors >= 1.7x one.
``--no-cluster`` skips the local-cluster runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import attrs
import orjson

from bench._args import positive_int
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner
from cdcflow.metadata import open_store
from cdcflow.pipeline import Pipeline
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.serialize import dumps_line
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import DetectPartitions, Filter, Map, ReadPartition, WriteFiles

__all__ = [
    "IdleResult", "ThroughputResult", "data_pipeline", "data_stream", "idle_batches", "main",
    "throughput",
]

_S = 1_000_000_000
_IDLE_WARMUP = 3  # the root batch and the first batches of fresh workers are not counted


class _Timings(EngineListener):
    def __init__(self) -> None:
        self.batches: list[BatchStats] = []

    def on_batch(self, stats: BatchStats) -> None:
        self.batches.append(stats)


@attrs.frozen
class IdleResult:
    runner: str
    median_ms: float
    p90_ms: float
    batches: int


@attrs.frozen
class ThroughputResult:
    runner: str
    records: int
    seconds: float
    batches: int

    @property
    def per_second(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


def _run(pipeline: Pipeline, runner: Runner, options: RunOptions) -> list[BatchStats]:
    timings = _Timings()
    store = open_store("memory://")
    try:
        Engine(pipeline, store, runner, options, timings).run()
    finally:
        store.close()
    return timings.batches


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def idle_batches(runner: Runner, label: str, batches: int) -> IdleResult:
    """Per-batch wall time of batches with 4 empty slices (no data, heartbeats only)."""
    origin = time.time_ns() - 3600 * _S  # far behind the clock: batches run back to back
    stream = ScriptedChangeStream("Idle", partitions=4, origin=origin)
    pipeline = Pipeline(f"bench-idle-{runner.name}")
    options = RunOptions(batch_interval=0, max_batch_span=1.0, max_batches=batches + _IDLE_WARMUP)
    with tempfile.TemporaryDirectory(prefix="cdcflow-bench-idle-") as out:
        (
            pipeline
            | DetectPartitions(stream="Idle", start_at=origin, client=stream)
            | ReadPartition(heartbeat="1s")
            | Map(_to_row)
            | WriteFiles(out, fsync=False)
        )
        stats = _run(pipeline, runner, options)[_IDLE_WARMUP:]
    ms = [s.seconds * 1000 for s in stats]
    return IdleResult(label, statistics.median(ms), _p90(ms), len(ms))


def _to_row(record: Any) -> dict[str, Any]:
    mod = record.mods[0]
    return {
        "ts": record.commit_timestamp.ns,
        "table": record.table_name,
        "type": record.mod_type,
        **mod.keys,
        **mod.new_values,
    }


def _enrich(row: dict[str, Any]) -> dict[str, Any]:
    # Stands for a transform's own work (parsing, validation, derived fields): about
    # 50 µs of Python per record, the order of decoding a change record from Spanner.
    text = dumps_line(row)
    digest = text
    for _ in range(120):
        digest = hashlib.sha256(digest + text).digest()
    parsed = orjson.loads(text)
    return {**parsed, "size": len(text), "digest": digest.hex()[:16]}


def data_pipeline(name: str, stream: ScriptedChangeStream, end: int, out: str) -> Pipeline:
    pipeline = Pipeline(name)
    (
        pipeline
        | DetectPartitions(stream=stream.stream, start_at=stream.origin, end_at=end, client=stream)
        | ReadPartition(heartbeat="1s")
        | "row" >> Map(_to_row)
        | "enrich" >> Map(_enrich)
        | "not deleted" >> Filter(lambda row: row["type"] != "DELETE")
        | WriteFiles(out, fsync=False)
    )
    return pipeline


def data_stream(records: int, partitions: int, span_s: int) -> ScriptedChangeStream:
    origin = 1_704_067_200 * _S
    stream = ScriptedChangeStream("Orders", partitions=partitions, buckets=64, origin=origin)
    step = span_s * _S // records
    for i in range(records):
        stream.write(
            "Orders",
            {"order_id": i},
            "INSERT",
            {"customer": f"customer-{i % 997}", "total": i * 0.25, "status": "NEW"},
            at=origin + 1 + i * step,
        )
    return stream


def throughput(
    runner: Runner, label: str, stream: ScriptedChangeStream, span_s: int, batch_span_s: float
) -> ThroughputResult:
    """Steady-state records/s over the data batches after the first one."""
    end = stream.origin + span_s * _S
    with tempfile.TemporaryDirectory(prefix="cdcflow-bench-tp-") as out:
        name = "bench-tp-" + label.replace("[", "-").rstrip("]")
        pipeline = data_pipeline(name, stream, end, out)
        options = RunOptions(batch_interval=0, max_batch_span=batch_span_s)
        stats = _run(pipeline, runner, options)
    data = [s for s in stats if s.records > 0][1:]
    return ThroughputResult(
        label, sum(s.records for s in data), sum(s.seconds for s in data), len(data)
    )


def _spark(master: str) -> Runner:
    from cdcflow.spark.runner import SparkRunner

    return SparkRunner(master)


def _timed(what: str, fn: Callable[[], Any]) -> Any:
    began = time.monotonic()
    result = fn()
    print(f"  ({what}: {time.monotonic() - began:.1f}s)", file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_spark", description=__doc__)
    parser.add_argument("--idle-batches", type=positive_int, default=30)
    parser.add_argument("--records", type=positive_int, default=128_000)
    parser.add_argument("--partitions", type=positive_int, default=8)
    parser.add_argument("--batches", type=positive_int, default=4, help="data batches per run")
    parser.add_argument("--no-cluster", dest="cluster", action="store_false",
                        help="skip the local-cluster runs (separate executor JVMs)")
    args = parser.parse_args(argv)
    span_s = 60
    batch_span = span_s / args.batches
    began = time.monotonic()
    print("bench_spark: Spark per-batch overhead and executor scaling", flush=True)
    print(f"  cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}", flush=True)

    idle_mem = _timed(
        "memory idle", lambda: idle_batches(InMemoryRunner(), "memory", args.idle_batches)
    )
    stream = data_stream(args.records, args.partitions, span_s)
    tp_mem = _timed(
        "memory throughput",
        lambda: throughput(InMemoryRunner(workers=1), "memory", stream, span_s, batch_span),
    )

    def spark_two() -> tuple[IdleResult, ThroughputResult]:
        # One session for both runs: a runner uses the active session and leaves it open.
        holder = _spark("local[2]")
        holder.open("bench-spark")
        try:
            idle = idle_batches(_spark("local[2]"), "spark local[2]", args.idle_batches)
            tp = throughput(_spark("local[2]"), "local[2]", stream, span_s, batch_span)
        finally:
            holder.close()
        return idle, tp

    idle_spark, tp2 = _timed("spark local[2]", spark_two)
    tp1 = _timed(
        "spark local[1]",
        lambda: throughput(_spark("local[1]"), "local[1]", stream, span_s, batch_span),
    )

    clusters: list[tuple[str, ThroughputResult]] = []
    if args.cluster:
        # Separate executor JVMs, each with its own Python workers: executors, not slots.
        for n in (1, 2):
            master = f"local-cluster[{n},1,1024]"

            def cluster_run(master: str = master, n: int = n) -> ThroughputResult:
                return throughput(_spark(master), f"cluster-{n}", stream, span_s, batch_span)

            name = f"Spark {master} ({n} executor{'s' if n > 1 else ''})"
            clusters.append((name, _timed(master, cluster_run)))

    print()
    print("idle batch (4 partitions, no data)   median      p90   batches")
    for r in (idle_mem, idle_spark):
        print(f"  {r.runner:<34} {r.median_ms:7.1f} ms {r.p90_ms:6.1f} ms {r.batches:6d}")
    print(
        f"  Spark adds {idle_spark.median_ms - idle_mem.median_ms:.1f} ms per batch (median); "
        f"target <= 150 ms: {'met' if idle_spark.median_ms <= 150 else 'MISSED'}"
    )
    print()
    print(
        f"throughput ({args.partitions} partitions, {args.records} records, steady state)"
        "   records/s   records   seconds"
    )
    for name, t in (
        ("in-memory runner, 1 thread (reference)", tp_mem),
        ("Spark local[1] (1 executor slot)", tp1),
        ("Spark local[2] (2 executor slots)", tp2),
        *clusters,
    ):
        print(f"  {name:<46} {t.per_second:9.0f} {t.records:9d} {t.seconds:9.2f}")
    ratio = tp2.per_second / tp1.per_second if tp1.per_second else 0.0
    print(
        f"  2 slots / 1 slot: {ratio:.2f}x; target >= 1.7x: {'met' if ratio >= 1.7 else 'MISSED'}"
    )
    if clusters:
        one, two = clusters[0][1].per_second, clusters[1][1].per_second
        ratio = two / one if one else 0.0
        print(
            f"  2 executors / 1 executor: {ratio:.2f}x; target >= 1.7x: "
            f"{'met' if ratio >= 1.7 else 'MISSED'}"
        )
    print(f"\nbench_spark took {time.monotonic() - began:.0f}s", flush=True)


if __name__ == "__main__":
    main()
