"""Snapshot then stream through the CLI on the emulator, SIGKILLed during the snapshot.

``Orders`` holds 30k rows before the start; a workload changes it while the pipeline reads
(``ReadChangeStream(snapshot=...) | WriteFiles(jsonl)``). The first run is killed while it
reads the snapshot, a restart runs to ``end_at``: every row of the snapshot is written once,
and replaying the output in commit order (snapshot rows and inserts as upserts, updates as
merges of the columns written, deletes) gives the table as read at ``end_at``.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from cdcflow.keyrange import token_range
from cdcflow.metadata import open_store
from cdcflow.model import PartitionState, Timestamp, is_snapshot_token
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import (
    SHOP_COLUMNS,
    SHOP_KEY,
    SHOP_TABLE,
    Workload,
    create_shop_database,
)
from tests.e2e_features import Feature, bulk_insert_orders, create_feature_database
from tests.e2e_helpers import in_window, unique

pytestmark = pytest.mark.emulator

S = 1_000_000_000
ROWS = 30_000
State = dict[int, dict[str, Any]]

PIPELINE = """
import os
import cdcflow as cf

pipeline = cf.Pipeline(os.environ["E2E_NAME"])
(pipeline
 | cf.ReadChangeStream(os.environ["E2E_DB"], os.environ["E2E_STREAM"],
                       start_at=os.environ["E2E_START"], end_at=os.environ["E2E_END"],
                       heartbeat="250ms", snapshot=["Orders"], tables=["Orders"])
 | cf.WriteFiles(os.environ["E2E_OUT"], format="jsonl"))
