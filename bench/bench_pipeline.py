"""A pipeline's rate per core beside the decoder's: Read -> Map -> WriteFiles in one task.

The decode benchmark's records (three-mod UPDATEs: INT64 key, STRING, NUMERIC, TIMESTAMP,
JSON columns, old and new values), serialized as Spanner sends them (50 per
PartialResultSet), are read by the real reader (SpannerChangeStreamClient: transport seam,
decoder, typed values) from a transport that replays the bytes from memory: no server, so
the pipeline and the decoder get the very same input and differ only in what the pipeline
adds. One partition, one slice, one task, the in-memory runner with one worker: one core.
Printed side by side:

* ``decode only``: the reader's decoder over the messages, every record made and dropped
  (with the collector as the engine sets it while batches run: what existed before is
  frozen out of full collections, and young collections are rarer; see
  ``cdcflow.processes.settled_heap``);
* ``Read -> count``: the whole run with a sink that counts records (the engine, the task,
  the chain, the byte quota);
* ``Read -> Map``: with a Map that makes each record a row dict (what a user's pipeline
  does first), into the counting sink;
* ``Read -> Map -> WriteFiles``: the rows written as JSONL files (Timestamps, Decimals and
  JSON values serialized), committed.

A pipeline's rate is its records over the seconds of the batch that read them (plan,
task, sink and store commit). Target: Read -> Map -> WriteFiles >= 60% of the
decode-only rate. ``python -m bench.bench_pipeline [--records N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench._args import positive_int
from bench.bench_decode import STREAM, _metadata_answer, encoded_messages
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.metadata import MemoryStore
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    ChildPartition,
    ChildPartitionsRecord,
    DataChangeRecord,
    Timestamp,
)
from cdcflow.pipeline import Pipeline
from cdcflow.processes import settled_heap
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.spanner import wire
from cdcflow.transforms import DetectPartitions, Map, ReadPartition, Sink, WriteFiles
from cdcflow.transforms.base import WriterContext

__all__ = ["Result", "main", "run"]

DATABASE = "projects/bench/instances/bench/databases/pipeline"
_START_NS = Timestamp.parse("2024-05-01T12:00:00Z").ns
_CHILD = "bench-child"


class ReplayTransport:
    """A Transport answering the metadata queries, the root query (one child partition)
    and every other change stream query with the same serialized messages."""

    def __init__(self, messages: Sequence[bytes]) -> None:
        self.messages = list(messages)
        root = ChildPartitionsRecord(INITIAL_PARTITION_TOKEN, Timestamp.from_ns(_START_NS),
                                     "00000000", [ChildPartition(_CHILD, ())])
        self.root = [m.SerializeToString() for m in wire.partial_result_sets(
            wire.row_type(wire.googlesql_column_type()), [wire.encode_googlesql([root])]
        )]

    def execute_streaming_sql(
        self, sql: str, params: Mapping[str, Any], *, priority: str, timeout: float,
        idle: float | None = None,
    ) -> Iterator[Any]:
        if "READ_" not in sql:
            return iter(_metadata_answer(sql))
        return iter(self.root if params["t"][1] is None else self.messages)

    def reset_session(self) -> None:
        return None

    def close(self) -> None:
        return None


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def write(self, element: Any) -> None:
        self.n += 1

    def close(self) -> int:
        return self.n

    def abort(self) -> None:
        return None


class Count(Sink[Any, int]):
    """Counts what it is given."""

    def __init__(self) -> None:
        self.total = 0

    def open_writer(self, ctx: WriterContext) -> _Counter:
        return _Counter()

    def commit(self, batch_id: int, messages: Sequence[int]) -> None:
        self.total += sum(messages)


def to_row(record: DataChangeRecord) -> dict[str, Any]:
    """A record as a row: what a pipeline's first Map typically makes."""
    return {
        "table": record.table_name,
        "op": record.mod_type,
        "commit_timestamp": record.commit_timestamp,
        "transaction": record.server_transaction_id,
        "mods": [{"keys": m.keys, "new": m.new_values, "old": m.old_values}
                 for m in record.mods],
    }


class _Batches(EngineListener):
    def __init__(self) -> None:
        self.batches: list[BatchStats] = []

    def on_batch(self, stats: BatchStats) -> None:
        self.batches.append(stats)


@attrs.frozen
class Result:
    name: str
    records: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else float("inf")


