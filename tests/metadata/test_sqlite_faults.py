"""Faults of the SQLite store's file, on real files: a store this process cannot write (a
read-only file or directory, at start or mid-run), a full disk, a lock held too long, and
the file deleted or replaced under a live run. Each ends in one StoreError (a
StoreSetupError at start) naming the file and the fix, never in a ``sqlite3`` traceback;
reads of a read-only store still work (``cdcflow status``).

Read-only is made with ``chmod`` for a user and with ``chattr +i`` for root (root writes
through mode bits); a test that needs ``chattr +i`` mid-run (mode bits do not affect an
open file) is skipped for other users.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cdcflow.engine.ownership import Ownership
from cdcflow.errors import FencedError, StoreError, StoreSetupError
from cdcflow.metadata import SQLiteStore, _sqlite_file, open_store, sqlite_url
from cdcflow.model import BatchPlan, PartitionMetadata, PartitionUpdate, Slice
from tests.fs_helpers import ROOT, read_only

P = "orders"
NS = 1_000_000_000


def _store_with_state(path: Path) -> None:
    store = SQLiteStore(path)
    store.insert_partitions(P, [PartitionMetadata("a", (), 0, 100, 0, "CREATED")])
    store.acquire_lease(P, "host:1", "run1", 60 * NS)
    store.close()


def _files(path: Path) -> list[Path]:
    return [p for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")) if p.exists()]


# -- read-only at start ------------------------------------------------------------------


def test_a_read_only_file_is_read_and_its_first_write_is_a_setup_error(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    _store_with_state(db)
    with read_only(*_files(db)):
        store = SQLiteStore(db)
        try:
            assert [p.token for p in store.partitions(P)] == ["a"]  # status can read it
            lease = store.lease(P)
            assert lease is not None and lease.owner == "host:1"
            with pytest.raises(StoreSetupError, match=r"cannot be written.*not writable.*"
                               r"make it writable"):
                store.acquire_lease(P, "host:2", "run2", 60 * NS, replace=lease.token)
        finally:
            store.close()
    assert SQLiteStore(db).lease(P) == lease  # nothing changed


def test_a_read_only_directory_is_read_and_refuses_writes(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    db = folder / "state.db"
    _store_with_state(db)
    assert _files(db) == [db]  # closed cleanly: no -wal, no -shm, and none can be created
    with read_only(folder):
        store = open_store(sqlite_url(db))
        try:
            assert [p.token for p in store.partitions(P)] == ["a"]
            with pytest.raises(StoreSetupError, match=r"directory .*state is not writable"):
                store.insert_partitions(P, [PartitionMetadata("b", (), 0, 100, 0, "CREATED")])
        finally:
            store.close()


def test_a_read_only_directory_still_shows_a_live_writers_commits(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    db = folder / "state.db"
    writer = SQLiteStore(db)
    writer.insert_partitions(P, [PartitionMetadata("a", (), 0, 100, 0, "CREATED")])
    try:
        with read_only(folder):
            reader = SQLiteStore(db)
            try:
                assert [p.token for p in reader.partitions(P)] == ["a"]  # in the -wal
                writer.insert_partitions(P, [PartitionMetadata("b", (), 0, 100, 0, "CREATED")])
                assert [p.token for p in reader.partitions(P)] == ["a", "b"]
            finally:
                reader.close()
    finally:
        writer.close()


def test_a_read_only_file_that_holds_no_store_is_refused_at_open(tmp_path: Path) -> None:
    db = tmp_path / "empty.db"
    db.touch()
    with read_only(db), pytest.raises(StoreSetupError, match=r"holds no cdcflow store.*"
                                      r"not writable"):
        SQLiteStore(db)


def test_a_write_sqlite_refuses_before_any_write_succeeded_is_a_setup_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "state.db"
    _store_with_state(db)
    # The access check misses it (as on a file system whose permissions access(2) cannot
    # tell): SQLite itself refuses the write.
    monkeypatch.setattr("cdcflow.metadata._sqlite_file._unwritable", lambda path: None)
    with read_only(*_files(db)):
        store = SQLiteStore(db)
        try:
            with pytest.raises(StoreSetupError, match="cannot be written") as info:
                store.acquire_lease("another", "host:2", "run2", 60 * NS)
            assert isinstance(info.value.__cause__, sqlite3.Error)
        finally:
            store.close()


# -- faults mid-run ----------------------------------------------------------------------


def _planned_store(db: Path) -> SQLiteStore:
    store = SQLiteStore(db)
    store.insert_partitions(P, [PartitionMetadata("a", (), 0, 100, 0, "RUNNING")])
    store.write_plan(P, BatchPlan(1, 50, (Slice("a", 0, 50),)), {})
    return store


@pytest.mark.skipif(not ROOT, reason="needs chattr +i (root): mode bits do not stop writes "
                    "through a file SQLite already holds open")
def test_a_store_that_turns_read_only_mid_run_fails_in_one_store_error(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = _planned_store(db)
    try:
        with read_only(Path(f"{db}-wal")):
            with pytest.raises(StoreError, match=r"failed to read or write .*check the "
                               r"disk") as info:
                store.commit_batch(P, 1, [PartitionUpdate("a", 50)], [])
            assert not isinstance(info.value, StoreSetupError)  # it had written: exit 1
            assert isinstance(info.value.__cause__, sqlite3.Error)
        # nothing of the failed commit was written, and the store works again
        assert store.pending_plan(P) is not None
        assert store.commit_batch(P, 1, [PartitionUpdate("a", 50)], [])
        assert store.partitions(P)[0].watermark == 50
    finally:
        store.close()


def test_a_full_disk_is_a_store_error_and_leaves_nothing_written(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = _planned_store(db)
    try:
        raw = store._db.connection()
        pages = raw.execute("PRAGMA page_count").fetchone()[0]
        raw.execute(f"PRAGMA max_page_count = {pages}")  # SQLite's own "disk is full"
        with pytest.raises(StoreError, match=r"disk of the SQLite store .* is full.*free "
                           r"space") as info:
            store.commit_batch(P, 1, [PartitionUpdate("a", 50)], [], state=b"x" * 1_000_000)
        assert isinstance(info.value.__cause__, sqlite3.Error)
        assert store.pending_plan(P) is not None and store.step_state(P) is None
    finally:
        store.close()


def test_a_lock_held_past_the_timeout_is_a_store_error(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = SQLiteStore(db, busy_timeout=0.2)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreError, match=r"stayed locked by another process for 0.2 s .*"
                           r"--takeover cannot break it: end that process") as info:
            store.acquire_lease(P, "host:1", "run1", 60 * NS)  # the first write, too
        assert not isinstance(info.value, StoreSetupError)
    finally:
        other.execute("ROLLBACK")
        other.close()
        store.close()


def test_a_write_that_waits_for_the_lock_says_so_then_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_sqlite_file, "LOCK_NOTE_AFTER", 0.2)
    db = tmp_path / "state.db"
    store = SQLiteStore(db, busy_timeout=5.0)
    other = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    release = threading.Timer(1.0, lambda: other.execute("ROLLBACK"))
    release.start()
    try:
        with caplog.at_level("WARNING", logger="cdcflow.store"):
            began = time.monotonic()
            lease = store.acquire_lease(P, "host:1", "run1", 60 * NS)  # waits, then writes
            waited = time.monotonic() - began
        notes = [r.getMessage() for r in caplog.records]
        assert len(notes) == 1, notes
        assert f"the SQLite store {db} is locked by another process" in notes[0]
        assert "waiting up to 4.8 s more" in notes[0] and "paused or hung" in notes[0]
        assert 0.9 < waited < 4.0
        assert store._db.connection().execute("PRAGMA busy_timeout").fetchone()[0] == 5000
        caplog.clear()
        store.renew_lease(P, lease, 60 * NS)  # no wait, no note
        assert not caplog.records
    finally:
        release.join()
        other.close()
        store.close()


def test_an_error_inside_a_statement_rolls_back_and_is_a_store_error(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = _planned_store(db)
    try:
        raw = store._db.connection()
        calls = 0

        def interrupt_late() -> int:  # once, after the first statements of the commit ran
            nonlocal calls
            calls += 1
            return 1 if calls == 40 else 0

        raw.set_progress_handler(interrupt_late, 1)
        with pytest.raises(StoreError, match=r"SQLite store .* failed: .*interrupted"):
            store.commit_batch(P, 1, [PartitionUpdate("a", 50)], [])
        raw.set_progress_handler(None, 1)
        assert store.pending_plan(P) is not None
        assert store.partitions(P)[0].watermark == 0
    finally:
        store.close()


# -- the file deleted or replaced under a live run ---------------------------------------


def _remove(db: Path) -> None:
    for p in _files(db):
        p.unlink()


def test_a_deleted_file_fences_the_lease_and_refuses_every_write(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = _planned_store(db)
    lease = store.acquire_lease(P, "host:1", "run1", 60 * NS)
    _remove(db)
    try:
        with pytest.raises(FencedError, match=r"deleted or replaced while this process used "
                           r"it; this run stops without writing anything more"):
            store.renew_lease(P, lease, 60 * NS)
        with pytest.raises(StoreError, match="deleted or replaced"):
            store.commit_batch(P, 1, [PartitionUpdate("a", 50)], [], fence=lease.token)
        with pytest.raises(StoreError, match="deleted or replaced"):
            store.write_plan(P, BatchPlan(2, 60, ()), {}, fence=lease.token)
        with pytest.raises(StoreError, match="deleted or replaced"):
            store.insert_partitions(P, [PartitionMetadata("b", (), 0, 100, 0, "CREATED")])
        store.release_lease(P, lease)  # changes nothing anyone sees: not refused
        fresh = SQLiteStore(db)  # a second run starts on a new file; the old writes fail
        try:
            assert fresh.lease(P) is None
            with pytest.raises(StoreError, match="deleted or replaced"):
                store.commit_batch(P, 1, [PartitionUpdate("a", 50)], [], fence=lease.token)
            assert fresh.partitions(P) == []
        finally:
            fresh.close()
    finally:
        store.close()


def test_a_replaced_file_refuses_writes(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = _planned_store(db)
    other = tmp_path / "other.db"
    _store_with_state(other)
    try:
        os.replace(other, db)
        with pytest.raises(StoreError, match="deleted or replaced"):
            store.commit_batch(P, 1, [PartitionUpdate("a", 50)], [])
    finally:
        store.close()


def test_the_heartbeat_stops_a_run_whose_file_was_deleted(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    store = SQLiteStore(db)
    lost: list[FencedError] = []
    stopped = threading.Event()

    def on_lost(error: FencedError) -> None:
        lost.append(error)
        stopped.set()

    owner = Ownership(store, P, ttl=0.3, on_lost=on_lost)
    owner.acquire(takeover=False)
    try:
        time.sleep(0.25)
        assert not stopped.is_set()  # renewals succeed while the file is there
        _remove(db)
        assert stopped.wait(5), "the heartbeat did not notice the deleted file"
        assert "deleted or replaced" in str(lost[0]) and owner.lost is lost[0]
    finally:
        owner.release()
        store.close()


# -- through the command line ------------------------------------------------------------

T0 = 1_700_000_000 * NS

PIPELINE = f"""
import time
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

