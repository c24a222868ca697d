"""One streaming SQL call to Spanner, without the stock client's retry loop.

:class:`GrpcTransport` sends ``ExecuteStreamingSql`` through the stock client's GAPIC
layer (so credentials, ``SPANNER_EMULATOR_HOST``, endpoints and headers behave as usual)
but with ``retry=None`` and a deadline: retrying is the caller's job, with bounded
backoff (:mod:`cdcflow.spanner.retry`). It yields each ``PartialResultSet`` as the bytes
the server sent (on the client's own gRPC channel, with the GAPIC layer's headers and error
mapping): the change stream reader parses them itself (:mod:`cdcflow.spanner.flat`), and
:func:`assemble_rows` merges chunked values into rows of protobuf ``Value`` for anyone else.

A call that passes its deadline (a stalled stream, a session RPC with no answer) makes
the next calls go out on a new connection (:mod:`cdcflow.spanner.connection`).

The transport is the seam tests wrap to inject failures (see ``Transport``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from cdcflow.errors import ConfigurationError
from cdcflow.spanner.connection import Connection, connection_api
from cdcflow.spanner.retry import status_name

__all__ = [
    "STOP_POLL_S", "STOP_SILENCE_S", "GrpcTransport", "Param", "RowAssembler", "Transport",
    "assemble_rows", "merge_values",
]

#: A query parameter: (Spanner type code name, wire value as text or None for NULL).
Param = tuple[str, str | None]

_PRIORITIES = {"LOW": 1, "MEDIUM": 2, "HIGH": 3}
# Multiplexed sessions live up to 28 days; refresh well before that.
_SESSION_MAX_AGE_S = 7 * 86_400


class Transport(Protocol):
    """Runs one streaming query; yields ``PartialResultSet`` messages: protobuf messages or
    their serialized bytes (faster to decode: see :mod:`cdcflow.spanner.flat`).

    ``timeout`` bounds the whole query; ``idle`` (None: no bound), the seconds the reader
    may wait for the next message: a stream silent for longer stalled (an open connection
    that carries nothing), and the transport ends it with a transient error. Once
    ``stopping()`` is true (the run was asked to stop), a transport may end a stream
    silent for :data:`STOP_SILENCE_S` the same way, instead of waiting out ``idle``: the
    caller gives the read up."""

    def execute_streaming_sql(
        self, sql: str, params: Mapping[str, Param], *, priority: str, timeout: float,
        idle: float | None = None, stopping: Callable[[], bool] | None = None,
    ) -> Iterator[Any]: ...

    def reset_session(self) -> None:
        """Forget the session (the server said it no longer exists)."""
        ...

    def close(self) -> None: ...


#: Deadline of a session RPC, in seconds.
_RPC_TIMEOUT = 30.0
#: Once the run is asked to stop, a stream silent this long is ended (seconds): a read of
#: a batch whose end has passed answers at once, so silence that long is a stall.
STOP_SILENCE_S = 5.0
#: How often a reader waiting for a message looks whether the run was asked to stop.
STOP_POLL_S = 0.5


def emulator_host() -> str | None:
    """The emulator every client of this process connects to (SPANNER_EMULATOR_HOST), or
    None for Spanner."""
    return os.environ.get("SPANNER_EMULATOR_HOST") or None


def endpoint() -> str:
    """Where the client connects: the emulator named by SPANNER_EMULATOR_HOST, or Spanner."""
    host = emulator_host()
    return f"the emulator at {host} (SPANNER_EMULATOR_HOST)" if host else "spanner.googleapis.com"


def new_client(project: str) -> Any:
    """A ``google.cloud.spanner.Client`` for ``project``; missing credentials become one
    ConfigurationError line naming the fix."""
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import spanner

    host = emulator_host()
    if host is not None and "://" in host:  # the client would warn, then fail to resolve it
        bare = host.split("://", 1)[1].rstrip("/")
        msg = (f"SPANNER_EMULATOR_HOST={host} has a scheme: give host:port alone "
               f"(export SPANNER_EMULATOR_HOST={bare})")
        raise ConfigurationError(msg)
    try:
        try:
            return spanner.Client(project=project, disable_builtin_metrics=True)
        except TypeError:  # client versions without built-in metrics
            return spanner.Client(project=project)
    except DefaultCredentialsError:
        msg = (
            "no Google Cloud credentials found: for the emulator, is SPANNER_EMULATOR_HOST "
            "exported in this shell? For Cloud Spanner run `gcloud auth application-default "
            "login` or set GOOGLE_APPLICATION_CREDENTIALS"
        )
        raise ConfigurationError(msg) from None


class GrpcTransport:
    """ExecuteStreamingSql on a multiplexed session of ``database``, created lazily.

    ``spanner_client`` is a ``google.cloud.spanner.Client``; by default one is built for
    the database's project (honouring ``SPANNER_EMULATOR_HOST`` and Application Default
    Credentials). ``what`` names the caller in log lines (default: ``reading <database>``).
    """

    #: PartialResultSets received ahead of the reader (each at most about 1 MiB), on a thread
    #: of their own, so the next message travels while the reader decodes this one; 0
    #: receives on the reader's thread only (then a stalled stream waits for its timeout:
    #: the ``idle`` bound needs the thread).
    prefetch = 2

    def __init__(self, database: str, spanner_client: Any = None, what: str | None = None
                 ) -> None:
        self.database = database
        self._client = spanner_client
        self._owns_client = spanner_client is None
        self._connection = Connection(self._open_api, what or f"reading {database}",
                                      _RPC_TIMEOUT, owns_first=True)
        self._session: str | None = None
        self._session_born = 0.0
        self._raw: Any = None  # the serialized-answer RPC; False: the client has no channel
        self._raw_api: Any = None  # the API (connection) ``_raw`` calls through
        self._lock = threading.Lock()

    def _open_api(self, connection: int) -> Any:
        parts = self.database.split("/")
        if self._client is None:
            self._client = new_client(parts[1])
        instance = self._client.instance(parts[3])
        # every connection its own channel: with the stream window of connection_api
        return connection_api(self._client, instance.emulator_host)

    def _spanner_api(self) -> Any:
        return self._connection.api()

    def _metadata(self) -> list[tuple[str, str]]:
        return [("google-cloud-resource-prefix", self.database)]

    def session(self) -> str:
        with self._lock:
            stale = time.monotonic() - self._session_born > _SESSION_MAX_AGE_S
            if self._session is None or stale:
                api = self._spanner_api()
                try:
                    self._session = self._create_session(api)
                except Exception as exc:
                    self._connection.failed(api, exc)
                    raise
                self._session_born = time.monotonic()
            return self._session

    def _create_session(self, api: Any) -> str:
        try:
            # No stock retry (it spins for 30 s on a closed port); the caller's
            # RetryPolicy decides.
            created = api.create_session(
                request={"database": self.database, "session": {"multiplexed": True}},
                metadata=self._metadata(), retry=None, timeout=_RPC_TIMEOUT,
            )
        except Exception as exc:
            # Servers without multiplexed sessions reject the flag; use a plain one.
            if status_name(exc) not in ("INVALID_ARGUMENT", "UNIMPLEMENTED"):
                raise
            created = api.create_session(
                request={"database": self.database}, metadata=self._metadata(),
                retry=None, timeout=_RPC_TIMEOUT,
            )
        return str(created.name)

    def reset_session(self) -> None:
        with self._lock:
            self._session = None

    def _raw_rpc(self, api: Any) -> Any:
        """ExecuteStreamingSql on the client's gRPC channel, answering each message as the
        bytes the server sent; wrapped like the GAPIC method (headers, errors mapped to
        google.api_core exceptions). None when the client's transport has no gRPC channel."""
        with self._lock:
            if self._raw_api is api:
                return self._raw or None
        raw: Any = False
        channel = getattr(getattr(api, "transport", None), "grpc_channel", None)
        if channel is not None:
            from google.api_core import gapic_v1
            from google.cloud.spanner_v1.services.spanner.transports.base import (
                DEFAULT_CLIENT_INFO,
            )
            from google.cloud.spanner_v1.types import ExecuteSqlRequest

            stub = channel.unary_stream(
                "/google.spanner.v1.Spanner/ExecuteStreamingSql",
                request_serializer=ExecuteSqlRequest.serialize,
                response_deserializer=None,
            )
            # api_core's wrapper would wait for the first message as the call is made,
            # before the reader's idle bound applies: awaited like the others, it is.
            stub._prefetch_first_result_ = False
            raw = gapic_v1.method.wrap_method(  # type: ignore[no-untyped-call]
                stub, default_retry=None, default_timeout=None,
                client_info=DEFAULT_CLIENT_INFO,
            )
        with self._lock:
            self._raw_api, self._raw = api, raw
        return raw or None

    def execute_streaming_sql(
        self, sql: str, params: Mapping[str, Param], *, priority: str, timeout: float,
        idle: float | None = None, stopping: Callable[[], bool] | None = None,
        read_at: int | None = None,
    ) -> Iterator[Any]:
        """The query's partial result sets: a strong read, or one as of ``read_at`` (ns)."""
        api = self._spanner_api()
        self._connection.deadline(timeout)
        request = _request(self.session(), sql, params, priority, read_at)
        try:
            yield from self._stream(api, request, timeout, idle, stopping)
        except Exception as exc:
            self._connection.failed(api, exc)
            raise

    def _stream(self, api: Any, request: Any, timeout: float, idle: float | None,
                stopping: Callable[[], bool] | None) -> Iterator[Any]:
        from google.api_core import gapic_v1
        from google.cloud.spanner_v1.types import PartialResultSet

        raw = self._raw_rpc(api)
        to_pb: Any
        if raw is not None:
            routing = gapic_v1.routing_header.to_grpc_metadata(  # type: ignore[no-untyped-call]
                (("session", request.session),)
            )
            stream = raw(
                request, retry=None, timeout=timeout, metadata=[*self._metadata(), routing]
            )
            to_pb = bytes
        else:
            stream = api.execute_streaming_sql(
                request=request, metadata=self._metadata(), retry=None, timeout=timeout
            )
            to_pb = PartialResultSet.pb
        if self.prefetch < 1:
            try:
                for item in stream:
                    yield to_pb(item)
            finally:
                # Stop the server streaming when the reader leaves early.
                cancel = getattr(stream, "cancel", None)
                if cancel is not None:
                    cancel()
            return
        yield from _prefetched(stream, to_pb, self.prefetch, idle, stopping)

    def close(self) -> None:
        with self._lock:
            api = self._connection.current
            if self._session is not None and api is not None:
                with contextlib.suppress(Exception):
                    api.delete_session(name=self._session, metadata=self._metadata())
            self._session = None
            self._raw = self._raw_api = None
            self._connection.close()
            if self._owns_client and self._client is not None:
                with contextlib.suppress(Exception):
                    self._client.close()
                self._client = None


