"""BatchSteps in the engine (GroupTransactions as the step): whole transactions across
partitions and batches, on both runners; exactly once across crashes; state across
restarts; what the engine refuses."""

from __future__ import annotations

import os
import pickle
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import orjson
import pytest

import cdcflow as cf
from cdcflow.engine.runner import Runner
from cdcflow.errors import PipelineDefinitionError
from cdcflow.metadata import MemoryStore, SQLiteStore
from cdcflow.model import DataChangeRecord
from cdcflow.stream import ChangeStreamClient, ChangeStreamQuery, StreamInfo
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import (
    Collect,
    DetectPartitions,
    FlatMap,
    GroupTransactions,
    IncompleteTransactionError,
    Map,
    ReadPartition,
    Transaction,
    WriteFiles,
    WriteTables,
)
from tests.engine.test_loop import CrashAt, _Crash, run

cloudpickle.register_pickle_by_value(sys.modules[__name__])

S = 1_000_000_000
T0 = 1_700_000_000 * S
END = T0 + 12 * S
TXN = T0 + 3 * S + 1  # just after p0 splits: its records come from p1 and p0's children


def stream() -> ScriptedChangeStream:
    """Two partitions; p0 splits at 3 s, so a transaction just after it is read by p1 in
    one batch and by p0's children (which wait for p0 to finish) in the next."""
    s = ScriptedChangeStream("S", partitions=2, buckets=16, origin=T0)
    s.split("p0", at=T0 + 3 * S, into=["a", "b"])
    for i in range(40):
        with s.transaction(at=T0 + (i * 271 % 11) * S + i * 1000 + 7, tag=f"t{i}") as tx:
            for k in range(1 + i % 4):
                tx.write("Orders" if k % 2 else "Items", (i * 7 + k * 5) % 16, "INSERT",
                         {"n": i})
    with s.transaction(at=TXN, tag="wide") as tx:
        for key in range(16):  # every bucket: p1, a and b
            tx.write("Orders" if key % 2 else "Items", key, "UPDATE", {"n": -1})
    return s


def truth(s: ScriptedChangeStream) -> dict[tuple[int, str], list[DataChangeRecord]]:
    out: dict[tuple[int, str], list[DataChangeRecord]] = {}
    for r in s.expected_records(T0, END):
        out.setdefault((r.commit_timestamp.ns, r.server_transaction_id), []).append(r)
    return out


def pipeline(client: ChangeStreamClient, *tail: Any, name: str = "txns",
             **source: Any) -> cf.Pipeline:
    p = cf.Pipeline(name)
    pc = (p | DetectPartitions(stream="S", start_at=T0, end_at=END - 1, client=client,
                               **source)
          | ReadPartition(heartbeat="500ms") | GroupTransactions())
    for step in tail[:-1]:
        pc = pc | step
    pc | tail[-1]
    return p


class Watching(Collect[Transaction]):
    """Collect that also notes, per committed batch, the transactions and the low
    watermark the sink heard after it."""

    def __init__(self) -> None:
        super().__init__()
        self.per_batch: list[tuple[int, int]] = []  # (items so far, low watermark)

    def on_watermark(self, watermark_ns: int) -> None:
        self.per_batch.append((len(self.items), watermark_ns))


def test_each_transaction_is_emitted_once_whole_and_in_order(runner: Runner) -> None:
    s = stream()
    out = Watching()
    summary = run(runner, pipeline(s, out))
    assert summary.reason == "end reached"
    want = truth(s)
    got = out.items
    keys = [(t.commit_timestamp.ns, t.server_transaction_id) for t in got]
    assert keys == sorted(want) and len(set(keys)) == len(keys)  # once each, in order
    for txn in got:
        records = want[(txn.commit_timestamp.ns, txn.server_transaction_id)]
        assert Counter(map(_ident, txn.records)) == Counter(map(_ident, records))
        assert txn.complete and txn.mods == sum(len(r.mods) for r in records)
        assert txn.tables == tuple(sorted({r.table_name for r in records}))
        assert [r.record_sequence for r in txn.records] == sorted(
            r.record_sequence for r in txn.records)
    wide = next(t for t in got if t.transaction_tag == "wide")
    assert len(wide.partitions) == 3 and set(wide.partitions) == {"p1", "a", "b"}
    # Emitted only once the low watermark passed it, and in the first batch that did.
    seen, before = 0, 0
    for upto, low in out.per_batch:
        for txn in got[seen:upto]:
            assert before <= txn.commit_timestamp.ns < low
        seen, before = upto, low
    assert seen == len(got)


