"""The records a :class:`~cdcflow.testing.ScriptedChangeStream`'s transactions give, per
partition, in the wire form a read of Spanner gives (typed later by the shaper)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from cdcflow.model import ColumnType, DataChangeRecord, Mod, ModType, Timestamp
from cdcflow.spanner.values import encode_values, encoders
from cdcflow.testing.columns import column_types
from cdcflow.testing.transaction import _Txn

__all__ = ["compile_records", "txn_id"]


def compile_records(
    txns: Iterable[_Txn], owner: Callable[[Mapping[str, Any], int], str],
    value_capture_type: str,
) -> dict[str, list[DataChangeRecord]]:
    """Per partition, the records of ``txns`` with mod values in the wire form: one
    DataChangeRecord per (partition, table, mod type) of a transaction, as Spanner groups
    them; ``owner(keys, at)`` is the partition that holds a key at a commit time."""
    out: dict[str, list[DataChangeRecord]] = {}
    known: dict[str, dict[str, Any]] = {}  # the columns' types so far, in commit order
    for txn in sorted(txns, key=lambda t: (t.at, t.seq)):
        groups: dict[tuple[str, str, ModType], list[Mod]] = {}
        columns: dict[tuple[str, str, ModType], dict[str, ColumnType]] = {}
        types = column_types(txn.changes, known)
        for table, keys, mod_type, new, old in txn.changes:
            token = owner(keys, txn.at)
            group = (token, table, mod_type)
            groups.setdefault(group, []).append(Mod(keys, new, old))
            cols = columns.setdefault(group, {})
            for name in [*keys, *new, *old]:
                if name not in cols:
                    cols[name] = ColumnType(name, types[table][name], name in keys,
                                            len(cols) + 1)
        for group, mods in groups.items():
            convs = encoders(tuple(columns[group].values()))
            groups[group] = [
                Mod(encode_values(m.keys, convs), encode_values(m.new_values, convs),
                    encode_values(m.old_values, convs))
                for m in mods
            ]
        by_partition: dict[str, list[tuple[str, str, ModType]]] = {}
        for group in groups:
            by_partition.setdefault(group[0], []).append(group)
        for token, part_groups in by_partition.items():
            for seq, group in enumerate(part_groups):
                _, table, mod_type = group
                out.setdefault(token, []).append(
                    DataChangeRecord(
                        partition_token=token,
                        commit_timestamp=Timestamp.from_ns(txn.at),
                        record_sequence=f"{seq:08d}",
                        server_transaction_id=txn_id(txn),
                        is_last_record_in_transaction_in_partition=seq == len(part_groups) - 1,
                        table_name=table,
                        column_types=tuple(columns[group].values()),
                        mods=tuple(groups[group]),
                        mod_type=mod_type,
                        value_capture_type=value_capture_type,
                        number_of_records_in_transaction=len(groups),
                        number_of_partitions_in_transaction=len(by_partition),
                        transaction_tag=txn.tag,
                    )
                )
    return out


def txn_id(txn: _Txn) -> str:
    """The server transaction id of a scripted transaction's records."""
    return f"txn-{txn.seq:08d}"
