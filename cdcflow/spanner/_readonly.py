"""Read-only transactions at an exact timestamp, on a session of their own: the plumbing of
snapshot reads (:mod:`cdcflow.spanner.snapshot`).

A snapshot read holds a read-only transaction across PartitionQuery and every partition's
query, and a session runs one transaction at a time, so each read takes a plain session of
its own (:class:`Session`) instead of the transport's shared one. Failures before a
query's first row are retried under the client's policy (a lost session is renewed); later
ones raise TransientError, which the engine answers by running the batch again.

google-cloud-spanner is imported lazily, in the functions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import ChangeStreamError, TransientError
from cdcflow.model import Timestamp
from cdcflow.spanner.retry import is_transient, status_name
from cdcflow.spanner.transport import GrpcTransport, assemble_rows

__all__ = [
    "RPC_TIMEOUT", "Row", "Session", "call_metadata", "partitions", "pb_timestamp", "read_at",
    "retried", "stream_rows", "too_old", "translated", "type_json",
]

Row = tuple[Any, list[Any]]  # (row type, protobuf values)
RPC_TIMEOUT = 60.0


def type_json(type_pb: Any) -> Any:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(type_pb, preserving_proto_field_name=True)


def pb_timestamp(ns: int) -> Any:
    from google.protobuf.timestamp_pb2 import Timestamp as PbTimestamp

    return PbTimestamp(seconds=ns // 1_000_000_000, nanos=ns % 1_000_000_000)


def call_metadata(database: str) -> list[tuple[str, str]]:
    return [("google-cloud-resource-prefix", database)]


class Session:
    """A plain session of one snapshot read, created on first use, deleted by
    :meth:`close`.

    A read holds a read-only transaction across PartitionQuery and every partition's
    query. A session runs one transaction at a time (the emulator's and Spanner's regular
    sessions; a new BeginTransaction invalidates the previous one: "Invalid transaction ID.
    Transaction ID must be >= N"), and the tables of a snapshot are read concurrently by
    tasks sharing one client, so each read takes a session of its own instead of the
    transport's shared one.
    """

    def __init__(self, transport: GrpcTransport) -> None:
        self._transport = transport
        self._name: str | None = None

    def __call__(self) -> str:
        if self._name is None:
            created = self._transport._spanner_api().create_session(
                request={"database": self._transport.database},
                metadata=call_metadata(self._transport.database), retry=None, timeout=RPC_TIMEOUT,
            )
            self._name = str(created.name)
        return self._name

    def reset(self) -> None:
        """Forget the session (the server said it no longer exists)."""
        self._name = None

    def close(self) -> None:
        """Delete the session; best effort (the server expires an idle one anyway)."""
        name, self._name = self._name, None
        if name is not None:
            # An expired or unreachable session is deleted by the server anyway.
            with contextlib.suppress(Exception):
                self._transport._spanner_api().delete_session(
                    name=name, metadata=call_metadata(self._transport.database), retry=None,
                    timeout=RPC_TIMEOUT,
                )


def retried(retry: RetryPolicy, session: Session, fn: Callable[[], Any]) -> Any:
    """``fn()`` under ``retry``: transient errors and a lost session (renewed) are retried;
    once the policy gives up on a transient error it raises TransientError, which the
    engine answers by running the batch again."""
    def worth(exc: BaseException) -> bool:
        if status_name(exc) == "NOT_FOUND" and "Session not found" in str(exc):
            session.reset()
            return True
        return is_transient(exc)

    try:
        return retry.call(fn, retry_if=worth)
    except Exception as exc:
        if not is_transient(exc):
            raise
        msg = (
            f"the snapshot read kept failing ({status_name(exc)}); check the database's "
            "health and quota, then run again"
        )
        raise TransientError(msg) from exc


def partitions(
    transport: GrpcTransport, session: Session, retry: RetryPolicy, sql: str,
    read_timestamp_ns: int, params: Mapping[str, Any],
) -> tuple[Any, list[bytes]]:
    """A read-only transaction at exactly ``read_timestamp_ns`` and the partition tokens of
    ``sql`` (with ``params``: its ``params`` and ``param_types`` fields) in it (an empty
    list when the query cannot be partitioned)."""
    api = transport._spanner_api()
    meta = call_metadata(transport.database)

    def begin() -> Any:
        return api.begin_transaction(
            request={"session": session(), "options": {"read_only": {
                "read_timestamp": pb_timestamp(read_timestamp_ns),
            }}},
            metadata=meta, retry=None, timeout=RPC_TIMEOUT,
        )

    txn = retried(retry, session, begin)

    def partition() -> list[bytes]:
        try:
            answer = api.partition_query(
                request={"session": session(), "transaction": {"id": txn.id},
                         "sql": sql, **params},
                metadata=meta, retry=None, timeout=RPC_TIMEOUT,
            )
        except Exception as exc:
            if status_name(exc) in ("INVALID_ARGUMENT", "UNIMPLEMENTED"):
                return []  # not root-partitionable here: one plain query instead
            raise
        return [p.partition_token for p in answer.partitions]

    return txn, retried(retry, session, partition)


def stream_rows(
    transport: GrpcTransport, session: Session, retry: RetryPolicy,
    request: Mapping[str, Any], timeout: float,
) -> Iterator[tuple[Any, list[Any]]]:
    """Rows of one query. Failures before its first row are retried; a failure after it
    raises TransientError (the engine replays the batch: rows are not resumable here)."""
    from google.cloud.spanner_v1.types import ExecuteSqlRequest, PartialResultSet

    api = transport._spanner_api()

    def start() -> tuple[Any, Any, Iterator[tuple[Any, list[Any]]]]:
        call = api.execute_streaming_sql(
            request=ExecuteSqlRequest(session=session(), **request),
            metadata=call_metadata(transport.database), retry=None, timeout=timeout,
        )
        rows = assemble_rows(PartialResultSet.pb(item) for item in call)
        return call, next(rows, None), rows  # the first row: errors up to here are retried

    call, first, rows = retried(retry, session, start)
    try:
        if first is None:
            return
        yield first
        yield from rows
    except Exception as exc:
        if not is_transient(exc):
            raise
        msg = (
            f"the snapshot query failed midway ({status_name(exc)}); the batch is read again "
            "under the run's batch_retries"
        )
        raise TransientError(msg) from exc
    finally:
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            cancel()


def read_at(read_timestamp_ns: int) -> dict[str, Any]:
    """A single-use read-only transaction at exactly ``read_timestamp_ns``."""
    return {"single_use": {"read_only": {"read_timestamp": pb_timestamp(read_timestamp_ns)}}}


def translated(rows: Iterator[Row], read_timestamp_ns: int) -> Iterator[Row]:
    try:
        yield from rows
    except Exception as exc:
        translated = too_old(exc, read_timestamp_ns)
        if translated is exc:
            raise
        raise translated from exc


def too_old(exc: Exception, read_timestamp_ns: int) -> Exception:
    text = str(getattr(exc, "message", exc))
    lower = text.lower()
    if status_name(exc) == "FAILED_PRECONDITION" and any(
        word in lower for word in ("too old", "staleness", "retention")
    ):
        msg = (
            f"the snapshot reads the tables as of {Timestamp.from_ns(read_timestamp_ns)} (just "
            "before start_at), older than the database keeps row versions; start later, or "
            f"raise the database's version_retention_period ({text})"
        )
        return ChangeStreamError(msg)
    return exc
