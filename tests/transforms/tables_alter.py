"""Shared by the WriteTables emulator tests: a shop database whose ``Orders`` table changes
shape while a workload writes (``ADD COLUMN`` Discount NUMERIC and ShippedAt TIMESTAMP, then
``DROP COLUMN`` Details), the workload's own record of every committed change, a pipeline
file reading the stream into WriteTables, and the checks of what WriteTables wrote.

The emulator applies DDL at once (a real Spanner schema change is a long-running operation
during which writes go on) and renders TIMESTAMP values in a change stream without their
fraction of a second, so the workload writes whole seconds into ShippedAt.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import attrs
import duckdb
import fsspec
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import create_shop_database
from tests.e2e_helpers import unique

__all__ = ["PIPELINE", "V1", "V2", "V3", "AlterCase", "AlterWorkload", "Written"]

#: The non-key columns of each version of ``Orders``, in table order.
V1 = ("Customer", "Status", "Quantity", "Price", "Details")
V2 = (*V1, "Discount", "ShippedAt")
V3 = ("Customer", "Status", "Quantity", "Price", "Discount", "ShippedAt")
META = ("_op", "_commit_ts", "_txn", "_seq", "_table")

PIPELINE = """
import os
import cdcflow as cf
from cdcflow.transforms import DetectPartitions, ReadPartition, WriteTables

options = {}
if os.environ["E2E_OUT"].startswith("s3://"):
    options["storage_options"] = {"client_kwargs": {"endpoint_url": os.environ["E2E_S3"]}}
pipeline = cf.Pipeline(os.environ["E2E_NAME"])
changes = (pipeline
 | DetectPartitions(database=os.environ["E2E_DB"], stream=os.environ["E2E_STREAM"],
                    start_at=os.environ["E2E_START"], end_at=os.environ["E2E_END"])
 | ReadPartition(heartbeat="250ms"))
for fmt in os.environ["E2E_FORMATS"].split(","):
    changes | fmt >> WriteTables(os.environ["E2E_OUT"] + "/" + fmt, format=fmt,
                                 file_size=os.environ["E2E_FILE_SIZE"],
                                 flush_interval="2s", **options)
