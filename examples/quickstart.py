"""Quick start: every change to the shop database's orders, as JSON lines.

    cdcflow emulator start --partition-alive-seconds 5 --database shop --ddl-file examples/shop.sql
    export SPANNER_EMULATOR_HOST=127.0.0.1:PORT     # the line the command above printed
    cdcflow run examples/quickstart.py --for 1m

Settings come from the environment, with defaults for the emulator:

    CDCFLOW_DATABASE  projects/test-project/instances/test-instance/databases/shop
    CDCFLOW_STREAM    OrdersStream
    CDCFLOW_START_AT  now       (or -10m, or RFC 3339; used on the first run only)
    CDCFLOW_END_AT    unset     (inclusive end; the run stops when every partition reaches it)
    CDCFLOW_OUT       out/orders (relative to this file)

Each output line is one changed row (a mod): table, operation, commit timestamp,
transaction id, primary key and new values. Deletes are kept; the demo checks that every
committed change arrives exactly once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import cdcflow as cf

DATABASE = os.environ.get(
    "CDCFLOW_DATABASE", "projects/test-project/instances/test-instance/databases/shop"
)


def mods_as_rows(record: cf.DataChangeRecord) -> Iterator[dict[str, Any]]:
    """One row per changed row of the record (a record holds a transaction's mods of one
    table and one mod type, in one partition)."""
    for index, mod in enumerate(record.mods):
        yield {
            "table": record.table_name,
            "op": record.mod_type,
            "commit_timestamp": record.commit_timestamp,
            "transaction_id": record.server_transaction_id,
            "record_sequence": record.record_sequence,
            "mod_index": index,
            "keys": dict(mod.keys),
            "new_values": dict(mod.new_values),
            "partition_token": record.partition_token,
        }


pipeline = cf.Pipeline("quickstart-orders")
(
    pipeline
    | cf.DetectPartitions(
        database=DATABASE,
        stream=os.environ.get("CDCFLOW_STREAM", "OrdersStream"),
        start_at=os.environ.get("CDCFLOW_START_AT", "now"),
        end_at=os.environ.get("CDCFLOW_END_AT") or None,
    )
    | cf.ReadPartition(heartbeat="500ms")
    | "rows" >> cf.FlatMap(mods_as_rows)
    | "files" >> cf.WriteFiles(os.environ.get("CDCFLOW_OUT", "out/orders"), format="jsonl")
)
