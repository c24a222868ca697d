"""examples/lake.py through the CLI on the emulator: snapshot, filtered stream, full rows,
Parquet per table; the lake replays to the database, also after a SIGKILL mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import (
    SHOP_COLUMNS,
    SHOP_KEY,
    SHOP_TABLE,
    Workload,
    create_shop_database,
)
from tests.e2e_helpers import unique

pytestmark = pytest.mark.emulator

EXAMPLE = Path(__file__).parent.parent / "examples" / "lake.py"
S = 1_000_000_000
State = dict[int, dict[str, Any]]


def _plain(value: Any) -> Any:
    import json

    serialize = getattr(value, "serialize", None)
    if serialize is not None:  # the stock client's JsonObject
        return json.loads(serialize())
    return float(value) if isinstance(value, Decimal) else value


def _read_at(db: Any, ns: int) -> State:
    columns = ", ".join((SHOP_KEY, *SHOP_COLUMNS))
    with db.snapshot(read_timestamp=Timestamp.from_ns(ns)) as snap:
        rows = list(snap.execute_sql(f"SELECT {columns} FROM {SHOP_TABLE}"))
    return {int(r[0]): {c: _plain(v) for c, v in zip(SHOP_COLUMNS, r[1:], strict=True)}
            for r in rows}


def _lake(path: Path) -> State:
    """The Orders table as the lake's rows replay it, in commit order."""
    table = ds.dataset(path / SHOP_TABLE, format="parquet").to_table()
    rows = sorted(table.to_pylist(), key=lambda r: (r["_commit_ts"], r["_seq"]))
    state: State = {}
    for row in rows:
        key = int(row[SHOP_KEY])
        if row["_op"] == "DELETE":
            state.pop(key, None)
        else:  # SNAPSHOT, INSERT, UPDATE: LookupRows gave the whole row
            state[key] = {c: row[c] for c in SHOP_COLUMNS}
    import json

    for values in state.values():
        if isinstance(values.get("Details"), str):
            values["Details"] = json.loads(values["Details"])
    return state


def test_the_lake_example_replays_to_the_database_after_a_sigkill(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    name = unique("lake")
    db = create_shop_database(spanner_emulator, name, "GOOGLE_STANDARD_SQL")
    before = Workload(db, rate=None, seed=11)
    before.run(count=80)
    start = before.committed[-1].commit_ns + 1
    during = Workload(db, rate=30, seed=12)
    during.start(count=120)  # about 4 s, while the pipeline reads
    end = max(start, Timestamp.now().ns) + 8 * S
    env = dict(
        os.environ, SPANNER_EMULATOR_HOST=spanner_emulator.host,
        CDCFLOW_DATABASE=spanner_emulator.database_path(name),
        CDCFLOW_START_AT=Timestamp.from_ns(start).rfc3339(),
        CDCFLOW_END_AT=Timestamp.from_ns(end).rfc3339(),
        CDCFLOW_LAKE=str(tmp_path / "lake"),
    )
    command = [sys.executable, "-m", "cdcflow", "run", str(EXAMPLE),
               "--metadata", f"sqlite:///{tmp_path / 'state.db'}", "--batch-interval", "250ms"]
    try:
        first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        time.sleep(5)  # the snapshot is in, the stream under way
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    finally:
        during.stop()
    assert done.returncode == 0, done.stderr
    assert during.committed[-1].commit_ns <= end
    lake = _lake(tmp_path / "lake")
    assert lake == _read_at(db, end)
    # The snapshot is in, once: the rows that existed at the start, marked SNAPSHOT.
    table = ds.dataset(tmp_path / "lake" / SHOP_TABLE, format="parquet").to_table()
    snapshot_keys = [k for k, op in zip(table[SHOP_KEY].to_pylist(), table["_op"].to_pylist(),
                                        strict=True) if op == "SNAPSHOT"]
    assert sorted(snapshot_keys) == sorted(_read_at(db, start - 1))
    # Every insert and delete once; updates once each, less those that changed nothing
    # (skip_unchanged=True drops them in the decoder).
    ops = table["_op"].to_pylist()
    for op in ("INSERT", "DELETE"):
        assert ops.count(op) == sum(1 for c in during.changes if c.mod_type == op)
    assert 0 < ops.count("UPDATE") <= sum(1 for c in during.changes if c.mod_type == "UPDATE")
