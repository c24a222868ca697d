"""``make demo`` (``python -m cdcflow.demo``): cdcflow end to end on the local emulator.

1. Start the Cloud Spanner emulator with fast partition churn (partitions split and merge
   every few seconds) and create the ``shop`` database (:mod:`cdcflow.spanner.workload`).
2. Commit random changes from a background thread, recording each committed change.
3. Run ``cdcflow run examples/quickstart.py --for 30s`` as a subprocess (live progress),
   serving Prometheus metrics on a free port (the URL is printed; the demo scrapes it once
   mid-run and shows a few values in its summary).
4. Compare: every change committed before the output's resolved watermark must be in the
   output exactly once, and nothing else may be there. Print a summary; exit 0 if the
   check passes, 1 if not.

No Docker; about a minute. Output and state go to ``examples/out/`` (recreated each time).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from cdcflow.cli import EXIT_INTERRUPTED
from cdcflow.model import INITIAL_PARTITION_TOKEN, Timestamp
from cdcflow.spanner.workload import Workload, create_shop_database

__all__ = ["ChangeKey", "check_exactly_once", "main", "read_output"]

#: (table, primary key as sorted (column, text) pairs, mod type, commit timestamp in ns)
ChangeKey = tuple[str, tuple[tuple[str, str], ...], str, int]

_PIPELINE_NAME = "quickstart-orders"


def _say(text: str) -> None:
    print(f"==> {text}", flush=True)


def _key(table: str, keys: Mapping[str, Any], op: str, ts_ns: int) -> ChangeKey:
    # Spanner's JSON renders INT64 as text; compare every key value as text.
    return table, tuple(sorted((k, str(v)) for k, v in keys.items())), op, ts_ns


def read_output(directory: Path) -> tuple[list[tuple[int, ChangeKey]], int | None]:
    """(batch id, change) for every row of the committed JSONL files, and the resolved
    watermark WriteFiles recorded (None if no batch committed)."""
    rows: list[tuple[int, ChangeKey]] = []
    for path in sorted(directory.glob("*.jsonl")):
        batch_id = int(path.name.split("-")[1])
        for line in path.read_text().splitlines():
            r = json.loads(line)
            ts = Timestamp.parse(r["commit_timestamp"]).ns
            rows.append((batch_id, _key(r["table"], r["keys"], r["op"], ts)))
    marker = directory / "_watermark.json"
    watermark = int(json.loads(marker.read_text())["ns"]) if marker.exists() else None
    return rows, watermark


def check_exactly_once(
    committed: Iterable[ChangeKey], read: Iterable[ChangeKey], watermark: int
) -> list[str]:
    """Problems found (empty: exactly once). Changes committed before ``watermark`` must be
    read exactly once; later ones at most once; nothing may be read that was not committed."""
    want = Counter(committed)
    got = Counter(read)
    problems = []
    missing = [c for c in want if c[3] < watermark and got[c] == 0]
    duplicated = [c for c, n in got.items() if n > 1]
    unknown = [c for c in got if c not in want]
    for label, items in (("missing", missing), ("read twice or more", duplicated),
                         ("read but never committed", unknown)):
        if items:
            sample = ", ".join(str(c) for c in sorted(items)[:3])
            problems.append(f"{len(items)} changes {label} (e.g. {sample})")
    return problems


def _splits_and_merges(parents: Mapping[str, Sequence[str]]) -> tuple[int, int]:
    """From child token -> parent tokens: parents with 2+ children, children with 2+ parents."""
    children: Counter[str] = Counter()
    merges = 0
    for parent_tokens in parents.values():
        real = [p for p in parent_tokens if p != INITIAL_PARTITION_TOKEN]
        merges += len(real) >= 2
        children.update(real)
    return sum(1 for n in children.values() if n >= 2), merges


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _free_port() -> int:
    # The run binds it a moment later; a race with another program is possible but rare,
    # and the run then fails with a one-line error naming the port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


#: The metrics the demo's summary shows, and how to print each.
_SHOWN = {
    "cdcflow_records_read_total": "{:,.0f} records read",
    "cdcflow_low_watermark_lag_seconds": "lag {:.2f} s",
    "cdcflow_splits_total": "{:.0f} splits",
    "cdcflow_stuck_partitions": "{:.0f} stuck partitions",
}


def _scrape(url: str) -> dict[str, float]:
    """The demo's metrics of interest, read from a scrape (empty if it fails)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in _SHOWN
    }


def _wait_and_scrape(proc: subprocess.Popen[bytes], url: str, at: float) -> dict[str, float]:
    """Wait for ``proc``; ``at`` seconds in (if it still runs), scrape ``url`` once."""
    deadline = time.monotonic() + at
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    scraped = _scrape(url) if proc.poll() is None else {}
    proc.wait()
    return scraped


