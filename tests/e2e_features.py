"""Shared by the end-to-end tests of snapshots, whole transactions, Consume and metrics
(tests/test_e2e_features_*.py): a database with the shop's ``Orders`` and two more tables
behind one change stream, a writer of multi-table transactions recording its ground truth,
and a pipeline file run through ``cdcflow run`` subprocesses that are SIGKILLed at random
moments and restarted.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from cdcflow.metadata import open_store
from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import SHOP_KEY, SHOP_TABLE, Workload, shop_ddl
from tests.e2e_helpers import unique

__all__ = [
    "FEATURE_STREAM",
    "Feature",
    "Key",
    "TableWriter",
    "Txn",
    "bulk_insert_orders",
    "create_feature_database",
    "workload_transactions",
]

FEATURE_STREAM = "AllStream"
#: (table, primary key value) of one changed row.
Key = tuple[str, int]
_FILE = re.compile(r"part-(\d+)-[0-9a-f]+\.jsonl$")
S = 1_000_000_000


def create_feature_database(emu: Emulator, name: str) -> Any:
    """``Orders`` (the shop's), ``Notes`` and ``Tags``, and ``AllStream`` over all of them."""
    ddl = [
        shop_ddl()[0],
        "CREATE TABLE Notes (NoteId INT64 NOT NULL, Body STRING(MAX)) PRIMARY KEY (NoteId)",
        "CREATE TABLE Tags (TagId INT64 NOT NULL, Label STRING(MAX)) PRIMARY KEY (TagId)",
        f"CREATE CHANGE STREAM {FEATURE_STREAM} FOR ALL OPTIONS "
        "(value_capture_type = 'OLD_AND_NEW_VALUES', retention_period = '1d')",
    ]
    return emu.create_database(name, ddl)


@attrs.frozen
class Txn:
    """A committed transaction: its commit timestamp and the rows it changed."""

    commit_ns: int
    keys: tuple[Key, ...]  # sorted


def workload_transactions(workload: Workload) -> list[Txn]:
    return [
        Txn(tx.commit_ns, tuple(sorted((c.table, int(c.keys[SHOP_KEY])) for c in tx.changes)))
        for tx in workload.committed
    ]


class TableWriter:
    """Multi-table transactions on ``Notes`` and ``Tags``: each inserts 1-3 notes and 1-2
    tags with fresh keys, or updates a note and inserts a tag; ``rate`` per second."""

    def __init__(self, database: Any, *, rate: float = 5.0, seed: int = 1) -> None:
        self.database = database
        self.rate = rate
        self.committed: list[Txn] = []
        self._rng = random.Random(seed)
        self._next = 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def step(self) -> None:
        notes, tags = [], []
        if self.committed and self._rng.random() < 0.3:
            notes.append(("update", self._rng.choice(
                [k for t in self.committed for tb, k in t.keys if tb == "Notes"])))
        else:
            notes += [("insert", self._key()) for _ in range(self._rng.randint(1, 3))]
        tags += [self._key() for _ in range(self._rng.randint(1, 2))]
        from google.api_core.exceptions import Aborted

        for attempt in range(20):
            try:
                with self.database.batch() as batch:
                    for op, key in notes:
                        method = batch.insert if op == "insert" else batch.update
                        method("Notes", ["NoteId", "Body"], [[key, f"note {key} {op}"]])
                    batch.insert("Tags", ["TagId", "Label"], [[k, f"tag {k}"] for k in tags])
                break
            except Aborted:
                time.sleep(0.01 * (attempt + 1))
        else:
            msg = "the writer's commit was aborted 20 times"
            raise RuntimeError(msg)
        keys = tuple(sorted([("Notes", k) for _, k in notes] + [("Tags", k) for k in tags]))
        self.committed.append(Txn(Timestamp.from_datetime(batch.committed).ns, keys))

    def _key(self) -> int:
        self._next += 1
        return self._next

    def start(self, seconds: float) -> None:
        def target() -> None:
            began = time.monotonic()
            done = 0
            try:
                while not self._stop.is_set() and time.monotonic() - began < seconds:
                    wait = began + done / self.rate - time.monotonic()
                    if wait > 0 and self._stop.wait(wait):
                        break
                    self.step()
                    done += 1
            except BaseException as e:
                self.error = e

        self._thread = threading.Thread(target=target, name="table-writer", daemon=True)
        self._thread.start()

    def idle(self) -> bool:
        """True once the writer has stopped committing."""
        return self._thread is not None and not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.error is not None:
            raise self.error


def bulk_insert_orders(database: Any, rows: int, chunk: int = 2500) -> int:
    """Insert ``rows`` Orders (keys 1..rows) in transactions of ``chunk`` rows; a start
    position after the last of those commits (ns).

    The emulator's commit timestamps can run a few ms ahead of the host's clock, so "now"
    right after the inserts may precede the last of them: a snapshot taken there would
    miss it. The position returned is the later of the clock and that commit, plus 1 us.
    """
    columns = [SHOP_KEY, "Customer", "Status", "Quantity", "Price", "Details"]
    last = 0
    for first in range(1, rows + 1, chunk):
        values = [
            [k, f"c{k % 97}", "NEW", k % 7, float(k % 500) + 0.5,
             json.dumps({"items": [{"sku": f"SKU-{k % 1000:03d}", "qty": 1}]})]
            for k in range(first, min(rows, first + chunk - 1) + 1)
        ]
        with database.batch() as batch:
            batch.insert(SHOP_TABLE, columns, values)
        last = max(last, Timestamp.from_datetime(batch.committed).ns)
    return max(Timestamp.now().ns, last) + 1_000


class Feature:
    """A pipeline file under ``tmp`` over database ``name``, run through the CLI.

    ``pipeline`` is the file's text; it reads E2E_NAME, E2E_DB, E2E_STREAM, E2E_START,
    E2E_END and E2E_OUT from the environment (``env``, extended by the caller).
    """

    def __init__(self, emu: Emulator, tmp: Path, name: str, pipeline: str,
                 *, store: str = "sqlite") -> None:
        self.emu = emu
        self.name = unique("pl")
        self.out = tmp / "out"
        self.file = tmp / "pipeline.py"
        self.file.write_text(pipeline)
        self.state_file = tmp / "state.db"
        if store == "sqlite":
            self.store_url = f"sqlite:///{self.state_file}"
        else:
            meta = unique("meta")
            emu.create_database(meta)
            self.store_url = f"spanner://{emu.database_path(meta)}"
        self.env = dict(
            os.environ, SPANNER_EMULATOR_HOST=emu.host, E2E_NAME=self.name,
            E2E_DB=emu.database_path(name), E2E_STREAM=FEATURE_STREAM, E2E_OUT=str(self.out),
        )

    def window(self, start_ns: int, end_ns: int) -> None:
        self.env["E2E_START"] = Timestamp.from_ns(start_ns).rfc3339()
        self.env["E2E_END"] = Timestamp.from_ns(end_ns).rfc3339()

    def command(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "cdcflow", "run", str(self.file),
                "--metadata", self.store_url, "--batch-interval", "250ms", *extra]

    def start(self, *extra: str, stderr: Any = subprocess.DEVNULL) -> subprocess.Popen[str]:
        return subprocess.Popen(self.command(*extra), env=self.env, stdout=subprocess.DEVNULL,
                                stderr=stderr, text=True, start_new_session=True)

    def run(self, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self.command(*extra), env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def kill_at_random(
        self, kills: int, *extra: str, seed: int, after: tuple[float, float] = (2.0, 4.0),
        progress: Callable[[], int] | None = None,
    ) -> int:
        """Start the run and SIGKILL it (with its children) ``kills`` times, each at a
        random moment ``after`` seconds (uniform) after it started, or, with ``progress``,
        after ``progress()`` first grew past its value when the run started. Returns how
        many runs were killed while still running."""
        rng = random.Random(seed)
        killed = 0
        for _ in range(kills):
            before = progress() if progress is not None else 0
            proc = self.start(*extra)
            began = time.monotonic()
            if progress is not None:
                while (proc.poll() is None and progress() <= before
                       and time.monotonic() - began < 120):
                    time.sleep(0.05)
                began = time.monotonic()
            while proc.poll() is None and time.monotonic() - began < rng.uniform(*after):
                time.sleep(0.05)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                killed += 1
            proc.wait(30)
        return killed

    def committed_batches(self) -> int:
        if self.store_url.startswith("sqlite:") and not self.state_file.exists():
            return 0
        store = open_store(self.store_url)
        try:
            return sum(1 for b in store.batches(self.name, limit=100_000) if b.committed_at)
        finally:
            store.close()

    def stored_partitions(self) -> int:
        """How many partitions the store holds (a first run stores its first ones before it
        plans a batch)."""
        if self.store_url.startswith("sqlite:") and not self.state_file.exists():
            return 0
        store = open_store(self.store_url)
        try:
            return len(store.partitions(self.name))
        except Exception:  # the store's tables are not created yet
            return 0
        finally:
            store.close()

    def planned_batches(self) -> int:
        if self.store_url.startswith("sqlite:") and not self.state_file.exists():
            return 0
        store = open_store(self.store_url)
        try:
            return len(store.batches(self.name, limit=100_000))
        except Exception:  # the store's tables are not created yet
            return 0
        finally:
            store.close()

    def output(self) -> list[tuple[int, int, dict[str, Any]]]:
        """(batch id, line number, element) for every written line, in commit order."""
        rows = []
        for path in sorted(self.out.glob("*.jsonl")):
            m = _FILE.search(path.name)
            assert m, f"unexpected output file {path.name}"
            for i, line in enumerate(path.read_text().splitlines()):
                rows.append((int(m.group(1)), i, json.loads(line)))
        return sorted(rows, key=lambda r: (r[0], r[1]))
