"""Memory under a slow sink: peak RSS against the process's byte quota.

A backlog made while it is read (:class:`bench._backlog.LazyBacklog`: 4 partitions, 64 KiB
of payload per record, 1 GB in all by default) runs through ``ReadPartition(max_inflight=
256)``, a Map that stalls on every 512th record (the records after it complete and wait
behind it, in order) and a sink that takes 1 ms per element and keeps nothing, on the
in-memory runner with 4 threads. Each quota runs in a fresh process, which prints its
baseline RSS (after imports), its peak RSS (VmHWM), and the quota's own peak of held
bytes. Target: peak RSS <= quota + 200 MB for a 1 GB backlog.

Then the same backlog at a 32 MiB quota goes into sinks that keep elements after
``write``: WriteFiles (Parquet: a file per task, its rows spilled past 2 MiB, less when
more writers are open in the process; with 4 tasks, then 8 and 16),
``Consume(max_inflight=16)`` (a 1 ms call: its queue stays charged to the quota) and
WriteTables (Parquet on local disk, ``spool_memory=32MiB``: its memory is the quota plus
its spool, so that line prints peak RSS - quota - spool_memory). Each counts what it wrote
or called.

``python -m bench.bench_memory [--mb N] [--quotas 256,32,8]``; ``CDCFLOW_BENCH_BACKLOG_MB``
sets the default backlog size (e.g. 128 for a quick run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from bench._args import from_env, int_list, positive_int

_S = 1_000_000_000
_MB = 1 << 20
_PAYLOAD = 64 << 10
_PARTITIONS = 4
_MAX_INFLIGHT = 256
_SINK_DELAY = 0.001
_STALL_EVERY = 512
_STALL = 0.05
_SPOOL_MEMORY = 32 << 20


def _same(record: Any) -> Any:
    return record


def _rss(field: str) -> int:
    """A VmRSS/VmHWM line of /proc/self/status, in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _SlowWriter:
    def __init__(self) -> None:
        self._count = 0

    def write(self, element: Any) -> None:
        time.sleep(_SINK_DELAY)
        self._count += 1

    def close(self) -> int:
        return self._count

    def abort(self) -> None:
        return None


def _stall(record: Any) -> Any:
    body = record.mods[0].new_values["body"]
    if int(body[:16]) % _STALL_EVERY == 0:
        time.sleep(_STALL)
    return record  # the whole record goes on: its payload is what the sink takes


def _call(record: Any) -> None:
    time.sleep(_SINK_DELAY)


def _row(record: Any) -> dict[str, Any]:
    return {"id": record.mods[0].keys["id"], "body": record.mods[0].new_values["body"]}


