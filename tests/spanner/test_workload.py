"""The shop database and the workload's ground truth, on the emulator."""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from cdcflow.errors import CdcflowError
from cdcflow.model import (
    ChildPartitionsRecord,
    DataChangeRecord,
    Timestamp,
)
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import (
    SHOP_COLUMNS,
    SHOP_KEY,
    SHOP_STREAM,
    SHOP_TABLE,
    CommittedChange,
    Dialect,
    Workload,
    create_shop_database,
    shop_ddl,
)
from cdcflow.stream import ChangeStreamQuery


def test_shop_ddl_validates_its_parameters() -> None:
    with pytest.raises(ValueError, match="GOOGLE_STANDARD_SQL or POSTGRESQL"):
        shop_ddl("MYSQL")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="NEW_ROW"):
        shop_ddl(value_capture_type="EVERYTHING")  # type: ignore[arg-type]
    assert "value_capture_type = 'NEW_ROW'" in shop_ddl("POSTGRESQL", "NEW_ROW")[1]


def test_workload_parameters_are_checked() -> None:
    with pytest.raises(ValueError, match="positive"):
        Workload(None, rate=0)
    with pytest.raises(ValueError, match="max_rows"):
        Workload(None, max_rows=0)


def _name() -> str:
    return f"shop-{uuid.uuid4().hex[:20]}"


def _rows(db: Any) -> dict[int, dict[str, Any]]:
    from google.cloud.spanner import KeySet

    with db.snapshot() as snap:
        rows = snap.read(SHOP_TABLE, [SHOP_KEY, *SHOP_COLUMNS], KeySet(all_=True))  # type: ignore[no-untyped-call]
        return {int(r[0]): dict(zip(SHOP_COLUMNS, r[1:], strict=True)) for r in rows}


def _replay(changes: list[CommittedChange]) -> dict[int, dict[str, Any]]:
    """The table the recorded changes produce from an empty one."""
    table: dict[int, dict[str, Any]] = {}
    for c in changes:
        key = c.keys[SHOP_KEY]
        if c.mod_type == "INSERT":
            assert key not in table
            table[key] = dict(c.new_values)
        elif c.mod_type == "UPDATE":
            table[key].update(c.new_values)
        else:
            del table[key]
    return table


@pytest.mark.emulator
@pytest.mark.parametrize("dialect", ["GOOGLE_STANDARD_SQL", "POSTGRESQL"])
def test_the_recorded_changes_replay_to_the_table(
    spanner_emulator: Emulator, dialect: Dialect
) -> None:
    db = create_shop_database(spanner_emulator, _name(), dialect, "NEW_ROW")
    workload = Workload(db, rate=None, seed=7, max_rows=4, multi_row_share=0.5)
    done = workload.run(count=40)
    assert len(done) == workload.transactions == 40
    assert workload.committed == done
    changes = workload.changes
    assert {c.mod_type for c in changes} == {"INSERT", "UPDATE", "DELETE"}
    assert any(len(tx.changes) > 1 for tx in done) and any(len(tx.changes) == 1 for tx in done)
    # Sequential commits have increasing timestamps; each change carries its transaction's.
    assert all(a.commit_ns < b.commit_ns for a, b in itertools.pairwise(done))
    assert all(c.commit_ns == done[c.transaction].commit_ns for c in changes)
    for tx in done:  # a key changes at most once per transaction
        keys = [c.keys[SHOP_KEY] for c in tx.changes]
        assert len(keys) == len(set(keys))
    expected = _replay(changes)
    assert _rows(db) == expected
    assert workload.live_keys == set(expected)
    with db.snapshot() as snap:
        options = list(snap.execute_sql(
            "SELECT option_value FROM information_schema.change_stream_options "
            "WHERE option_name = 'value_capture_type'"))
    assert options == [["NEW_ROW"]]


@pytest.mark.emulator
@pytest.mark.timeout(120)
def test_a_key_space_smaller_than_the_transactions_never_stalls(
    spanner_emulator: Emulator,
) -> None:
    # Keys 1..3: every key is soon live, and a transaction may want more rows than keys.
    db = create_shop_database(spanner_emulator, _name())
    workload = Workload(db, rate=None, seed=2, max_rows=6, multi_row_share=0.7, key_space=4)
    done = workload.run(count=150)
    assert len(done) == 150 and all(1 <= len(tx.changes) <= 3 for tx in done)
    assert _rows(db) == _replay(workload.changes)
    assert workload.live_keys <= {1, 2, 3}
    with pytest.raises(ValueError, match="key_space >= 2"):
        Workload(db, key_space=1)


