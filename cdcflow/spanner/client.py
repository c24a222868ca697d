"""ChangeStreamClient on google-cloud-spanner: bounded queries, bounded retries, fast decode.

Each :class:`~cdcflow.stream.ChangeStreamQuery` is one change stream query with
``start_timestamp = start`` and ``end_timestamp = end - 1 ns`` (the function's bounds are
inclusive, slices are half-open). The dialect (GoogleSQL or PostgreSQL) and the partition
mode are read from the database once per stream.

Windows. A slice is read in consecutive queries (windows) when one query cannot span it:
MUTABLE_KEY_RANGE streams accept at most 30 minutes per query, and a server refuses a
query that asks for more than it can hold at once with RESOURCE_EXHAUSTED (the emulator,
past 128 MB of changes). Such a refusal halves the window, at once and without counting as
a failed attempt, down to :data:`NARROWEST_WINDOW_NS`; each window read doubles the next;
the client's next reads start at the widest window it has seen answered. Windows stop
where the partition ends. What a slice gives does not depend on its windows.

Retries. Transient errors (see :func:`cdcflow.spanner.retry.is_transient`) are retried
with the delays of a :class:`~cdcflow.backoff.RetryPolicy` (capped exponential backoff,
full jitter): at most ``attempts`` calls in a row without progress and, if the policy has
a ``deadline``, none starting later than that after the first failing one. A retry
re-issues the query from the timestamp of the last record the caller consumed and drops
what the caller already has (:mod:`cdcflow.spanner.resumption`).

Values and filters. Mod values are typed from the records' column types (``typed=True``,
see :mod:`cdcflow.spanner.values`) or kept in the wire form; a
:class:`~cdcflow.stream.RecordFilter` is applied while decoding (see
:mod:`cdcflow.spanner.shape`): a record it drops becomes a HeartbeatRecord at its commit
timestamp. :meth:`SpannerChangeStreamClient.describe_stream` checks the filter's table and
column names against what the stream tracks (information_schema) and raises
PipelineDefinitionError listing them.

Measurement. :meth:`SpannerChangeStreamClient.read` returns an
:class:`~cdcflow.spanner.retry.ObservedRead`: its
``counters()`` say what the read's queries cost (latency histograms and errors by gRPC
status, see :class:`~cdcflow.spanner.retry.QueryStats`); tasks add them to their counters.

Clients hold gRPC channels, so tasks get theirs from :func:`cached_client` (one per
process and arguments). Pickling a client pickles only its arguments; unpickling
returns the process's cached client.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import (
    ChangeStreamError,
    ConfigurationError,
    StreamNotFoundError,
    TransientError,
)
from cdcflow.keyrange import KeyRange
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    MAX_NS,
    ChangeRecord,
    DataChangeRecord,
    Timestamp,
)
from cdcflow.spanner.flat import MessageDecoder
from cdcflow.spanner.resumption import Resumption
from cdcflow.spanner.retry import (
    ObservedRead,
    QueryStats,
    RetryLog,
    is_transient,
    status_name,
)
from cdcflow.spanner.shape import RecordShaper
from cdcflow.spanner.snapshot import read_snapshot, split_snapshot
from cdcflow.spanner.tracked import tracked_columns
from cdcflow.spanner.translate import error_text, session_gone, translate, unreachable
from cdcflow.spanner.transport import (
    STOP_POLL_S,
    GrpcTransport,
    Param,
    Transport,
    assemble_rows,
    emulator_host,
    endpoint,
)
from cdcflow.stream import ChangeStreamClient, ChangeStreamQuery, RecordFilter, StreamInfo

_log = logging.getLogger("cdcflow.spanner")
_retry_log = RetryLog(_log)

__all__ = ["SpannerChangeStreamClient", "cached_client"]

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_DATABASE = re.compile(r"^projects/[^/]+/instances/[^/]+/databases/[^/]+$")
_PRIORITIES = ("LOW", "MEDIUM", "HIGH")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT_NS = {"s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "d": 86_400 * 10**9}
_DEFAULT_RETENTION_NS = 86_400 * 10**9
#: MUTABLE_KEY_RANGE change stream queries accept at most 30 minutes between start and end.
_MUTABLE_WINDOW_NS = 30 * 60 * 10**9
#: The narrowest window RESOURCE_EXHAUSTED narrows a query to (see the module docstring).
NARROWEST_WINDOW_NS = 1_000_000
#: A change stream query with no message for this many heartbeat intervals (and at least
#: STALL_MIN_S seconds) stalled: it is ended and read again from where it was.
STALL_HEARTBEATS = 6
STALL_MIN_S = 60.0

Dialect = Literal["GOOGLE_STANDARD_SQL", "POSTGRESQL"]


def _rfc3339(ns: int) -> str:
    return Timestamp.from_ns(ns).rfc3339()


def _retention_ns(text: str | None) -> int:
    if not text:
        return _DEFAULT_RETENTION_NS
    m = _DURATION.match(text)
    if m is None:
        return _DEFAULT_RETENTION_NS
    return int(float(m.group(1)) * _UNIT_NS[m.group(2)])


class SpannerChangeStreamClient:
    """Reads change streams of one database with the stock google-cloud-spanner client.

    ``priority`` is the RPC priority of every query (LOW, MEDIUM, HIGH); ``query_timeout``
    the deadline of each query in seconds. ``spanner_client`` replaces the default
    ``google.cloud.spanner.Client`` (built for the database's project; it honours
    ``SPANNER_EMULATOR_HOST`` and Application Default Credentials). Nothing connects until
    the first call. ``transport`` is the seam for tests: set it to wrap the default one.
    ``typed`` and ``filter``: see the module docstring. ``data_boost``: snapshot reads
    (:meth:`snapshot`) run on Data Boost.
    """

    def __init__(
        self,
        database: str,
        *,
        priority: str = "MEDIUM",
        query_timeout: float = 600.0,
        retry: RetryPolicy | None = None,
        spanner_client: Any = None,
        typed: bool = True,
        filter: RecordFilter | None = None,
        data_boost: bool = False,
    ) -> None:
        if not _DATABASE.match(database):
            msg = (
                f"database {database!r}: write the full path "
                "projects/PROJECT/instances/INSTANCE/databases/DATABASE"
            )
            raise StreamNotFoundError(msg)
        priority = priority.upper()
        if priority not in _PRIORITIES:
            msg = f"priority={priority!r}: use one of {', '.join(_PRIORITIES)}"
            raise ValueError(msg)
        if query_timeout <= 0:
            msg = f"query_timeout={query_timeout}: use a positive number of seconds"
            raise ValueError(msg)
        self.database = database
        self.priority = priority
        self.query_timeout = float(query_timeout)
        self.retry = retry or RetryPolicy()
        self.typed = typed
        self.filter = filter
        self.data_boost = data_boost
        self._shaper = RecordShaper(typed, filter)
        self._spanner_client = spanner_client
        self._transport: Transport | None = None
        self._dialect: Dialect | None = None
        self._streams: dict[str, StreamInfo] = {}
        self._lock = threading.Lock()
        # The widest query window known to be answered (MAX_NS until one is refused).
        self._width = MAX_NS

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            self._transport = GrpcTransport(self.database, self._spanner_client)
        return self._transport

    @transport.setter
    def transport(self, value: Transport) -> None:
        self._transport = value

    def __reduce__(self) -> tuple[Any, ...]:
        # Channels and sessions do not travel: the receiving process uses its own client.
        return (_restore, (self.database, self.priority, self.query_timeout, self.typed,
                           self.filter, self.data_boost))

    def with_options(
        self, *, typed: bool = True, filter: RecordFilter | None = None
    ) -> SpannerChangeStreamClient:
        """A client of the same database with these read options; it shares this one's
        transport (closing either closes it)."""
        other = SpannerChangeStreamClient(
            self.database, priority=self.priority, query_timeout=self.query_timeout,
            retry=self.retry, spanner_client=self._spanner_client, typed=typed, filter=filter,
            data_boost=self.data_boost,
        )
        other._transport = self._transport
        return other

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._transport = None

    def _rows(self, sql: str, params: Mapping[str, Param]) -> list[list[Any]]:
        """A small metadata query, retried like change stream queries."""
        failed = 1

        def once() -> list[list[Any]]:
            responses = self.transport.execute_streaming_sql(
                sql, params, priority=self.priority, timeout=min(self.query_timeout, 60.0)
            )
            return [row for _, row in assemble_rows(responses)]

        def count(retry: int, exc: BaseException, delay: float) -> None:
            nonlocal failed
            failed = retry + 1

        try:
            return self.retry.call(once, retry_if=self._retry_if, on_retry=count)
        except Exception as exc:
            failure = self._failure(exc, None, failed)
            if failure is exc:
                raise
            raise failure from exc

    @staticmethod
    def _worth_retrying(exc: BaseException) -> bool:
        if isinstance(exc, ChangeStreamError | StreamNotFoundError | TransientError):
            return False
        return session_gone(exc) or is_transient(exc)

    def _retry_if(self, exc: BaseException) -> bool:
        """The policy's predicate: transient errors and a lost session (renewed here)."""
        if not self._worth_retrying(exc):
            return False
        if session_gone(exc):
            self.transport.reset_session()
        return True

    def _retry_after(
        self, exc: Exception, failed: int, streak_began: float, what: str = "a query",
        stopping: Callable[[], bool] | None = None,
    ) -> bool:
        """After ``failed`` failures in a row, the first of them begun at ``streak_began``
        (on the policy's clock): sleep and return True to retry, or return False when the
        error is not retryable (the caller translates it). Raises TransientError when the
        policy's attempts or deadline are spent, or once ``stopping()`` (the run was asked
        to stop: no retry, nor the rest of a delay). A retry is logged (``what`` failed):
        at INFO, and as a warning from the third failure in a row on."""
        if not self._retry_if(exc):
            return False
        delay = self.retry.delay(failed)
        if not self.retry.allows(failed, self.retry.clock() - streak_began, delay):
            raise self._failure(exc, None, failed) from exc
        if stopping is not None and stopping():
            raise self._given_up(exc, what) from exc
        _retry_log.log(logging.WARNING if failed >= 3 else logging.INFO,
                       "%s failed (%s: %s); trying again in %.1f s (failure %d in a row)",
                       what, status_name(exc), error_text(exc), delay, failed)
        if stopping is None:
            self.retry.sleep(delay)
            return True
        left = delay
        while left > 0:  # in steps: a stop that comes meanwhile waits no longer
            if stopping():
                raise self._given_up(exc, what) from exc
            step = min(left, STOP_POLL_S)
            self.retry.sleep(step)
            left -= step
        return True

    @staticmethod
    def _given_up(exc: Exception, what: str) -> TransientError:
        msg = (f"{what} was given up, as the run was asked to stop, where it failed "
               f"({status_name(exc)}: {error_text(exc)}); the next run reads it again")
        return TransientError(msg)

    def _failure(self, exc: Exception, query: ChangeStreamQuery | None, failed: int
                 ) -> Exception:
        """What to raise for ``exc`` once retrying stopped after ``failed`` attempts."""
        if self._worth_retrying(exc) and status_name(exc) == "RESOURCE_EXHAUSTED":
            msg = (
                f"Spanner kept refusing the read after {failed} attempts (RESOURCE_EXHAUSTED: "
                f"{error_text(exc)}), even in windows of "
                f"{NARROWEST_WINDOW_NS // 1_000_000} ms of commits: the instance is out of "
                "capacity or quota (or one commit holds more than it answers at once); add "
                "capacity or wait, then run again"
            )
            return TransientError(msg)
        if self._worth_retrying(exc):
            msg = (
                f"Spanner kept failing after {failed} attempts ({status_name(exc)}: "
                f"{error_text(exc)}); check the network path to {endpoint()} and the "
                "database's health and quota, then run again"
            )
            return TransientError(msg)
        return self._translate(exc, query)

    # -- metadata ---------------------------------------------------------------------------

    def dialect(self) -> Dialect:
        """The database's SQL dialect, read once."""
        if self._dialect is None:
            rows = self._rows(
                "SELECT option_value FROM information_schema.database_options "
                "WHERE option_name = 'database_dialect'",
                {},
            )
            value = rows[0][0].string_value if rows else "GOOGLE_STANDARD_SQL"
            self._dialect = "POSTGRESQL" if value == "POSTGRESQL" else "GOOGLE_STANDARD_SQL"
        return self._dialect

    def describe_stream(self, stream: str) -> StreamInfo:
        """The stream's name as the database spells it, partition mode, dialect, retention.

        Raises StreamNotFoundError when the database or the stream does not exist, and
        PipelineDefinitionError when the client's filter names a table or column the
        stream does not track.
        """
        with self._lock:
            cached = self._streams.get(stream)
        if cached is not None:
            return cached
        _check_identifier(stream)
        _log.info("connecting to %s through %s", self.database, endpoint())
        try:
            dialect = self.dialect()
        except TransientError as e:
            # The first contact: a server that never answered is a configuration problem.
            if e.__cause__ is not None and unreachable(e.__cause__):
                msg = (
                    f"cannot reach {endpoint()}: {error_text(e.__cause__)[:160]}; is it running, "
                    "and is the host:port right?"
                )
                raise ConfigurationError(msg) from None
            raise
        names = [row[0].string_value for row in self._rows(
            "SELECT change_stream_name FROM information_schema.change_streams", {}
        )]
        name = stream if stream in names else next(
            (n for n in names if n.lower() == stream.lower()), None
        )
        if name is None:
            known = ", ".join(sorted(names)) or "none"
            msg = (
                f"change stream {stream!r} not found in {self.database} (streams: {known}); "
                f"fix the name or create it with CREATE CHANGE STREAM {stream} FOR ..."
            )
            raise StreamNotFoundError(msg)
        options = {
            row[0].string_value.lower(): row[1].string_value
            for row in self._rows(
                "SELECT option_name, option_value FROM information_schema.change_stream_options "
                f"WHERE change_stream_name = '{name}'",
                {},
            )
        }
        mode = options.get("partition_mode", "IMMUTABLE_KEY_RANGE").upper()
        info = StreamInfo(
            name=name,
            partition_mode=(
                "MUTABLE_KEY_RANGE" if mode == "MUTABLE_KEY_RANGE" else "IMMUTABLE_KEY_RANGE"
            ),
            dialect=dialect,
            retention_ns=_retention_ns(options.get("retention_period")),
            keys_follow_lineage=emulator_host() is None,
        )
        if self.filter is not None and self.filter.names():
            tracked = self.tracked_columns(name)
            resolved = self.filter.resolved(tracked)
            resolved.check(name, tracked)
            if resolved != self.filter:  # names as the database spells them
                with self._lock:
                    self.filter = resolved
                    self._shaper = RecordShaper(self.typed, resolved)
        with self._lock:
            self._streams[stream] = info
        return info

    def tracked_columns(self, stream: str) -> dict[str, set[str]]:
        """Table -> columns (keys included) that change stream ``stream`` (its name as the
        database spells it) tracks, from information_schema."""
        return tracked_columns(lambda sql: self._rows(sql, {}), stream, self.dialect())

    # -- snapshots (cdcflow.stream.SnapshotClient) -----------------------------------------

    def snapshot_tables(self, stream: str) -> list[str]:
        """The tables ``stream`` tracks, sorted."""
        return sorted(self.tracked_columns(self.describe_stream(stream).name))

    def snapshot_split(
        self, stream: str, table: str, read_timestamp_ns: int, rows_per_task: int
    ) -> list[KeyRange]:
        """``table``'s keys as of ``read_timestamp_ns`` cut into key ranges of about
        ``rows_per_task`` rows ([] for a table of at most that many; see
        :func:`cdcflow.spanner.snapshot.split_snapshot`)."""
        self.describe_stream(stream)
        return split_snapshot(
            self._grpc(), lambda sql: self._rows(sql, {}), table=table,
            read_timestamp_ns=read_timestamp_ns, dialect=self.dialect(),
            rows_per_task=rows_per_task, retry=self.retry, priority=self.priority,
            timeout=self.query_timeout,
        )

    def snapshot(
        self, stream: str, table: str, read_timestamp_ns: int,
        key_range: KeyRange | None = None,
    ) -> Iterator[DataChangeRecord]:
        """``table`` (``key_range`` of it; the columns ``stream`` tracks) as of exactly
        ``read_timestamp_ns``, in snapshot records typed and filtered like change records
        (see :mod:`cdcflow.spanner.snapshot`)."""
        name = self.describe_stream(stream).name
        return read_snapshot(
            self._grpc(), lambda sql: self._rows(sql, {}), table=table,
            tracked=self.tracked_columns(name).get(table, ()),
            read_timestamp_ns=read_timestamp_ns, dialect=self.dialect(), shaper=self._shaper,
            retry=self.retry, priority=self.priority, timeout=self.query_timeout,
            data_boost=self.data_boost, key_range=key_range,
        )

    def _grpc(self) -> GrpcTransport:
        """The gRPC transport snapshots read through (they need its sessions' API)."""
        transport = self.transport
        if not isinstance(transport, GrpcTransport):
            msg = f"a snapshot reads through GrpcTransport, not {type(transport).__name__}"
            raise ConfigurationError(msg)
        return transport

    # -- reading ----------------------------------------------------------------------------

    def _statement(
        self, info: StreamInfo, token: str | None, start: int, end: int, heartbeat: int
    ) -> tuple[str, dict[str, Param]]:
        # end >= MAX_NS means "no end": the function reads on while the partition lives.
        end_value = None if end >= MAX_NS else _rfc3339(end - 1)
        if info.dialect == "POSTGRESQL":
            # MUTABLE_KEY_RANGE streams answer in ChangeStreamRecord protos (BYTES) instead
            function = "read_proto_bytes_" if info.partition_mode == "MUTABLE_KEY_RANGE" else (
                "read_json_"
            )
            sql = f"SELECT * FROM spanner.{function}{info.name}($1, $2, $3, $4, null)"
            return sql, {
                "p1": ("TIMESTAMP", _rfc3339(start)),
                "p2": ("TIMESTAMP", end_value),
                "p3": ("STRING", token),
                "p4": ("INT64", str(heartbeat)),
            }
        sql = (
            f"SELECT ChangeRecord FROM READ_{info.name}(start_timestamp => @s, "
            "end_timestamp => @e, partition_token => @t, heartbeat_milliseconds => @h)"
        )
        return sql, {
            "s": ("TIMESTAMP", _rfc3339(start)),
            "e": ("TIMESTAMP", end_value),
            "t": ("STRING", token),
            "h": ("INT64", str(heartbeat)),
        }

    def _stall_after(self, heartbeat_millis: int) -> float:
        """Seconds without a message after which a change stream query stalled: the
        server sends a heartbeat record every ``heartbeat_millis`` when it has nothing
        else, so silence of several heartbeats is a connection that carries nothing
        (at least :data:`STALL_MIN_S`, at most the query's timeout)."""
        return min(self.query_timeout,
                   max(STALL_MIN_S, STALL_HEARTBEATS * heartbeat_millis / 1000))

    def _query(
        self, info: StreamInfo, token: str | None, start: int, end: int, heartbeat: int,
        stats: QueryStats, sizes: dict[int, int], stopping: Callable[[], bool] | None = None,
    ) -> Iterator[list[ChangeRecord]]:
        """The records of one query, a message's at a time (the caller handles them all
        before it asks for the next: the time it holds them is not the query's)."""
        sql, params = self._statement(info, token, start, end, heartbeat)
        label = token if token is not None else INITIAL_PARTITION_TOKEN
        clock = time.perf_counter
        began = clock()
        held = 0.0  # time the caller held this query's records: not the query's
        paused: float | None = None
        first: float | None = None
        try:
            transport = self.transport
            # passed only when there is one, to a transport that takes it (one written
            # before the check existed is called as then)
            told = {} if stopping is None or not _takes_stopping(transport) else {
                "stopping": stopping}
            responses = transport.execute_streaming_sql(
                sql, params, priority=self.priority, timeout=self.query_timeout,
                idle=self._stall_after(heartbeat), **told,
            )
            decoder = MessageDecoder(self._shaper, sizes)
            decode = decoder.decode
            for message in responses:
                arrived = clock()
                records = decode(message, label)
                if first is None and decoder.rows_seen:
                    first = arrived - began
                if records:
                    paused = clock()
                    yield records
                    held += clock() - paused
                    paused = None
            records = decoder.finish(label)
            if records:
                paused = clock()
                yield records
                held += clock() - paused
                paused = None
        finally:
            # Ended, failed, or abandoned while the caller held a record (then it ended
            # when the caller last took one).
            stats.query((clock() if paused is None else paused) - began - held, first)

    def read(self, query: ChangeStreamQuery) -> ObservedRead:
        """Records of ``query.partition_token`` with ``start <= position < end``, and what
        their queries cost (:meth:`ObservedRead.counters`).

        See the module docstring for how retries resume without duplicates.
        """
        _check_identifier(query.stream)
        stats = QueryStats()
        if query.end <= query.start:
            return ObservedRead(iter(()), stats)
        info = self.describe_stream(query.stream)
        sizes: dict[int, int] = {}  # what the decoder measured of the records it gives
        return ObservedRead.of_runs(self._read(query, info, stats, sizes), stats, sizes)

    def _read(
        self, query: ChangeStreamQuery, info: StreamInfo, stats: QueryStats,
        sizes: dict[int, int],
    ) -> Iterator[Sequence[ChangeRecord]]:
        """The records of ``query`` in runs (a message's, or what is left of it), read in
        consecutive windows until the partition ends (module docstring); a query that
        fails is retried from the last position given, without what was given there."""
        token = query.partition_token
        what = f"the change stream query of partition {token or INITIAL_PARTITION_TOKEN}"
        # The widest window one query may span; RESOURCE_EXHAUSTED halves a window.
        widest = _MUTABLE_WINDOW_NS if info.partition_mode == "MUTABLE_KEY_RANGE" else MAX_NS
        start = query.start
        end = min(query.end, start + min(widest, self._width))
        # The root query's records (the first partitions) come in one window; a partition
        # ends at its ChildPartitionsRecord or PartitionEndRecord.
        read = Resumption(ended=token is None)
        failed = 0  # failures in a row without progress
        streak_began = 0.0  # when the first of them began, on the policy's clock
        while True:
            progressed = False
            began = self.retry.clock()
            try:
                for records in self._query(
                    info, token, start, end, query.heartbeat_millis, stats, sizes,
                    query.stopping,
                ):
                    given = read.given(records, end) if records else records
                    if not given:
                        continue
                    progressed = True
                    yield given
                    if read.ended and token is not None:
                        return  # nothing of the partition follows its end
            except Exception as exc:
                stats.error(exc)
                if progressed or failed == 0:
                    # A stream that made progress failed just now, not when it began.
                    streak_began = self.retry.clock() if progressed else began
                    failed = 0
                again = read.failed()  # from the last position given, if any
                if again is not None:
                    start = again
                narrower = self._narrower(exc, start, end, what)
                if narrower is not None:
                    end = narrower
                    continue
                failed += 1
                if not self._retry_after(exc, failed, streak_began, what, query.stopping):
                    translated = self._translate(exc, query)
                    if translated is exc:
                        raise
                    raise translated from exc
                continue
            if read.ended or end >= query.end:
                return
            # This window is read: the next starts at its end, as wide again (at most).
            self._width = max(self._width, end - start)
            width = min(widest, 2 * (end - start))
            start, end = end, min(query.end, end + width)
            read.next_window()
            failed = 0

    def _narrower(self, exc: Exception, start: int, end: int, what: str) -> int | None:
        """After RESOURCE_EXHAUSTED on the window ``[start, end)``, the end of one half as
        wide (not narrower than :data:`NARROWEST_WINDOW_NS`), remembered for this client's
        next reads; None for any other error, or a window that cannot narrow."""
        if status_name(exc) != "RESOURCE_EXHAUSTED" or end - start <= NARROWEST_WINDOW_NS:
            return None
        width = max(NARROWEST_WINDOW_NS, (end - start) // 2)
        self._width = width
        _log.info("%s asked for more than the server holds at once (%s); reading windows "
                  "of %.3f s", what, error_text(exc), width / 1e9)
        self.retry.sleep(self.retry.delay(1))
        return start + width

    def _translate(self, exc: Exception, query: ChangeStreamQuery | None) -> Exception:
        """A cdcflow error naming the fix for a permanent Spanner error."""
        return translate(exc, self.database, query)


_TAKES_STOPPING: dict[type, bool] = {}


def _takes_stopping(transport: Transport) -> bool:
    """Whether ``transport.execute_streaming_sql`` takes ``stopping`` (see ``Transport``),
    by its class."""
    kind = type(transport)
    takes = _TAKES_STOPPING.get(kind)
    if takes is None:
        params: dict[str, inspect.Parameter] = {}
        with contextlib.suppress(TypeError, ValueError):
            params = dict(inspect.signature(transport.execute_streaming_sql).parameters)
        takes = _TAKES_STOPPING[kind] = "stopping" in params or any(
            p.kind is p.VAR_KEYWORD for p in params.values())
    return takes


def _check_identifier(stream: str) -> None:
    if not _IDENTIFIER.match(stream or ""):
        msg = (
            f"{stream!r} is not a change stream name: use an identifier (letters, digits, '_', "
            "not starting with a digit)"
        )
        raise StreamNotFoundError(msg)


_CacheKey = tuple[int, str, str, float, bool, RecordFilter | None, bool]
_cache: dict[_CacheKey, SpannerChangeStreamClient] = {}
_cache_lock = threading.Lock()


def cached_client(
    database: str,
    *,
    priority: str = "MEDIUM",
    query_timeout: float = 600.0,
    typed: bool = True,
    filter: RecordFilter | None = None,
    data_boost: bool = False,
) -> ChangeStreamClient:
    """The process's client for these arguments, created on first use (nothing connects
    until it reads). Keyed by process id too, so a forked worker never reuses a channel."""
    key = (os.getpid(), database, priority.upper(), float(query_timeout), typed, filter,
           data_boost)
    with _cache_lock:
        client = _cache.get(key)
        if client is None:
            client = SpannerChangeStreamClient(
                database, priority=priority, query_timeout=query_timeout, typed=typed,
                filter=filter, data_boost=data_boost,
            )
            _cache[key] = client
        return client


def _restore(
    database: str, priority: str, query_timeout: float, typed: bool = True,
    filter: RecordFilter | None = None, data_boost: bool = False,
) -> ChangeStreamClient:
    return cached_client(database, priority=priority, query_timeout=query_timeout,
                         typed=typed, filter=filter, data_boost=data_boost)
