"""SQLiteStore specifics: WAL, schema versions, several connections and processes on one file."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cdcflow.errors import PlanConflictError, StoreError, StoreNotFoundError, StoreSetupError
from cdcflow.metadata import SQLiteStore, open_store, sqlite_url
from cdcflow.metadata.sqlite import SCHEMA_VERSION
from cdcflow.model import MAX_NS, BatchPlan, PartitionMetadata, PartitionState, PartitionUpdate

P = "orders"


def part(token: str, start: int = 100) -> PartitionMetadata:
    return PartitionMetadata(token, (), start, MAX_NS, start, PartitionState.CREATED)


def run_python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "meta.db"


def test_the_database_is_in_wal_mode_with_a_busy_timeout(db: Path) -> None:
    store = SQLiteStore(db, busy_timeout=2.5)
    with sqlite3.connect(db) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn = store._db.connection()
    assert conn is not None
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 2500
    store.close()


def test_missing_parent_directories_are_created(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "meta.db"
    store = open_store(sqlite_url(path))
    store.insert_partitions(P, [part("x")])
    store.close()
    assert path.is_file()


def test_a_new_file_records_the_schema_version(db: Path) -> None:
    SQLiteStore(db).close()
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT version FROM cdcflow_schema").fetchall() == [(SCHEMA_VERSION,)]
    SQLiteStore(db).close()  # reopening does not add a second version row
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT COUNT(*) FROM cdcflow_schema").fetchone()[0] == 1


def test_a_newer_schema_version_is_refused(db: Path) -> None:
    SQLiteStore(db).close()
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE cdcflow_schema SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError, match=r"newer cdcflow.*upgrade cdcflow"):
        SQLiteStore(db)


def test_a_file_that_is_not_a_database_is_refused(db: Path) -> None:
    db.write_text("hello, not sqlite " * 100)
    with pytest.raises(StoreError, match="not a usable SQLite database"):
        SQLiteStore(db)


def test_a_damaged_page_found_after_opening_is_a_setup_error(db: Path) -> None:
    # (exit 2, as a file that cannot be opened: retrying cannot mend it)
    store = SQLiteStore(db)
    store.insert_partitions(P, [part(f"t{i:05d}") for i in range(2000)])
    store.close()
    raw = db.read_bytes()
    found = 0
    for page in range(2, len(raw) // 4096):
        bad = db.with_name(f"bad{page}.db")
        bad.write_bytes(raw[:4096 * page] + b"\xde\xad" * 2048 + raw[4096 * (page + 1):])
        try:
            damaged = SQLiteStore(bad)
        except StoreSetupError:  # found while opening
            continue
        try:
            damaged.partitions(P)
        except StoreError as e:
            assert isinstance(e, StoreSetupError), e
            assert "is not a usable SQLite database" in str(e)
            found += 1
        finally:
            damaged.close()
    assert found


def test_positions_keep_the_full_int64_range(db: Path) -> None:
    store = SQLiteStore(db)
    store.insert_partitions(P, [PartitionMetadata("x", (), 0, MAX_NS, MAX_NS - 1, "CREATED")])
    store.write_plan(P, BatchPlan(1, MAX_NS, ()), {})
    store.commit_batch(P, 1, [PartitionUpdate("x", MAX_NS, finished=True)], [])
    (row,) = store.partitions(P)
    assert row.end == MAX_NS and row.watermark == MAX_NS
    assert store.batches(P)[0].end == MAX_NS
    store.close()


def test_a_closed_store_says_how_to_reopen(db: Path) -> None:
    store = SQLiteStore(db)
    store.close()
    store.close()
    with pytest.raises(StoreError, match=r"closed; open it again"):
        store.partitions(P)


def test_two_connections_share_one_file(db: Path) -> None:
    a, b = SQLiteStore(db), SQLiteStore(db)
    a.insert_partitions(P, [part("x")])
    assert [p.token for p in b.partitions(P)] == ["x"]
    a.write_plan(P, BatchPlan(1, 500, ()), {"x": PartitionState.RUNNING})
    with pytest.raises(PlanConflictError):
        b.write_plan(P, BatchPlan(2, 600, ()), {})
    assert b.commit_batch(P, 1, [PartitionUpdate("x", 500)], [])
    assert not a.commit_batch(P, 1, [PartitionUpdate("x", 500)], [])
    assert a.partitions(P)[0].watermark == 500
    a.close()
    b.close()


def test_a_write_waits_for_another_writer_then_reports_the_lock(db: Path) -> None:
    store = SQLiteStore(db, busy_timeout=0.05)
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(StoreError, match="locked by another process"):
        store.insert_partitions(P, [part("x")])
    holder.execute("ROLLBACK")
    holder.close()
    assert store.insert_partitions(P, [part("x")]) == 1
    store.close()


def test_the_batch_log_keeps_the_newest_entries(db: Path) -> None:
    store = SQLiteStore(db, batch_log_size=3)
    for i in range(1, 7):
        store.write_plan(P, BatchPlan(i, i * 10, ()), {})
        if i < 6:
            store.commit_batch(P, i, [], [])
    assert [b.batch_id for b in store.batches(P)] == [6, 5, 4]
    assert store.last_batch_id(P) == 6
    store.close()


_RACE = """
    import sys
    from cdcflow.errors import PlanConflictError
    from cdcflow.metadata import open_store
    from cdcflow.model import BatchPlan, PartitionMetadata

    store = open_store(sys.argv[1])
    me = sys.argv[2]
    for i in range(20):
        store.insert_partitions(
            "orders", [PartitionMetadata(f"{me}-{i}", (), 0, 100, 0, "CREATED")]
        )
    try:
        store.write_plan("orders", BatchPlan(1, 100, ()), {})
        print("planned")
    except PlanConflictError:
        print("conflict")
    store.close()
