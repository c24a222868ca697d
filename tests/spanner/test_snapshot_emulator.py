"""Snapshot then stream against the Cloud Spanner emulator, in both dialects.

A workload writes to the shop database before the start, while the snapshot is read and
while the stream is read. Replaying the pipeline's output (snapshot rows as upserts, then
the changes in output order) must give what a strong read of the database gives at the
end, and the snapshot must be the database as of ``start - 1 ns``: a row the workload
deletes after the start is in it.
"""

from __future__ import annotations

from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.errors import ChangeStreamError
from cdcflow.metadata import MemoryStore
from cdcflow.model import DataChangeRecord, Timestamp
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.retry import RetryPolicy
from cdcflow.spanner.workload import (
    SHOP_COLUMNS,
    SHOP_KEY,
    SHOP_STREAM,
    SHOP_TABLE,
    Workload,
    create_shop_database,
)
from cdcflow.transforms import Collect, ReadChangeStream
from tests.spanner.test_typed_emulator import TYPED, _name, _Written

pytestmark = pytest.mark.emulator

S = 1_000_000_000
Key = int
State = dict[Key, dict[str, Any]]


def _apply(state: State, mod_type: str, key: Key, values: dict[str, Any]) -> None:
    if mod_type == "DELETE":
        state.pop(key, None)
    elif mod_type == "INSERT" or key not in state:
        state[key] = {c: None for c in SHOP_COLUMNS} | dict(values)
    else:
        state[key].update(values)


def replay(records: list[DataChangeRecord]) -> State:
    state: State = {}
    for r in records:
        assert r.table_name == SHOP_TABLE
        for m in r.mods:
            _apply(state, r.mod_type, m.keys[SHOP_KEY], dict(m.new_values))
    return state


def strong_read(db: Any, dialect: str) -> State:
    quote = '"' if dialect == "POSTGRESQL" else "`"
    columns = ", ".join(f"{quote}{c}{quote}" for c in (SHOP_KEY, *SHOP_COLUMNS))
    with db.snapshot() as snap:
        rows = list(snap.execute_sql(f"SELECT {columns} FROM {quote}{SHOP_TABLE}{quote}"))
    out: State = {}
    for row in rows:
        values = dict(zip(SHOP_COLUMNS, row[1:], strict=True))
        details = values["Details"]
        if details is not None:  # the stock client's JsonObject: compare as plain JSON
            values["Details"] = _plain(details)
        out[int(row[0])] = values
    return out


def _plain(value: Any) -> Any:
    import json

    serialize = getattr(value, "serialize", None)
    return json.loads(serialize()) if serialize is not None else value


@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def test_snapshot_then_stream_replays_to_the_database_under_a_concurrent_workload(
    spanner_emulator: Emulator, dialect: str
) -> None:
    name = f"snap{dialect[:2].lower()}"
    db = create_shop_database(spanner_emulator, name, dialect)  # type: ignore[arg-type]
    before = Workload(db, rate=None, seed=5)
    before.run(count=120)
    at_start: State = {}
    for change in before.changes:
        _apply(at_start, change.mod_type, change.keys[SHOP_KEY], dict(change.new_values))
    start = before.committed[-1].commit_ns + 1  # every commit before it is in the snapshot

    during = Workload(db, rate=40, seed=6)
    during.start(count=160)  # about 4 s: during the snapshot and the stream
    end = max(start, Timestamp.now().ns) + 9 * S
    out = Collect()
    p = cf.Pipeline(f"snapshot-{dialect}")
    (p
     | ReadChangeStream(spanner_emulator.database_path(name), SHOP_STREAM, start_at=start,
                        end_at=end, heartbeat="250ms", snapshot=True,
                        data_boost=dialect == "POSTGRESQL")
     | out)
    try:
        options = RunOptions(max_batch_span=2.0, batch_interval=0.2, batch_retries=2)
        summary = Engine(p, MemoryStore(), InMemoryRunner(), options).run()
    finally:
        during.stop()
    assert summary.reason == "end reached"
    assert during.transactions == 160
    assert during.committed[-1].commit_ns < end, "the workload outlasted the read window"

    records: list[DataChangeRecord] = out.items
    flags = [r.is_snapshot for r in records]
    first_change = flags.index(False)
    assert all(flags[:first_change]) and not any(flags[first_change:])
    snapshot = records[:first_change]
    assert {r.partition_token for r in snapshot} == {f"snapshot/{SHOP_TABLE}"}
    assert all(r.commit_timestamp.ns == start - 1 and r.mod_type == "INSERT" for r in snapshot)

    # The snapshot is the database as of start - 1 ns, typed like the changes ...
    assert replay(snapshot) == at_start
    # ... rows deleted after the start are in it, and their deletes come as changes ...
    deleted_later = {
        c.keys[SHOP_KEY] for c in during.changes if c.mod_type == "DELETE"
        and c.keys[SHOP_KEY] in at_start
    }
    assert deleted_later, "the workload deleted no row that existed at the start"
    changes = records[first_change:]
    assert all(r.commit_timestamp.ns >= start for r in changes)
    deletes = {m.keys[SHOP_KEY] for r in changes if r.mod_type == "DELETE" for m in r.mods}
    assert deleted_later <= deletes
    # ... no change is missed or repeated ...
    assert sum(len(r.mods) for r in changes) == len(during.changes)
    # ... and snapshot plus changes, in output order, are the database at the end.
    assert replay(records) == strong_read(db, dialect)


