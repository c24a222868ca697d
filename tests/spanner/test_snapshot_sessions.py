"""Snapshot reads of several tables at once through one client, on the emulator: each read
holds a read-only transaction, and a session runs one transaction at a time, so reads that
shared the client's session invalidated each other ("Invalid transaction ID")."""

from __future__ import annotations

import threading

import pytest

from cdcflow.model import Timestamp
from cdcflow.spanner.client import SpannerChangeStreamClient
from cdcflow.spanner.emulator import Emulator
from tests.e2e_features import FEATURE_STREAM, bulk_insert_orders, create_feature_database
from tests.e2e_helpers import unique

pytestmark = pytest.mark.emulator


def test_tables_read_concurrently_through_one_client(spanner_emulator: Emulator) -> None:
    name = unique("ses")
    db = create_feature_database(spanner_emulator, name)
    after_orders = bulk_insert_orders(db, 4000)
    with db.batch() as batch:
        batch.insert("Notes", ["NoteId", "Body"], [[i, f"n{i}"] for i in range(2500)])
        batch.insert("Tags", ["TagId", "Label"], [[i, f"t{i}"] for i in range(1500)])
    # after every insert (the emulator's commit timestamps can run ahead of the host clock)
    at = max(after_orders, Timestamp.now().ns, Timestamp.from_datetime(batch.committed).ns + 1)
    client = SpannerChangeStreamClient(spanner_emulator.database_path(name))
    rows: dict[str, int] = {}
    errors: list[BaseException] = []

    def read(table: str) -> None:
        try:
            rows[table] = sum(len(r.mods) for r in client.snapshot(FEATURE_STREAM, table, at))
        except BaseException as e:  # handed to the test's thread
            errors.append(e)

    try:
        threads = [threading.Thread(target=read, args=(t,)) for t in ("Orders", "Notes", "Tags")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        client.close()
    assert not errors, errors
    assert rows == {"Orders": 4000, "Notes": 2500, "Tags": 1500}
