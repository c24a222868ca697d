"""GroupTransactions against the emulator: multi-table transactions committed by a
workload come out one for one, whole (same tables and rows per transaction)."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import MemoryStore
from cdcflow.model import Timestamp
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.transforms import DetectPartitions, GroupTransactions, ReadPartition, Transaction

pytestmark = pytest.mark.emulator

DDL = [
    "CREATE TABLE Orders (OrderId INT64 NOT NULL, Total INT64) PRIMARY KEY (OrderId)",
    "CREATE TABLE Items (OrderId INT64 NOT NULL, Line INT64 NOT NULL, Sku STRING(MAX)) "
    "PRIMARY KEY (OrderId, Line)",
    "CREATE CHANGE STREAM Shop FOR ALL OPTIONS (retention_period = '1d')",
]


def test_grouped_output_matches_the_committed_transactions(spanner_emulator: Any) -> None:
    name = f"txn{uuid.uuid4().hex[:12]}"
    db = spanner_emulator.create_database(name, DDL)
    rng = random.Random(5)
    start = Timestamp.now()
    committed: dict[int, Counter[str]] = {}  # commit ns -> rows written per table
    for order in range(40):
        lines = rng.randrange(0, 4)
        with db.batch() as batch:
            batch.insert("Orders", ("OrderId", "Total"), [(order, order * 10)])
            if lines:
                batch.insert("Items", ("OrderId", "Line", "Sku"),
                             [(order, line, f"sku-{line}") for line in range(lines)])
        rows = Counter({"Orders": 1})
        if lines:
            rows["Items"] = lines
        committed[Timestamp.from_datetime(batch.committed).ns] = rows
    end = Timestamp.from_ns(max(committed) + 1_000_000)
    assert len(committed) == 40  # one commit timestamp per transaction

    out = cf.Collect[Transaction]()
    p = cf.Pipeline("txn-emulator")
    (p | DetectPartitions(spanner_emulator.database_path(name), "Shop", start_at=start,
                          end_at=end)
     | ReadPartition(heartbeat="500ms") | GroupTransactions() | out)
    summary = Engine(p, MemoryStore(), InMemoryRunner(workers=2),
                     RunOptions(batch_interval=0.1, max_batch_span=1.0)).run()
    assert summary.reason == "end reached"

    got = {t.commit_timestamp.ns: t for t in out.items}
    assert len(got) == len(out.items) == len(committed)  # one for one, each once
    assert [t.commit_timestamp.ns for t in out.items] == sorted(committed)
    for at, rows in committed.items():
        txn = got[at]
        assert txn.complete
        assert txn.tables == tuple(sorted(rows))
        written = Counter[str]()
        for r in txn.records:
            written[r.table_name] += len(r.mods)
        assert written == rows
        assert len(txn.records) == txn.records[0].number_of_records_in_transaction
        assert len({r.server_transaction_id for r in txn.records}) == 1
