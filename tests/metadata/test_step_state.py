"""The BatchSteps' state in every store: stored with the batch commit, read back, reset.

Runs against every store in conftest.STORE_FACTORIES (the Spanner ones on the emulator).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from cdcflow.errors import FencedError
from cdcflow.metadata import MetadataStore, SQLiteStore, open_store
from cdcflow.metadata.sqlite import SCHEMA_VERSION
from cdcflow.model import PartitionState, PartitionUpdate
from tests.metadata.test_contract import P, part, plan

RUNNING = PartitionState.RUNNING


def _batch(store: MetadataStore, batch_id: int, state: bytes | None, watermark: int,
           fence: int | None = None) -> bool:
    store.write_plan(P, plan(batch_id, end=watermark, tokens=("a",), start=watermark - 100),
                     {"a": RUNNING}, fence=fence)
    return store.commit_batch(P, batch_id, [PartitionUpdate("a", watermark, False)], [],
                              fence=fence, state=state)


def test_the_state_is_stored_with_the_batch_commit(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("a")])
    assert store.step_state(P) is None
    assert _batch(store, 1, b"one", 200)
    assert store.step_state(P) == b"one"
    # A batch without state leaves the stored one; the next state replaces it.
    assert _batch(store, 2, None, 300)
    assert store.step_state(P) == b"one"
    assert _batch(store, 3, b"\x00three\xff", 400)
    assert store.step_state(P) == b"\x00three\xff"
    # Committing a committed batch again stores nothing.
    assert not store.commit_batch(P, 3, [PartitionUpdate("a", 400, False)], [], state=b"x")
    assert store.step_state(P) == b"\x00three\xff"
    assert store.step_state("other") is None


def test_a_pending_batch_has_not_changed_the_state(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("a")])
    _batch(store, 1, b"committed", 200)
    store.write_plan(P, plan(2, end=300, tokens=("a",), start=200), {})
    assert store.step_state(P) == b"committed"  # what a replay of batch 2 starts from


def test_a_fenced_commit_stores_no_state(store: MetadataStore) -> None:
    lease = store.acquire_lease(P, "host:1", "run-1", 10**12)
    store.insert_partitions(P, [part("a")])
    _batch(store, 1, b"mine", 200, fence=lease.token)
    store.write_plan(P, plan(2, end=300, tokens=("a",), start=200), {}, fence=lease.token)
    store.acquire_lease(P, "host:2", "run-2", 10**12, replace=lease.token)
    with pytest.raises(FencedError):
        store.commit_batch(P, 2, [PartitionUpdate("a", 300, False)], [], fence=lease.token,
                           state=b"stale")
    assert store.step_state(P) == b"mine"


def test_reset_forgets_the_state(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("a")])
    _batch(store, 1, b"before", 200)
    store.reset(P)
    assert store.step_state(P) is None


def test_the_state_survives_reopening(store: MetadataStore) -> None:
    store.insert_partitions(P, [part("a")])
    _batch(store, 1, bytes(range(256)) * 64, 200)
    again = open_store(store.url)
    try:
        assert again.step_state(P) == bytes(range(256)) * 64
    finally:
        if again is not store:
            again.close()


@pytest.mark.emulator
def test_the_spanner_store_keeps_a_state_larger_than_a_cell(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    from tests.metadata.conftest import STORE_FACTORIES

    store = STORE_FACTORIES["spanner"].make(request, tmp_path)
    try:
        store.insert_partitions(P, [part("a")])
        big = bytes(range(251)) * ((12 << 20) // 251 + 1)  # over one 10 MiB BYTES cell
        _batch(store, 1, big, 200)
        assert store.step_state(P) == big
        _batch(store, 2, b"small again", 300)  # the chunks past the new last one go
        assert store.step_state(P) == b"small again"
    finally:
        store.close()


def test_a_version_2_sqlite_file_is_upgraded_in_place(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    # A file as version 2 wrote it: the pipelines table without step_state.
    SQLiteStore(db).close()
    with sqlite3.connect(db) as raw:
        raw.execute("ALTER TABLE pipelines DROP COLUMN step_state")
        raw.execute("UPDATE cdcflow_schema SET version = 2")
        raw.execute("INSERT INTO pipelines (pipeline, source) VALUES ('orders', '{}')")
    store = SQLiteStore(db)
    try:
        assert store.source(P) == "{}"  # rows of version 2 read as before
        assert store.step_state(P) is None
        store.insert_partitions(P, [part("a")])
        _batch(store, 1, b"state", 200)
        assert store.step_state(P) == b"state"
    finally:
        store.close()
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT MAX(version) FROM cdcflow_schema").fetchone() == (
            SCHEMA_VERSION,)