def _repo_root() -> Path:
    here = Path(__file__).resolve().parents[1]
    if (here / "examples" / "quickstart.py").is_file():
        return here
    return Path.cwd()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cdcflow.demo", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the run lasts")
    parser.add_argument("--rate", type=float, default=20.0,
                        help="workload transactions per second (default 20)")
    parser.add_argument("--runner", default="memory", help="cdcflow runner (memory or spark)")
    parser.add_argument("--latency", choices=("normal", "low"), default="normal",
                        help="cdcflow run --latency preset (low: 200ms batches)")
    parser.add_argument("--partition-alive-seconds", type=int, default=3,
                        help="emulator partition lifetime: split/merge every N..2N s")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    from cdcflow.metadata import open_store
    from cdcflow.spanner.emulator import Emulator

    args = _parse_args(argv)
    root = _repo_root()
    pipeline_file = root / "examples" / "quickstart.py"
    work = root / "examples" / "out" / "demo"
    out_dir, state = work / "orders", work / "state.db"
    work.parent.mkdir(parents=True, exist_ok=True)
    lock = (work.parent / ".demo.lock").open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        _say(f"another demo is running in {work.parent}; wait for it to finish")
        return 1
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    store_url = f"sqlite:///{state}"

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds through the finally below: nothing left running

    signal.signal(signal.SIGTERM, terminate)
    _say(f"starting the Cloud Spanner emulator (partitions split and merge every "
         f"{args.partition_alive_seconds}-{2 * args.partition_alive_seconds} s)")
    emulator = Emulator(partition_alive_seconds=args.partition_alive_seconds).start()
    workload: Workload | None = None
    try:
        _say(f"emulator on {emulator.host}; creating the shop database")
        database = create_shop_database(emulator)
        database_path = emulator.database_path("shop")
        workload = Workload(database, rate=args.rate)
        start_at = Timestamp.now()  # after the stream exists: reading may start no earlier
        workload.start()
        _say(f"workload committing ~{args.rate:g} transactions/s; running "
             f"`cdcflow run examples/quickstart.py --for {args.seconds:g}s`")
        env = {
            **os.environ,
            "SPANNER_EMULATOR_HOST": emulator.host,
            "CDCFLOW_DATABASE": database_path,
            "CDCFLOW_START_AT": start_at.rfc3339(),
            "CDCFLOW_OUT": str(out_dir),
        }
        env.pop("CDCFLOW_END_AT", None)
        port = _free_port()
        metrics_url = f"http://127.0.0.1:{port}/metrics"
        _say(f"metrics at {metrics_url} while the run lasts (Prometheus text format)")
        began = time.monotonic()
        # Ctrl-C reaches the run too (same process group): it stops after its current
        # batch, and the demo goes on to check what was read. The no-op handler (not
        # SIG_IGN, which the child would inherit) keeps the demo alive meanwhile.
        previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
        try:
            run = subprocess.Popen(
                [sys.executable, "-m", "cdcflow", "run", str(pipeline_file), "--runner",
                 args.runner, "--metadata", store_url, "--for", f"{args.seconds}s", "--reset",
                 "--metrics-port", str(port), "--latency", args.latency],
                env=env,
            )
            scraped = _wait_and_scrape(run, metrics_url, at=args.seconds * 0.7)
        finally:
            signal.signal(signal.SIGINT, previous)
        run_seconds = time.monotonic() - began
        workload.stop()
        if run.returncode not in (0, EXIT_INTERRUPTED):
            _say(f"cdcflow run exited with {run.returncode}; the demo failed")
            return 1

        committed = [_key(c.table, c.keys, c.mod_type, c.commit_ns) for c in workload.changes]
        rows, watermark = read_output(out_dir)
        store = open_store(store_url)
        try:
            parts = store.partitions(_PIPELINE_NAME)
            batches = {b.batch_id: b for b in store.batches(_PIPELINE_NAME, limit=100_000)}
        finally:
            store.close()
        if watermark is None:
            _say("no batch committed any output; the demo failed")
            return 1
        splits, merges = _splits_and_merges({p.token: p.parent_tokens for p in parts})
        lags = [
            (batches[b].committed_at - change[3]) / 1e9  # type: ignore[operator]
            for b, change in rows
            if b in batches and batches[b].committed_at is not None
        ]
        before = sum(1 for c in committed if c[3] < watermark)
        problems = check_exactly_once(committed, (c for _, c in rows), watermark)

        print()
        _say("summary")
        print(f"  changes committed     {len(committed):,} (in {workload.transactions:,} "
              f"transactions over {run_seconds:.0f} s)")
        print(f"  changes read          {len(rows):,} (the check covers the {before:,} "
              "committed before the resolved watermark)")
        print(f"  resolved watermark    {Timestamp.from_ns(watermark).rfc3339()}")
        print(f"  partitions            {len(parts)} seen: {splits} split, {merges} merged")
        if lags:
            print(f"  end-to-end lag        p50 {statistics.median(lags):.2f} s, "
                  f"p99 {_percentile(lags, 0.99):.2f} s, max {max(lags):.2f} s "
                  "(commit in Spanner -> batch committed)")
        print(f"  output                {out_dir}/*.jsonl ({len(list(out_dir.glob('*.jsonl')))}"
              " files)")
        print(f"  progress              cdcflow status --metadata {store_url}")
        if scraped:
            shown = ", ".join(fmt.format(scraped[name]) for name, fmt in _SHOWN.items()
                              if name in scraped)
            print(f"  metrics (mid-run)     {shown} (from {metrics_url})")
        if problems:
            _say("CHECK FAILED: " + "; ".join(problems))
            return 1
        _say(f"check passed: all {before:,} changes committed before the watermark were read "
             "exactly once, and nothing else")
        return 0
    finally:
        if workload is not None:
            with contextlib.suppress(Exception):  # already stopped, or its error was raised
                workload.stop()
        emulator.stop()
        lock.close()


if __name__ == "__main__":
    sys.exit(main())
