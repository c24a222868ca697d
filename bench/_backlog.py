"""A change stream backlog made on the fly: records exist only while they are read.

:class:`LazyBacklog` is a ChangeStreamClient over ``partitions`` partitions, each holding
``records`` DataChangeRecords spread evenly over ``span_ns`` after ``origin``, every one
with a string column of ``payload`` bytes. Nothing is kept between reads, so the memory a
run takes is the pipeline's own, not the backlog's (a ScriptedChangeStream holds its whole
script). Reads are deterministic, as a change stream's are within retention.
"""

from __future__ import annotations

from collections.abc import Iterator

from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    Mod,
    Timestamp,
)
from cdcflow.stream import ChangeStreamQuery, StreamInfo

__all__ = ["LazyBacklog"]

_COLUMNS = (
    ColumnType("id", {"code": "INT64"}, True, 1),
    ColumnType("body", {"code": "STRING"}, False, 2),
)


class LazyBacklog:
    """A ChangeStreamClient whose partitions ``p0..p{n-1}`` hold generated records."""

    def __init__(
        self, stream: str, *, partitions: int, records: int, payload: int, origin: int,
        span_ns: int,
    ) -> None:
        self.stream = stream
        self.partitions = partitions
        self.records = records
        self.payload = payload
        self.origin = origin
        self.span_ns = span_ns

    @property
    def end(self) -> int:
        """A position after every record."""
        return self.origin + self.span_ns + 1

    @property
    def total_bytes(self) -> int:
        """The backlog's payload bytes (the string columns alone)."""
        return self.partitions * self.records * self.payload

    def describe_stream(self, stream: str) -> StreamInfo:
        return StreamInfo(name=stream)

    def close(self) -> None:
        return None

    def _at(self, i: int) -> int:
        return self.origin + 1 + i * self.span_ns // self.records

    def read(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        if query.partition_token is None:
            for i in range(self.partitions):
                yield ChildPartitionsRecord(
                    partition_token=INITIAL_PARTITION_TOKEN,
                    start_timestamp=Timestamp.from_ns(query.start),
                    record_sequence=f"{i:08d}",
                    child_partitions=(ChildPartition(f"p{i}", ()),),
                )
            return
        token = query.partition_token
        part = int(token[1:])
        filler = "x" * (self.payload - 16)
        # the first record at or after the slice's start
        first = max(0, -(-(query.start - self.origin - 1) * self.records // self.span_ns))
        for i in range(first, self.records):
            at = self._at(i)
            if at < query.start:
                continue
            if at >= query.end:
                break
            yield DataChangeRecord(
                partition_token=token,
                commit_timestamp=Timestamp.from_ns(at),
                record_sequence="00000000",
                server_transaction_id=f"{part}-{i}",
                is_last_record_in_transaction_in_partition=True,
                table_name="Backlog",
                column_types=_COLUMNS,
                mods=(Mod({"id": str(part * self.records + i)},
                          {"body": f"{i:016d}{filler}"}),),
                mod_type="INSERT",
                value_capture_type="OLD_AND_NEW_VALUES",
                number_of_records_in_transaction=1,
                number_of_partitions_in_transaction=1,
            )
        yield HeartbeatRecord(partition_token=token, timestamp=Timestamp.from_ns(query.end - 1))
