"""What each write of the Spanner metadata store costs in mutations, and how writes are cut
to stay under Spanner's limit of 80,000 mutations per commit.

The rule (Spanner's documentation of the limit and of CommitStats.mutation_count): an insert
or update counts one mutation per column it writes, the key columns included; a delete
counts one per row (one per key range), plus one per secondary index entry it removes.
Index maintenance is not spelled out for inserts and updates, so it is counted as generously
as Beam's SpannerIO estimates it: every cell of every index entry a write adds or removes.
The partition table has two secondary indexes, each entry holding two indexed columns and
the table's two key columns, so an entry is 4 cells.

=========================================  =======================================  =====
write                                      cells                                    total
=========================================  =======================================  =====
insert a partition (12 columns)            12 + 2 indexes x 4                          20
update a partition's progress or state     7 columns (key, Watermark, State, the 3     15
                                           state times) + (State, Watermark) entry
                                           removed and added: 2 x 4
delete a partition                         1 + 1 per index entry                        3
log a plan (batch row, prune range)        10 columns + 1 range                        11
write a pipeline record                    11 columns                                  11
mark a batch committed                     4 columns + the pipeline record (the        15
                                           sinks' durable marks)
=========================================  =======================================  =====

Every transaction is kept under a budget (:data:`DEFAULT_MUTATION_BUDGET`, half the limit,
so that a miscount by a factor of two still commits). docs/spanner-store.md has the
arithmetic and how a batch's commit stays atomic when it takes several transactions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from cdcflow.errors import StoreError

__all__ = [
    "DEFAULT_MUTATION_BUDGET",
    "DELETE_PARTITION",
    "INSERT_PARTITION",
    "LOG_PLAN",
    "MARK_COMMITTED",
    "MIN_MUTATION_BUDGET",
    "MUTATION_LIMIT",
    "PIPELINE_ROW",
    "UPDATE_PARTITION",
    "check_budget",
    "chunks",
]

#: Spanner's limit of mutations per commit.
MUTATION_LIMIT = 80_000
#: Mutations one transaction of the store may use.
DEFAULT_MUTATION_BUDGET = 40_000

_INDEX_ENTRY = 4  # two indexed columns and the table's two key columns
_INDEXES = 2
INSERT_PARTITION = 12 + _INDEXES * _INDEX_ENTRY
UPDATE_PARTITION = 7 + 2 * _INDEX_ENTRY
DELETE_PARTITION = 1 + _INDEXES
LOG_PLAN = 10 + 1
PIPELINE_ROW = 11
MARK_COMMITTED = 5 + PIPELINE_ROW
#: The BatchSteps' state is stored in chunks of at most this many bytes (a BYTES cell holds
#: at most 10 MiB), each chunk a row of three columns; replacing it also deletes the chunks
#: beyond the new last one (one range).
STATE_CHUNK_BYTES = 8 << 20
STATE_CHUNK = 3
#: The largest state a commit stores: Spanner refuses commits over 100 MB in all.
MAX_STATE_BYTES = 64 << 20


def state_mutations(pipeline: str, size: int) -> int:
    """Mutations of storing a state of ``size`` bytes; StoreError for a state over
    MAX_STATE_BYTES (Spanner refuses commits over 100 MB)."""
    if size > MAX_STATE_BYTES:
        msg = (
            f"pipeline {pipeline!r}: the batch steps' state is {size} bytes, over the Spanner "
            f"store's limit of {MAX_STATE_BYTES}; a step keeps what the low watermark has not "
            "passed, so lower max_batch_span (or find the partition that lags)"
        )
        raise StoreError(msg)
    return 1 + STATE_CHUNK * max(1, -(-size // STATE_CHUNK_BYTES))

#: The smallest budget: a final transaction's fixed writes plus a few partitions. Only tests
#: go near it (a small budget makes the split paths run with a handful of partitions).
MIN_MUTATION_BUDGET = PIPELINE_ROW + LOG_PLAN + 2 * INSERT_PARTITION

_T = TypeVar("_T")


def check_budget(budget: int) -> int:
    if not MIN_MUTATION_BUDGET <= budget <= MUTATION_LIMIT:
        msg = (
            f"mutation_budget={budget}: use a number of mutations per transaction between "
            f"{MIN_MUTATION_BUDGET} and Spanner's limit {MUTATION_LIMIT} (default "
            f"{DEFAULT_MUTATION_BUDGET})"
        )
        raise ValueError(msg)
    return budget


def chunks(items: Sequence[tuple[_T, int]], room: int) -> list[list[_T]]:
    """``items`` (each with its cost in mutations) cut into consecutive runs whose costs add
    up to at most ``room``; at least one run, possibly empty. Every cost must fit ``room``."""
    out: list[list[_T]] = [[]]
    used = 0
    for item, cost in items:
        if cost > room:
            msg = f"one write of {cost} mutations does not fit a transaction of {room}"
            raise ValueError(msg)
        if used + cost > room:
            out.append([])
            used = 0
        out[-1].append(item)
        used += cost
    return out