"""

_PART = re.compile(r"part-(\d+)-(\d+)-(\d+)\.(parquet|jsonl)$")


@attrs.frozen
class Change:
    key: int
    commit_ns: int
    mod_type: str
    values: dict[str, Any]  # the columns written (an INSERT: all of its version's)


class AlterWorkload:
    """Random inserts, updates and deletes of ``Orders`` in the columns of the table's
    current version, recording each committed change (the ground truth)."""

    def __init__(self, database: Any, dialect: str, seed: int) -> None:
        self.database = database
        self.pg = dialect == "POSTGRESQL"
        self.rng = random.Random(seed)
        self.live: set[int] = set()
        self.columns: tuple[str, ...] = V1
        self.changes: list[Change] = []

    def _values(self) -> dict[str, Any]:
        rng = self.rng
        every = {
            "Customer": rng.choice(("ada", "grace", "alan", "edsger")),
            "Status": rng.choice(("NEW", "PAID", "SHIPPED")),
            "Quantity": rng.randint(1, 10**12),
            "Price": round(rng.uniform(1, 500), 2),
            "Details": {"gift": rng.random() < 0.5, "n": rng.randint(1, 9)},
            "Discount": Decimal(rng.randint(0, 10**6)) / 1000,
            # whole seconds: the emulator drops the fraction in a change stream
            "ShippedAt": datetime(2024, 1, 1, tzinfo=UTC) + timedelta(
                seconds=rng.randint(0, 10**8)),
        }
        return {c: every[c] for c in self.columns}

    def step(self) -> None:
        planned: list[tuple[str, int, dict[str, Any]]] = []
        touched: set[int] = set()
        for _ in range(self.rng.choice((1, 1, 2, 3))):
            roll = self.rng.random()
            candidates = sorted(self.live - touched)
            if candidates and roll < 0.45:
                key = self.rng.choice(candidates)
                values = self._values()
                chosen = self.rng.sample(list(values), self.rng.randint(1, len(values)))
                planned.append(("UPDATE", key, {c: values[c] for c in values if c in chosen}))
            elif candidates and roll < 0.6:
                key = self.rng.choice(candidates)
                planned.append(("DELETE", key, {}))
            else:
                key = self.rng.randrange(1, 1 << 40)
                while key in self.live or key in touched:
                    key = self.rng.randrange(1, 1 << 40)
                planned.append(("INSERT", key, self._values()))
            touched.add(key)
        from google.cloud.spanner import KeySet

        with self.database.batch() as batch:
            for op, key, values in planned:
                if op == "DELETE":
                    batch.delete("Orders", KeySet(keys=[[key]]))  # type: ignore[no-untyped-call]
                    continue
                cells = [json.dumps(v, sort_keys=True) if c == "Details" else v
                         for c, v in values.items()]
                write = batch.insert if op == "INSERT" else batch.update
                write("Orders", ["OrderId", *values], [[key, *cells]])
        commit_ns = Timestamp.from_datetime(batch.committed).ns
        for op, key, values in planned:
            (self.live.discard if op == "DELETE" else self.live.add)(key)
            self.changes.append(Change(key, commit_ns, op, values))

    def run(self, seconds: float, rate: float) -> None:
        began = time.monotonic()
        done = 0
        while time.monotonic() - began < seconds:
            wait = began + done / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self.step()
            done += 1

    def alter(self, statements: Sequence[str], columns: tuple[str, ...]) -> None:
        """Apply ``statements`` (GoogleSQL; quoted for PostgreSQL) in one schema update,
        between quiet pauses longer than a batch span, so that no batch holds rows of both
        shapes (see :meth:`script`)."""
        time.sleep(1.2)
        if self.pg:
            statements = [
                re.sub(r"\b(Orders|Discount|ShippedAt|Details)\b", r'"\1"', sql)
                .replace("NUMERIC", "numeric").replace("TIMESTAMP", "timestamptz")
                for sql in statements]
        self.database.update_ddl(list(statements)).result(120)
        self.columns = columns
        time.sleep(1.2)

    def script(self, seconds: float, rate: float) -> None:
        """The three phases: v1; ADD COLUMN Discount and ShippedAt; v2; DROP Details; v3.

        The pauses keep the expected versions exact: a partition that splits or merges is
        read on from its end in the next batch, so a batch can hold rows committed before
        rows of the batch before it (by at most a batch span); rows of the old shape after
        a version that dropped a column start one more version (nothing is lost)."""
        self.run(seconds, rate)
        self.alter(["ALTER TABLE Orders ADD COLUMN Discount NUMERIC",
                    "ALTER TABLE Orders ADD COLUMN ShippedAt TIMESTAMP"], V2)
        self.run(seconds, rate)
        self.alter(["ALTER TABLE Orders DROP COLUMN Details"], V3)
        self.run(seconds, rate)


class AlterCase:
    """A shop database, the pipeline file and the environment of ``cdcflow run``."""

    def __init__(self, emu: Emulator, tmp: Path, dialect: str, out: str,
                 formats: Sequence[str] = ("parquet", "jsonl"), file_size: str = "64KiB",
                 s3: str | None = None) -> None:
        self.name = unique("alter")
        self.dialect = dialect
        self.database = create_shop_database(emu, self.name, dialect)  # type: ignore[arg-type]
        self.file = tmp / "pipeline.py"
        self.file.write_text(PIPELINE)
        self.state_file = tmp / "state.db"
        self.out = out
        self.env = dict(
            os.environ, SPANNER_EMULATOR_HOST=emu.host, E2E_NAME=self.name,
            E2E_DB=emu.database_path(self.name),
            E2E_STREAM="OrdersStream" if dialect == "GOOGLE_STANDARD_SQL" else "ordersstream",
            E2E_OUT=out, E2E_FORMATS=",".join(formats), E2E_FILE_SIZE=file_size,
            E2E_S3=s3 or "",
        )

    def window(self, start: Timestamp, changes: Sequence[Change]) -> None:
        last = max(c.commit_ns for c in changes)
        end = max(Timestamp.now().ns, last + 1_000_000)
        self.env["E2E_START"] = start.rfc3339()
        self.env["E2E_END"] = Timestamp.from_ns(end).rfc3339()

    def command(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "cdcflow", "run", str(self.file), "--metadata",
                f"sqlite:///{self.state_file}", "--batch-interval", "0s",
                "--set", "max_batch_span=500ms", *extra]


# -- reading back -----------------------------------------------------------------------


class Written:
    """One table's output under ``root`` on ``fs``: schema files, data files by version."""

    def __init__(self, fs: Any, root: str, table: str = "Orders") -> None:
        self.fs, self.root, self.table = fs, root.rstrip("/"), table
        names = fs.find(f"{self.root}/{table}")
        self.schemas = sorted(n for n in names if "/_schema/" in n)
        self.parts: list[tuple[int, int, int, str]] = sorted(
            (int(m.group(3)), int(m.group(1)), int(m.group(2)), n)
            for n in names if (m := _PART.search(n)) and "/." not in n)

    def versions(self) -> list[dict[str, Any]]:
        return [json.loads(self.fs.cat_file(n)) for n in self.schemas]

    def files(self, version: int | None = None) -> list[str]:
        return [n for v, _, _, n in self.parts if version is None or v == version]

    def check_layout(self) -> None:
        """v1, v2, v3 in order with the expected columns; each version's files hold only
        its columns; every file of a version holds batches before any file of the next."""
        docs = self.versions()
        assert [d["version"] for d in docs] == [1, 2, 3], self.schemas
        for doc, cols in zip(docs, (V1, V2, V3), strict=True):
            assert [c["name"] for c in doc["columns"]] == ["OrderId", *cols], doc
            assert doc["key_columns"] == ["OrderId"]
        for k in (1, 2):
            older = [last for v, _, last, _ in self.parts if v == k]
            newer = [first for v, first, _, _ in self.parts if v == k + 1]
            assert older and newer, self.parts
            assert max(older) < min(newer), f"v{k} file written after v{k + 1}: {self.parts}"

    def local_copy(self, into: Path) -> Path:
        """Every data and schema file copied to ``into`` (same layout)."""
        for name in self.schemas + self.files():
            target = into / name[len(self.root) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(self.fs.cat_file(name))
        return into / self.table


def parquet_rows(written: Written) -> list[dict[str, Any]]:
    """Every row, read with pyarrow.dataset over the union of the versions' schemas; checks
    each file holds exactly its version's columns, typed."""
    schemas = []
    for v, cols in zip((1, 2, 3), (V1, V2, V3), strict=True):
        for name in written.files(v):
            with written.fs.open(name, "rb") as f:
                schema = pq.read_schema(f)
            assert schema.names == ["OrderId", *cols, *META], (name, schema.names)
            assert schema.field("_commit_ts").type == pa.timestamp("ns", tz="UTC")
            assert schema.field("Quantity").type == pa.int64()
            if "ShippedAt" in cols:
                assert schema.field("ShippedAt").type == pa.timestamp("ns", tz="UTC")
            schemas.append(schema)
    unified = pa.unify_schemas(schemas)
    dataset = ds.dataset(written.files(), filesystem=written.fs, format="parquet",
                         schema=unified)
    table = dataset.to_table()
    # timestamps as integer nanoseconds (pyarrow makes datetimes of them only with pandas)
    for i, field in enumerate(table.schema):
        if pa.types.is_timestamp(field.type):
            table = table.set_column(i, field.name, table.column(i).cast(pa.int64()))
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def duckdb_rows(path: Path, fmt: str) -> list[dict[str, Any]]:
    """Every row of a local copy, read by DuckDB (files of all versions, by column name)."""
    con = duckdb.connect()
    try:
        glob = str(path / f"part-*.{fmt}")
        if fmt == "parquet":
            rel = con.sql(f"SELECT * FROM read_parquet('{glob}', union_by_name = true)")
        else:
            rel = con.sql(f"SELECT * FROM read_json_auto('{glob}', union_by_name = true, "
                          "format = 'newline_delimited')")
        if fmt == "parquet":
            kinds = dict(zip(rel.columns, map(str, rel.types), strict=True))
            assert kinds["_commit_ts"] == kinds["ShippedAt"] == "TIMESTAMPTZ_NS", kinds
            assert kinds["Quantity"] == "BIGINT", kinds
        # timestamps as integer nanoseconds (Python datetimes of TIMESTAMPTZ need pytz)
        select = ", ".join(
            f'epoch_ns("{n}") AS "{n}"' if str(t).startswith("TIMESTAMP") else f'"{n}"'
            for n, t in zip(rel.columns, rel.types, strict=True))
        rel = rel.project(select)
        names = rel.columns
        return [dict(zip(names, row, strict=True)) for row in rel.fetchall()]
    finally:
        con.close()


def micros(value: Any) -> int:
    """A timestamp as read back (integer nanoseconds, an aware datetime from DuckDB, RFC 3339
    text from JSON lines) in microseconds since the epoch."""
    if isinstance(value, int):
        return value // 1000
    if isinstance(value, str):
        return Timestamp.parse(value).ns // 1000
    assert isinstance(value, datetime) and value.tzinfo is not None, value
    return Timestamp.from_datetime(value).ns // 1000


def check_rows(rows: Sequence[dict[str, Any]], changes: Sequence[Change], pg: bool) -> None:
    """Every committed change exactly once, with the values an INSERT wrote (typed)."""
    expected = Counter((c.key, c.commit_ns // 1000, c.mod_type) for c in changes)
    seen = Counter((int(r["OrderId"]), micros(r["_commit_ts"]), r["_op"]) for r in rows)
    lost, extra = expected - seen, seen - expected
    assert not lost, f"{sum(lost.values())} changes lost, e.g. {list(lost)[:3]}"
    assert not extra, f"{sum(extra.values())} duplicated or unknown, e.g. {list(extra)[:3]}"
    by_change = {(int(r["OrderId"]), micros(r["_commit_ts"]), r["_op"]): r for r in rows}
    checked = Counter[str]()
    for c in changes:
        if c.mod_type != "INSERT":
            continue
        row = by_change[(c.key, c.commit_ns // 1000, c.mod_type)]
        assert row["Customer"] == c.values["Customer"]
        assert row["Quantity"] == c.values["Quantity"] and type(row["Quantity"]) is int
        if "Discount" in c.values:
            # PostgreSQL NUMERIC has no fixed scale: the sink keeps it as text
            got = Decimal(row["Discount"]) if pg or isinstance(row["Discount"], str) \
                else row["Discount"]
            assert got == c.values["Discount"], (row, c)
            assert pg or isinstance(row["Discount"], Decimal | str)
            want = Timestamp.from_datetime(c.values["ShippedAt"]).ns // 1000
            assert micros(row["ShippedAt"]) == want, (row, c)
            checked["v2+"] += 1
        else:
            assert row["Details"] is not None
            checked["v1"] += 1
        if "Details" not in c.values:
            assert row.get("Details") is None
    assert checked["v1"] and checked["v2+"], checked


def fs_local() -> Any:
    return fsspec.filesystem("file")