_END = object()


def _prefetched(
    stream: Any, to_pb: Any, depth: int, idle: float | None = None,
    stopping: Callable[[], bool] | None = None,
) -> Iterator[Any]:
    """``to_pb`` of every item of ``stream`` (a gRPC response iterator), received up to
    ``depth`` items ahead on a daemon thread. An error of the stream is raised here, after
    the items before it; so is a stall: no item for ``idle`` seconds while the reader
    waits (DEADLINE_EXCEEDED, which the reader retries), or for :data:`STOP_SILENCE_S`
    once ``stopping()`` is true. Leaving early (an exception, ``close()``) cancels the
    call, which ends the thread even while it waits for the server."""
    items: queue.SimpleQueue[tuple[Any, BaseException | None]] = queue.SimpleQueue()
    room = threading.Semaphore(depth)
    stop = threading.Event()

    def pump() -> None:
        try:
            for item in stream:
                room.acquire()
                if stop.is_set():
                    return
                items.put((to_pb(item), None))
            items.put((_END, None))
        except BaseException as exc:  # delivered to the reader, which raises it
            items.put((_END, exc))

    threading.Thread(target=pump, name="cdcflow-prefetch", daemon=True).start()
    try:
        while True:
            if stopping is None:
                try:
                    item, error = items.get(timeout=idle)
                except queue.Empty:
                    raise _stalled(idle) from None
            else:
                item, error = _next_unless_stopped(items, idle, stopping)
            if item is _END:
                if error is not None:
                    raise error
                return
            room.release()
            yield item
    finally:
        stop.set()
        room.release()  # a pump waiting for room wakes, sees stop and ends
        # Stop the server streaming when the reader leaves early (a no-op once it ended).
        cancel = getattr(stream, "cancel", None)
        if cancel is not None:
            cancel()


