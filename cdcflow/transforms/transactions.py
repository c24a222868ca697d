"""GroupTransactions: whole Spanner transactions out of DataChangeRecords.

Spanner writes one DataChangeRecord per table a transaction changed, in every partition
whose key ranges it touched, so one transaction's records arrive from several tasks and,
when partitions lag each other, over several batches. ``GroupTransactions`` is a
:class:`~cdcflow.transforms.base.BatchStep`: it collects the records of each transaction
across partitions and batches and emits the transaction whole once the low watermark has
passed its commit timestamp (every partition has then been read past it, so no record of
it can still come). Transactions come out in (commit timestamp, server transaction id)
order, each once: the engine stores the step's state — the transactions not yet emitted —
with every batch commit, so a replayed batch emits exactly what it emitted before.

Counts. Every record carries ``number_of_records_in_transaction`` and
``number_of_partitions_in_transaction``; an emitted transaction must have exactly that many
records from that many partitions, else :class:`IncompleteTransactionError` stops the run.
When records can legitimately be missing — the source pushes filters down (``tables=``,
``exclude_tables=``, ``mod_types=``, ``columns=``, ``skip_unchanged=``) or a ParDo runs
between ReadPartition and GroupTransactions — pipeline validation notices it, the step
checks only that no count is exceeded, and ``Transaction.complete`` tells whether a
transaction has all of its records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from cdcflow.errors import IncompleteTransactionError
from cdcflow.model import DataChangeRecord, Timestamp
from cdcflow.transforms.base import BatchStep, PrimitiveTransform
from cdcflow.transforms.source import DetectPartitions, ReadPartition

__all__ = ["GroupTransactions", "IncompleteTransactionError", "Transaction"]

_Key = tuple[int, str]  # (commit timestamp in ns, server transaction id)
#: GroupTransactions' state: the records of every transaction not emitted yet.
_State = Mapping[_Key, tuple[DataChangeRecord, ...]]


def _sequence_key(record: DataChangeRecord) -> tuple[int, int, str]:
    # record_sequence is a decimal string; compare numerically, whatever its zero padding.
    seq = record.record_sequence
    return (0, int(seq), "") if seq.isdigit() else (1, 0, seq)


@attrs.frozen
class Transaction:
    """One Spanner transaction: its DataChangeRecords from every partition, ordered by
    ``record_sequence``.

    ``complete`` is False when records may be missing by design (pushed-down source
    filters, or a ParDo before GroupTransactions; see the module docstring).
    """

    commit_timestamp: Timestamp
    server_transaction_id: str
    transaction_tag: str
    records: tuple[DataChangeRecord, ...]
    complete: bool = True

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables the transaction changed (of its records), sorted."""
        return tuple(sorted({r.table_name for r in self.records}))

    @property
    def mods(self) -> int:
        """How many rows the transaction changed (mods over all its records)."""
        return sum(len(r.mods) for r in self.records)

    @property
    def partitions(self) -> tuple[str, ...]:
        """The partitions its records came from, sorted."""
        return tuple(sorted({r.partition_token for r in self.records}))

    @property
    def is_system_transaction(self) -> bool:
        return any(r.is_system_transaction for r in self.records)


class GroupTransactions(BatchStep[DataChangeRecord, Transaction, _State]):
    """Emit one :class:`Transaction` per Spanner transaction (see the module docstring).

    Apply it to ReadPartition's records (``ReadChangeStream(...) | GroupTransactions()``).
    A transaction is held until the low watermark passes its commit timestamp, so output
    lags the batch by up to ``max_batch_span`` (plus an idle partition's wait for its next
    read, ``idle_read_interval``); the state holds only such transactions.
    """

    def __init__(self) -> None:
        self._exact = True

    def check_upstream(self, path: Sequence[PrimitiveTransform[Any, Any]]) -> None:
        """Check exact counts only when every record of a transaction reaches this step:
        the source filters nothing and nothing runs between ReadPartition and this step."""
        source = path[0] if path else None
        filtered = isinstance(source, DetectPartitions) and source.filter is not None
        direct = len(path) == 2 and isinstance(path[-1], ReadPartition)
        self._exact = direct and not filtered

    def initial_state(self) -> _State:
        return {}

    def process_batch(
        self, state: _State, elements: Sequence[DataChangeRecord], low_watermark: Timestamp
    ) -> tuple[_State, Iterable[Transaction]]:
        pending: dict[_Key, tuple[DataChangeRecord, ...]] = dict(state)
        snapshot: list[Transaction] = []
        for record in elements:
            if not isinstance(record, DataChangeRecord):
                msg = (
                    f"GroupTransactions takes DataChangeRecords, got {type(record).__name__}; "
                    "apply it to ReadPartition's output (or to a Filter of it)"
                )
                raise TypeError(msg)
            if record.is_snapshot:
                # Rows of the initial snapshot are no transaction of the stream: each record
                # (up to 1000 rows of one table) is its own, emitted at once (the stream
                # starts only after the whole snapshot committed, so they come first).
                snapshot.append(Transaction(
                    commit_timestamp=record.commit_timestamp,
                    server_transaction_id=record.server_transaction_id,
                    transaction_tag=record.transaction_tag, records=(record,)))
                continue
            key = (record.commit_timestamp.ns, record.server_transaction_id)
            pending[key] = (*pending.get(key, ()), record)
        low = low_watermark.ns
        ready = sorted(key for key in pending if key[0] < low)
        out = [self._transaction(pending.pop(key)) for key in ready]
        return pending, [*snapshot, *out]

    def _transaction(self, records: tuple[DataChangeRecord, ...]) -> Transaction:
        ordered = tuple(sorted(records, key=_sequence_key))
        first = ordered[0]
        want_records = first.number_of_records_in_transaction
        want_parts = first.number_of_partitions_in_transaction
        parts = len({r.partition_token for r in ordered})
        exceeded = len(ordered) > want_records or parts > want_parts
        short = len(ordered) != want_records or parts != want_parts
        if exceeded or (self._exact and short):
            cause = (
                "a record was delivered twice (report this as a bug)" if exceeded else
                "records were lost upstream: a partition was read past a window without "
                "its records, or the change stream's retention dropped them"
            )
            msg = (
                f"transaction {first.server_transaction_id} committed at "
                f"{first.commit_timestamp} has {len(ordered)} record(s) from {parts} "
                f"partition(s), but its records say {want_records} record(s) from "
                f"{want_parts} partition(s); likely cause: {cause}. The batch was not "
                "committed; run again with --reset from an earlier start_at to re-read it"
            )
            raise IncompleteTransactionError(msg)
        return Transaction(
            commit_timestamp=first.commit_timestamp,
            server_transaction_id=first.server_transaction_id,
            transaction_tag=first.transaction_tag,
            records=ordered,
            complete=not short,
        )

    def describe_params(self) -> str:
        return "" if self._exact else "partial (filtered upstream)"
