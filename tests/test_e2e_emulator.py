"""End to end on the real Cloud Spanner emulator, through the public CLI.

A workload commits inserts, updates and deletes (single- and multi-row transactions) while
the emulator splits and merges partitions every 2-4 s; `cdcflow run` with `end_at` writes
JSONL; every committed change must appear exactly once, and each key's changes in commit
order. Covered: both dialects, every value capture type, the SQLite and the Spanner store,
runs SIGKILLed and restarted, and the Spark runner (local-cluster: separate executor JVMs).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from cdcflow.metadata import open_store
from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import SHOP_KEY, SHOP_STREAM, Workload, create_shop_database

pytestmark = pytest.mark.emulator

PIPELINE = """
import os
import cdcflow as cf
from cdcflow.transforms import DetectPartitions, ReadPartition, WriteFiles

pipeline = cf.Pipeline(os.environ["E2E_NAME"])
(pipeline
 | DetectPartitions(database=os.environ["E2E_DB"], stream=os.environ["E2E_STREAM"],
                    start_at=os.environ["E2E_START"], end_at=os.environ["E2E_END"])
 | ReadPartition(heartbeat="250ms")
 | WriteFiles(os.environ["E2E_OUT"], format="jsonl"))
"""

_FILE = re.compile(r"part-(\d+)-[0-9a-f]+\.jsonl$")
_counter = iter(range(1_000_000))


def _unique(prefix: str) -> str:
    return f"{prefix}{os.getpid() % 1000}x{next(_counter)}"


class Case:
    """A shop database, a pipeline file reading it, and helpers to run and check."""

    def __init__(
        self, emu: Emulator, tmp: Path, *, dialect: str = "GOOGLE_STANDARD_SQL",
        capture: str = "OLD_AND_NEW_VALUES", store: str = "sqlite",
    ) -> None:
        self.emu = emu
        self.name = _unique("e2e")
        self.database = create_shop_database(emu, self.name, dialect, capture)  # type: ignore[arg-type]
        self.out = tmp / "out"
        self.file = tmp / "pipeline.py"
        self.file.write_text(PIPELINE)
        self.state_file = tmp / "state.db"  # the SQLite store's file (when store="sqlite")
        if store == "sqlite":
            self.store_url = f"sqlite:///{self.state_file}"
        else:
            self.store_url = f"spanner://{emu.database_path(_unique('meta'))}"
            emu.create_database(self.store_url.removeprefix("spanner://").split("/")[-1])
        self.env = dict(
            os.environ,
            SPANNER_EMULATOR_HOST=emu.host,
            E2E_NAME=self.name,
            E2E_DB=emu.database_path(self.name),
            E2E_STREAM=SHOP_STREAM if dialect == "GOOGLE_STANDARD_SQL" else SHOP_STREAM.lower(),
            E2E_OUT=str(self.out),
        )

    def window(self, start: Timestamp, end: Timestamp) -> None:
        self.env["E2E_START"] = start.rfc3339()
        self.env["E2E_END"] = end.rfc3339()

    def command(self, *extra: str) -> list[str]:
        return [
            sys.executable, "-m", "cdcflow", "run", str(self.file), "--metadata", self.store_url,
            "--batch-interval", "250ms", *extra,
        ]

    def run(self, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self.command(*extra), env=self.env, capture_output=True, text=True, timeout=timeout,
        )
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def output(self) -> list[tuple[int, int, dict[str, Any]]]:
        """(batch id, line number, record) for every written line, in file order."""
        rows = []
        for path in sorted(self.out.glob("*.jsonl")):
            m = _FILE.search(path.name)
            assert m, f"unexpected output file {path.name}"
            for i, line in enumerate(path.read_text().splitlines()):
                rows.append((int(m.group(1)), i, json.loads(line)))
        return rows


def _check_exactly_once(case: Case, workload: Workload) -> int:
    """Every committed change exactly once; each key's changes in commit order."""
    expected = Counter(
        (int(c.keys[SHOP_KEY]), c.commit_ns, c.mod_type) for c in workload.changes
    )
    seen: Counter[tuple[int, int, str]] = Counter()
    by_key: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    inserted: dict[tuple[int, int], dict[str, Any]] = {}
    for batch, line, record in case.output():
        ts = Timestamp.parse(record["commit_timestamp"]).ns
        for mod in record["mods"]:
            key = int(mod["keys"][SHOP_KEY])
            seen[(key, ts, record["mod_type"])] += 1
            by_key[key].append((batch, line, ts))
            if record["mod_type"] == "INSERT":
                inserted[(key, ts)] = mod["new_values"]
    lost = expected - seen
    extra = seen - expected
    assert not lost, f"{sum(lost.values())} changes lost, e.g. {list(lost)[:3]}"
    assert not extra, f"{sum(extra.values())} changes duplicated or unknown, e.g. {list(extra)[:3]}"
    for key, events in by_key.items():
        stamps = [ts for _, _, ts in sorted(events)]
        assert stamps == sorted(stamps), f"key {key}: changes out of commit order"
    # The decoded values are the committed ones (every capture type reports an insert's row).
    for change in workload.changes:
        if change.mod_type == "INSERT":
            got = inserted[(int(change.keys[SHOP_KEY]), change.commit_ns)]
            assert got["Customer"] == change.new_values["Customer"]
            assert got["Status"] == change.new_values["Status"]
    return sum(expected.values())