def _next_unless_stopped(
    items: queue.SimpleQueue[tuple[Any, BaseException | None]], idle: float | None,
    stopping: Callable[[], bool],
) -> tuple[Any, BaseException | None]:
    """The next item of ``items``, looking every :data:`STOP_POLL_S` whether the run was
    asked to stop: a stall (see :func:`_prefetched`) raises."""
    began = time.monotonic()
    while True:
        waited = time.monotonic() - began
        left = None if idle is None else idle - waited
        try:
            return items.get(timeout=STOP_POLL_S if left is None else
                             max(0.0, min(left, STOP_POLL_S)))
        except queue.Empty:
            waited = time.monotonic() - began
            if idle is not None and waited >= idle:
                raise _stalled(idle) from None
            if waited >= STOP_SILENCE_S and stopping():
                raise _stalled(waited, stopping=True) from None


def _stalled(idle: float | None, *, stopping: bool = False) -> Exception:
    from google.api_core.exceptions import DeadlineExceeded

    if stopping:
        message = (f"no message from Spanner for {idle:.0f} s, and the run was asked to "
                   "stop: the read is given up")
    else:
        message = (f"no message from Spanner for {idle:g} s: the stream stalled (its "
                   "connection is open but carries nothing)")
    return DeadlineExceeded(message)  # type: ignore[no-untyped-call]


