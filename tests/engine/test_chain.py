"""The fused chain's bundles: a DoFn with ``bundle_size > 1`` gets consecutive elements of a
task at once; outputs, counters and error handling stay what a record-at-a-time run
gives; heartbeats and the byte quota end bundles early, so a held bundle never blocks
reading. Run on both runners where the engine is involved."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import cloudpickle
import pytest

import cdcflow as cf
from cdcflow.engine.quota import approx_size, process_quota
from cdcflow.engine.runner import Runner
from cdcflow.engine.task import FailedElement, run_task
from cdcflow.errors import PipelineStopped
from cdcflow.model import DataChangeRecord
from cdcflow.policy import ErrorPolicy
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.stream import ChangeStreamQuery, StreamInfo
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import (
    Collect,
    DetectPartitions,
    DoFn,
    Filter,
    FlatMap,
    Map,
    ParDo,
    ReadPartition,
)
from cdcflow.transforms.base import SinkWriter, WriterContext
from tests.engine.test_loop import run
from tests.engine.test_task import T0, S, items, program, task

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Spark workers lack tests/


def _v(element: Any) -> int:
    return int(element.mods[0].new_values["v"]) if hasattr(element, "mods") else int(element)


class _Tag(DoFn[Any, tuple[int, int, int]]):
    """(value, bundle number in this task, bundle length): which bundle each element was in."""

    def __init__(self, size: int) -> None:
        self.bundle_size = size
        self.bundles = 0

    def process(self, element: Any) -> Iterable[tuple[int, int, int]]:
        return [(_v(element), 0, 1)]

    def process_bundle(self, elements: Sequence[Any]) -> Sequence[Iterable[tuple[int, int, int]]]:
        self.bundles += 1
        return [[(_v(e), self.bundles, len(elements))] for e in elements]


class _Scale(DoFn[Any, int]):
    """x -> [10x] (none for 7), the same by process and process_bundle; fails on 3."""

    def __init__(self, size: int) -> None:
        self.bundle_size = size

    def process(self, element: Any) -> Iterable[int]:
        v = _v(element)
        if v == 3:
            raise ValueError("bad 3")
        return [] if v == 7 else [10 * v]

    def process_bundle(self, elements: Sequence[Any]) -> Sequence[Iterable[int]]:
        return [self.process(e) for e in elements]


def _stream(n: int, partitions: int = 1, spacing: int = 1000) -> ScriptedChangeStream:
    s = ScriptedChangeStream("S", partitions=partitions, buckets=8 * partitions, origin=T0)
    for i in range(n):
        s.write("T", i, "INSERT", {"v": i}, at=T0 + S + i * spacing)
    return s


def test_bundles_are_runs_of_consecutive_records_up_to_the_size() -> None:
    result = run_task(program(_stream(11), ParDo(_Tag(4)), Collect()),
                      task("p0", T0, T0 + 100 * S))
    assert items(result) == [(i, i // 4 + 1, 4 if i < 8 else 3) for i in range(11)]


def _branching(size: int, dead: Any) -> Any:
    return program(
        _stream(12),
        "dup" >> FlatMap(lambda r: [r, r] if _v(r) % 2 else [r]),
        [
            ["scale" >> ParDo(_Scale(size)), "big" >> Filter(lambda x: x > 20), "A" >> Collect()],
            ["B" >> Collect()],
            ["tag" >> Map(_v), "C" >> Collect()],
        ],
        policy=ErrorPolicy(retries=1, backoff=0.001, then="skip", dead_letter=dead),
    )


def test_a_bundled_run_gives_what_a_record_at_a_time_run_gives() -> None:
    results = []
    for size in (1, 5):
        dead = "dead" >> Collect()
        results.append(run_task(_branching(size, dead), task("p0", T0, T0 + 100 * S)))
    one, bundled = results
    for label in ("A", "B", "C"):
        assert items(bundled, label) == items(one, label)
    assert items(one, "A") == [40, 50, 50, 60, 80, 90, 90, 100, 110, 110]
    failed = [f for f in items(bundled, "dead") if isinstance(f, FailedElement)]
    assert [(f.label, _v(f.element)) for f in failed] == [("scale", 3), ("scale", 3)]
    assert [_v(f.element) for f in items(one, "dead")] == [3, 3]
    # The same counts, but a bundle holds more bytes at once.
    held = ("bundle_retries", "inflight_bytes_peak")
    assert ({k: v for k, v in bundled.counters.items() if k not in held}
            == {k: v for k, v in one.counters.items() if k not in held})
    assert bundled.counters["inflight_bytes_peak"] > one.counters["inflight_bytes_peak"]
    # Records 0-4 give "scale" 0 1 1 2 3 3 4, taken 5 at a time: both chunks hold a 3, so
    # both raised inside process_bundle and ran element by element.
    assert bundled.counters["bundle_retries"] == 2 and "bundle_retries" not in one.counters


class _PickyWriter(SinkWriter[int, list[int]]):
    """Keeps what it is given, but refuses 61 (a sink's write that fails on an element)."""

    def __init__(self) -> None:
        self.items: list[int] = []

    def write(self, element: int) -> None:
        if element == 61:
            raise ValueError("no 61")
        self.items.append(element)

    def close(self) -> list[int]:
        return self.items

    def abort(self) -> None:
        return None


class _Picky(Collect[int]):
    def open_writer(self, ctx: WriterContext) -> SinkWriter[int, list[int]]:
        return _PickyWriter()


def _odd(x: int) -> int:
    if x == 90:
        raise ValueError("not 90")
    return x + 1


def _tenfold(x: int) -> int:
    if x == 3:
        raise ValueError("not 3")
    return 10 * x


def _fan_out_first(read: ReadPartition, dead: Any) -> Any:
    return program(
        _stream(12),
        "dup" >> FlatMap(lambda r: [r, r] if _v(r) % 2 else [r]),
        "scale" >> ParDo(_Scale(1)),  # none for 7, fails on 3
        "big" >> Filter(lambda x: x > 20),
        "plus" >> Map(_odd),  # fails on 90 (9, twice)
        "out" >> _Picky(),  # refuses 61 (6 once)
        read=read, policy=ErrorPolicy(retries=1, backoff=0.001, then="skip", dead_letter=dead),
    )


def _maps_first(read: ReadPartition, dead: Any) -> Any:
    return program(
        _stream(12),
        "v" >> Map(_v),
        "tenfold" >> Map(_tenfold),  # fails on 3: a function that raises mid-line
        "dup" >> FlatMap(lambda x: [x, x] if x % 20 else [x]),
        "big" >> Filter(lambda x: x > 20),
        "plus" >> Map(_odd),  # fails on 90 (9, twice)
        "out" >> _Picky(),  # refuses 61 (6 once)
        read=read, policy=ErrorPolicy(retries=1, backoff=0.001, then="skip", dead_letter=dead),
    )


@pytest.mark.parametrize(("line", "out", "dead", "writes"), [
    (_fan_out_first, [41, 51, 51, 81, 101, 111, 111],  # 6 refused, 9 failed, 7 gave none
     [("scale", 3), ("scale", 3), ("out", 61), ("plus", 90), ("plus", 90)], 8),
    (_maps_first, [41, 51, 51, 71, 71, 81, 101, 111, 111],  # 3 failed, 6 refused, 9 failed
     [("tenfold", 3), ("out", 61), ("plus", 90), ("plus", 90)], 10),
])
def test_a_chain_that_is_one_line_gives_what_the_general_path_gives(
    line: Any, out: list[int], dead: list[tuple[str, int]], writes: int,
) -> None:
    # One line of ParDos into one sink runs fused (Chain._push_line, Maps called directly
    # while one element goes down the line); with max_inflight the same line runs on the
    # general path. Outputs, dead letters and counts agree.
    results = []
    for read in (ReadPartition(), ReadPartition(max_inflight=2)):
        results.append(run_task(line(read, "dead" >> Collect()),
                                task("p0", T0, T0 + 100 * S)))
    fused, general = results
    assert items(fused, "out") == items(general, "out") == out

    def failed(result: Any) -> list[tuple[str, Any]]:
        return [(f.label, f.element if isinstance(f.element, int) else _v(f.element))
                for f in items(result, "dead")]

    assert failed(fused) == failed(general) == dead
    held = ("inflight_bytes_peak", "quota_waits", "quota_wait_us")
    assert ({k: v for k, v in fused.counters.items() if k not in held}
            == {k: v for k, v in general.counters.items() if k not in held})
    assert fused.counters["sink_writes/out"] == writes  # 61's write was attempted
    for key in ("dead_lettered", "sink_writes/dead", "skipped", "retries"):
        assert fused.counters[key] == len(dead)
    assert fused.counters["elements_in/plus"] == fused.counters["elements_out/big"]


def _drop_all(read: ReadPartition, dead: Any) -> Any:
    return program(
        _stream(4), "v" >> Map(_v), "none" >> Filter(lambda x: False), "out" >> _Picky(),
        read=read, policy=ErrorPolicy(retries=1, backoff=0.001, then="skip", dead_letter=dead),
    )


def test_a_step_that_passes_nothing_counts_its_zero_outputs_on_both_paths() -> None:
    fused, general = (run_task(_drop_all(read, "dead" >> Collect()),
                               task("p0", T0, T0 + 100 * S))
                      for read in (ReadPartition(), ReadPartition(max_inflight=2)))
    assert fused.counters["elements_in/none"] == general.counters["elements_in/none"] == 4
    # the metrics' in - out accounting needs the 0, as the general path gives it
    assert fused.counters["elements_out/none"] == general.counters["elements_out/none"] == 0
    assert "sink_writes/out" not in fused.counters


def _pair(record: Any) -> list[dict[str, int]]:
    row = {"v": _v(record), "n": 0}
    return [row, row]  # one object twice: what the next steps do to it shows their order


class _Logged:
    """Steps that note each call in a file (the pipeline runs pickled: a list would not
    come back)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def note(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line + "\n")

    def bump(self, row: dict[str, int]) -> dict[str, int]:
        self.note(f"bump {row['v']}")
        row["n"] += 1
        return row

    def seen(self, row: dict[str, int]) -> int:
        self.note(f"seen {row['v']}:{row['n']}")
        if row["v"] == 2:
            raise ValueError("stop at 2")
        return row["n"]


def test_a_line_calls_its_steps_depth_first_like_the_general_path(tmp_path: Any) -> None:
    # Each output of a fan-out goes to the end of the line before the next one, as on the
    # general path: steps that share an element, or have side effects, see the same order,
    # and a stop happens after the same calls.
    results = []
    for branch in (False, True):
        log = _Logged(str(tmp_path / f"calls-{branch}"))
        steps: list[Any] = ["pair" >> FlatMap(_pair), "bump" >> Map(log.bump),
                            "seen" >> Map(log.seen), "out" >> Collect()]
        if branch:  # a second sink: the general path
            steps = [[steps, ["side" >> Collect()]]]
        with pytest.raises(PipelineStopped, match="stop at 2"):
            run_task(program(_stream(4), *steps, policy=ErrorPolicy(retries=0, then="stop")),
                     task("p0", T0, T0 + 100 * S))
        with open(log.path) as f:
            results.append(f.read().splitlines())
    fused, general = results
    assert fused == general == [
        "bump 0", "seen 0:1", "bump 0", "seen 0:2", "bump 1", "seen 1:1", "bump 1",
        "seen 1:2", "bump 2", "seen 2:1",
    ]


class _Named(DoFn[Any, str]):
    """A DoFn whose function is made in setup, as the README suggests for as_function."""

    def setup(self) -> None:
        names = {0: "zero", 1: "one"}
        self.name = lambda element: names.get(_v(element), "many")

    def process(self, element: Any) -> Iterable[str]:
        return [self.name(element)]

    def as_function(self) -> Any:
        return self.name


def test_as_function_is_asked_after_setup() -> None:
    result = run_task(program(_stream(3), ParDo(_Named()), Collect()),
                      task("p0", T0, T0 + 100 * S))
    assert items(result) == ["zero", "one", "many"]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def _unprintable(record: Any) -> int:
    raise _Unprintable


@pytest.mark.parametrize("read", [ReadPartition(), ReadPartition(max_inflight=2)])
def test_an_exception_that_cannot_be_printed_is_skipped_or_stops_in_one_line(
    read: ReadPartition,
) -> None:
    skip = program(_stream(1), Map(_unprintable), Collect(), read=read,
                   policy=ErrorPolicy(then="skip", dead_letter="dead" >> Collect()))
    failed = items(run_task(skip, task("p0", T0, T0 + 100 * S)), "dead")
    assert [f.error for f in failed] == ["_Unprintable (its message could not be printed)"]
    stop = program(_stream(1), Map(_unprintable), Collect(), read=read,
                   policy=ErrorPolicy(then="stop"))
    with pytest.raises(PipelineStopped, match=r"_Unprintable \(its message could not"):
        run_task(stop, task("p0", T0, T0 + 100 * S))


def test_a_heartbeat_ends_a_bundle() -> None:
    s = ScriptedChangeStream("S", partitions=1, buckets=8, origin=T0)
    for burst in range(3):  # three bursts of 3 records, a second apart
        for i in range(3):
            s.write("T", burst * 3 + i, "INSERT", {"v": burst * 3 + i},
                    at=T0 + (burst + 1) * S + i * 1000)
    prog = program(s, ParDo(_Tag(100)), Collect(), read=ReadPartition(heartbeat="100ms"))
    result = run_task(prog, task("p0", T0, T0 + 10 * S))
    assert items(result) == [(i, i // 3 + 1, 3) for i in range(9)]


def test_bundles_under_max_inflight_keep_record_order() -> None:
    read = ReadPartition(max_inflight=4)
    prog = program(_stream(50), ParDo(_Tag(3)), Map(lambda t: t[0]), Collect(), read=read)
    result = run_task(prog, task("p0", T0, T0 + 100 * S))
    assert items(result) == list(range(50))


def _key(t: tuple[int, int, int]) -> int:
    return t[0]


class _Slow:
    """A client that takes a millisecond per data record, so that concurrent tasks fill
    their bundles at the same time."""

    def __init__(self, inner: ScriptedChangeStream) -> None:
        self.inner = inner

    def describe_stream(self, stream: str) -> StreamInfo:
        return self.inner.describe_stream(stream)

    def read(self, query: ChangeStreamQuery) -> Iterator[Any]:
        for record in self.inner.read(query):
            if isinstance(record, DataChangeRecord):
                time.sleep(0.001)
            yield record

    def close(self) -> None:
        self.inner.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_inflight", [1, 4])
def test_a_quota_smaller_than_the_bundles_of_every_task_does_not_deadlock(
    runner: Runner, max_inflight: int
) -> None:
    # Four partitions read at once, each wanting bundles of 1000 records, with a quota of a
    # few records: a task whose next record does not fit runs its held bundle first.
    s = _stream(400, partitions=4)
    size = approx_size(next(iter(s.expected_records(T0, T0 + 10 * S))))
    limit = int(12.5 * size)  # bundles end at 4 records; four tasks holding 3 each fill it
    out: Collect[tuple[int, int, int]] = Collect()
    p = cf.Pipeline("bundles")
    (p
     | DetectPartitions(stream="S", start_at=T0, end_at=T0 + 2 * S, client=_Slow(s))
     | ReadPartition(heartbeat="10s", max_inflight=max_inflight, max_inflight_bytes=limit)
     | ParDo(_Tag(1000))
     | out)
    if isinstance(runner, InMemoryRunner):
        process_quota(limit).reset_peak()
    done = threading.Event()
    failure: list[BaseException] = []

    def go() -> None:
        try:
            run(runner, p, max_batch_span=3600.0)
        except BaseException as exc:  # reported below
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=go, daemon=True).start()
    assert done.wait(100), "the run did not finish: held bundles deadlocked the quota"
    assert not failure, failure
    assert sorted(map(_key, out.items)) == list(range(400))
    # A bundle ends at a quarter of the quota's bytes: never more than 4 records here.
    assert max(t[2] for t in out.items) <= limit // 4 // size + 1
    if isinstance(runner, InMemoryRunner):
        stats = process_quota().stats()
        assert stats.peak <= limit and stats.used == 0


class _NeedsRedis(DoFn[Any, Any]):
    def setup(self) -> None:
        raise ImportError("needs redis: pip install redis")

    def process(self, element: Any) -> Iterable[Any]:
        yield element


def test_an_error_of_the_pipeline_s_own_code_names_where_under_every_runner(
    runner: Runner,
) -> None:
    """What no error policy covers (here a DoFn's setup) names its place in a note that the
    one-line report carries, on Spark as in memory."""
    from cdcflow.errors import SparkTaskError

    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    stream.write("T", 1, "INSERT", {"v": 1}, at=T0 + S)
    p = cf.Pipeline("own-code")
    (p | DetectPartitions(stream="S", start_at=T0, end_at=T0 + 3 * S, client=stream)
     | ReadPartition() | "enrich" >> ParDo(_NeedsRedis()) | Collect())
    with pytest.raises((ImportError, SparkTaskError)) as info:
        run(runner, p)
    text = " ".join([str(info.value), *getattr(info.value, "__notes__", ())])
    assert "needs redis: pip install redis" in text
    assert "in setup() of step 'enrich'" in text


class _NotAWriterSink(cf.Sink):
    def open_writer(self, ctx: WriterContext) -> Any:
        return {"not": "a writer"}

    def commit(self, batch_id: int, messages: Sequence[Any]) -> None:
        return None


class _Seven(DoFn[Any, int]):
    def process(self, element: Any) -> Any:
        return 7


def test_a_sink_whose_open_writer_returns_no_writer_is_named_with_the_fix(
    runner: Runner,
) -> None:
    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    stream.write("T", 1, "INSERT", {"v": 1}, at=T0 + S)
    p = cf.Pipeline("not-a-writer")
    (p | DetectPartitions(stream="S", start_at=T0, end_at=T0 + 3 * S, client=stream)
     | ReadPartition() | "out" >> _NotAWriterSink())
    with pytest.raises(Exception) as info:  # on Spark, carried back from the executor
        run(runner, p)
    assert ("sink 'out': open_writer() returned dict, not a SinkWriter (an object with "
            "write(element), close() and abort()); fix the sink") in str(info.value)


def test_a_dofn_whose_process_returns_one_value_says_what_it_must_return() -> None:
    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    stream.write("T", 1, "INSERT", {"v": 1}, at=T0 + S)
    p = cf.Pipeline("one-value", error_policy=ErrorPolicy(retries=0))
    (p | DetectPartitions(stream="S", start_at=T0, end_at=T0 + 3 * S, client=stream)
     | ReadPartition() | "seven" >> ParDo(_Seven()) | Collect())
    with pytest.raises(PipelineStopped, match=r"_Seven.process\(\) returned a value of type "
                       r"int; it must return an iterable of outputs"):
        run(InMemoryRunner(workers=1), p)
