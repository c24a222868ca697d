"""End to end on the real Cloud Spanner emulator, through the public CLI.

A workload commits inserts, updates and deletes (single- and multi-row transactions) while
the emulator splits and merges partitions every 2-4 s; `cdcflow run` with `end_at` writes
JSONL; every committed change must appear exactly once, and each key's changes in commit
order. Covered: both dialects, every value capture type, the SQLite and the Spanner store,
runs SIGKILLed and restarted, and the Spark runner (local-cluster: separate executor JVMs).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import Workload
from tests.e2e_helpers import (
    Case,
    check_exactly_once,
    committed_batches,
    end_after,
    partitions_read,
    run_workload,
)

pytestmark = pytest.mark.emulator


@pytest.mark.parametrize(
    ("dialect", "capture", "store"),
    [
        ("GOOGLE_STANDARD_SQL", "OLD_AND_NEW_VALUES", "sqlite"),
        ("GOOGLE_STANDARD_SQL", "NEW_VALUES", "spanner"),
        ("GOOGLE_STANDARD_SQL", "NEW_ROW", "sqlite"),
        ("GOOGLE_STANDARD_SQL", "NEW_ROW_AND_OLD_VALUES", "spanner"),
        ("POSTGRESQL", "OLD_AND_NEW_VALUES", "spanner"),
        ("POSTGRESQL", "NEW_ROW", "sqlite"),
    ],
)
def test_every_change_exactly_once_in_key_order(
    spanner_emulator: Emulator, tmp_path: Path, dialect: str, capture: str, store: str
) -> None:
    case = Case(spanner_emulator, tmp_path, dialect=dialect, capture=capture, store=store)
    workload, start = run_workload(case, seconds=6)
    case.window(start, end_after(workload))
    case.run()
    assert check_exactly_once(case, workload) > 30
    assert partitions_read(case) >= 2


def _run_with_kills(case: Case, kills: int, *extra: str, progress: int = 2) -> int:
    """Start the run and SIGKILL it (with everything it started) ``kills`` times, each time
    once ``progress`` more batches have committed plus a random moment into the next one;
    then let a last run finish. Returns how many runs were killed mid-run."""
    rng = random.Random(7)
    killed = 0
    for _ in range(kills):
        before = committed_batches(case) if case.state_file.exists() else 0
        proc = subprocess.Popen(
            case.command(*extra), env=case.env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if case.state_file.exists() and committed_batches(case) >= before + progress:
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.5))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            killed += 1
        proc.wait(30)
    case.run(*extra)
    return killed


def test_sigkilled_runs_resume_without_loss_or_duplicates(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    case = Case(spanner_emulator, tmp_path)
    start = Timestamp.now()
    workload = Workload(case.database, rate=15, seed=11)
    thread = workload.start(seconds=12)
    # The pipeline reads live while the workload commits, up to a bound in the near future.
    case.window(start, Timestamp.from_ns(start.ns + 14_000_000_000))
    try:
        killed = _run_with_kills(case, 4, "--set", "max_batch_span=1s")
    finally:
        workload.stop()
    assert not thread.is_alive()
    assert killed == 4
    assert check_exactly_once(case, workload) > 50


@pytest.mark.spark
def test_spark_local_cluster_driver_sigkilled_resumes_exactly_once(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    """Executors in their own JVMs and Python workers (local-cluster mode); the kill takes
    the driver with everything it started."""
    case = Case(spanner_emulator, tmp_path)
    workload, start = run_workload(case, seconds=8)
    case.window(start, end_after(workload))
    killed = _run_with_kills(case, 1, "--runner", "spark", "--master", "local-cluster[2,1,1024]",
                             "--set", "max_batch_span=500ms")
    assert killed == 1
    assert check_exactly_once(case, workload) > 50