def _request(session: str, sql: str, params: Mapping[str, Param], priority: str,
             read_at: int | None = None) -> Any:
    """A single-use read-only query: strong, or as of ``read_at`` (ns since the epoch)."""
    from google.cloud.spanner_v1.types import ExecuteSqlRequest, RequestOptions, Type
    from google.protobuf.struct_pb2 import NULL_VALUE, Struct

    struct = Struct()
    types: dict[str, Any] = {}
    for name, (code, value) in params.items():
        if value is None:
            struct.fields[name].null_value = NULL_VALUE
        else:
            struct.fields[name].string_value = value
        types[name] = Type(code=code)
    bound: dict[str, Any] = {"strong": True}
    if read_at is not None:
        seconds, nanos = divmod(read_at, 1_000_000_000)
        bound = {"read_timestamp": {"seconds": seconds, "nanos": nanos}}
    return ExecuteSqlRequest(
        session=session,
        sql=sql,
        params=struct,
        param_types=types,
        transaction={"single_use": {"read_only": bound}},
        request_options=RequestOptions(priority=_PRIORITIES[priority]),
    )


# --- rows from partial result sets ----------------------------------------------------------

_FLOAT_CODES = (3, 15)  # FLOAT64, FLOAT32
_CODE_BOOL = 1
_CODE_ARRAY = 8
_CODE_STRUCT = 9


def merge_values(lhs: Any, rhs: Any, type_: Any) -> Any:
    """Join a value split across two PartialResultSets (Spanner's chunking rules): the
    protobuf ``Value`` ``lhs`` ends in the middle of what ``rhs`` continues; ``type_`` is
    the column's ``Type``."""
    from google.protobuf.struct_pb2 import ListValue, Value

    code = type_.code
    if code in (_CODE_ARRAY, _CODE_STRUCT):
        left = list(lhs.list_value.values)
        right = list(rhs.list_value.values)
        if left and right:
            if code == _CODE_ARRAY:
                elem = type_.array_element_type
            else:
                elem = type_.struct_type.fields[len(left) - 1].type_
            first = right[0]
            last = left[-1]
            mergeable = (
                elem.code != _CODE_BOOL
                and first.WhichOneof("kind") != "null_value"
                and last.WhichOneof("kind") != "null_value"
            )
            if mergeable:
                left[-1] = merge_values(last, first, elem)
                right = right[1:]
        return Value(list_value=ListValue(values=left + right))
    if code in _FLOAT_CODES and lhs.WhichOneof("kind") != "string_value":
        return lhs
    return Value(string_value=lhs.string_value + rhs.string_value)


class RowAssembler:
    """Rows from protobuf PartialResultSets, fed one at a time (see :func:`assemble_rows`).

    ``row_type`` is the ``StructType`` of the result metadata, taken from the first message
    unless :meth:`start` set it (a reader that read the metadata itself).
    """

    __slots__ = ("_pending", "_row", "_width", "row_type")

    def __init__(self) -> None:
        self.row_type: Any = None
        self._width = 0
        self._row: list[Any] = []
        self._pending: Any = None

    def start(self, row_type: Any) -> None:
        """Set the result's row type (the first message's metadata)."""
        self.row_type = row_type
        self._width = len(row_type.fields)

    def idle(self) -> bool:
        """No row begun: no chunk waits for its rest, no row lacks columns."""
        return self._pending is None and not self._row

    def add(self, prs: Any) -> list[tuple[Any, list[Any]]]:
        """The rows ``prs`` completes, as ``(row_type, values)``."""
        if self.row_type is None:
            self.start(prs.metadata.row_type)
        values: list[Any] = list(prs.values)
        if not values:
            return []
        row_type, width, row = self.row_type, self._width, self._row
        if self._pending is not None:
            values[0] = merge_values(self._pending, values[0], row_type.fields[len(row)].type_)
            self._pending = None
        if prs.chunked_value:
            self._pending = values.pop()
        out = []
        for value in values:
            row.append(value)
            if len(row) == width:
                out.append((row_type, row))
                row = []
        self._row = row
        return out

    def finish(self) -> list[tuple[Any, list[Any]]]:
        """The last row, when the stream ended on a chunk that completes it."""
        row, self._row = self._row, []
        if self._pending is not None:
            row.append(self._pending)
            self._pending = None
        return [(self.row_type, row)] if row and len(row) == self._width else []


def assemble_rows(responses: Iterator[Any]) -> Iterator[tuple[Any, list[Any]]]:
    """Rows from PartialResultSets (protobuf messages or their serialized bytes): yields
    ``(row_type, values)`` per row.

    ``row_type`` is the ``StructType`` of the result metadata (sent with the first
    message); ``values`` holds one protobuf ``Value`` per column.
    """
    assembler = RowAssembler()
    parse: Any = None
    for prs in responses:
        if isinstance(prs, bytes):
            if parse is None:
                from google.cloud.spanner_v1.types import PartialResultSet

                parse = PartialResultSet.pb().FromString
            prs = parse(prs)
        yield from assembler.add(prs)
    yield from assembler.finish()
