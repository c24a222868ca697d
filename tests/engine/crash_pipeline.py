"""A pipeline that kills its own process (SIGKILL) at a chosen point; run by test_crash.py.

    python crash_pipeline.py RUNNER STATE_DIR [STAGE:BATCH]

RUNNER is ``memory`` or ``spark`` (``local[2]``). STAGE is ``planned`` (planned, its plan
not written yet: that happens once its tasks return; with pipelined batches its tasks may
have run already), ``committing`` (plan durable, no sink committed it: at the start of
the sink's commit), ``sinks`` (sinks
committed, store not), ``batch`` (store committed; with pipelined batches the next batch is
reading and its plan is not written), ``ahead`` (inside the sink commit of batch BATCH,
after it, once the tasks of batch BATCH+1, read ahead, have staged output: "ahead" is
printed first) or ``task`` (inside a task, at the BATCH-th record the process running the
task reads: this process on the memory runner, a Python worker on Spark); ``none:0`` kills
nowhere. A further argument ``serial`` runs with ``pipelined=False``, ``wide`` with
``max_batch_span=30s`` (batches of hundreds of records, not tens). Progress lives in
STATE_DIR/state.db, output in STATE_DIR/out. Without a kill point the run goes to its end
and prints the number of records it read.

The kill takes the driver's process group when the driver leads one (start it with
``start_new_session``): on Spark that is the driver, its JVM and, from a task, the Python
worker too, as a machine crash would.

    python crash_pipeline.py RUNNER STATE_DIR live

reads a stream without end, printing each committed batch, until SIGTERM.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from typing import Any

import cdcflow as cf
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner
from cdcflow.metadata import open_store
from cdcflow.model import BatchPlan
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.spark.runner import SparkRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import DetectPartitions, Map, ReadPartition, WriteFiles

S = 1_000_000_000
T0 = 1_700_000_000 * S
END = T0 + 30 * S


def stream() -> ScriptedChangeStream:
    rng = random.Random(11)
    s = ScriptedChangeStream("S", partitions=2, buckets=32, origin=T0)
    s.split("p0", at=T0 + 3 * S, into=["a", "b"])
    s.merge(["b", "p1"], at=T0 + 7 * S, into="m")
    s.split("m", at=T0 + 11 * S, into=["m1", "m2", "m3"])
    s.merge(["a", "m1"], at=T0 + 15 * S + 5, into="n")
    for i in range(400):
        with s.transaction(at=T0 + rng.randrange(0, 29 * S)) as tx:
            for _ in range(rng.choice([1, 2])):
                tx.write("T", rng.randrange(20), "UPDATE", {"i": i})
    return s


def make_runner(name: str) -> Runner:
    if name == "memory":
        return InMemoryRunner(workers=2)
    if name == "spark":
        return SparkRunner("local[2]")
    msg = f"unknown runner {name!r}: use memory or spark"
    raise SystemExit(msg)


def _die(driver: int) -> None:
    sys.stdout.flush()
    if os.getpgid(driver) == driver:
        os.killpg(driver, signal.SIGKILL)  # the driver and everything it started
    else:
        os.kill(driver, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)  # a Spark Python worker lives in another group


class KillAt(EngineListener):
    def __init__(self, stage: str, batch: int) -> None:
        self.stage, self.batch = stage, batch

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        self._maybe("planned", plan.batch_id)

    def on_sinks_committed(self, batch_id: int) -> None:
        self._maybe("sinks", batch_id)

    def on_batch(self, stats: BatchStats) -> None:
        self._maybe("batch", stats.batch_id)

    def _maybe(self, stage: str, batch_id: int) -> None:
        if (stage, batch_id) == (self.stage, self.batch):
            _die(os.getpid())


class KillOnRecord:
    """A Map function that kills the run at the n-th record the process running it sees."""

    def __init__(self, n: int, driver: int) -> None:
        self.n, self.driver = n, driver

    def __call__(self, record: Any) -> Any:
        # Every task unpickles its own copy of this function (and of the globals it pulls
        # in), so count in the live __main__ module of the process, whichever it is.
        seen: list[int] = vars(sys.modules["__main__"]).setdefault("_crash_seen", [0])
        seen[0] += 1
        if seen[0] == self.n:
            _die(self.driver)
        return record


class AheadFiles(WriteFiles):
    """WriteFiles that dies inside the sink commit of batch ``kill_after``, once it has
    committed and the next batch's tasks (read ahead meanwhile) have staged a file; or at
    the start of the sink commit of batch ``kill_before`` (its plan is in the store)."""

    def __init__(self, path: str, kill_after: int, driver: int, kill_before: int = 0) -> None:
        super().__init__(path)
        self.kill_after, self.kill_before, self.driver = kill_after, kill_before, driver

    def default_label(self) -> str:
        return "WriteFiles"

    def commit(self, batch_id: int, messages: Any) -> None:
        if batch_id == self.kill_before:
            _die(self.driver)
        super().commit(batch_id, messages)
        if batch_id != self.kill_after:
            return
        staged = f".part-{batch_id + 1:010d}-"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                names = os.listdir(self._temp_dir(batch_id + 1))
            except FileNotFoundError:
                names = []
            if any(n.startswith(staged) and n.endswith(".tmp") for n in names):
                print("ahead", flush=True)
                break
            time.sleep(0.001)
        _die(self.driver)


class Announce(EngineListener):
    def on_batch(self, stats: BatchStats) -> None:
        print("batch", stats.batch_id, flush=True)


def live(runner: Runner, state: str) -> None:
    """Read a stream that never ends; stop on SIGTERM after the current batch."""
    s = ScriptedChangeStream("S", origin=time.time_ns() - 60 * S)
    p = cf.Pipeline("live")
    p | DetectPartitions(stream="S", start_at="-5s", client=s) | ReadPartition() | WriteFiles(
        os.path.join(state, "out"))
    store = open_store(f"sqlite:///{os.path.join(state, 'state.db')}")
    options = RunOptions(batch_interval=0.05, base_dir=state)
    summary = Engine(p, store, runner, options, Announce()).run()
    store.close()
    print(summary.reason, summary.batches, flush=True)


def main() -> None:
    runner, state = make_runner(sys.argv[1]), sys.argv[2]
    if sys.argv[3:] == ["live"]:
        live(runner, state)
        return
    stage, _, batch = sys.argv[3].partition(":") if len(sys.argv) > 3 else ("none", "", "0")
    p = cf.Pipeline("crash")
    (p
     | DetectPartitions(stream="S", start_at=T0, end_at=END - 1, client=stream())
     | ReadPartition(heartbeat="500ms")
     | Map(KillOnRecord(int(batch) if stage == "task" else 0, os.getpid()))
     | AheadFiles(os.path.join(state, "out"), int(batch) if stage == "ahead" else 0,
                  os.getpid(), int(batch) if stage == "committing" else 0))
    store = open_store(f"sqlite:///{os.path.join(state, 'state.db')}")
    listener = (KillAt(stage, int(batch)) if stage not in ("task", "ahead", "committing")
                else None)
    options = RunOptions(max_batch_span=30.0 if "wide" in sys.argv[4:] else 2.0,
                         batch_interval=0.0, base_dir=state,
                         pipelined="serial" not in sys.argv[4:])
    summary = Engine(p, store, runner, options, listener).run()
    store.close()
    print(summary.reason, summary.records)


if __name__ == "__main__":
    main()
