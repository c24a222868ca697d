"""WriteTables on the real Cloud Spanner emulator, through the public CLI: a workload writes
while ``Orders`` gains two columns (``ALTER TABLE ... ADD COLUMN``) and later loses one
(``DROP COLUMN``); the stream lands in local Parquet and JSON lines, and in ``s3://`` on a
loopback S3 API server (moto) with the run SIGKILLed several times. The datasets are read
back with pyarrow.dataset and DuckDB (Spark: tests/transforms/test_tables_spark.py).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from tests.transforms.tables_alter import (
    AlterCase,
    AlterWorkload,
    Written,
    check_rows,
    duckdb_rows,
    fs_local,
    parquet_rows,
)

pytestmark = pytest.mark.emulator

DIALECTS = ["GOOGLE_STANDARD_SQL", "POSTGRESQL"]


def _jsonl_rows(written: Written) -> list[dict[str, Any]]:
    """Every JSON line, read with pyarrow.dataset (a schema per version's files)."""
    rows: list[dict[str, Any]] = []
    for version in (1, 2, 3):
        table = ds.dataset(written.files(version), filesystem=written.fs,
                           format="json").to_table()
        assert "Details" in table.column_names or version == 3
        assert table.schema.field("Quantity").type == pa.int64()
        rows += table.to_pylist()
    return rows


@pytest.mark.parametrize("dialect", DIALECTS)
def test_add_and_drop_column_mid_stream_land_schema_versions_in_order_exactly_once(
    spanner_emulator: Emulator, tmp_path: Path, dialect: str
) -> None:
    out = tmp_path / "out"
    case = AlterCase(spanner_emulator, tmp_path, dialect, str(out), file_size="2KiB")
    workload = AlterWorkload(case.database, dialect, seed=5)
    start = Timestamp.now()
    workload.script(seconds=2.5, rate=12)
    case.window(start, workload.changes)
    proc = subprocess.run(case.command(), env=case.env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pg = dialect == "POSTGRESQL"
    for fmt in ("parquet", "jsonl"):
        written = Written(fs_local(), str(out / fmt))
        written.check_layout()
        assert len(written.files()) >= 4, written.parts  # not one file per version
        # each schema file is older than every data file of its version
        for k in (2, 3):
            schema_at = (out / fmt / "Orders" / "_schema" / f"v{k}.json").stat().st_mtime_ns
            assert all(Path(n).stat().st_mtime_ns <= schema_at for n in written.files(k - 1))
            assert all(Path(n).stat().st_mtime_ns >= schema_at for n in written.files(k))
        rows = parquet_rows(written) if fmt == "parquet" else _jsonl_rows(written)
        check_rows(rows, workload.changes, pg)
        check_rows(duckdb_rows(out / fmt / "Orders", fmt), workload.changes, pg)
    assert len(workload.changes) > 60


# -- s3:// on a loopback moto server, SIGKILLed -------------------------------------------


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": endpoint},
                           skip_instance_cache=True)
    fs.mkdir("lake")
    yield endpoint
    server.stop()


def _committed(case: AlterCase) -> int:
    from cdcflow.metadata import open_store

    if not case.state_file.exists():
        return 0
    store = open_store(f"sqlite:///{case.state_file}")
    try:
        return sum(1 for b in store.batches(case.name, limit=100_000) if b.committed_at)
    finally:
        store.close()


def test_s3_with_alter_table_sigkilled_three_times_lands_every_change_once(
    spanner_emulator: Emulator, tmp_path: Path, s3: str
) -> None:
    dialect = "GOOGLE_STANDARD_SQL"
    case = AlterCase(spanner_emulator, tmp_path, dialect, "s3://lake/cdc", s3=s3,
                     formats=("parquet",), file_size="2KiB")
    workload = AlterWorkload(case.database, dialect, seed=9)
    start = Timestamp.now()
    workload.script(seconds=2.5, rate=12)
    case.window(start, workload.changes)
    fs = fsspec.filesystem("s3", client_kwargs={"endpoint_url": s3}, skip_instance_cache=True)
    rng = random.Random(3)
    killed = 0
    for _ in range(3):
        before = _committed(case)
        proc = subprocess.Popen(case.command(), env=case.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if _committed(case) >= before + 3:
                break
            time.sleep(0.02)
        # a small file_size cuts a file nearly every batch: a kill lands among uploads
        time.sleep(rng.uniform(0, 0.3))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            killed += 1
        proc.wait(30)
    assert killed == 3
    fs.invalidate_cache()
    assert fs.find("lake/cdc/parquet/Orders"), "the killed runs had written files"
    done = subprocess.run(case.command(), env=case.env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    fs.invalidate_cache()
    written = Written(fs, "lake/cdc/parquet")
    written.check_layout()
    check_rows(parquet_rows(written), workload.changes, pg=False)
    # DuckDB's httpfs extension is not available offline: it reads a local copy.
    local = written.local_copy(tmp_path / "copy")
    check_rows(duckdb_rows(local, "parquet"), workload.changes, pg=False)
