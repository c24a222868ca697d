"""MUTABLE_KEY_RANGE streams through the engine: partitions announced mid-stream, key ranges
moving between partitions, partitions that end without children (ScriptedMutableStream)."""

from __future__ import annotations

import random
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import MemoryStore
from cdcflow.model import PartitionState
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedMutableStream

S = 1_000_000_000
T0 = 1_700_000_000 * S
END = T0 + 20 * S


def _stream(writes: int = 200, seed: int = 3) -> ScriptedMutableStream:
    """a and b from T0. At 5 s a announces c; key 1 moves a -> c at 6 s; a's other keys
    move to b at 8 s and a ends at 9 s (no children); at 15 s c hands everything to b and
    ends. Under "announced partitions wait for their announcer" c (start 5 s) would cap
    every batch at 5 s + max_batch_span while a needs to read to 9 s: a stall."""
    s = ScriptedMutableStream("S", partitions=["a", "b"], buckets=16, origin=T0)
    rng = random.Random(seed)
    for i in range(writes):
        s.write("T", rng.randrange(10), "UPDATE", {"v": i}, at=T0 + rng.randrange(1, 19 * S))
    s.announce("c", by="a", at=T0 + 5 * S)
    s.move([1], to="c", at=T0 + 6 * S)
    s.hand_over("a", to="b", at=T0 + 8 * S)
    s.end("a", at=T0 + 9 * S)
    s.hand_over("c", to="b", at=T0 + 15 * S)
    s.end("c", at=T0 + 15 * S + 1)
    return s


def _run(stream: ScriptedMutableStream, store: MemoryStore, span: float = 2.0) -> list[Any]:
    out: cf.Collect[Any] = cf.Collect()
    p = cf.Pipeline("mutable")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=END - 1, client=stream)
     | cf.ReadPartition(heartbeat="500ms") | out)
    # the real clock (long past END): the store stamps finished_at with it too
    opts = RunOptions(batch_interval=0, max_batch_span=span, gc_ttl=0)
    summary = Engine(p, store, InMemoryRunner(workers=2), opts).run()
    assert summary.reason == "end reached", summary
    return list(out.items)


@pytest.mark.timeout(60)
def test_a_partition_announced_mid_stream_is_read_at_once_and_nothing_stalls() -> None:
    stream = _stream()
    store = MemoryStore()
    got = _run(stream, store)
    expected = stream.expected_records(T0, END)
    assert sorted(got, key=expected.index) == expected and len(got) == len(expected)
    # per-key commit order across the moves a -> c -> b
    by_key: dict[int, list[int]] = {}
    for r in got:
        by_key.setdefault(r.mods[0].keys["id"], []).append(r.commit_timestamp.ns)
    assert all(ts == sorted(ts) for ts in by_key.values())
    assert {r.partition_token for r in got} == {"a", "b", "c"}


def test_partitions_that_end_without_children_are_garbage_collected() -> None:
    store = MemoryStore()
    _run(_stream(), store)
    left = store.partitions("mutable")
    # a and c ended mid-stream without children and the root's children all started; b
    # read to the pipeline's end and stays as the record of how far it got
    assert [(p.token, p.state) for p in left] == [("b", PartitionState.FINISHED)]


def test_the_scripted_stream_speaks_the_mode() -> None:
    s = _stream(writes=0)
    with pytest.raises(ValueError, match="do not split"):
        s.split("b", at=T0 + S)
    with pytest.raises(ValueError, match="still owns"):
        s.end("b", at=T0 + 19 * S)
    assert s.describe_stream("S").partition_mode == "MUTABLE_KEY_RANGE"
