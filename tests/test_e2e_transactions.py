"""GroupTransactions through the CLI on the emulator, with SIGKILLs and restarts.

Two writers commit transactions while the emulator splits and merges partitions every
2-4 s: the shop workload (single- and multi-row transactions on ``Orders``) and a writer of
multi-table transactions (``Notes`` and ``Tags``). ``cdcflow run`` of
``ReadChangeStream | GroupTransactions | Map(summary) | WriteFiles(jsonl)`` is SIGKILLed at
random moments and restarted until ``end_at``: every committed transaction must be in the
output exactly once, whole (the rows its writer committed), in commit-timestamp order. On
the SQLite store, on the Spanner store, and on the Spark runner.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

import pytest

from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import Workload
from tests.e2e_features import (
    Feature,
    TableWriter,
    Txn,
    create_feature_database,
    workload_transactions,
)
from tests.e2e_helpers import in_window, unique

pytestmark = pytest.mark.emulator

S = 1_000_000_000

PIPELINE = """
import os
import cdcflow as cf
from cdcflow.transforms import GroupTransactions, Transaction


def summary(t: Transaction) -> dict:
    keys = sorted([r.table_name, int(next(iter(m.keys.values())))]
                  for r in t.records for m in r.mods)
    return {"txn": t.server_transaction_id, "ts": t.commit_timestamp.ns,
            "tables": list(t.tables), "rows": t.mods, "records": len(t.records),
            "partitions": len(t.partitions), "complete": t.complete,
            "snapshot": any(r.is_snapshot for r in t.records), "keys": keys}


pipeline = cf.Pipeline(os.environ["E2E_NAME"])
(pipeline
 | cf.ReadChangeStream(os.environ["E2E_DB"], os.environ["E2E_STREAM"],
                       start_at=os.environ["E2E_START"], end_at=os.environ["E2E_END"],
                       heartbeat="250ms", snapshot=os.environ.get("E2E_SNAPSHOT") == "1")
 | GroupTransactions()
 | "summary" >> cf.Map(summary)
 | cf.WriteFiles(os.environ["E2E_OUT"], format="jsonl"))
"""


def check_transactions(feature: Feature, expected: list[Txn]) -> int:
    """Every expected transaction exactly once, whole, in commit order; returns how many."""
    out = [element for _, _, element in feature.output() if not element["snapshot"]]
    got = Counter(Txn(e["ts"], tuple((t, k) for t, k in e["keys"])) for e in out)
    want = Counter(expected)
    lost, extra = want - got, got - want
    assert not lost, f"{sum(lost.values())} transactions lost or torn, e.g. {list(lost)[:2]}"
    assert not extra, f"{sum(extra.values())} duplicated or torn, e.g. {list(extra)[:2]}"
    assert all(e["complete"] and e["rows"] == len(e["keys"]) for e in out)
    order = [(e["ts"], e["txn"]) for e in out]
    assert order == sorted(order), "transactions out of commit-timestamp order"
    assert len({e["txn"] for e in out}) == len(out)
    return len(out)


def _writers(feature: Feature, db: object, seconds: float, seed: int
             ) -> tuple[Workload, TableWriter, int]:
    start = Timestamp.now().ns
    workload = Workload(db, rate=12, seed=seed, multi_row_share=0.5)
    writer = TableWriter(db, rate=5, seed=seed)
    workload.start(seconds=seconds)
    writer.start(seconds)
    feature.window(start, start + int((seconds + 2) * S))
    return workload, writer, start


def _finish(feature: Feature, workload: Workload, writer: TableWriter, *extra: str) -> None:
    # The writers commit for their whole time (kills that come early, or an emulator slowed
    # by other tests, must not cut the transactions the test counts on), then stop.
    deadline = time.monotonic() + 60
    while not writer.idle() and time.monotonic() < deadline:
        time.sleep(0.1)
    workload.stop()
    writer.stop()
    feature.run(*extra)


def _expected(feature: Feature, workload: Workload, writer: TableWriter) -> list[Txn]:
    return in_window(feature.env, workload_transactions(workload) + writer.committed)


@pytest.mark.parametrize("store", ["sqlite", "spanner"])
def test_whole_transactions_exactly_once_across_sigkills(
    spanner_emulator: Emulator, tmp_path: Path, store: str
) -> None:
    name = unique("txn")
    db = create_feature_database(spanner_emulator, name)
    feature = Feature(spanner_emulator, tmp_path, name, PIPELINE, store=store)
    seed = random.randrange(1 << 20)
    workload, writer, _ = _writers(feature, db, 9, seed)
    try:
        killed = feature.kill_at_random(3 if store == "sqlite" else 2,
                                        "--set", "max_batch_span=1s", seed=seed,
                                        after=(1.5, 3.0))
    finally:
        _finish(feature, workload, writer, "--set", "max_batch_span=1s")
    assert killed >= 2
    expected = _expected(feature, workload, writer)
    assert check_transactions(feature, expected) == len(expected) > 40
    out = [e for _, _, e in feature.output()]
    # Spanner's transactions came whole: multi-table ones, multi-row ones, and some whose
    # records came from several partitions.
    assert sum(len(e["tables"]) == 2 for e in out) >= 10
    assert sum(e["rows"] > 1 for e in out if e["tables"] == ["Orders"]) >= 5


@pytest.mark.spark
def test_whole_transactions_on_spark_across_a_sigkill(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    name = unique("txs")
    db = create_feature_database(spanner_emulator, name)
    feature = Feature(spanner_emulator, tmp_path, name, PIPELINE)
    seed = random.randrange(1 << 20)
    workload, writer, _ = _writers(feature, db, 6, seed)
    extra = ("--runner", "spark", "--master", "local[2]", "--set", "max_batch_span=1s")
    try:
        killed = feature.kill_at_random(
            1, *extra, seed=seed, after=(0.5, 2.0),
            progress=feature.committed_batches,
        )
    finally:
        _finish(feature, workload, writer, *extra)
    assert killed == 1
    expected = _expected(feature, workload, writer)
    assert check_transactions(feature, expected) == len(expected) > 30