def test_the_wide_transaction_spans_batches_and_waits_for_its_last_partition() -> None:
    s = stream()
    out = Watching()
    store = MemoryStore()
    run(_memory(), pipeline(s, out), store)
    wide = next(i for i, t in enumerate(out.items) if t.transaction_tag == "wide")
    # p1's record of it was read in a batch whose low watermark stayed below it (p0's
    # children had not read it yet): the batch that emitted it is a later one.
    emitted_in = next(n for n, (upto, _) in enumerate(out.per_batch) if upto > wide)
    lows = [low for _, low in out.per_batch]
    assert lows[emitted_in - 1] <= TXN < lows[emitted_in]
    assert TXN < T0 + 4 * S  # within batch 2's span (max_batch_span 2 s): read by p1 there


def test_source_filters_give_partial_transactions_checked_against_their_counts(
    runner: Runner,
) -> None:
    s = stream()
    out = Collect[Transaction]()
    run(runner, pipeline(s, out, tables=["Orders"]))
    want = truth(s)
    partial = [t for t in out.items if not t.complete]
    assert partial  # transactions that also wrote Items
    for txn in out.items:
        assert txn.tables == ("Orders",)
        full = want[(txn.commit_timestamp.ns, txn.server_transaction_id)]
        assert len(txn.records) == sum(r.table_name == "Orders" for r in full)
        assert txn.complete == (len(txn.records) == len(full))


class Dropping:
    """A client that loses one record of one transaction (a stand-in for a lost read)."""

    def __init__(self, inner: ScriptedChangeStream, tag: str) -> None:
        self.inner, self.tag = inner, tag

    def describe_stream(self, stream: str) -> StreamInfo:
        return self.inner.describe_stream(stream)

    def read(self, query: ChangeStreamQuery) -> Iterator[Any]:
        for record in self.inner.read(query):
            if (isinstance(record, DataChangeRecord) and record.transaction_tag == self.tag
                    and record.partition_token == "b"):
                continue
            yield record

    def close(self) -> None:
        self.inner.close()


def test_a_transaction_missing_records_stops_the_run_naming_it(runner: Runner) -> None:
    s = stream()
    out = Collect[Transaction]()
    store = MemoryStore()
    with pytest.raises(IncompleteTransactionError) as info:
        run(runner, pipeline(Dropping(s, "wide"), out), store)
    (txn_id,) = {r.server_transaction_id for r in s.expected_records(TXN, TXN + 1)}
    text = str(info.value)
    assert txn_id in text and "from 2 partition(s)" in text and "from 3 partition(s)" in text
    assert "likely cause" in text
    assert store.pending_plan("txns") is not None  # the batch was not committed
    assert all(t.transaction_tag != "wide" for t in out.items)


