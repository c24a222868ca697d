"""Spanner's errors as cdcflow's: what to raise for a permanent error, and how to tell a
lost session, an unreachable server and an error's text."""

from __future__ import annotations

import os
import re

from cdcflow.errors import (
    ChangeStreamError,
    ConfigurationError,
    StartTooEarlyError,
    StreamNotFoundError,
)
from cdcflow.model import Timestamp
from cdcflow.spanner.retry import status_name
from cdcflow.stream import ChangeStreamQuery

__all__ = ["error_text", "session_gone", "translate", "unreachable"]

_READER_ROLE = "roles/spanner.databaseReader"
# What gRPC says when an HTTP server that is not Spanner answered (a wrong host:port).
_HTTP_STATUS = re.compile(r"Received http2 header with status: (\d+)")


def translate(exc: Exception, database: str, query: ChangeStreamQuery | None) -> Exception:
    """A cdcflow error naming the fix for a permanent Spanner error."""
    status = status_name(exc)
    if status is None:
        return exc  # not an RPC error (cdcflow's own, or a bug): keep it as it is
    text = error_text(exc)
    stream = query.stream if query is not None else "?"
    if (http := _HTTP_STATUS.search(text)) is not None:
        host = os.environ.get("SPANNER_EMULATOR_HOST")
        where = f"SPANNER_EMULATOR_HOST={host}" if host else "the Spanner endpoint"
        msg = (f"{where} answered as a web server, not Spanner (HTTP status {http.group(1)}): "
               "fix the host:port")
        return ConfigurationError(msg)
    if status == "PERMISSION_DENIED":
        msg = (
            f"permission denied reading {database}: grant the caller {_READER_ROLE} "
            f"(or a role with spanner.databases.select) on the database ({text})"
        )
        return ChangeStreamError(msg)
    if status == "UNAUTHENTICATED":
        msg = (
            "Spanner rejected the credentials: run `gcloud auth application-default login`, "
            "set GOOGLE_APPLICATION_CREDENTIALS, or set SPANNER_EMULATOR_HOST for the "
            f"emulator ({text})"
        )
        return ChangeStreamError(msg)
    if "Instance not found" in text:
        msg = f"instance of {database} does not exist: fix the path or create it ({text})"
        return StreamNotFoundError(msg)
    if "Database not found" in text:
        msg = f"database {database} does not exist: fix the path or create it ({text})"
        return StreamNotFoundError(msg)
    if "Table-valued function not found" in text or (
        "read_json_" in text and "does not exist" in text
    ):
        msg = (
            f"change stream {stream!r} not found in {database}: fix the name or create "
            f"it with CREATE CHANGE STREAM ({text})"
        )
        return StreamNotFoundError(msg)
    if "too far in the past" in text or "retention" in text.lower():
        start = Timestamp.from_ns(query.start).rfc3339() if query is not None else "?"
        msg = (
            f"start {start} is before what change stream {stream!r} holds (changes since "
            "it was created, for its retention_period, 1 day by default): start later "
            "with --reset (the metadata store keeps the pipeline's position, so a changed "
            "start_at alone does not move it; start_at='now' or a time after the stream's "
            f"creation), or raise the stream's retention_period ({text})"
        )
        return StartTooEarlyError(msg)
    if "partition_token is invalid" in text:
        msg = (
            f"partition token does not belong to change stream {stream!r}: the stored "
            f"state is from another stream or database; reset the pipeline ({text})"
        )
        return ChangeStreamError(msg)
    msg = f"change stream query on {database} failed ({status}: {text})"
    return ChangeStreamError(msg)


def unreachable(exc: BaseException) -> bool:
    """A connection that never came up (refused, unknown host), as opposed to one that broke."""
    text = error_text(exc)
    return status_name(exc) == "UNAVAILABLE" and (
        "failed to connect to all addresses" in text or "DNS resolution failed" in text
        or "errors resolving" in text or "Connection refused" in text
    )


def session_gone(exc: BaseException) -> bool:
    return status_name(exc) == "NOT_FOUND" and "Session not found" in str(exc)


def error_text(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    return message if isinstance(message, str) else str(exc)