def _child(mb: int, quota_mb: int, sink_name: str, tasks: int = _PARTITIONS
           ) -> dict[str, Any]:
    """One run in this process into ``sink_name`` (slow, files, consume, tables), over
    ``tasks`` partitions read by as many workers; what it measured."""
    import cdcflow as cf
    from bench._backlog import LazyBacklog
    from cdcflow.engine.loop import Engine, RunOptions
    from cdcflow.engine.quota import process_quota
    from cdcflow.metadata import MemoryStore
    from cdcflow.processes import choose_arrow_pool, tune_malloc
    from cdcflow.runners.in_memory import InMemoryRunner

    tune_malloc()  # as `cdcflow run` does
    choose_arrow_pool()
    from cdcflow.transforms import (
        Consume,
        DetectPartitions,
        Map,
        ReadPartition,
        Sink,
        WriteFiles,
        WriteTables,
    )

    class SlowSink(Sink[Any, int]):
        def __init__(self) -> None:
            self.count = 0

        def open_writer(self, ctx: Any) -> _SlowWriter:
            return _SlowWriter()

        def commit(self, batch_id: int, messages: Sequence[int]) -> None:
            self.count += sum(messages)

    records = max(1, mb * _MB // (_PAYLOAD * tasks))
    origin = 1_704_067_200 * _S
    backlog = LazyBacklog("Backlog", partitions=tasks, records=records,
                          payload=_PAYLOAD, origin=origin, span_ns=60 * _S)
    out = tempfile.mkdtemp(prefix="cdcflow-bench-memory-")
    sink: Any = {
        "tables": lambda: WriteTables(out, format="parquet", spool_memory=_SPOOL_MEMORY),
        "files": lambda: WriteFiles(out, format="parquet"),
        "consume": lambda: Consume(_call, max_inflight=16),
        "slow": SlowSink,
    }[sink_name]()
    p = cf.Pipeline("bench-memory")
    (p
     | DetectPartitions(stream="Backlog", start_at=origin, end_at=backlog.end, client=backlog)
     | ReadPartition(heartbeat="1s", max_inflight=_MAX_INFLIGHT,
                     max_inflight_bytes=quota_mb * _MB)
     | Map({"slow": _stall, "files": _row}.get(sink_name, _same))
     | sink)
    base = _rss("VmRSS")
    began = time.monotonic()
    # one batch per partition slice: the whole backlog is one slice of each partition
    opts = RunOptions(batch_interval=0, max_batch_span=3600.0)
    Engine(p, MemoryStore(), InMemoryRunner(workers=tasks), opts).run()
    stats = process_quota().stats()
    if sink_name in ("tables", "files"):
        import pyarrow.dataset as ds

        where = f"{out}/Backlog" if sink_name == "tables" else out
        count = ds.dataset(where, format="parquet").count_rows()
    elif sink_name == "consume":
        count = sink.stats().acked
    else:
        count = sink.count
    shutil.rmtree(out, ignore_errors=True)
    return {
        "records": count, "expected": records * tasks,
        "backlog": backlog.total_bytes, "quota": stats.limit, "quota_peak": stats.peak,
        "waits": stats.waits, "base_rss": base, "peak_rss": _rss("VmHWM"),
        "seconds": time.monotonic() - began,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_memory", description=__doc__)
    parser.add_argument("--mb", type=positive_int,
                        help="backlog payload in MiB (default: CDCFLOW_BENCH_BACKLOG_MB, "
                             "else 1024)")
    parser.add_argument("--quotas", type=int_list, default="256,32,8",
                        help="quotas in MiB, one run each")
    parser.add_argument("--child", type=positive_int, help=argparse.SUPPRESS)
    parser.add_argument("--sink", default="slow", help=argparse.SUPPRESS)
    parser.add_argument("--tasks", type=positive_int, default=_PARTITIONS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mb is None:
        args.mb = from_env(parser, "CDCFLOW_BENCH_BACKLOG_MB", "1024", positive_int)
    if args.child is not None:
        print(json.dumps(_child(args.mb, args.child, args.sink, args.tasks)))
        return
    print(f"bench_memory: a slow sink (1 ms per element) facing a {args.mb} MiB backlog "
          f"({_PARTITIONS} partitions, {_PAYLOAD >> 10} KiB records, "
          f"max_inflight={_MAX_INFLIGHT})", flush=True)
    print(f"  {'quota':>9} {'quota peak':>11} {'waits':>7} {'base RSS':>9} {'peak RSS':>9} "
          f"{'RSS - quota':>12} {'records':>8} {'seconds':>8}  target: peak RSS <= quota + 200 MB")
    for quota_mb in args.quotas:
        r = _run(args.mb, quota_mb)
        over, verdict = _judged(r)
        print(f"  {r['quota'] / _MB:7.0f} MiB {r['quota_peak'] / _MB:7.1f} MiB {r['waits']:7d} "
              f"{r['base_rss'] / 1e6:6.0f} MB {r['peak_rss'] / 1e6:6.0f} MB {over:9.0f} MB "
              f"{r['records']:8d} {r['seconds']:8.1f}  {verdict}", flush=True)
    for sink_name, title in (("files", "WriteFiles (parquet)"),
                             ("consume", "Consume(max_inflight=16)")):
        r = _run(args.mb, 32, "--sink", sink_name)
        over, verdict = _judged(r)
        print(f"  {title}, quota {r['quota'] / _MB:.0f} MiB: peak RSS {r['peak_rss'] / 1e6:.0f} "
              f"MB (base {r['base_rss'] / 1e6:.0f} MB), RSS - quota {over:.0f} MB, "
              f"{r['records']} in {r['seconds']:.1f} s  target: <= 200 MB  {verdict}",
              flush=True)
    for tasks in (8, 16):  # the Parquet writers of a process share one spill budget
        r = _run(args.mb, 32, "--sink", "files", "--tasks", str(tasks))
        over, verdict = _judged(r)
        print(f"  WriteFiles (parquet), {tasks} tasks, quota {r['quota'] / _MB:.0f} MiB: peak "
              f"RSS {r['peak_rss'] / 1e6:.0f} MB, RSS - quota {over:.0f} MB, {r['records']} "
              f"in {r['seconds']:.1f} s  target: <= 200 MB  {verdict}", flush=True)
    r = _run(args.mb, 32, "--sink", "tables")
    over, verdict = _judged(r, _SPOOL_MEMORY)
    print(f"  WriteTables (parquet, spool_memory {_SPOOL_MEMORY >> 20} MiB), quota "
          f"{r['quota'] / _MB:.0f} MiB: peak RSS {r['peak_rss'] / 1e6:.0f} MB (base "
          f"{r['base_rss'] / 1e6:.0f} MB), RSS - quota - spool_memory {over:.0f} MB, "
          f"{r['records']} rows in {r['seconds']:.1f} s  target: <= 200 MB  {verdict}",
          flush=True)


def _judged(r: dict[str, Any], spool: int = 0) -> tuple[float, str]:
    """(peak RSS - quota - ``spool`` in MB, the verdict against the 200 MB target)."""
    over = (r["peak_rss"] - r["quota"] - spool) / 1e6
    if r["records"] != r["expected"]:
        return over, f"WRONG: {r['records']} of {r['expected']} records"
    return over, "met" if over <= 200 else "MISSED"


def _run(mb: int, quota_mb: int, *flags: str) -> dict[str, Any]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_memory", "--mb", str(mb), "--child", str(quota_mb),
         *flags],
        check=True, capture_output=True, text=True, cwd=here,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    main()
