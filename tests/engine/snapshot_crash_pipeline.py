"""A snapshot-then-stream pipeline that kills its own process (SIGKILL) at a chosen point;
run by test_snapshot.py.

    python snapshot_crash_pipeline.py STATE_DIR [STAGE:N]

STAGE is ``sinks`` (the sinks committed batch N, the store did not) or ``task`` (at the
N-th record this process pushes through the pipeline, in the middle of the snapshot when N
is small). Batch 1 splits both tables into key ranges; batches 2 to 5 read them, two at a
time (one record each), and the stream follows. Progress lives in STATE_DIR/state.db,
output in STATE_DIR/out. Without a kill point the run goes to its end and prints why it
ended.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import cdcflow as cf
from cdcflow.engine.listener import EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import open_store
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import DetectPartitions, Map, ReadPartition, WriteFiles

S = 1_000_000_000
T0 = 1_700_000_000 * S
START = T0 + 5 * S
END = T0 + 20 * S
#: A (2,300 rows) splits into 5 key ranges, B (700) into 2; two snapshot tasks per batch.
ROWS_PER_TASK = 500


def stream() -> ScriptedChangeStream:
    s = ScriptedChangeStream(
        "S", partitions=2, buckets=16, origin=T0,
        snapshot_rows={
            "A": [(i, {"v": i}) for i in range(2_300)],
            "B": [({"k": f"k{i}"}, {"w": i}) for i in range(700)],
        },
    )
    s.split("p0", at=START + 4 * S, into=["a", "b"])
    for i in range(200):
        at = T0 + (i * 97 % 190) * S // 10
        s.write("A", i * 13 % 2_400, "UPDATE" if i % 3 else "DELETE",
                {} if i % 3 == 0 else {"v": -i}, at=at)
    return s


class KillAfterSinks(EngineListener):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def on_sinks_committed(self, batch_id: int) -> None:
        if batch_id == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


class KillOnRecord:
    """Kills the process at the n-th record it pushes (counted in its __main__ module)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, record: Any) -> Any:
        seen: list[int] = vars(sys.modules["__main__"]).setdefault("_crash_seen", [0])
        seen[0] += 1
        if seen[0] == self.n:
            os.kill(os.getpid(), signal.SIGKILL)
        return record


def main() -> None:
    state = sys.argv[1]
    stage, _, n = sys.argv[2].partition(":") if len(sys.argv) > 2 else ("", "", "0")
    p = cf.Pipeline("snapshot-crash")
    pc = (p
          | DetectPartitions(stream="S", start_at=START, end_at=END - 1, client=stream(),
                             snapshot=True, snapshot_rows_per_task=ROWS_PER_TASK,
                             snapshot_tasks_per_batch=2)
          | ReadPartition(heartbeat="500ms"))
    if stage == "task":
        pc = pc | Map(KillOnRecord(int(n)))
    pc | WriteFiles(os.path.join(state, "out"))
    store = open_store(f"sqlite:///{os.path.join(state, 'state.db')}")
    listener = KillAfterSinks(int(n)) if stage == "sinks" else None
    options = RunOptions(max_batch_span=3.0, batch_interval=0, batch_retries=0)
    summary = Engine(p, store, InMemoryRunner(workers=2), options, listener).run()
    store.close()
    print(summary.reason, flush=True)


if __name__ == "__main__":
    main()