stream = ScriptedChangeStream("S", partitions=2, origin={T0})
for i in range(40):
    stream.write("T", i, "INSERT", {{"v": i}}, at={T0} + (i + 1) * 100_000_000)

def slow(record):
    time.sleep(0.2)
    return record.mods[0].new_values["v"]

pipeline = cf.Pipeline("faults")
(pipeline
 | cf.DetectPartitions(stream="S", start_at={T0}, end_at={T0} + 5 * 10**9, client=stream)
 | cf.ReadPartition() | "value" >> cf.Map(slow) | cf.Print())
"""


def _cdcflow_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "CDCFLOW_DEBUG"}


def _run(path: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cdcflow", *extra], capture_output=True, text=True,
        cwd=path.parent, timeout=timeout, stdin=subprocess.DEVNULL, env=_cdcflow_env(),
    )


def _one_error(done: subprocess.CompletedProcess[str], code: int) -> str:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("cdcflow: error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def test_cli_a_read_only_store_is_one_line_exit_2_and_status_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.py"
    path.write_text(textwrap.dedent(PIPELINE))
    state = tmp_path / ".cdcflow"
    state.mkdir()
    db = state / "state.db"
    _store_with_state(db)
    with read_only(state, *_files(db)):
        done = _run(path, "run", str(path), "--for", "20s")
        line = _one_error(done, 2)
        assert f"SQLite store {db} cannot be written" in line and "writable" in line
        assert done.stdout == ""
        status = _run(path, "status", str(path), "--pipeline", P)
        assert status.returncode == 0, status.stderr
        assert "Traceback" not in status.stderr


def test_cli_a_store_file_deleted_mid_run_stops_the_run_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.py"
    path.write_text(textwrap.dedent(PIPELINE))
    db = tmp_path / ".cdcflow" / "state.db"
    run = _start(path)
    try:
        _wait_for_a_commit(run, db)
        _remove(db)
        began = time.monotonic()
        out, err = run.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        _stop(run)
    done = subprocess.CompletedProcess(run.args, run.returncode, out, err)
    line = _one_error(done, 1)
    assert "was deleted or replaced while this process used it" in line, err
    assert took < 15, took  # a third of the lease, plus the batch in flight
    assert not db.exists()  # the stopped run wrote no new file


@pytest.mark.skipif(not ROOT, reason="needs chattr +i (root): mode bits do not stop writes "
                    "through a file SQLite already holds open")
def test_cli_a_store_turning_read_only_mid_run_is_one_line_exit_1(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.py"
    path.write_text(textwrap.dedent(PIPELINE))
    db = tmp_path / ".cdcflow" / "state.db"
    wal = Path(f"{db}-wal")
    run = _start(path)
    try:
        _wait_for_a_commit(run, db)
        with read_only(wal):
            out, err = run.communicate(timeout=60)
    finally:
        _stop(run)
    line = _one_error(subprocess.CompletedProcess(run.args, run.returncode, out, err), 1)
    assert "failed to read or write (disk I/O error)" in line


def _start(path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "run", str(path), "--set", "max_batch_span=1s",
         "--batch-interval", "0s", "--set", "lease_ttl=1.5s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=path.parent,
        stdin=subprocess.DEVNULL, env=_cdcflow_env(), start_new_session=True,
    )


def _wait_for_a_commit(run: subprocess.Popen[str], db: Path) -> None:
    for _ in range(300):
        if run.poll() is not None or _committed(db):
            break
        time.sleep(0.1)
    assert run.poll() is None, run.communicate()[1]


def _stop(run: subprocess.Popen[str]) -> None:
    if run.poll() is None:
        run.kill()
        run.communicate()


def _committed(db: Path) -> bool:
    if not db.exists():
        return False
    raw = sqlite3.connect(db)
    try:
        row = raw.execute("SELECT COUNT(*) FROM batches WHERE committed_at IS NOT NULL"
                          ).fetchone()
    except sqlite3.Error:
        return False
    finally:
        raw.close()
    return bool(row and row[0])