"""


def test_processes_writing_one_file_serialize(db: Path) -> None:
    SQLiteStore(db).close()
    procs = [run_python(_RACE, sqlite_url(db), f"w{n}") for n in range(4)]
    outcomes = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        outcomes.append(out.strip())
    assert sorted(outcomes) == ["conflict"] * 3 + ["planned"]
    store = SQLiteStore(db)
    assert len(store.partitions(P)) == 80
    assert store.last_batch_id(P) == 1
    store.close()


_CRASH_IN_COMMIT = """
    import os, sys
    from cdcflow.metadata import SQLiteStore
    from cdcflow.model import PartitionUpdate

    def die(*args, **kwargs):
        os._exit(3)  # the process dies after the watermark updates, before COMMIT

    SQLiteStore._insert = staticmethod(die)
    store = SQLiteStore(sys.argv[1])
    store.commit_batch("orders", 1, [PartitionUpdate("x", 900, finished=True)], [])
"""


def test_a_process_that_dies_mid_commit_leaves_the_previous_state(db: Path) -> None:
    store = SQLiteStore(db)
    store.insert_partitions(P, [part("x")])
    store.write_plan(P, BatchPlan(1, 900, ()), {"x": PartitionState.RUNNING})
    before = store.partitions(P)
    store.close()

    proc = run_python(_CRASH_IN_COMMIT, str(db))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err

    again = SQLiteStore(db)
    assert again.partitions(P) == before
    assert again.pending_plan(P) == BatchPlan(1, 900, (), planned_at=again.batches(P)[0].planned_at)
    assert again.commit_batch(P, 1, [PartitionUpdate("x", 900, finished=True)], [])
    assert again.partitions(P)[0].state == PartitionState.FINISHED
    again.close()


def test_a_version_3_file_gets_the_batch_statistics_column(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    store = SQLiteStore(db)
    store.insert_partitions(P, [part("a")])
    store.write_plan(P, BatchPlan(1, 200, (), planned_at=1), {})
    store.commit_batch(P, 1, [PartitionUpdate("a", 200)], [])
    store.close()
    with sqlite3.connect(db) as raw:  # the file as version 3 wrote it
        raw.execute("ALTER TABLE batches DROP COLUMN stats")
        raw.execute("UPDATE cdcflow_schema SET version = 3")
    store = SQLiteStore(db)
    try:
        assert [b.stats for b in store.batches(P)] == [{}]  # rows of version 3 read as before
        store.write_plan(P, BatchPlan(2, 300, (), planned_at=2), {})
        store.commit_batch(P, 2, [PartitionUpdate("a", 300)], [], stats={"retries": 1})
        assert [b.stats for b in store.batches(P)] == [{"retries": 1}, {}]
    finally:
        store.close()
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT MAX(version) FROM cdcflow_schema").fetchone() == (
            SCHEMA_VERSION,)


def _files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_opening_without_create_creates_and_changes_nothing(tmp_path: Path) -> None:
    # What `cdcflow status` opens: a mistyped URL, or another program's database, is
    # reported, not made into a store.
    missing = tmp_path / "no" / "such.db"
    with pytest.raises(StoreNotFoundError, match=r"holds no cdcflow metadata \(no such file\)"
                       r".*or `cdcflow metadata init sqlite:///.*/such.db`\) to create it"):
        open_store(sqlite_url(missing), create=False)
    with pytest.raises(StoreNotFoundError, match=r"\(it is a directory\)"):
        SQLiteStore(tmp_path, create=False)
    app = tmp_path / "app.db"
    with sqlite3.connect(app) as raw:
        raw.execute("CREATE TABLE users (id INTEGER PRIMARY KEY)")
    raw.close()
    empty = tmp_path / "empty.db"
    empty.touch()
    before = {p: p.read_bytes() for p in (app, empty)}
    for path in (app, empty):
        with pytest.raises(StoreNotFoundError, match=r"\(it has no cdcflow tables\): check"):
            open_store(sqlite_url(path), create=False)
    assert _files(tmp_path) == ["app.db", "empty.db"]  # no directory, no -wal, no -journal
    assert {p: p.read_bytes() for p in (app, empty)} == before


def test_opening_without_create_reads_a_store_and_does_not_upgrade_one(db: Path) -> None:
    store = SQLiteStore(db)
    store.insert_partitions(P, [part("a")])
    store.close()
    store = SQLiteStore(db, create=False)
    try:
        assert [p.token for p in store.partitions(P)] == ["a"] and store.pipelines() == [P]
        assert store.insert_partitions(P, [part("b")]) == 1  # an open store is a store
    finally:
        store.close()
    with sqlite3.connect(db) as raw:  # the file as version 3 wrote it
        raw.execute("ALTER TABLE batches DROP COLUMN stats")
        raw.execute("UPDATE cdcflow_schema SET version = 3")
    raw.close()
    with pytest.raises(StoreSetupError, match=r"schema version 3, .*upgrade it with `cdcflow "
                       r"metadata init sqlite:///.*` \(or a run of a pipeline\)"):
        SQLiteStore(db, create=False)
    with sqlite3.connect(db) as raw:
        assert raw.execute("SELECT MAX(version) FROM cdcflow_schema").fetchone() == (3,)
        assert "stats" not in {row[1] for row in raw.execute("PRAGMA table_info(batches)")}
    raw.close()