"""


def _plain(value: Any) -> Any:
    serialize = getattr(value, "serialize", None)
    if serialize is not None:  # the stock client's JsonObject
        return json.loads(serialize())
    return float(value) if isinstance(value, Decimal) else value


def read_orders_at(db: Any, ns: int) -> State:
    columns = ", ".join((SHOP_KEY, *SHOP_COLUMNS))
    with db.snapshot(read_timestamp=Timestamp.from_ns(ns)) as snap:
        rows = list(snap.execute_sql(f"SELECT {columns} FROM {SHOP_TABLE}"))
    return {int(r[0]): {c: _plain(v) for c, v in zip(SHOP_COLUMNS, r[1:], strict=True)}
            for r in rows}


def replay(records: list[dict[str, Any]]) -> tuple[State, Counter[int]]:
    """The table the records replay to, and how often each key came in a snapshot row."""
    snapshot_rows: Counter[int] = Counter()
    changes = []
    for record in records:
        ts = Timestamp.parse(record["commit_timestamp"]).ns
        for mod in record["mods"]:
            key = int(mod["keys"][SHOP_KEY])
            if record["is_snapshot"]:
                snapshot_rows[key] += 1
            changes.append((ts, key, record["mod_type"], mod["new_values"]))
    changes.sort(key=lambda c: (c[0], c[1]))
    state: State = {}
    for _, key, mod_type, values in changes:
        if mod_type == "DELETE":
            del state[key]
        elif mod_type == "INSERT":
            assert key not in state, f"key {key} inserted twice"
            state[key] = dict(values)
        else:
            state[key].update(values)
    return state, snapshot_rows


def test_a_snapshot_killed_midway_replays_to_the_database(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    name = unique("snap")
    db = create_feature_database(spanner_emulator, name)
    start = bulk_insert_orders(db, ROWS)
    feature = Feature(spanner_emulator, tmp_path, name, PIPELINE)
    workload = Workload(db, rate=15, seed=random.randrange(1 << 20))
    writing = workload.start(seconds=8)
    end = start + 10 * S
    feature.window(start, end)
    try:
        # Killed a random moment after the run stored its first partitions (the tables'
        # snapshots), while it reads them: before the snapshot's batch commits (its plan is
        # written when its tasks have read it).
        killed = feature.kill_at_random(
            1, seed=start, after=(0.2, 1.0), progress=feature.stored_partitions
        )
        assert killed == 1
        assert feature.stored_partitions() >= 1
        assert feature.committed_batches() == 0, "the snapshot committed before the kill"
    finally:
        writing.join(30)  # its 8 s of changes, also while the pipeline is down
        workload.stop()
    feature.run()
    records = [element for _, _, element in feature.output()]
    state, snapshot_rows = replay(records)
    assert set(snapshot_rows) == set(range(1, ROWS + 1))
    assert max(snapshot_rows.values()) == 1, "a snapshot row was written twice"
    assert all(r["commit_timestamp"] == Timestamp.from_ns(start - 1).rfc3339()
               for r in records if r["is_snapshot"])
    streamed = sum(len(r["mods"]) for r in records if not r["is_snapshot"])
    assert streamed == len(in_window(feature.env, workload.changes)) > 20
    truth = read_orders_at(db, end)
    assert len(truth) > ROWS - 100
    assert state == truth


SPLIT_SCRIPT = Path(__file__).with_name("e2e_snapshot_pipeline.py")
SPLIT_ROWS = 3_000


def _split_run(state: Path, db: str, start: int, end: int, kill: int | None = None
               ) -> tuple[int, dict[str, Any]]:
    args = [sys.executable, str(SPLIT_SCRIPT), str(state), db, Timestamp.from_ns(start).rfc3339(),
            Timestamp.from_ns(end).rfc3339(), *([str(kill)] if kill else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    summary = json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else {}
    assert done.returncode in (0, -signal.SIGKILL), done.stderr[-3000:]
    return done.returncode, summary


def _range_of(token: str) -> Any:
    return token_range(token) if is_snapshot_token(token) else None


def _strong_read(db: Any, dialect: str, ns: int) -> State:
    q = '"' if dialect == "POSTGRESQL" else "`"
    columns = ", ".join(f"{q}{c}{q}" for c in (SHOP_KEY, *SHOP_COLUMNS))
    with db.snapshot(read_timestamp=Timestamp.from_ns(ns)) as snap:
        rows = list(snap.execute_sql(f"SELECT {columns} FROM {q}{SHOP_TABLE}{q}"))
    return {int(r[0]): {c: _plain(v) for c, v in zip(SHOP_COLUMNS, r[1:], strict=True)}
            for r in rows}


@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def test_a_snapshot_split_into_key_ranges_killed_after_some_committed_reads_the_rest_once(
    spanner_emulator: Emulator, tmp_path: Path, dialect: str
) -> None:
    """Orders (3,000 rows) splits into 10 key ranges read three per batch while a workload
    writes. The run is SIGKILLed once the sinks committed batch 3 (the second batch of
    ranges), before the store did; the restart replays batch 3 and reads the ranges left,
    never one that committed, and the output replays to the database at the end."""
    name = unique("split")
    db = create_shop_database(spanner_emulator, name, dialect)  # type: ignore[arg-type]
    start = bulk_insert_orders(db, SPLIT_ROWS, chunk=SPLIT_ROWS)
    path = spanner_emulator.database_path(name)
    end = start + 7 * S
    workload = Workload(db, rate=25, seed=random.randrange(1 << 20))
    workload.start(seconds=5)
    try:
        code, _ = _split_run(tmp_path, path, start, end, kill=3)
        assert code == -signal.SIGKILL
        store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
        try:
            pending = store.pending_plan("split-snapshot")
            finished = {p.token for p in store.partitions("split-snapshot")
                        if _range_of(p.token) is not None
                        and p.state == PartitionState.FINISHED}
        finally:
            store.close()
        assert pending is not None and pending.batch_id == 3
        assert len(finished) == 3  # batch 2's ranges committed
        code, summary = _split_run(tmp_path, path, start, end)
    finally:
        workload.stop()
    assert code == 0 and summary["reason"] == "end reached"
    # the workload wrote inside the window (on a slow machine its last commits may fall past
    # end: the comparison below reads the database at end, so they are outside it)
    assert any(t.commit_ns < end for t in workload.committed)

    records = [json.loads(line) for f in sorted((tmp_path / "out").glob("*.jsonl"))
               for line in f.read_text().splitlines()]
    state, snapshot_rows = replay(records)
    at_start = _strong_read(db, dialect, start - 1)
    assert set(snapshot_rows) == set(at_start) and len(at_start) == SPLIT_ROWS
    assert max(snapshot_rows.values()) == 1, "a snapshot row was written twice"
    assert state == _strong_read(db, dialect, end)
    # The restart read the pending batch's ranges and those after, no finished one ...
    read_again = set(summary["snapshot_tokens"])
    assert read_again and not read_again & finished
    assert {sl.token for sl in pending.slices} <= read_again
    # ... so it read every row but the finished ranges' (counted as they were pushed).
    done_rows = sum(len(r["mods"]) for r in records if r["partition_token"] in finished)
    assert done_rows == 3 * 300
    assert summary["snapshot_rows"] == SPLIT_ROWS - done_rows
