"""Shared by the end-to-end tests (tests/test_e2e_emulator.py) and the fault-injection
suite (tests/faults): a shop database on the emulator, a pipeline file that reads its
change stream into JSONL through the public CLI, and the exactly-once check against the
workload's ground truth."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cdcflow.metadata import open_store
from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import SHOP_KEY, SHOP_STREAM, Workload, create_shop_database

__all__ = [
    "PIPELINE",
    "Case",
    "check_exactly_once",
    "committed_batches",
    "end_after",
    "in_window",
    "partitions_read",
    "run_workload",
    "unique",
]

#: The pipeline every case runs: the whole stream into JSONL files. E2E_QUERY_TIMEOUT sets
#: the change-stream query deadline (the default is DetectPartitions' own, 10 minutes).
PIPELINE = """
import os
import cdcflow as cf
from cdcflow.transforms import DetectPartitions, ReadPartition, WriteFiles

pipeline = cf.Pipeline(os.environ["E2E_NAME"])
(pipeline
 | DetectPartitions(database=os.environ["E2E_DB"], stream=os.environ["E2E_STREAM"],
                    start_at=os.environ["E2E_START"], end_at=os.environ["E2E_END"],
                    query_timeout=os.environ.get("E2E_QUERY_TIMEOUT", "10m"))
 | ReadPartition(heartbeat="250ms")
 | WriteFiles(os.environ["E2E_OUT"], format="jsonl"))
"""

_FILE = re.compile(r"part-(\d+)-[0-9a-f]+\.jsonl$")
_counter = iter(range(1_000_000))


def unique(prefix: str) -> str:
    """A database or pipeline name not used before in this test session."""
    return f"{prefix}{os.getpid() % 1000}x{next(_counter)}"


class Case:
    """A shop database, a pipeline file reading it, and helpers to run and check.

    ``env`` is the environment of ``cdcflow run``; its SPANNER_EMULATOR_HOST is the
    emulator's (a test may point it elsewhere, e.g. at a proxy). The database and the
    Spanner store's database are created directly on the emulator.
    """

    def __init__(
        self, emu: Emulator, tmp: Path, *, dialect: str = "GOOGLE_STANDARD_SQL",
        capture: str = "OLD_AND_NEW_VALUES", store: str = "sqlite",
    ) -> None:
        self.emu = emu
        self.name = unique("e2e")
        self.database = create_shop_database(emu, self.name, dialect, capture)  # type: ignore[arg-type]
        self.out = tmp / "out"
        self.file = tmp / "pipeline.py"
        self.file.write_text(PIPELINE)
        self.state_file = tmp / "state.db"  # the SQLite store's file (when store="sqlite")
        if store == "sqlite":
            self.store_url = f"sqlite:///{self.state_file}"
        else:
            self.store_url = f"spanner://{emu.database_path(unique('meta'))}"
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


def check_exactly_once(case: Case, workload: Workload) -> int:
    """Every change committed inside the run's window exactly once (a transaction the
    emulator committed after ``end_at`` is outside it, by definition); each key's changes in
    commit order. Returns how many changes were checked."""
    changes = in_window(case.env, workload.changes)
    expected: Counter[tuple[int, int, str]] = Counter(
        (int(c.keys[SHOP_KEY]), c.commit_ns, c.mod_type) for c in changes
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
    for change in changes:
        if change.mod_type == "INSERT":
            got = inserted[(int(change.keys[SHOP_KEY]), change.commit_ns)]
            assert got["Customer"] == change.new_values["Customer"]
            assert got["Status"] == change.new_values["Status"]
    return sum(expected.values())


class _Committed(Protocol):
    @property
    def commit_ns(self) -> int: ...


_C = TypeVar("_C", bound=_Committed)


def in_window(env: Mapping[str, str], committed: Iterable[_C]) -> list[_C]:
    """What was committed before the window's end (``E2E_END`` in ``env``): a run reads
    ``[start_at, end_at)``, and a workload's last transaction can commit after a window set
    before it ran (the emulator retries an aborted commit, a loaded machine is slow)."""
    end = Timestamp.parse(env["E2E_END"]).ns
    return [c for c in committed if c.commit_ns < end]


def run_workload(case: Case, seconds: float, rate: float = 15.0) -> tuple[Workload, Timestamp]:
    """Run a workload for ``seconds``; return it and the time at which it started."""
    start = Timestamp.now()
    workload = Workload(case.database, rate=rate, seed=random.randrange(1 << 30))
    workload.run(seconds=seconds)
    return workload, start


def end_after(workload: Workload) -> Timestamp:
    """A window end past every change the workload committed: now, or just after its last
    commit when that is later (under load the emulator's commit timestamps run a few ms
    ahead of the host's clock, so "now" taken right after a commit can precede it)."""
    last = max((c.commit_ns for c in workload.changes), default=0)
    return Timestamp.from_ns(max(Timestamp.now().ns, last + 1_000_000))


def partitions_read(case: Case) -> int:
    """How many partitions the output's records came from (more than one: churn was seen)."""
    return len({record["partition_token"] for _, _, record in case.output()})


def committed_batches(case: Case) -> int:
    """How many batches of the case's pipeline the store has committed (read directly,
    through this process's SPANNER_EMULATOR_HOST for a Spanner store)."""
    store = open_store(case.store_url)
    try:
        return sum(1 for b in store.batches(case.name, limit=100_000) if b.committed_at)
    finally:
        store.close()
