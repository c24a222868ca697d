"""Test helpers: :class:`ScriptedChangeStream`, an in-memory change stream you script.

Use it wherever a pipeline needs a Spanner change stream in a unit test: it implements
:class:`cdcflow.stream.ChangeStreamClient`, is deterministic and picklable (so it runs
on every runner), and knows the ground truth to assert against::

    from cdcflow.testing import ScriptedChangeStream

    stream = ScriptedChangeStream("Orders", partitions=2)           # p0, p1 from time 0
    stream.write("Orders", {"id": 1}, "INSERT", {"total": 5}, at=T0 + 1_000)
    stream.split("p0", at=T0 + 5_000, into=["p0a", "p0b"])
    stream.merge(["p0b", "p1"], at=T0 + 9_000, into="m")
    with stream.transaction(at=T0 + 10_000) as tx:                  # one transaction,
        tx.write("Orders", {"id": 1}, "UPDATE", {"total": 6})       # several mods
        tx.write("Orders", {"id": 2}, "INSERT", {"total": 1})

    source = DetectPartitions(stream="Orders", start_at=T0, end_at=T0 + 20_000, client=stream)
    ...
    assert collected == stream.expected_records(T0, T0 + 20_001)

Model. Keys are hashed into ``buckets`` buckets; the initial partitions share the buckets
in contiguous chunks, a split shares its parent's buckets among the children, a merge
unions its parents' buckets. A data change is routed to the partition that owns its key's
bucket at its commit time, so the same key can move between partitions over time, exactly
the situation in which per-key ordering matters. A transaction yields one
DataChangeRecord per (partition, table, mod type), as Spanner groups them.

Reads follow the change stream contract:

- The root query (``partition_token=None``) returns one ChildPartitionsRecord per
  partition alive at the query start, each carrying ``INITIAL_PARTITION_TOKEN`` and
  starting at the query start (their parent list is empty, as Spanner's is), then ends.
- A partition's query returns its records with ``start <= commit_timestamp < end`` in
  commit order, a HeartbeatRecord whenever ``heartbeat_millis`` pass without one, and,
  when the partition ends inside the query, a ChildPartitionsRecord at its end (a merge
  child is reported by every parent, each listing all parents); then the query ends.

Positions (``at=``) are integer nanoseconds since the epoch, or anything
:func:`cdcflow.durations.parse_time` takes (RFC 3339 text, a datetime).

Values. Each column gets the Spanner type of the values written to it (int -> INT64,
Decimal -> NUMERIC, datetime -> TIMESTAMP, dict -> JSON, ...; see
:mod:`cdcflow.testing.columns`), reported in ``column_types``. Values are encoded in
Spanner's wire form and decoded by the real decoder's converters, so reads give exactly
what a read of Spanner gives: typed values by default, the wire form with
``stream.with_options(typed=False)``, which also takes a
:class:`~cdcflow.stream.RecordFilter` (what ``DetectPartitions(typed=..., tables=...)``
passes on).

Snapshots: ``snapshot_rows={"T": [({"id": 1}, {"v": "a"}), ...]}`` are rows at the origin;
``snapshot`` reads a table as of a timestamp (:mod:`cdcflow.testing.tablestate`), as a
source with ``snapshot=`` does, and ``rows_at`` is the ground truth.

Fault injection: :meth:`ScriptedChangeStream.fail_reads` makes the next reads raise (its
counters live in each copy of the object: a runner pickles its program and counts in its
own copy); :meth:`ScriptedChangeStream.stall` makes a partition stop answering for a while.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, TypeVar

import attrs

from cdcflow.durations import parse_time
from cdcflow.errors import ChangeStreamError, StreamNotFoundError, TransientError
from cdcflow.keyrange import KeyRange, range_token
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    MAX_NS,
    ChangeRecord,
    ChildPartition,
    ChildPartitionsRecord,
    DataChangeRecord,
    ModType,
    Timestamp,
    snapshot_token,
)
from cdcflow.spanner.shape import RecordShaper, default_shaper
from cdcflow.stream import ChangeStreamQuery, RecordFilter, StreamInfo
from cdcflow.testing.columns import ScriptedView, column_types
from cdcflow.testing.compiled import compile_records, txn_id
from cdcflow.testing.reads import failing, with_heartbeats
from cdcflow.testing.tablestate import Row, initial_rows, rows_at, snapshot_of, split_of
from cdcflow.testing.transaction import ScriptedChange, ScriptedTransaction, _Txn

__all__ = ["ScriptedChange", "ScriptedChangeStream", "ScriptedTransaction"]

TimeLike = int | str | datetime
_R = TypeVar("_R", bound=ChangeRecord)


@attrs.define
class _Partition:
    token: str
    start: int
    buckets: tuple[int, ...]
    parents: tuple[str, ...]
    end: int = MAX_NS
    children: tuple[str, ...] = ()


class ScriptedChangeStream:
    """A deterministic in-memory :class:`~cdcflow.stream.ChangeStreamClient`.

    ``partitions``: how many initial partitions (tokens ``p0``, ``p1``, ...) or their
    tokens; they exist from ``origin`` (ns) on. ``buckets``: key-hash buckets shared among
    partitions (a partition needs at least one, so it bounds how finely they split).
    ``partition_mode`` is what :meth:`describe_stream` reports. ``snapshot_rows``: table ->
    rows ``(key, values)`` that exist at ``origin`` (see the module docstring). Builder
    methods return the stream, so calls chain.
    """

    def __init__(
        self,
        stream: str = "Stream",
        *,
        partitions: int | Sequence[str] = 1,
        buckets: int = 64,
        origin: TimeLike = 0,
        value_capture_type: str = "OLD_AND_NEW_VALUES",
        partition_mode: Literal["IMMUTABLE_KEY_RANGE", "MUTABLE_KEY_RANGE"] = (
            "IMMUTABLE_KEY_RANGE"
        ),
        snapshot_rows: Mapping[str, Iterable[tuple[Any, Mapping[str, Any]]]] | None = None,
    ) -> None:
        tokens = [f"p{i}" for i in range(partitions)] if isinstance(partitions, int) else list(
            partitions
        )
        if not tokens or len(set(tokens)) != len(tokens):
            msg = "ScriptedChangeStream needs one or more initial partitions with unique tokens"
            raise ValueError(msg)
        if buckets < len(tokens):
            msg = f"buckets={buckets} is fewer than the {len(tokens)} partitions; raise buckets"
            raise ValueError(msg)
        self.stream = stream
        self.buckets = buckets
        self.origin = _ns(origin)
        self.value_capture_type = value_capture_type
        self.partition_mode = partition_mode
        self._parts: dict[str, _Partition] = {}
        for token, chunk in zip(tokens, _chunks(tuple(range(buckets)), len(tokens)), strict=True):
            self._parts[token] = _Partition(token, self.origin, chunk, ())
        self._txns: list[_Txn] = []
        self._initial: dict[str, list[Row]] = initial_rows(snapshot_rows)
        self._compiled: dict[str, list[DataChangeRecord]] | None = None
        self._fail_left = 0
        self._fail_after = 0
        self._fail_error: type[Exception] = TransientError
        self._fail_token: str | None = None
        self._stall: tuple[str, int, float] | None = None  # token, from position, until
        self.reads = 0  # read() calls made on this copy
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()

    # -- pickling (the lock stays behind) ---------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # Plain tuples pickle an order of magnitude faster than attrs instances, and the
        # compiled records are rebuilt on first read where the copy lands.
        state = self.__dict__.copy()
        del state["_lock"], state["_compile_lock"]
        state["_compiled"] = None
        state["_txns"] = [(t.at, t.seq, t.tag, t.changes) for t in self._txns]
        state["_parts"] = [attrs.astuple(p, recurse=False) for p in self._parts.values()]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_txns"] = [_Txn(*t) for t in state["_txns"]]
        state["_parts"] = {p[0]: _Partition(*p) for p in state["_parts"]}
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"ScriptedChangeStream({self.stream!r}, partitions={len(self._parts)}, "
            f"transactions={len(self._txns)})"
        )

    # -- scripting --------------------------------------------------------------------------

    def split(
        self, token: str, at: TimeLike, into: int | Sequence[str] = 2
    ) -> ScriptedChangeStream:
        """End partition ``token`` at ``at``; its keys continue in the new partitions.

        ``into``: how many children (tokens ``token.0``, ``token.1``, ...) or their tokens.
        """
        at_ns = _ns(at)
        parent = self._alive(token, at_ns)
        names = [f"{token}.{i}" for i in range(into)] if isinstance(into, int) else list(into)
        if len(names) < 2 or len(names) > len(parent.buckets):
            msg = (
                f"split({token!r}) into {len(names)} partitions: use 2 to "
                f"{len(parent.buckets)} (the key buckets it owns; raise buckets= for more)"
            )
            raise ValueError(msg)
        self._check_new(names)
        for name, chunk in zip(names, _chunks(parent.buckets, len(names)), strict=True):
            self._parts[name] = _Partition(name, at_ns, chunk, (token,))
        parent.end, parent.children = at_ns, tuple(names)
        self._compiled = None
        return self

    def merge(
        self, tokens: Sequence[str], at: TimeLike, into: str | None = None
    ) -> ScriptedChangeStream:
        """End partitions ``tokens`` at ``at``; their keys continue in one new partition."""
        at_ns = _ns(at)
        if len(tokens) < 2 or len(set(tokens)) != len(tokens):
            msg = f"merge({list(tokens)!r}) needs two or more distinct partition tokens"
            raise ValueError(msg)
        parents = [self._alive(t, at_ns) for t in tokens]
        name = into if into is not None else "+".join(tokens)
        self._check_new([name])
        buckets = tuple(sorted(b for p in parents for b in p.buckets))
        self._parts[name] = _Partition(name, at_ns, buckets, tuple(tokens))
        for p in parents:
            p.end, p.children = at_ns, (name,)
        self._compiled = None
        return self

    def write(
        self,
        table: str,
        key: Mapping[str, Any] | Any,
        mod_type: ModType = "INSERT",
        new_values: Mapping[str, Any] | None = None,
        *,
        at: TimeLike,
        old_values: Mapping[str, Any] | None = None,
        tag: str = "",
    ) -> ScriptedChangeStream:
        """Commit a one-mod transaction at ``at``.

        ``key`` is a dict of primary-key columns, or a single value for the column ``id``.
        """
        with self.transaction(at=at, tag=tag) as tx:
            tx.write(table, key, mod_type, new_values, old_values)
        return self

    def transaction(self, at: TimeLike, tag: str = "") -> ScriptedTransaction:
        """A transaction committed at ``at``; add mods with ``tx.write(...)`` in a ``with``."""
        return ScriptedTransaction(self, _ns(at), tag)

    def fail_reads(
        self,
        count: int,
        *,
        after_records: int = 0,
        error: type[Exception] = TransientError,
        token: str | None = None,
    ) -> ScriptedChangeStream:
        """Make the next ``count`` reads raise ``error`` after yielding ``after_records``.

        ``token`` limits the failures to reads of that partition (None: any partition).
        The default error is what a client raises once its own retries of UNAVAILABLE are
        spent.
        """
        self._fail_left, self._fail_after = count, after_records
        self._fail_error, self._fail_token = error, token
        return self

    def stall(self, token: str, seconds: float, *, after: TimeLike | None = None
              ) -> ScriptedChangeStream:
        """Make partition ``token`` stop answering: its reads that start at ``after`` or
        later (default: every read) block before their first record until ``seconds``
        (wall clock) have passed since this call, then answer as usual. What a partition
        whose server hangs looks like to a run: its watermark stops while the clock moves
        (``pipeline.run(stuck_after=...)`` reports it). The deadline is absolute, so every
        copy of the stream (a runner pickles it) stalls until the same moment."""
        if not seconds >= 0:
            msg = f"stall(seconds={seconds!r}): use a number of seconds >= 0"
            raise ValueError(msg)
        if token not in self._parts:
            msg = f"unknown partition {token!r}; known: {', '.join(sorted(self._parts))}"
            raise ValueError(msg)
        start = self.origin if after is None else _ns(after)
        self._stall = (token, start, time.time() + seconds)
        return self

    def _add_txn(self, txn: _Txn) -> None:
        if txn.at < self.origin:
            msg = f"a transaction at {txn.at} is before the stream's origin {self.origin}"
            raise ValueError(msg)
        column_types(txn.changes)  # values of types no column can hold fail here
        txn.seq = len(self._txns)
        self._txns.append(txn)
        self._compiled = None

    def _alive(self, token: str, at: int) -> _Partition:
        p = self._parts.get(token)
        if p is None:
            msg = f"unknown partition {token!r}; known: {', '.join(sorted(self._parts))}"
            raise ValueError(msg)
        if p.end != MAX_NS:
            msg = f"partition {token!r} already ended at {p.end}; script changes in time order"
            raise ValueError(msg)
        if at <= p.start:
            msg = f"partition {token!r} starts at {p.start}; end it after that, not at {at}"
            raise ValueError(msg)
        return p

    def _check_new(self, names: Sequence[str]) -> None:
        clash = [n for n in names if n in self._parts or n == INITIAL_PARTITION_TOKEN]
        if clash or len(set(names)) != len(names):
            msg = f"partition tokens {sorted(set(clash) or names)!r} are taken; pick new ones"
            raise ValueError(msg)

    # -- ground truth -----------------------------------------------------------------------

    def partitions_at(self, at: TimeLike) -> list[str]:
        """Tokens of the partitions alive at ``at``, sorted."""
        at_ns = _ns(at)
        return sorted(p.token for p in self._parts.values() if p.start <= at_ns < p.end)

    def owner(self, key: Mapping[str, Any] | Any, at: TimeLike) -> str:
        """The token of the partition that owns ``key`` at ``at``."""
        keys = dict(key) if isinstance(key, Mapping) else {"id": key}
        return self._owner(_bucket(keys, self.buckets), _ns(at))

    def expected_changes(
        self, start: TimeLike | None = None, end: TimeLike | None = None
    ) -> list[ScriptedChange]:
        """Every scripted change with ``start <= commit < end``, in commit order."""
        lo = self.origin if start is None else _ns(start)
        hi = MAX_NS if end is None else _ns(end)
        out: list[ScriptedChange] = []
        index = 0
        for txn in sorted(self._txns, key=lambda t: (t.at, t.seq)):
            for table, keys, mod_type, new, old in txn.changes:
                if lo <= txn.at < hi:
                    out.append(
                        ScriptedChange(txn.at, txn_id(txn), index, table, keys, mod_type, new,
                                       old)
                    )
                index += 1
        return out

    def expected_records(
        self, start: TimeLike | None = None, end: TimeLike | None = None
    ) -> list[DataChangeRecord]:
        """The DataChangeRecords a complete read of ``[start, end)`` delivers.

        Ordered by (commit timestamp, transaction, partition token, record sequence): the
        order of any single partition, and of any single key, is this order's restriction.
        """
        return self._expected(start, end, default_shaper)

    def _expected(
        self, start: TimeLike | None, end: TimeLike | None, shaper: RecordShaper
    ) -> list[DataChangeRecord]:
        lo = self.origin if start is None else _ns(start)
        hi = MAX_NS if end is None else _ns(end)
        compiled = self._records()
        shaped = (
            shaper.shape(r) for recs in compiled.values() for r in recs
            if lo <= r.commit_timestamp.ns < hi
        )
        return sorted((r for r in shaped if isinstance(r, DataChangeRecord)), key=_record_order)

    def tables(self) -> dict[str, set[str]]:
        """Table -> column names, of everything written so far (what a filter may name)."""
        out: dict[str, set[str]] = {}
        for table, rows in self._initial.items():
            for keys, values in rows:
                out.setdefault(table, set()).update(keys, values)
        for txn in self._txns:
            for table, keys, _, new, old in txn.changes:
                out.setdefault(table, set()).update(keys, new, old)
        return out

    def with_options(
        self, *, typed: bool = True, filter: RecordFilter | None = None
    ) -> ScriptedView:
        """This stream read with mod values typed (default) or in the wire form, and only
        what ``filter`` keeps (see :class:`~cdcflow.testing.columns.ScriptedView`)."""
        return ScriptedView(self, typed, filter)

    def rows_at(self, table: str, at: TimeLike) -> list[dict[str, Any]]:
        """``table``'s rows as of ``at`` (keys and values in one dict), sorted by key."""
        rows = rows_at(self._initial.get(table, ()), self._txns, table, _ns(at))
        return [{**values, **keys} for keys, values in rows]

    # -- ChangeStreamClient and SnapshotClient ------------------------------------------------

    def snapshot_tables(self, stream: str) -> list[str]:
        """The tables this stream tracks: those with rows or changes (sorted)."""
        self._check_stream(stream)
        return sorted(self.tables())

    def snapshot_split(
        self, stream: str, table: str, read_timestamp_ns: int, rows_per_task: int
    ) -> list[KeyRange]:
        """``table``'s key ranges as of ``read_timestamp_ns`` (see
        :class:`~cdcflow.stream.SnapshotClient`; the key order is
        :mod:`cdcflow.testing.tablestate`'s). A read of ``"snapshot/<table>"`` for
        :meth:`fail_reads`, which fails before any key."""
        self._check_stream(stream)
        if self._read_fails(snapshot_token(table)):
            list(failing(iter(()), 0, self._fail_error))  # raises
        rows = rows_at(self._initial.get(table, ()), self._txns, table, read_timestamp_ns)
        return split_of(table, rows, rows_per_task)

    def snapshot(self, stream: str, table: str, read_timestamp_ns: int,
                 key_range: KeyRange | None = None) -> Iterator[DataChangeRecord]:
        """``table`` (``key_range`` of it) as of ``read_timestamp_ns`` (see
        :class:`~cdcflow.stream.SnapshotClient`); :meth:`fail_reads` with the snapshot
        partition's token (``"snapshot/<table>"``, or a range's) makes it fail."""
        return self._snapshot(stream, table, read_timestamp_ns, default_shaper, key_range)

    def _snapshot(
        self, stream: str, table: str, read_timestamp_ns: int, shaper: RecordShaper,
        key_range: KeyRange | None = None,
    ) -> Iterator[DataChangeRecord]:
        self._check_stream(stream)
        fail = self._read_fails(
            snapshot_token(table) if key_range is None else range_token(table, key_range)
        )
        rows = rows_at(self._initial.get(table, ()), self._txns, table, read_timestamp_ns)
        records = snapshot_of(table, rows, read_timestamp_ns, shaper, key_range)
        return failing(records, self._fail_after, self._fail_error) if fail else records

    def describe_stream(self, stream: str) -> StreamInfo:
        self._check_stream(stream)
        return StreamInfo(name=stream, partition_mode=self.partition_mode)

    def read(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        """Yield the records of ``query`` (see the module docstring for what they are)."""
        return self._read(query, default_shaper)

    def _read(self, query: ChangeStreamQuery, shaper: RecordShaper) -> Iterator[ChangeRecord]:
        self._check_stream(query.stream)
        if query.start >= query.end:
            return iter(())
        fail = self._read_fails(query.partition_token)
        stall = self._stall
        if stall is not None and query.partition_token == stall[0] and query.start >= stall[1]:
            time.sleep(max(0.0, stall[2] - time.time()))
        records = _shaped(
            self._root(query) if query.partition_token is None else self._part(query), shaper
        )
        return failing(records, self._fail_after, self._fail_error) if fail else records

    def close(self) -> None:
        return None

    def _read_fails(self, token: str | None) -> bool:
        """Count a read of ``token``; whether it is one :meth:`fail_reads` makes fail."""
        with self._lock:
            self.reads += 1
            fail = self._fail_left > 0 and self._fail_token in (None, token)
            if fail:
                self._fail_left -= 1
            return fail

    def _check_stream(self, stream: str) -> None:
        if stream != self.stream:
            msg = (
                f"change stream {stream!r} not found (this scripted stream is "
                f"{self.stream!r}); pass stream={self.stream!r} to DetectPartitions"
            )
            raise StreamNotFoundError(msg)

    def _root(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        alive = self.partitions_at(query.start)
        if not alive:
            msg = (
                f"no partition exists at {Timestamp.from_ns(query.start)}: the scripted stream "
                f"starts at {Timestamp.from_ns(self.origin)}; start reading at or after it"
            )
            raise ChangeStreamError(msg)
        for i, token in enumerate(alive):
            yield ChildPartitionsRecord(
                partition_token=INITIAL_PARTITION_TOKEN,
                start_timestamp=Timestamp.from_ns(query.start),
                record_sequence=f"{i:08d}",
                child_partitions=(ChildPartition(token, ()),),
            )

    def _part(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]:
        token = query.partition_token
        assert token is not None
        p = self._parts.get(token)
        if p is None:
            msg = f"partition token {token!r} is not known to the scripted stream"
            raise ChangeStreamError(msg)
        if not p.start <= query.start <= p.end:
            msg = (
                f"partition {token!r} holds [{p.start}, {p.end}); a query starting at "
                f"{query.start} is outside it"
            )
            raise ChangeStreamError(msg)
        hb = max(1, query.heartbeat_millis) * 1_000_000
        stop = min(query.end, p.end)
        recs = self._records().get(token, [])
        first = bisect.bisect_left(recs, query.start, key=lambda r: r.commit_timestamp.ns)
        yield from with_heartbeats(
            itertools.islice(recs, first, None), token, query.start, stop, hb
        )
        if p.end < query.end:
            yield ChildPartitionsRecord(
                partition_token=token,
                start_timestamp=Timestamp.from_ns(p.end),
                record_sequence="00000000",
                child_partitions=tuple(
                    ChildPartition(c, self._parts[c].parents) for c in p.children
                ),
            )

    # -- compiling transactions into per-partition records -----------------------------------

    def _owner(self, bucket: int, at: int) -> str:
        for p in self._parts.values():
            if p.start <= at < p.end and bucket in p.buckets:
                return p.token
        msg = f"no partition owns bucket {bucket} at {at}"  # unreachable: buckets are covered
        raise AssertionError(msg)

    def _records(self) -> dict[str, list[DataChangeRecord]]:
        compiled = self._compiled
        if compiled is not None:
            return compiled
        with self._compile_lock:  # concurrent tasks of a runner compile once, not each
            if self._compiled is None:
                self._compiled = self._compile()
            return self._compiled

    def _compile(self) -> dict[str, list[DataChangeRecord]]:
        """Per partition, its records with mod values in the wire form."""
        # bucket -> the partitions that ever owned it: a write looks at those (a few), not
        # at every partition (10,000 partitions made compiling minutes long)
        owners: dict[int, list[_Partition]] = {}
        for part in self._parts.values():
            for bucket in part.buckets:
                owners.setdefault(bucket, []).append(part)

        def owner(keys: Mapping[str, Any], at: int) -> str:
            bucket = _bucket(keys, self.buckets)
            for part in owners.get(bucket, ()):
                if part.start <= at < part.end:
                    return part.token
            return self._owner(bucket, at)  # raises: buckets are always covered

        return compile_records(self._txns, owner, self.value_capture_type)


def _ns(value: TimeLike) -> int:
    return parse_time(value)


def _chunks(items: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    size, extra = divmod(len(items), n)
    out, pos = [], 0
    for i in range(n):
        step = size + (1 if i < extra else 0)
        out.append(items[pos : pos + step])
        pos += step
    return out


def _bucket(keys: Mapping[str, Any], buckets: int) -> int:
    return zlib.crc32(repr(sorted(keys.items())).encode()) % buckets


def _record_order(r: DataChangeRecord) -> tuple[int, str, str, str]:
    return r.commit_timestamp.ns, r.server_transaction_id, r.partition_token, r.record_sequence


def _shaped(records: Iterator[ChangeRecord], shaper: RecordShaper) -> Iterator[ChangeRecord]:
    for record in records:
        yield shaper.shape(record) if isinstance(record, DataChangeRecord) else record