@pytest.mark.emulator
def test_a_second_workload_continues_on_the_existing_rows(spanner_emulator: Emulator) -> None:
    db = create_shop_database(spanner_emulator, _name())
    first = Workload(db, rate=None, seed=1)
    first.run(count=15)
    second = Workload(db, rate=None, seed=2)
    second.run(count=15)
    # The second one knew the live keys: its updates and deletes hit existing rows.
    assert _rows(db) == _replay(first.changes + second.changes)


@pytest.mark.emulator
def test_the_stream_reports_exactly_the_recorded_changes(spanner_emulator: Emulator) -> None:
    name = _name()
    db = create_shop_database(spanner_emulator, name, value_capture_type="NEW_ROW")
    start = Timestamp.now().ns
    workload = Workload(db, rate=None, seed=3)
    workload.start(count=25)
    workload.stop()
    end = workload.committed[-1].commit_ns + 1
    client = SpannerChangeStreamClient(spanner_emulator.database_path(name))
    try:
        data = _read_stream(client, start, end)
    finally:
        client.close()
    read = sorted(
        (r.commit_timestamp.ns, r.mod_type, int(m.keys[SHOP_KEY]))
        for r in data for m in r.mods
    )
    recorded = sorted((c.commit_ns, c.mod_type, c.keys[SHOP_KEY]) for c in workload.changes)
    assert read == recorded
    # NEW_ROW: inserts and updates report the whole row the workload's model holds.
    row_after = {(c.commit_ns, c.keys[SHOP_KEY]): c for c in workload.changes}
    inserts = [(r, m) for r in data for m in r.mods if r.mod_type == "INSERT"]
    assert inserts
    for r, m in inserts:
        change = row_after[(r.commit_timestamp.ns, int(m.keys[SHOP_KEY]))]
        details = m.new_values["Details"]
        # The stream renders a JSON column's value as JSON text inside the mod.
        assert (json.loads(details) if isinstance(details, str) else details) == (
            change.new_values["Details"])
        assert m.new_values["Customer"] == change.new_values["Customer"]


def _read_stream(client: SpannerChangeStreamClient, start: int, end: int
                 ) -> list[DataChangeRecord]:
    """Follow the stream from the root partition through every child up to ``end``."""
    queue: list[tuple[str | None, int]] = [(None, start)]
    seen: set[str] = set()
    data: list[DataChangeRecord] = []
    while queue:
        token, begin = queue.pop(0)
        for r in client.read(ChangeStreamQuery(SHOP_STREAM, token, begin, end, 500)):
            if isinstance(r, DataChangeRecord):
                data.append(r)
            elif isinstance(r, ChildPartitionsRecord):
                for child in r.child_partitions:
                    if child.token not in seen:
                        seen.add(child.token)
                        queue.append((child.token, r.start_timestamp.ns))
    return data


@pytest.fixture
def running() -> Iterator[list[Workload]]:
    started: list[Workload] = []
    yield started
    for w in started:
        with contextlib.suppress(Exception):  # the test has reported the failure already
            w.stop()


@pytest.mark.emulator
def test_start_and_stop_in_a_thread(spanner_emulator: Emulator, running: list[Workload]) -> None:
    db = create_shop_database(spanner_emulator, _name())
    workload = Workload(db, rate=200, seed=4)
    running.append(workload)
    thread = workload.start()
    with pytest.raises(CdcflowError, match="already running"):
        workload.start()
    while workload.transactions < 3:
        thread.join(0.05)
    workload.stop()
    assert not thread.is_alive()
    count = workload.transactions
    assert count >= 3 and _rows(db) == _replay(workload.changes)


@pytest.mark.emulator
def test_stop_reraises_what_the_thread_raised(spanner_emulator: Emulator) -> None:
    db = create_shop_database(spanner_emulator, _name())
    db.update_ddl([f"DROP CHANGE STREAM {SHOP_STREAM}", f"DROP TABLE {SHOP_TABLE}"]).result(60)
    workload = Workload(db, rate=None)
    workload.start(count=1)
    with pytest.raises(Exception, match=SHOP_TABLE):
        workload.stop()


@pytest.mark.emulator
def test_create_with_a_client_refuses_an_existing_database(spanner_emulator: Emulator) -> None:
    name = _name()
    client = spanner_emulator.client()
    db = create_shop_database(client, name, "POSTGRESQL")
    with db.snapshot() as snap:
        streams = list(snap.execute_sql(
            "SELECT change_stream_name FROM information_schema.change_streams"))
    assert streams == [["ordersstream"]]  # PostgreSQL folds the unquoted name
    with pytest.raises(CdcflowError, match="already exists"):
        create_shop_database(client, name)
    with pytest.raises(CdcflowError, match="instance 'nowhere' does not exist"):
        create_shop_database(client, _name(), instance="nowhere")
