"""Commit-to-sink latency and idle cost: ``cdcflow run`` with the default 1 s batches and
with ``--latency low``, side by side on the demo's workload.

A Cloud Spanner emulator (started here, partitions splitting and merging every 3-6 s, as in
``make demo``) holds the shop database. For each preset, in turn:

* **busy**: the demo's workload commits ``--rate`` transactions per second while
  ``cdcflow run examples/quickstart.py --latency PRESET`` reads for ``--seconds``; every
  output row's latency is the time from its commit in Spanner (its commit timestamp) to the
  store commit of the batch that delivered it (the batch log's ``committed_at``: the sinks
  had committed it just before). Printed: p50, p99 and max over the changes committed once
  the run was up (after its first batch committed; the ones committed while the process
  started wait for its start-up, which says nothing of the preset).
* **idle**: the same pipeline over the same stream with nothing being written, for
  ``--idle`` seconds: the run's CPU time (user + system, from the kernel's accounting of the
  finished child process) less that of a run of one batch (start-up and shut-down), per
  second of wall time between the two.

Targets: with ``--latency low``, p50 <= 0.3 s and p99 <= 1 s.

``python -m bench.bench_latency [--seconds S] [--idle S] [--rate TPS]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._args import positive_float
from cdcflow.demo import read_output
from cdcflow.metadata import open_store
from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import Workload, create_shop_database

__all__ = ["main"]

_ROOT = Path(__file__).resolve().parents[1]
_PIPELINE = _ROOT / "examples" / "quickstart.py"
_NAME = "quickstart-orders"  # the quickstart pipeline's name


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _run(emulator: Emulator, database: str, preset: str, seconds: float, work: Path,
         tag: str, *limit: str) -> tuple[float, Path, str]:
    """``cdcflow run`` for ``seconds`` from now (or as ``limit`` says); (its CPU seconds,
    output dir, store URL)."""
    out = work / f"{tag}-{preset}"
    store_url = f"sqlite:///{work / f'{tag}-{preset}.db'}"
    env = {**os.environ, "SPANNER_EMULATOR_HOST": emulator.host, "CDCFLOW_DATABASE": database,
           "CDCFLOW_START_AT": Timestamp.now().rfc3339(), "CDCFLOW_OUT": str(out)}
    env.pop("CDCFLOW_END_AT", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [sys.executable, "-m", "cdcflow", "run", str(_PIPELINE), "--metadata", store_url,
         *(limit or ("--for", f"{seconds}s")), "--latency", preset],
        env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, out, store_url


def _latencies(out: Path, store_url: str) -> tuple[list[float], int]:
    """Latencies of the changes committed once the run was up (after its first batch
    committed), and how many changes it delivered in all. The changes committed while the
    process started (the interpreter, the store, the first query) wait for it, which says
    nothing of the steady state the presets are about."""
    rows, _ = read_output(out)
    store = open_store(store_url)
    try:
        committed = {b.batch_id: b.committed_at for b in store.batches(_NAME, limit=100_000)}
    finally:
        store.close()
    up = min((at for at in committed.values() if at is not None), default=0)
    lags = [(committed[b] - change[3]) / 1e9 for b, change in rows
            if committed.get(b) is not None and change[3] > up]
    return lags, len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_latency",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=positive_float, default=30.0, help="busy run length")
    parser.add_argument("--idle", type=positive_float, default=15.0, help="idle run length")
    parser.add_argument("--rate", type=positive_float, default=20.0,
                        help="transactions per second")
    args = parser.parse_args()
    print(f"bench_latency: the demo workload ({args.rate:g} transactions/s) for "
          f"{args.seconds:g} s per preset; idle runs of {args.idle:g} s", flush=True)
    print(f"  cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}", flush=True)
    emulator = Emulator(partition_alive_seconds=3).start()
    try:
        db = create_shop_database(emulator)
        database = emulator.database_path("shop")
        rows = []
        with tempfile.TemporaryDirectory(prefix="bench-latency-") as tmp:
            work = Path(tmp)
            for preset in ("normal", "low"):
                workload = Workload(db, rate=args.rate, seed=7)
                workload.start()
                try:
                    _, out, url = _run(emulator, database, preset, args.seconds, work, "busy")
                finally:
                    workload.stop()
                lags, delivered = _latencies(out, url)
                # idle: CPU per second of a run with nothing to read, less what a run of
                # one batch costs (start-up, store, lease, the first query, shut-down)
                began = time.monotonic()
                base_cpu, _, _ = _run(emulator, database, preset, 0, work, "once",
                                      "--max-batches", "1")
                base_wall, began = time.monotonic() - began, time.monotonic()
                cpu, _, _ = _run(emulator, database, preset, args.idle, work, "idle")
                wall = time.monotonic() - began
                idle = max(0.0, cpu - base_cpu) / max(wall - base_wall, 1e-9)
                rows.append((preset, lags, delivered, idle))
        print("\n  preset   changes (timed)  commit->sink p50    p99    max   "
              "idle CPU (of one core)")
        for preset, lags, delivered, idle in rows:
            if not lags:
                print(f"  {preset:7} no output: the run delivered nothing")
                continue
            print(f"  {preset:7} {delivered:7,} ({len(lags):6,})  {statistics.median(lags):12.2f} s"
                  f" {_percentile(lags, 0.99):5.2f} s {max(lags):5.2f} s   {idle:6.1%}")
        low = next((lags for preset, lags, _, _ in rows if preset == "low"), [])
        if low:
            p50, p99 = statistics.median(low), _percentile(low, 0.99)
            verdict = "met" if p50 <= 0.3 and p99 <= 1.0 else "MISSED"
            print(f"  --latency low: target p50 <= 0.3 s and p99 <= 1 s: {verdict} "
                  f"(p50 {p50:.2f} s, p99 {p99:.2f} s)")
        print("  (idle CPU: a run with nothing to read, less a run of one batch: start-up and "
              "shut-down excluded)")
    finally:
        emulator.stop()


if __name__ == "__main__":
    main()
