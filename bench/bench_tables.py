"""WriteTables throughput vs a plain pyarrow/fsspec write of the same rows (the ceiling), to a
local directory and to an S3 API server (moto) on loopback, parquet, jsonl and csv.

WriteTables starts from DataChangeRecords with typed values (what the decoder yields by
default) and ends with the files in storage; the ceiling starts from the finished rows (built
before its clock starts) and writes the same rows, in the same format, into as many files at
the same destination, with nothing else: no batching, staging or durability (parquet:
``pa.Table.from_pylist`` and ``pq.write_table``; jsonl: ``orjson.dumps`` per row; csv:
``pa.Table.from_pylist`` and ``pyarrow.csv.write_csv``). Also files per hour for 50
partitions with 1 s batches (a simulated clock: expect at most tables x 3600 / flush_interval).

``python -m bench.bench_tables [--rows N] [--batch K]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from decimal import Decimal
from typing import Any

import fsspec
import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from bench._args import positive_int
from cdcflow.model import ColumnType, DataChangeRecord, Mod, Timestamp
from cdcflow.transforms import tables as tables_module
from cdcflow.transforms._tablerows import Schema, columns_of, json_value, jsonl_row, rows_of
from cdcflow.transforms.base import SinkContext, WriterContext
from cdcflow.transforms.tables import TaskRows, WriteTables

__all__ = ["main"]

T0 = 1_700_000_000 * 1_000_000_000
_COLS = (ColumnType("id", {"code": "INT64"}, True, 1), ColumnType("name", {"code": "STRING"},
                                                                      False, 2),
         ColumnType("total", {"code": "NUMERIC"}, False, 3),
         ColumnType("at", {"code": "TIMESTAMP"}, False, 4))


def _records(n: int, table: str = "Orders", token: str = "p0",
             at: int = T0) -> list[DataChangeRecord]:
    """Typed values, as the decoder yields them by default (one shared column list)."""
    when = Timestamp.from_ns(1_704_067_200_123_456_789)
    return [DataChangeRecord(token, Timestamp.from_ns(at + i), f"{i:08d}", f"t{i}", True, table,
                             _COLS, [Mod({"id": i}, {"name": f"name-{i}",
                                                     "total": Decimal(i) / 100, "at": when})],
                             "INSERT", "NEW_ROW", 1, 1) for i in range(n)]


def _wt(url: str, records: list[DataChangeRecord], batch: int, **kw: Any) -> float:
    """WriteTables from the records to the files in storage (uploads finished)."""
    sink = WriteTables(url, flush_interval="1h", **kw)
    sink.setup(SinkContext("bench", "WriteTables", "/"))
    t0 = time.perf_counter()
    for b, start in enumerate(range(0, len(records), batch), 1):
        w = sink.open_writer(WriterContext("bench", "WriteTables", b, "p0", 0, 1, "a"))
        for r in records[start:start + batch]:
            w.write(r)
        m = w.close()
        sink.commit(b, [m] if isinstance(m, TaskRows) else [])
    sink.flush()
    elapsed = time.perf_counter() - t0
    sink.close()
    return elapsed


def _rows(records: list[DataChangeRecord], fmt: str) -> list[dict[str, Any]]:
    """The rows WriteTables writes, already built (outside the ceiling's clock): typed
    values for parquet and csv; for jsonl the values as they appear in the line."""
    rows = [row for r in records for row in rows_of(r, "flat")]
    if fmt == "jsonl":
        schema = Schema("Orders", 1, columns_of(records[0]))
        rows = [jsonl_row(row, schema, "flat") for row in rows]
    return rows


def _ceiling(url: str, rows: list[dict[str, Any]], fmt: str, files: int, **kw: Any) -> float:
    """The same rows written with pyarrow (parquet, csv) or orjson (jsonl) and fsspec, into
    as many files as WriteTables wrote, at the same destination."""
    schema = Schema("Orders", 1, columns_of(_records(1)[0])).arrow("flat", fmt)
    fs, root = fsspec.core.url_to_fs(url, **kw)
    fs.makedirs(f"{root}/ceiling", exist_ok=True)
    t0 = time.perf_counter()
    step = -(-len(rows) // max(files, 1))
    for k, start in enumerate(range(0, len(rows), step)):
        chunk = rows[start:start + step]
        with fs.open(f"{root}/ceiling/part-{k}.{fmt}", "wb") as f:
            if fmt == "parquet":
                pq.write_table(pa.Table.from_pylist(chunk, schema=schema), f)
            elif fmt == "csv":
                pacsv.write_csv(pa.Table.from_pylist(chunk, schema=schema), f)
            else:
                f.write(b"".join([orjson.dumps(row, default=json_value,
                                               option=orjson.OPT_APPEND_NEWLINE)
                                  for row in chunk]))
    return time.perf_counter() - t0


def _side_by_side(name: str, url: str, records: list[DataChangeRecord], batch: int,
                  repeat: int, **kw: Any) -> None:
    """Best of ``repeat`` runs of each, interleaved (the machine's load hits both alike)."""
    for fmt in ("parquet", "jsonl", "csv"):
        rows = _rows(records, fmt)
        wt = ceiling = float("inf")
        files = 0
        for k in range(repeat):
            target = f"{url}/wt-{fmt}-{k}"
            wt = min(wt, _wt(target, records, batch, format=fmt, file_size="16MiB",
                             storage_options=kw))
            fs, root = fsspec.core.url_to_fs(target, **kw)
            files = len([p for p in fs.find(root) if "/part-" in p])
            ceiling = min(ceiling, _ceiling(f"{url}/{fmt}-{k}", rows, fmt, files, **kw))
        n = len(records)
        print(f"{name:6} {fmt:8} WriteTables {n / wt:10,.0f} rows/s   plain {n / ceiling:10,.0f} "
              f"rows/s   ratio {ceiling / wt:5.0%}   ({files} files)", flush=True)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def _files_per_hour(directory: str, partitions: int = 50, tables: int = 5) -> None:
    clock = _Clock()
    saved = tables_module.time
    tables_module.time = clock  # type: ignore[assignment]
    try:
        sink = WriteTables(directory, flush_interval="60s", file_size="64MiB")
        sink.setup(SinkContext("bench", "WriteTables", "/"))
        for b in range(1, 3601):
            clock.now = float(b)
            messages = []
            for p in range(partitions):
                w = sink.open_writer(WriterContext("bench", "WriteTables", b, f"p{p}", 0, 1, "a"))
                for r in _records(2, table=f"T{p % tables}", token=f"p{p}", at=T0 + b * 10**9):
                    w.write(r)
                m = w.close()
                if isinstance(m, TaskRows):
                    messages.append(m)
            sink.commit(b, messages)
        sink.flush()
    finally:
        tables_module.time = saved
    files = sum(1 for _, _, names in os.walk(directory) for n in names if n.startswith("part-"))
    print(f"files per hour: {files} for {partitions} partitions, {tables} tables, 1 s batches, "
          f"flush_interval 60s (bound {tables * 3600 // 60})", flush=True)


def _open_tables(directory: str) -> None:
    """A batch's commit (and the durable mark) with one table active, beside 10 and
    10,000 tables whose files are open but got nothing in the batch: the work should follow
    the active tables."""
    cost = {}
    for n in (10, 10_000):
        sink = WriteTables(os.path.join(directory, f"open-{n}"), flush_interval="1h")
        sink.setup(SinkContext("bench", "WriteTables", "/"))
        opening = [r for t in range(n) for r in _records(1, table=f"T{t}")]
        batches = [(1, opening)] + [(b, _records(2, at=T0 + b * 10**9)) for b in range(2, 502)]
        t0 = 0.0
        for b, records in batches:
            if b == 2:
                t0 = time.perf_counter()
            w = sink.open_writer(WriterContext("bench", "WriteTables", b, "p0", 0, 1, "a"))
            for r in records:
                w.write(r)
            m = w.close()
            sink.commit(b, [m] if isinstance(m, TaskRows) else [])
            sink.durable_batch()
        cost[n] = (time.perf_counter() - t0) / 500
        sink.close()
    print(f"per batch, one active table: {cost[10] * 1e6:,.0f} us with 10 open tables, "
          f"{cost[10_000] * 1e6:,.0f} us with 10,000", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_tables", description=__doc__)
    parser.add_argument("--rows", type=positive_int, default=200_000)
    parser.add_argument("--batch", type=positive_int, default=5_000)
    parser.add_argument("--repeat", type=positive_int, default=3)
    args = parser.parse_args()
    records = _records(args.rows)
    tmp = tempfile.mkdtemp(prefix="bench-tables-")
    try:
        _side_by_side("local", tmp, records, args.batch, args.repeat)
        try:
            from moto.server import ThreadedMotoServer
        except ImportError:
            print("s3     skipped: pip install 'moto[server]'")
        else:
            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
            server.start()
            host, port = server.get_host_and_port()
            for k, v in {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                         "AWS_DEFAULT_REGION": "us-east-1"}.items():
                os.environ.setdefault(k, v)
            kw = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}}
            fsspec.filesystem("s3", **kw).mkdir("bench")
            try:
                _side_by_side("s3", "s3://bench/cdc", records, args.batch, args.repeat, **kw)
            finally:
                server.stop()
        _files_per_hour(os.path.join(tmp, "hourly"))
        _open_tables(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
