"""A data lake of the shop's orders: a snapshot, then a filtered stream of full rows, as
Parquet files per table.

    cdcflow emulator start --partition-alive-seconds 5 --database shop --ddl-file examples/shop.sql
    export SPANNER_EMULATOR_HOST=127.0.0.1:PORT     # the line the command above printed
    cdcflow run examples/lake.py --for 1m

What each step does:

* ``snapshot=True``: every row of the tracked tables as of the instant before ``start_at``
  comes first (``_op`` = ``SNAPSHOT``), then the changes from ``start_at`` on: no gap, no
  overlap;
* ``tables=`` and ``skip_unchanged=``: filters pushed down into the decoder (records of
  other tables and updates that changed nothing never become Python objects);
* ``LookupRows``: an OLD_AND_NEW_VALUES stream reports only the columns a transaction
  wrote; one stale read per bundle of records (at its first commit timestamp), rolled
  forward through the records, gives the whole row as of each commit;
* ``WriteTables``: one directory per table, a schema file per table version, Parquet
  files near ``file_size`` or one per ``flush_interval``, exactly once, on a local path or
  any fsspec URL (``s3://bucket/lake``).

Replaying the output in order — snapshot rows and INSERT/UPDATE rows as upserts, DELETE
rows as deletes — gives the table as it is at the end of the run.

Settings come from the environment, with defaults for the emulator:

    CDCFLOW_DATABASE  projects/test-project/instances/test-instance/databases/shop
    CDCFLOW_STREAM    OrdersStream
    CDCFLOW_START_AT  now       (used on the first run only)
    CDCFLOW_END_AT    unset     (inclusive end; the run stops when every partition reaches it)
    CDCFLOW_LAKE      out/lake  (relative to this file; or s3://..., memory://...)
"""

from __future__ import annotations

import os
from pathlib import Path

import cdcflow as cf

DATABASE = os.environ.get(
    "CDCFLOW_DATABASE", "projects/test-project/instances/test-instance/databases/shop"
)
LAKE = os.environ.get("CDCFLOW_LAKE", "out/lake")
if "://" not in LAKE:
    LAKE = str(Path(__file__).parent / LAKE)

pipeline = cf.Pipeline("lake-orders")
(
    pipeline
    | cf.ReadChangeStream(
        DATABASE,
        os.environ.get("CDCFLOW_STREAM", "OrdersStream"),
        start_at=os.environ.get("CDCFLOW_START_AT", "now"),
        end_at=os.environ.get("CDCFLOW_END_AT") or None,
        snapshot=True,                 # the tables' rows first, as of just before start_at
        tables=["Orders"],             # pushed-down filters
        skip_unchanged=True,
    )
    | cf.LookupRows(database=DATABASE)  # full rows as of each commit timestamp
    | cf.WriteTables(LAKE, format="parquet", rows="flat", flush_interval="10s")
)
