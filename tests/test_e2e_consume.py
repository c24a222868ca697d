"""Consume through the CLI on the emulator, SIGKILLed twice and restarted.

``ReadChangeStream | FlatMap(one element per row) | Consume(fn, max_inflight=16, key=row)``
where ``fn`` appends the row's key, commit timestamp, ``idempotency_key`` and the run's pid
to a file. What README's "Side effects with Consume" promises, checked:

- at-least-once: every committed change is consumed, nothing else is;
- a key's calls run one at a time in commit order, within each run;
- repeats come only from a replayed batch: a run repeats nothing of its own, and what a
  restarted run repeats of earlier runs comes, per key, before anything new;
- ``idempotency_key`` is stable across replays: deduplicated by it (and the row), the
  calls are exactly the committed changes.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import SHOP_KEY, Workload
from tests.e2e_features import Feature, create_feature_database
from tests.e2e_helpers import in_window, unique

pytestmark = pytest.mark.emulator

S = 1_000_000_000

PIPELINE = """
import json
import os
import random
import time

import cdcflow as cf
from cdcflow.transforms import idempotency_key

LOG = os.environ["E2E_LOG"]


def rows(r: cf.DataChangeRecord) -> list[dict]:
    return [{"key": int(m.keys["OrderId"]), "ts": r.commit_timestamp.ns, "op": r.mod_type,
             "id": idempotency_key(r), "pid": os.getpid()} for m in r.mods]


def consume(row: dict) -> None:
    time.sleep(random.random() * 0.02)  # calls of different keys finish out of order
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (json.dumps(row) + "\\n").encode())  # one write: whole lines
    finally:
        os.close(fd)


pipeline = cf.Pipeline(os.environ["E2E_NAME"])
(pipeline
 | cf.ReadChangeStream(os.environ["E2E_DB"], os.environ["E2E_STREAM"],
                       start_at=os.environ["E2E_START"], end_at=os.environ["E2E_END"],
                       heartbeat="250ms", tables=["Orders"])
 | cf.FlatMap(rows)
 | cf.Consume(consume, max_inflight=16, key=lambda row: row["key"]))
"""


def _lines(log: Path) -> int:
    return log.read_bytes().count(b"\n") if log.exists() else 0


def test_consume_is_at_least_once_in_key_order_across_sigkills(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    name = unique("con")
    db = create_feature_database(spanner_emulator, name)
    feature = Feature(spanner_emulator, tmp_path, name, PIPELINE)
    log = tmp_path / "consumed.jsonl"
    feature.env["E2E_LOG"] = str(log)
    seed = random.randrange(1 << 20)
    start = Timestamp.now().ns
    workload = Workload(db, rate=20, seed=seed, multi_row_share=0.4)
    workload.start(seconds=9)
    feature.window(start, start + 11 * S)
    try:
        # Each run is killed a random moment after its first call.
        killed = feature.kill_at_random(2, "--set", "max_batch_span=1s", seed=seed,
                                        after=(0.2, 2.5), progress=lambda: _lines(log))
    finally:
        workload.stop()
    feature.run("--set", "max_batch_span=1s")
    assert killed == 2

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    runs = list(dict.fromkeys(c["pid"] for c in calls))  # in the order they started
    assert len(runs) == 3
    change = lambda c: (c["key"], c["ts"], c["op"])  # noqa: E731
    changes = in_window(feature.env, workload.changes)
    expected = {(int(c.keys[SHOP_KEY]), c.commit_ns, c.mod_type) for c in changes}
    assert len(expected) == len(changes) > 60  # ~150 at 20 tx/s, fewer when loaded
    consumed = {change(c) for c in calls}
    assert consumed == expected, (
        f"lost {len(expected - consumed)}, unknown {len(consumed - expected)}")

    seen_before: set[tuple[int, int, str]] = set()
    repeated = 0
    for pid in runs:
        mine = [c for c in calls if c["pid"] == pid]
        assert len({change(c) for c in mine}) == len(mine), f"run {pid} repeated a call"
        by_key: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for c in mine:
            by_key[c["key"]].append(c)
        for key, seq in by_key.items():
            stamps = [c["ts"] for c in seq]
            assert stamps == sorted(stamps), f"run {pid}: key {key} out of commit order"
            # A replayed batch comes first: what this run repeats precedes what is new.
            old = [change(c) in seen_before for c in seq]
            assert old == sorted(old, reverse=True), f"run {pid}: key {key} repeats late"
            repeated += sum(old)
        seen_before |= {change(c) for c in mine}
    # Deduplicated by idempotency_key (and the row), the calls are the changes, once each.
    by_id: dict[tuple[str, int], set[tuple[int, int, str]]] = defaultdict(set)
    for c in calls:
        by_id[(c["id"], c["key"])].add(change(c))
    assert all(len(v) == 1 for v in by_id.values())
    assert len(by_id) == len(expected)
    assert repeated == len(calls) - len(expected)