@pytest.fixture(scope="module", params=["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def written(request: pytest.FixtureRequest, spanner_emulator: Emulator) -> _Written:
    return _Written(spanner_emulator, request.param)


def test_snapshot_values_are_typed_like_change_records(written: _Written) -> None:
    client = written.client()
    try:
        assert client.snapshot_tables(written.stream) == sorted([written.table, written.other])
        (record,) = client.snapshot(written.stream, written.table, written.end)
        other = list(client.snapshot(written.stream, written.other, written.end))
    finally:
        client.close()
    assert record.is_snapshot and record.commit_timestamp.ns == written.end
    assert record.server_transaction_id == "snapshot" and record.record_sequence == "00000000"
    (mod,) = record.mods  # row 2 was deleted before the read timestamp
    d = written.dialect
    assert mod.keys == {_name("Id", d): 1}
    typed = {**TYPED, "S": "changed"}  # updated after the insert
    values = {c: mod.new_values[_name(c, d)] for c in typed}
    for column, want in typed.items():
        assert values[column] == want, column
        assert type(values[column]) is type(want), column
    # A stale read keeps the fraction of a second that the emulator's stream drops.
    fraction = "123456789" if d == "GOOGLE_STANDARD_SQL" else "123456000"
    assert mod.new_values[_name("T", d)] == Timestamp.parse(f"2024-05-01T12:00:00.{fraction}Z")
    # Column types as the stream reports them, keys marked.
    changes, _ = written.read()
    insert = changes[0]
    stream_types = {c.name: (c.type, c.is_primary_key) for c in insert.column_types}
    assert {c.name: (c.type, c.is_primary_key) for c in record.column_types} == stream_types
    # Only the columns the stream tracks: Other(V) and its key.
    (row,) = other
    assert [c.name for c in row.column_types] == [_name("K", d), _name("V", d)]
    assert row.mods[0].keys == {_name("K", d): "a"} and row.mods[0].new_values == {
        _name("V", d): 1}


def test_snapshot_filters_and_wire_values(written: _Written) -> None:
    d = written.dialect
    client = written.client(typed=False, columns={written.table: [_name("I", d)]})
    try:
        (record,) = client.snapshot(written.stream, written.table, written.end)
        dropped = client.with_options(
            filter=cf_filter(tables=[written.other])
        ).snapshot(written.stream, written.table, written.end)
        assert list(dropped) == []
    finally:
        client.close()
    assert [c.name for c in record.column_types] == [_name("Id", d), _name("I", d)]
    assert record.mods[0].keys == {_name("Id", d): "1"}
    assert record.mods[0].new_values == {_name("I", d): str(-(2**63))}


def test_a_snapshot_older_than_the_kept_versions_names_the_fix(written: _Written) -> None:
    client = written.client()
    # Two hours ago the database did not exist yet: the emulator's PostgreSQL dialect looks
    # the table up in the schema of that time first, GoogleSQL checks the staleness first.
    error, fix = (ChangeStreamError, "version_retention_period") if (
        written.dialect == "GOOGLE_STANDARD_SQL") else (Exception, "does not exist")
    try:
        with pytest.raises(error, match=fix):
            list(client.snapshot(written.stream, written.table, written.start - 7200 * S))
    finally:
        client.close()


def test_a_snapshot_read_rides_out_a_short_outage(
    written: _Written, spanner_emulator: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections are refused for a moment right before the snapshot's queries: the
    client's bounded retries carry the read through, with the same rows as without."""
    from tests.faults.proxy import FaultProxy

    want = _snapshot(written.client(), written)
    with FaultProxy(spanner_emulator.host, lifetime=60) as proxy:
        monkeypatch.setenv("SPANNER_EMULATOR_HOST", proxy.host)
        client = SpannerChangeStreamClient(
            written.path, retry=RetryPolicy(attempts=30, initial=0.1, maximum=0.5),
        )
        client.snapshot_tables(written.stream)  # connected, the stream described
        proxy.drop(1.5)
        assert _snapshot(client, written) == want
        assert [e.kind for e in proxy.events] == ["drop"]


def _snapshot(client: SpannerChangeStreamClient, written: _Written) -> list[Any]:
    try:
        return [r.mods for r in client.snapshot(written.stream, written.table, written.end)]
    finally:
        client.close()


def cf_filter(**options: Any) -> Any:
    from cdcflow.stream import RecordFilter

    return RecordFilter.build(**options)