def _pipeline(shape: str, n: int, out: str) -> tuple[Pipeline, Count | None]:
    end = _START_NS + n * 1000 + 8  # after the last record (1 µs apart, +7 ns)
    pipeline = Pipeline(f"bench-pipeline-{shape}")
    read = (pipeline
            | DetectPartitions(database=DATABASE, stream=STREAM, start_at=_START_NS,
                               end_at=end)
            | ReadPartition(heartbeat="10s"))
    if shape == "files":
        read | Map(to_row) | WriteFiles(out, fsync=False)
        return pipeline, None
    count = Count()
    (read | Map(to_row) | count) if shape == "map" else (read | count)
    return pipeline, count


def _run_once(shape: str, n: int) -> tuple[int, float]:
    """(records the data batch read, its seconds); checks what reached the sink."""
    with tempfile.TemporaryDirectory(prefix="cdcflow-bench-pipeline-") as out:
        pipeline, count = _pipeline(shape, n, out)
        batches = _Batches()
        options = RunOptions(batch_interval=0, max_batch_span=3600.0, pipelined=False,
                             max_task_bytes=None)
        Engine(pipeline, MemoryStore(), InMemoryRunner(workers=1), options, batches).run()
        data = [b for b in batches.batches if b.records]
        if len(data) != 1 or data[0].records != n:
            msg = f"expected one batch of {n} records, got {[b.records for b in data]}"
            raise AssertionError(msg)
        if count is not None:
            written = count.total
        else:
            written = sum(len(p.read_bytes().splitlines()) for p in Path(out).rglob("*.jsonl")
                          if p.is_file() and "_cdcflow" not in p.parts)
        if written != n:
            msg = f"{shape}: {written} of {n} records reached the sink; the benchmark is invalid"
            raise AssertionError(msg)
        return n, data[0].seconds


def _decode_only(messages: Sequence[bytes]) -> int:
    from cdcflow.spanner.flat import MessageDecoder
    from cdcflow.spanner.shape import RecordShaper

    decoder = MessageDecoder(RecordShaper())
    count = 0
    for message in messages:
        for _ in decoder.decode(message, _CHILD):
            count += 1
    return count


def run(n: int, rounds: int = 5) -> list[Result]:
    """Every reader's best round of ``rounds`` (see the module docstring)."""
    from cdcflow.spanner.client import cached_client

    messages = encoded_messages(n, 50)
    source = DetectPartitions(database=DATABASE, stream=STREAM, start_at=_START_NS)
    # the client every task of this process gets (engine.task.make_client's arguments)
    client: Any = cached_client(
        DATABASE, priority=source.priority, query_timeout=source.query_timeout,
        typed=source.typed, filter=source.filter, data_boost=source.data_boost,
    )
    client.transport = ReplayTransport(messages)
    shapes = (("Read -> count", "count"), ("Read -> Map", "map"),
              ("Read -> Map -> WriteFiles", "files"))
    best = {name: float("inf") for name in ("decode only", *(name for name, _ in shapes))}
    # Rounds interleave the readers, so that a busy moment of the machine falls on all of
    # them alike; each keeps its best round.
    for _ in range(rounds):
        # the collector as the engine sets it while batches run (processes.settled_heap),
        # so that both sides pay it alike
        with settled_heap():
            began = time.perf_counter()
            if _decode_only(messages) != n:
                msg = "the decoder did not give every record; the benchmark is invalid"
                raise AssertionError(msg)
            best["decode only"] = min(best["decode only"], time.perf_counter() - began)
        for name, shape in shapes:
            best[name] = min(best[name], _run_once(shape, n)[1])
    return [Result(name, n, seconds) for name, seconds in best.items()]


def table(results: Sequence[Result]) -> str:
    decode = results[0]
    lines = [f"  {'':28} {'records':>8} {'seconds':>8} {'records/s':>10} {'x decode':>9}"]
    for r in results:
        lines.append(f"  {r.name:28} {r.records:8d} {r.seconds:8.3f} {r.rate:10,.0f} "
                     f"{r.rate / decode.rate:9.2f}")
    files = results[-1].rate / decode.rate
    lines.append(f"  Read -> Map -> WriteFiles: target >= 0.60 of the decode-only rate per core: "
                 f"{'met' if files >= 0.6 else 'MISSED'} ({files:.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_pipeline", description=__doc__)
    parser.add_argument("--records", type=positive_int, default=20_000)
    parser.add_argument("--rounds", type=positive_int, default=5)
    args = parser.parse_args(argv)
    print(f"bench_pipeline: {args.records} three-mod records, 50 per message, one task on one "
          f"core (load average {os.getloadavg()[0]:.2f}, cores: {os.cpu_count()})")
    print(table(run(args.records, args.rounds)))


if __name__ == "__main__":
    main()
