"""Snapshot then stream of the shop's ``Orders`` on the emulator, its snapshot split into
key ranges; a run that SIGKILLs itself at a chosen point. Run by test_e2e_snapshot.py.

    python e2e_snapshot_pipeline.py STATE_DIR DATABASE START END [KILL_BATCH]

With KILL_BATCH the process kills itself once the sinks committed that batch, before the
store did (the batch is then pending: a restart replays it). Output (JSONL) goes to
STATE_DIR/out, progress to STATE_DIR/state.db. The last line printed is a JSON summary:
why the run ended, the snapshot partitions its batches read, and how many snapshot rows it
pushed through the pipeline.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import cdcflow as cf
from cdcflow.engine.listener import EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import open_store
from cdcflow.model import BatchPlan, is_snapshot_token
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.spanner.workload import SHOP_STREAM
from cdcflow.transforms import Map, ReadChangeStream, WriteFiles

#: Orders of ~3,000 rows split into ~10 ranges, read three per batch (each range's query
#: partitions on Data Boost: the emulator takes the option and ignores it).
ROWS_PER_TASK = 300
TASKS_PER_BATCH = 3


class Listen(EngineListener):
    def __init__(self, kill_batch: int | None) -> None:
        self.kill_batch = kill_batch
        self.snapshot_tokens: list[str] = []

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        self.snapshot_tokens += [s.token for s in plan.slices if is_snapshot_token(s.token)]

    def on_sinks_committed(self, batch_id: int) -> None:
        if batch_id == self.kill_batch:
            os.kill(os.getpid(), signal.SIGKILL)


def count_snapshot_rows(record: Any) -> Any:
    """Counts the snapshot rows this process pushes (in its __main__ module: tasks run
    in threads of this process, each on its own copy of the function)."""
    if record.is_snapshot:
        counter: list[int] = vars(sys.modules["__main__"]).setdefault("_snapshot_rows", [0])
        counter[0] += len(record.mods)
    return record


def main() -> None:
    state, database, start, end = sys.argv[1:5]
    kill = int(sys.argv[5]) if len(sys.argv) > 5 else None
    p = cf.Pipeline("split-snapshot")
    (p
     | ReadChangeStream(database, SHOP_STREAM, start_at=start, end_at=end, heartbeat="250ms",
                        snapshot=True, snapshot_rows_per_task=ROWS_PER_TASK,
                        snapshot_tasks_per_batch=TASKS_PER_BATCH, data_boost=True)
     | Map(count_snapshot_rows)
     | WriteFiles(os.path.join(state, "out"), format="jsonl"))
    store = open_store(f"sqlite:///{os.path.join(state, 'state.db')}")
    listener = Listen(kill)
    options = RunOptions(max_batch_span=2.0, batch_interval=0.2, batch_retries=2)
    summary = Engine(p, store, InMemoryRunner(workers=2), options, listener).run()
    store.close()
    rows = vars(sys.modules["__main__"]).get("_snapshot_rows", [0])[0]
    print(json.dumps({"reason": summary.reason, "snapshot_tokens": listener.snapshot_tokens,
                      "snapshot_rows": rows}), flush=True)


if __name__ == "__main__":
    main()