def _workload(case: Case, seconds: float, rate: float = 15.0) -> tuple[Workload, Timestamp]:
    """Run a workload for ``seconds``; return it and the time at which it started."""
    start = Timestamp.now()
    workload = Workload(case.database, rate=rate, seed=random.randrange(1 << 30))
    workload.run(seconds=seconds)
    return workload, start


def _partitions_read(case: Case) -> int:
    """How many partitions the output's records came from (more than one: churn was seen)."""
    return len({record["partition_token"] for _, _, record in case.output()})


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
    workload, start = _workload(case, seconds=6)
    case.window(start, Timestamp.now())
    case.run()
    assert _check_exactly_once(case, workload) > 30
    assert _partitions_read(case) >= 2


def _committed_batches(case: Case) -> int:
    store = open_store(case.store_url)
    try:
        return sum(1 for b in store.batches(case.name, limit=100_000) if b.committed_at)
    finally:
        store.close()


def _run_with_kills(case: Case, kills: int, *extra: str, progress: int = 2) -> int:
    """Start the run and SIGKILL it (with everything it started) ``kills`` times, each time
    once ``progress`` more batches have committed plus a random moment into the next one;
    then let a last run finish. Returns how many runs were killed mid-run."""
    rng = random.Random(7)
    killed = 0
    for _ in range(kills):
        before = _committed_batches(case) if case.state_file.exists() else 0
        proc = subprocess.Popen(
            case.command(*extra), env=case.env, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            if case.state_file.exists() and _committed_batches(case) >= before + progress:
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
    assert _check_exactly_once(case, workload) > 50


@pytest.mark.spark
def test_spark_local_cluster_exactly_once(spanner_emulator: Emulator, tmp_path: Path) -> None:
    case = Case(spanner_emulator, tmp_path)
    workload, start = _workload(case, seconds=5)
    case.window(start, Timestamp.now())
    case.run("--runner", "spark", "--master", "local-cluster[2,1,1024]", timeout=420)
    assert _check_exactly_once(case, workload) > 30


@pytest.mark.spark
def test_spark_driver_sigkilled_resumes_exactly_once(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    case = Case(spanner_emulator, tmp_path)
    workload, start = _workload(case, seconds=8)
    case.window(start, Timestamp.now())
    killed = _run_with_kills(case, 2, "--runner", "spark", "--master", "local[2]",
                             "--set", "max_batch_span=500ms")
    assert killed == 2
    assert _check_exactly_once(case, workload) > 50
