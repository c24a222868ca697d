"""What the engine tells listeners per batch: phase timings, the tasks' counters, and the
commit timestamps that give the commit-to-sink latency; the run summary's totals."""

from __future__ import annotations

from typing import Any

import cdcflow as cf
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import MemoryStore
from cdcflow.policy import ErrorPolicy
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream

S = 1_000_000_000
T0 = 1_700_000_000 * S


class _Stats(EngineListener):
    def __init__(self) -> None:
        self.batches: list[BatchStats] = []

    def on_batch(self, stats: BatchStats) -> None:
        self.batches.append(stats)


def _odd_fails(r: Any) -> Any:
    if r.mods[0].new_values["v"] % 3 == 0:
        raise ValueError("poison")
    return r


def test_batches_carry_phases_counters_and_commit_times() -> None:
    stream = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(30):
        stream.write("T", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S // 10)
    out: cf.Collect[Any] = cf.Collect()
    dead: cf.Collect[Any] = cf.Collect()
    p = cf.Pipeline("stats", error_policy=ErrorPolicy(retries=1, backoff=0, then="skip",
                                                      dead_letter="dead" >> dead))
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 5 * S, client=stream)
     | cf.ReadPartition() | "keep even" >> cf.Filter(lambda r: r.mods[0].new_values["v"] % 2 == 0)
     | "check" >> cf.Map(_odd_fails) | "out" >> out)
    listener = _Stats()
    summary = Engine(p, MemoryStore(), InMemoryRunner(workers=2),
                     RunOptions(batch_interval=0, max_batch_span=1.0), listener).run()
    assert summary.reason == "end reached"
    total: dict[str, int] = {}
    for b in listener.batches:
        assert set(b.phases) == {"plan", "execute", "sink_commit", "store_commit", "gc"}
        assert all(v >= 0 for v in b.phases.values())
        assert len(b.commit_times) <= 64 * b.slices
        assert all(t <= b.sinks_committed_at for t in b.commit_times)
        for k, v in b.counters.items():
            total[k] = total.get(k, 0) + v
    evens = [v for v in range(30) if v % 2 == 0]
    poison = [v for v in evens if v % 3 == 0]
    assert total["elements_in/keep even"] == 30 == summary.records
    assert total["elements_out/keep even"] == len(evens) == total["elements_in/check"]
    assert total["elements_out/check"] == len(evens) - len(poison)
    assert total["sink_writes/out"] == len(out.items) == len(evens) - len(poison)
    assert total["dead_lettered"] == len(dead.items) == len(poison) == summary.dead_lettered
    assert summary.skipped == len(poison) and summary.retried == len(poison)  # one retry each
    sampled = sorted(t for b in listener.batches for t in b.commit_times)
    assert sampled and sampled[0] >= T0