def _rows(directory: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("part-"):
            rows += [orjson.loads(line) for line in (directory / name).read_bytes().splitlines()]
    return rows


def as_row(t: Transaction) -> dict[str, Any]:
    return {"at": t.commit_timestamp.ns, "id": t.server_transaction_id,
            "records": len(t.records), "tables": list(t.tables)}


# Batch 3 reads p1's record of the wide transaction (held in the state), batch 4 the rest
# of it from p0's children (and emits it).
@pytest.mark.parametrize(("stage", "batch"),
                         [("planned", 3), ("sinks", 3), ("sinks", 4), ("batch", 3)])
def test_a_crash_at_any_stage_gives_each_transaction_once(
    runner: Runner, tmp_path: Path, stage: str, batch: int
) -> None:
    s = stream()
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    run(runner, pipeline(s, Map(as_row), WriteFiles(clean)))
    store = SQLiteStore(tmp_path / "state.db")
    with pytest.raises(_Crash):
        run(runner, pipeline(s, Map(as_row), WriteFiles(crashed)), store,
            CrashAt(stage, batch))
    # a plan is written once its tasks have returned: after on_planned, before the sinks
    assert (store.pending_plan("txns") is not None) == (stage == "sinks")
    store.close()
    store = SQLiteStore(tmp_path / "state.db")  # a new run, as after a restart
    summary = run(runner, pipeline(s, Map(as_row), WriteFiles(crashed)), store)
    store.close()
    assert summary.reason == "end reached"
    rows = _rows(crashed)
    assert rows == _rows(clean)
    assert [(r["at"], r["id"]) for r in rows] == sorted(truth(s))
    names = sorted(n for n in os.listdir(clean) if n.startswith("part-"))
    assert names == sorted(n for n in os.listdir(crashed) if n.startswith("part-"))


def test_the_state_survives_a_restart_on_sqlite(tmp_path: Path) -> None:
    s = stream()
    clean = Collect[Transaction]()
    run(_memory(), pipeline(s, clean))
    first, second = Collect[Transaction](), Collect[Transaction]()
    store = SQLiteStore(tmp_path / "state.db")
    run(_memory(), pipeline(s, first), store, max_batches=3)
    store.close()
    store = SQLiteStore(tmp_path / "state.db")
    blob = store.step_state("txns")
    assert blob is not None
    held = pickle.loads(blob)["GroupTransactions"]
    assert TXN in {at for at, _ in held}  # p1's part of the wide transaction waits there
    run(_memory(), pipeline(s, second), store)
    store.close()
    assert first.items + second.items == clean.items
    wide = [t for t in second.items if t.transaction_tag == "wide"]
    assert len(wide) == 1 and len(wide[0].partitions) == 3


def test_a_batch_step_must_follow_read_partition() -> None:
    p = cf.Pipeline("bad")
    (p | DetectPartitions(stream="S", start_at=T0, end_at=END, client=stream())
     | GroupTransactions() | Collect())
    with pytest.raises(PipelineDefinitionError, match="put ReadPartition"):
        p.validate()


def test_two_batch_steps_on_one_path_are_refused() -> None:
    p = pipeline(stream(), "again" >> GroupTransactions(), Collect(), name="two")
    with pytest.raises(PipelineDefinitionError, match="at most one BatchStep on any path"):
        p.validate()


def test_a_staging_sink_fed_by_a_batch_step_is_refused(tmp_path: Path) -> None:
    p = pipeline(stream(), FlatMap(lambda t: t.records), WriteTables(str(tmp_path / "lake")))
    with pytest.raises(PipelineDefinitionError, match="stages batches"):
        run(_memory(), p)


def test_a_staging_sink_beside_a_batch_step_replays_without_it(tmp_path: Path) -> None:
    p = cf.Pipeline("beside")
    records = (p | DetectPartitions(stream="S", start_at=T0, end_at=END - 1, client=stream())
               | ReadPartition(heartbeat="500ms"))
    out = Collect[Transaction]()
    records | GroupTransactions() | out
    records | WriteTables(str(tmp_path / "lake"), format="jsonl", file_size="1GiB")
    summary = run(_memory(), p)
    assert summary.reason == "end reached" and len(out.items) == len(truth(stream()))


def _ident(r: DataChangeRecord) -> tuple[str, str, str]:
    return r.partition_token, r.record_sequence, r.table_name


def _memory() -> Runner:
    from cdcflow.runners.in_memory import InMemoryRunner

    return InMemoryRunner(workers=2)
