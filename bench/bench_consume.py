"""What keyed concurrency buys a side-effect sink: Consume with max_inflight=16 vs 1.

``fn`` stands for a remote call: it sleeps ``--call-ms`` (10 ms) per element. Two settings,
each run with ``max_inflight=1`` and ``16`` and printed side by side:

* **writer**: one Consume writer fed directly (no engine): the pool alone.
* **pipeline**: a whole run on the in-memory runner over a ScriptedChangeStream with one
  partition (so tasks do not add concurrency of their own), keyed by row, ``--keys`` rows.

Every run checks what Consume promises: each element consumed exactly once, each key's
calls in commit order and never two at once. A violation fails the benchmark.

``python -m bench.bench_consume [--records N] [--keys K] [--call-ms MS]``.
Target: max_inflight=16 >= 10x max_inflight=1.
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import attrs

from bench._args import non_negative_float, positive_int
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import MemoryStore
from cdcflow.model import DataChangeRecord
from cdcflow.pipeline import Pipeline
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Consume, DetectPartitions, ReadPartition, idempotency_key
from cdcflow.transforms.base import WriterContext

__all__ = ["Result", "main", "run_pipeline", "run_writer", "table"]

_S = 1_000_000_000
_T0 = 1_700_000_000 * _S

# Calls recorded by run id. The in-memory runner unpickles fn in this process, and this
# module is imported there by name, so the recorder's calls land here.
_CALLS: dict[str, list[tuple[Any, str, float, float]]] = defaultdict(list)


@attrs.frozen
class Result:
    setting: str
    max_inflight: int
    elements: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.elements / self.seconds


class _Call:
    """Sleeps ``seconds`` and records (key, element id, start, end) under ``run``."""

    def __init__(self, run: str, seconds: float) -> None:
        self.run, self.seconds = run, seconds

    def __call__(self, element: Any) -> None:
        start = time.monotonic()
        time.sleep(self.seconds)
        key, ident = _key(element), _ident(element)
        _CALLS[self.run].append((key, ident, start, time.monotonic()))


def _key(element: Any) -> Any:
    if isinstance(element, DataChangeRecord):
        return element.mods[0].keys["id"]
    return element[0]


def _ident(element: Any) -> str:
    return idempotency_key(element) if isinstance(element, DataChangeRecord) else element[1]


def _check(run: str, expected: Sequence[tuple[Any, str]]) -> None:
    """Every element once; per key, the expected order and no overlap."""
    calls = sorted(_CALLS.pop(run), key=lambda c: c[2])
    if sorted(c[1] for c in calls) != sorted(e[1] for e in expected):
        msg = f"{run}: not every element was consumed exactly once"
        raise AssertionError(msg)
    want: dict[Any, list[str]] = defaultdict(list)
    for key, ident in expected:
        want[key].append(ident)
    got: dict[Any, list[tuple[str, float, float]]] = defaultdict(list)
    for key, ident, start, end in calls:
        got[key].append((ident, start, end))
    for key, mine in got.items():
        if [ident for ident, _, _ in mine] != want[key]:
            msg = f"{run}: key {key!r} was consumed out of order"
            raise AssertionError(msg)
        if any(b[1] < a[2] for a, b in itertools.pairwise(mine)):
            msg = f"{run}: key {key!r} had two calls at once"
            raise AssertionError(msg)


def run_writer(records: int, keys: int, call_s: float, max_inflight: int) -> Result:
    run = uuid.uuid4().hex
    rng = random.Random(1)
    elements = [(rng.randrange(keys), f"e{i}") for i in range(records)]
    consume = Consume(_Call(run, call_s), max_inflight=max_inflight, key=_key)
    writer = consume.open_writer(WriterContext("bench", "consume", 1, "tok", 0, 1, "a"))
    began = time.perf_counter()
    for element in elements:
        writer.write(element)
    writer.close()
    seconds = time.perf_counter() - began
    _check(run, elements)
    return Result("writer", max_inflight, records, seconds)


def run_pipeline(records: int, keys: int, call_s: float, max_inflight: int) -> Result:
    run = uuid.uuid4().hex
    rng = random.Random(2)
    stream = ScriptedChangeStream("S", partitions=1, origin=_T0)
    for i in range(records):
        stream.write("T", rng.randrange(keys), "UPDATE", {"i": i}, at=_T0 + (i + 1) * 1000)
    end = _T0 + (records + 2) * 1000
    consume = Consume(_Call(run, call_s), max_inflight=max_inflight, key=_key)
    pipeline = Pipeline("bench-consume")
    source = DetectPartitions(stream="S", start_at=_T0, end_at=end, client=stream)
    pipeline | source | ReadPartition() | consume
    options = RunOptions(batch_interval=0, max_batch_span=3600, max_task_bytes=None)
    began = time.perf_counter()
    Engine(pipeline, MemoryStore(), InMemoryRunner(workers=2), options).run()
    seconds = time.perf_counter() - began
    expected = stream.expected_records(_T0, end + 1)
    _check(run, [(_key(r), _ident(r)) for r in expected])
    if consume.stats().acked != records:
        msg = f"the pipeline acked {consume.stats().acked} of {records} changes"
        raise AssertionError(msg)
    return Result("pipeline", max_inflight, records, seconds)


def table(results: Sequence[Result], title: str) -> str:
    lines = [title, f"{'setting':10} {'max_inflight':>12} {'elements':>9} {'seconds':>8} "
                    f"{'elements/s':>11}"]
    for r in results:
        lines.append(f"{r.setting:10} {r.max_inflight:12d} {r.elements:9d} {r.seconds:8.3f} "
                     f"{r.rate:11,.0f}")
    by = {(r.setting, r.max_inflight): r for r in results}
    ratios = [
        f"{setting}: {by[setting, 1].seconds / by[setting, 16].seconds:.1f}x"
        for setting in ("writer", "pipeline") if (setting, 1) in by and (setting, 16) in by
    ]
    lines.append("max_inflight=16 / 1 (target >= 10x): " + "   ".join(ratios))
    lines.append("per-key order and exactly-once delivery verified in every run")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_consume", description=__doc__)
    parser.add_argument("--records", type=positive_int, default=400)
    parser.add_argument("--keys", type=positive_int, default=200)
    parser.add_argument("--call-ms", type=non_negative_float, default=10.0,
                        help="milliseconds fn sleeps per call (0: none)")
    args = parser.parse_args(argv)
    call_s = args.call_ms / 1000
    results = [
        runner(args.records, args.keys, call_s, n)
        for runner in (run_writer, run_pipeline)
        for n in (1, 16)
    ]
    print(table(results, f"consume: {args.records} elements over {args.keys} random keys, "
                         f"fn sleeps {args.call_ms:g} ms per call"))


if __name__ == "__main__":
    main()
