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
from collections import Counter
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import SHOP_COLUMNS, SHOP_KEY, SHOP_TABLE, Workload
from tests.e2e_features import Feature, bulk_insert_orders, create_feature_database
from tests.e2e_helpers import unique

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
    workload.start(seconds=8)
    end = start + 10 * S
    feature.window(start, end)
    try:
        # Killed a random moment after the snapshot's batch was planned, before it commits.
        killed = feature.kill_at_random(
            1, seed=start, after=(0.2, 1.0), progress=feature.planned_batches
        )
        assert killed == 1
        assert feature.planned_batches() >= 1
        assert feature.committed_batches() == 0, "the snapshot committed before the kill"
    finally:
        workload.stop()
    feature.run()
    records = [element for _, _, element in feature.output()]
    state, snapshot_rows = replay(records)
    assert set(snapshot_rows) == set(range(1, ROWS + 1))
    assert max(snapshot_rows.values()) == 1, "a snapshot row was written twice"
    assert all(r["commit_timestamp"] == Timestamp.from_ns(start - 1).rfc3339()
               for r in records if r["is_snapshot"])
    streamed = sum(len(r["mods"]) for r in records if not r["is_snapshot"])
    assert streamed == len(workload.changes) > 20
    assert workload.committed[-1].commit_ns <= end
    truth = read_orders_at(db, end)
    assert len(truth) > ROWS - 100
    assert state == truth
