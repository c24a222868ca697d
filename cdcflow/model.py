"""Change-stream records and partition metadata.

Records mirror Spanner's change stream record types field for field (GoogleSQL names in
snake_case). Every record carries the ``partition_token`` it was read from. JSON values are
plain Python values. Timestamps are :class:`Timestamp`: timezone-aware UTC datetimes that
keep nanoseconds. This module imports nothing of cdcflow.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Mapping
from datetime import UTC, date, datetime, timedelta
from typing import Any, Literal, TypeAlias, cast

import attrs

__all__ = [
    "BATCH_STATS",
    "INITIAL_PARTITION_TOKEN",
    "MAX_NS",
    "SNAPSHOT_TOKEN_PREFIX",
    "BatchPlan",
    "BatchRecord",
    "ChangeRecord",
    "ChildPartition",
    "ChildPartitionsRecord",
    "ColumnType",
    "DataChangeRecord",
    "HeartbeatRecord",
    "JsonString",
    "Lease",
    "Mod",
    "ModType",
    "MoveInEvent",
    "MoveOutEvent",
    "PartitionEndRecord",
    "PartitionEventRecord",
    "PartitionMetadata",
    "PartitionStartRecord",
    "PartitionState",
    "PartitionUpdate",
    "Slice",
    "Timestamp",
    "ValueCaptureType",
    "is_snapshot_token",
    "record_position",
    "snapshot_table",
    "snapshot_token",
]

#: Token of the synthetic root partition; its query passes a NULL partition token and
#: returns the stream's first child partitions (the name Beam's metadata table uses).
INITIAL_PARTITION_TOKEN = "Parent0"

#: Prefix of the tokens of snapshot partitions: ``snapshot/<table>`` reads the table as of
#: the instant before the stream's start (see :func:`snapshot_token`), and
#: ``snapshot/<table>/<index>/<range>`` one key range of it (:mod:`cdcflow.keyrange`).
#: Change stream tokens and table names never contain a '/'.
SNAPSHOT_TOKEN_PREFIX = "snapshot/"

#: Largest position, "no end": the largest signed 64-bit value (2262-04-11), so positions
#: fit every store's integer column and Spark's LongType.
MAX_NS = (1 << 63) - 1

_NS_PER_S = 1_000_000_000
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_RFC3339 = re.compile(
    r"^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"(Z|z|[+-]\d{2}:\d{2})?$"
)


# datetime's comparisons, applied to a Timestamp's microsecond part. Typed for any right
# operand: like datetime they give NotImplemented for a non-datetime and raise TypeError
# for a naive one.
_Compare: TypeAlias = Callable[[datetime, object], bool]
_dt_lt = cast(_Compare, datetime.__lt__)
_dt_le = cast(_Compare, datetime.__le__)
_dt_gt = cast(_Compare, datetime.__gt__)
_dt_ge = cast(_Compare, datetime.__ge__)


class JsonString(str):
    """A JSON column's value that is a JSON string, typed: the string itself (``"str"`` for
    the JSON text ``"\"str\""``), marked so that a sink writing JSON as text writes it back
    as JSON text, apart from a wire value (which is the JSON text)."""

    __slots__ = ()


class Timestamp(datetime):
    """A timezone-aware UTC datetime that keeps nanoseconds.

    Equality, ordering and hashing follow the instant to the nanosecond, consistently with
    plain ``datetime`` values, which are instants to the microsecond:

    - two Timestamps compare by :attr:`ns`;
    - a Timestamp whose :attr:`nanosecond` is 0 equals, and hashes like, the datetime of
      the same instant;
    - a Timestamp whose :attr:`nanosecond` is not 0 equals no plain datetime, and orders
      after the datetime of its microsecond (and before the next microsecond's).

    So equality is transitive over any mix of Timestamps and datetimes, and equal values
    hash equal (sets and dict keys may mix them). Comparing with a naive datetime raises
    TypeError, as between datetimes.
    """

    # Slots, not a __dict__: decoders make one Timestamp per record and value, and a dict
    # each would double the allocations (and the garbage collector's work). ``_ns`` caches
    # :attr:`ns`, ``_text`` :meth:`rfc3339` (None until first computed; decoders that know
    # them set them at once).
    __slots__ = ("_nanosecond", "_ns", "_text")

    _nanosecond: int
    _ns: int | None
    _text: str | None

    def __new__(cls, *args: Any, nanosecond: int = 0, **kwargs: Any) -> Timestamp:
        if "tzinfo" not in kwargs and len(args) < 8:
            kwargs["tzinfo"] = UTC
        self = super().__new__(cls, *args, **kwargs)
        if self.tzinfo is None:
            msg = "Timestamp needs a timezone; pass tzinfo=datetime.UTC"
            raise ValueError(msg)
        if not 0 <= nanosecond < 1000:
            msg = f"nanosecond must be in 0..999 (the part below microseconds), got {nanosecond}"
            raise ValueError(msg)
        self._nanosecond = nanosecond
        self._ns = None
        self._text = None
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Timestamp.from_ns, (self.ns,))

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # datetime defines __reduce_ex__, which pickle and copy prefer over __reduce__;
        # without this override a pickled Timestamp loses its nanoseconds.
        return self.__reduce__()

    @property
    def nanosecond(self) -> int:
        """The nanoseconds below the microsecond (0..999)."""
        return self._nanosecond

    @property
    def ns(self) -> int:
        """Integer nanoseconds since the Unix epoch."""
        ns = self._ns
        if ns is None:
            delta: timedelta = datetime.__sub__(self, _EPOCH)
            micros = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
            ns = self._ns = micros * 1000 + self._nanosecond
        return ns

    @classmethod
    def from_ns(cls, ns: int) -> Timestamp:
        micros, nanos = divmod(ns, 1000)
        dt = _EPOCH + timedelta(microseconds=micros)
        ts = cls(
            dt.year, dt.month, dt.day, dt.hour, dt.minute, dt.second, dt.microsecond,
            tzinfo=UTC, nanosecond=nanos,
        )
        ts._ns = ns
        return ts

    @classmethod
    def from_datetime(cls, value: datetime) -> Timestamp:
        """Convert a datetime (naive values are taken as UTC); keeps ``.nanosecond`` if any."""
        if isinstance(value, Timestamp):
            return value
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        nanos = int(getattr(value, "nanosecond", 0) or 0)
        return cls(
            value.year, value.month, value.day, value.hour, value.minute, value.second,
            value.microsecond, tzinfo=UTC, nanosecond=nanos % 1000,
        )

    @classmethod
    def parse(cls, text: str) -> Timestamp:
        """Parse an RFC 3339 timestamp with up to nine fractional digits."""
        m = _RFC3339.match(text.strip())
        if m is None:
            msg = f"not an RFC 3339 timestamp: {text!r}; write e.g. 2024-05-01T12:00:00.123456789Z"
            raise ValueError(msg)
        year, month, day, hour, minute, second, frac, zone = m.groups()
        frac = (frac or "").ljust(9, "0")
        base = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second),
                        tzinfo=UTC)
        if zone and zone not in ("Z", "z"):
            sign = 1 if zone[0] == "+" else -1
            offset = timedelta(hours=int(zone[1:3]), minutes=int(zone[4:6]))
            base = base - sign * offset
        return cls.from_ns(cls.from_datetime(base).ns + int(frac))

    @classmethod
    def now(cls, tz: Any = None) -> Timestamp:
        return cls.from_datetime(datetime.now(UTC))

    # datetime's own methods build their results at microsecond precision, and replace()
    # builds one without __new__ (its slots unset): these keep the nanoseconds.

    def replace(self, *args: Any, **kwargs: Any) -> datetime:  # type: ignore[override]
        """``datetime.replace``, keeping :attr:`nanosecond` (or taking ``nanosecond=``); a
        Timestamp, or a plain datetime when ``tzinfo=None`` makes it naive."""
        nanosecond = kwargs.pop("nanosecond", self._nanosecond)
        value = datetime(self.year, self.month, self.day, self.hour, self.minute, self.second,
                         self.microsecond, self.tzinfo, fold=self.fold).replace(*args, **kwargs)
        if value.tzinfo is None:
            return value
        return Timestamp(value.year, value.month, value.day, value.hour, value.minute,
                         value.second, value.microsecond, value.tzinfo, fold=value.fold,
                         nanosecond=nanosecond)

    def astimezone(self, tz: Any = None) -> Timestamp:
        """``datetime.astimezone``, keeping :attr:`nanosecond`."""
        value = datetime.astimezone(self, tz)
        if type(value) is not Timestamp:  # a tzinfo whose fromutc() made another type
            return Timestamp.from_datetime(value)
        value._nanosecond = self._nanosecond
        value._ns = None
        value._text = None
        return value

    def __add__(self, other: Any) -> Timestamp:
        if isinstance(other, timedelta):
            return Timestamp.from_ns(self.ns + _timedelta_ns(other))
        return NotImplemented

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        if isinstance(other, timedelta):
            return Timestamp.from_ns(self.ns - _timedelta_ns(other))
        return datetime.__sub__(self, other)  # datetime - datetime: a timedelta (in µs)

    def __getattr__(self, name: str) -> Any:
        # Only reached when a slot is unset: an instance some other datetime method made
        # without __new__. It has no nanoseconds; the caches start empty.
        if name in ("_nanosecond", "_ns", "_text"):
            value = 0 if name == "_nanosecond" else None
            object.__setattr__(self, name, value)
            return value
        msg = f"'Timestamp' object has no attribute {name!r}"
        raise AttributeError(msg)

    def rfc3339(self) -> str:
        """RFC 3339 text in UTC with nine fractional digits, e.g.
        ``2024-05-01T12:00:00.123456789Z``."""
        text = self._text
        if text is None:
            if self.tzinfo is not UTC and self.utcoffset():
                text = Timestamp.from_ns(self.ns).rfc3339()  # another zone: say it in Z
            else:
                text = (
                    f"{self.year:04d}-{self.month:02d}-{self.day:02d}T{self.hour:02d}:"
                    f"{self.minute:02d}:{self.second:02d}.{self.microsecond:06d}"
                    f"{self._nanosecond:03d}Z"
                )
            self._text = text
        return text

    def __str__(self) -> str:
        return self.rfc3339()

    def __repr__(self) -> str:
        return f"Timestamp.parse({self.rfc3339()!r})"

    # Against a plain datetime only the microsecond instant can differ: with n >= 0
    # nanoseconds past it, self < d iff its microsecond is < d, self >= d iff it is >= d,
    # and <=, > depend on whether n is 0. datetime's own comparison of the microsecond part
    # keeps its rules (aware vs naive raises, other types give NotImplemented).

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Timestamp):
            return self.ns == other.ns
        if isinstance(other, datetime) and self._nanosecond:
            return False
        return datetime.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __lt__(self, other: date) -> bool:
        if isinstance(other, Timestamp):
            return self.ns < other.ns
        return _dt_lt(self, other)

    def __le__(self, other: date) -> bool:
        if isinstance(other, Timestamp):
            return self.ns <= other.ns
        if self._nanosecond:
            return _dt_lt(self, other)
        return _dt_le(self, other)

    def __gt__(self, other: date) -> bool:
        if isinstance(other, Timestamp):
            return self.ns > other.ns
        if self._nanosecond:
            return _dt_ge(self, other)
        return _dt_gt(self, other)

    def __ge__(self, other: date) -> bool:
        if isinstance(other, Timestamp):
            return self.ns >= other.ns
        return _dt_ge(self, other)

    def __hash__(self) -> int:
        # Equal to the equivalent datetime's hash when there is one (nanosecond 0); two
        # equal Timestamps share the instant and the nanosecond, so their hashes agree.
        base = datetime.__hash__(self)
        return hash((base, self._nanosecond)) if self._nanosecond else base


def _timedelta_ns(value: timedelta) -> int:
    return ((value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds) * 1000


def _ts(value: Any) -> Timestamp:
    if isinstance(value, Timestamp):
        return value
    if isinstance(value, int):
        return Timestamp.from_ns(value)
    if isinstance(value, datetime):
        return Timestamp.from_datetime(value)
    if isinstance(value, str):
        return Timestamp.parse(value)
    msg = f"expected a timestamp (datetime, RFC 3339 text or integer ns), got {value!r}"
    raise TypeError(msg)


def _tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value)


ModType: TypeAlias = Literal["INSERT", "UPDATE", "DELETE"]
ValueCaptureType: TypeAlias = Literal[
    "OLD_AND_NEW_VALUES", "NEW_ROW", "NEW_VALUES", "NEW_ROW_AND_OLD_VALUES"
]


@attrs.frozen
class ColumnType:
    """A column of a tracked table; ``type`` is the decoded JSON type (``{"code": "INT64"}``)."""

    name: str
    type: Any
    is_primary_key: bool
    ordinal_position: int


@attrs.frozen
class Mod:
    """One changed row: primary key, new and old column values as plain dicts."""

    keys: Mapping[str, Any]
    new_values: Mapping[str, Any] = attrs.field(factory=dict)
    old_values: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class DataChangeRecord:
    """Changes of one table in one transaction, as read from one partition."""

    partition_token: str
    commit_timestamp: Timestamp = attrs.field(converter=_ts)
    record_sequence: str
    server_transaction_id: str
    is_last_record_in_transaction_in_partition: bool
    table_name: str
    column_types: tuple[ColumnType, ...] = attrs.field(converter=_tuple)
    mods: tuple[Mod, ...] = attrs.field(converter=_tuple)
    mod_type: ModType
    value_capture_type: str
    number_of_records_in_transaction: int
    number_of_partitions_in_transaction: int
    transaction_tag: str = ""
    is_system_transaction: bool = False
    #: True for a row of the initial snapshot (``snapshot=`` of the source): an INSERT of
    #: the row as it was at ``commit_timestamp``, the instant before the stream's start.
    #: Not a field of Spanner's records.
    is_snapshot: bool = False


@attrs.frozen
class HeartbeatRecord:
    """No change in the partition up to ``timestamp``."""

    partition_token: str
    timestamp: Timestamp = attrs.field(converter=_ts)


@attrs.frozen
class ChildPartition:
    token: str
    parent_partition_tokens: tuple[str, ...] = attrs.field(converter=_tuple)


@attrs.frozen
class ChildPartitionsRecord:
    """The partition ends at ``start_timestamp``; the children continue from there."""

    partition_token: str
    start_timestamp: Timestamp = attrs.field(converter=_ts)
    record_sequence: str
    child_partitions: tuple[ChildPartition, ...] = attrs.field(converter=_tuple)


@attrs.frozen
class PartitionStartRecord:
    """MUTABLE_KEY_RANGE: new partitions to read from ``start_timestamp``."""

    partition_token: str
    start_timestamp: Timestamp = attrs.field(converter=_ts)
    record_sequence: str
    partition_tokens: tuple[str, ...] = attrs.field(converter=_tuple)


@attrs.frozen
class PartitionEndRecord:
    """MUTABLE_KEY_RANGE: the partition ends at ``end_timestamp``."""

    partition_token: str
    end_timestamp: Timestamp = attrs.field(converter=_ts)
    record_sequence: str


@attrs.frozen
class MoveInEvent:
    source_partition_token: str


@attrs.frozen
class MoveOutEvent:
    destination_partition_token: str


@attrs.frozen
class PartitionEventRecord:
    """MUTABLE_KEY_RANGE: key ranges moved into or out of the partition."""

    partition_token: str
    commit_timestamp: Timestamp = attrs.field(converter=_ts)
    record_sequence: str
    move_in_events: tuple[MoveInEvent, ...] = attrs.field(converter=_tuple, default=())
    move_out_events: tuple[MoveOutEvent, ...] = attrs.field(converter=_tuple, default=())


ChangeRecord: TypeAlias = (
    DataChangeRecord
    | HeartbeatRecord
    | ChildPartitionsRecord
    | PartitionStartRecord
    | PartitionEndRecord
    | PartitionEventRecord
)


def record_position(record: ChangeRecord) -> int:
    """The record's position (its timestamp) in integer nanoseconds since the epoch."""
    if isinstance(record, DataChangeRecord | PartitionEventRecord):
        return record.commit_timestamp.ns
    if isinstance(record, HeartbeatRecord):
        return record.timestamp.ns
    if isinstance(record, ChildPartitionsRecord | PartitionStartRecord):
        return record.start_timestamp.ns
    return record.end_timestamp.ns


def snapshot_token(table: str) -> str:
    """The token of the snapshot partition of ``table``."""
    return SNAPSHOT_TOKEN_PREFIX + table


def is_snapshot_token(token: str) -> bool:
    """Whether ``token`` names a snapshot partition (a table's initial snapshot, or a key
    range of it)."""
    return token.startswith(SNAPSHOT_TOKEN_PREFIX)


def snapshot_table(token: str) -> str:
    """The table a snapshot partition reads; raises ValueError for any other token."""
    if not is_snapshot_token(token):
        msg = f"{token!r} is not a snapshot token (those start {SNAPSHOT_TOKEN_PREFIX!r})"
        raise ValueError(msg)
    return token[len(SNAPSHOT_TOKEN_PREFIX):].partition("/")[0]


class PartitionState(enum.StrEnum):
    CREATED = "CREATED"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"


@attrs.frozen
class PartitionMetadata:
    """A partition's stored state. Positions are integer nanoseconds since the epoch.

    ``watermark`` is the position up to which everything the partition holds has been read,
    processed and committed; reading resumes there. ``end`` is exclusive (MAX_NS: no end).
    """

    token: str
    parent_tokens: tuple[str, ...] = attrs.field(converter=_tuple)
    start: int
    end: int
    watermark: int
    state: PartitionState = attrs.field(converter=PartitionState)
    heartbeat_millis: int = 1000
    created_at: int = 0
    scheduled_at: int | None = None
    running_at: int | None = None
    finished_at: int | None = None


@attrs.frozen
class Slice:
    """One partition's share of a batch: read positions ``start <= ts < end``."""

    token: str
    start: int
    end: int


@attrs.frozen
class BatchPlan:
    """A planned micro-batch, written to the store before any sink commits it (write-ahead:
    once its tasks have returned; see :mod:`cdcflow.engine.batch`).

    ``end`` is the batch end T; each slice ends at ``min(T, partition end)``. Replaying a
    crashed batch whose plan was written re-executes exactly these slices.
    """

    batch_id: int
    end: int
    slices: tuple[Slice, ...] = attrs.field(converter=_tuple)
    planned_at: int = 0


@attrs.frozen
class PartitionUpdate:
    """A partition's progress in a committed batch."""

    token: str
    watermark: int
    finished: bool = False


def _float_map(value: Mapping[str, float]) -> dict[str, float]:
    return dict(value)


@attrs.frozen
class BatchRecord:
    """A row of the batch log.

    ``stats``: what the engine measured of the batch when it committed it (see
    :data:`BATCH_STATS`); empty for a batch never committed, or committed by a version
    that did not record them.
    """

    batch_id: int
    end: int
    planned_at: int
    committed_at: int | None
    slices: int
    records: int = 0
    stats: Mapping[str, float] = attrs.field(factory=dict, converter=_float_map)


#: The names a batch log entry's ``stats`` may hold: seconds of the batch's phases before
#: its store commit, its bytes read, its elements retried, skipped and dead-lettered, and
#: the span the batches after it were paced to (ns; see :mod:`cdcflow.engine.pacing`) and
#: the lease token of the run that committed it.
BATCH_STATS = (
    "plan_seconds", "execute_seconds", "sink_commit_seconds", "bytes", "retries", "skipped",
    "dead_lettered", "next_span_ns", "lease_token",
)


@attrs.frozen
class Lease:
    """Who runs a pipeline, and the fencing token of that run.

    ``token`` grows with every acquisition, across owners and resets: a store refuses a
    plan or commit fenced with any token but the current one, so a stale or second driver
    can never plan or commit. ``owner`` is ``host:pid``; ``run_id`` is unique per run.
    Times are ns since the epoch (the store's clock); ``expires_at`` is 0 once released.
    """

    owner: str
    run_id: str
    token: int
    acquired_at: int
    renewed_at: int
    expires_at: int

    def alive(self, now_ns: int) -> bool:
        """True while the lease holds: not released and not expired at ``now_ns``."""
        return now_ns < self.expires_at

    @property
    def host(self) -> str:
        return self.owner.rpartition(":")[0]

    @property
    def pid(self) -> int | None:
        text = self.owner.rpartition(":")[2]
        return int(text) if text.isdigit() else None
