"""Two openers of a new SQLite store at the same moment (found by the fault suite).

The fault suite's progress reader opened the SQLite store while the first `cdcflow run`
was creating it, and that run exited 1 at once with ``cdcflow: error: .../state.db is not
a usable SQLite database (database is locked); point the URL at a new file or at a cdcflow
store``; its restart resumed and the output stayed exactly once. The same happens to a run
whose store `cdcflow status` opens at that moment. The cause: ``PRAGMA journal_mode = WAL``
on a new file needs an exclusive lock, and SQLite answers SQLITE_BUSY at once, without the
busy handler, to the second of two connections that both want it; the store reports that
as an unusable file.
"""

from __future__ import annotations

import threading
from pathlib import Path

from cdcflow.metadata.sqlite import SQLiteStore

ATTEMPTS = 500  # each one a fresh file; the race hits about 1 in 20 on a 2-core machine


def test_two_openers_of_a_new_sqlite_store_both_succeed(tmp_path: Path) -> None:
    for attempt in range(ATTEMPTS):
        path = tmp_path / f"state-{attempt}.db"
        barrier = threading.Barrier(2)
        errors: list[str] = []

        def open_store(path: Path = path, barrier: threading.Barrier = barrier,
                       errors: list[str] = errors) -> None:
            barrier.wait()
            try:
                SQLiteStore(path).close()
            except Exception as e:
                errors.append(str(e))

        threads = [threading.Thread(target=open_store) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, f"attempt {attempt}: {errors[0]}"
