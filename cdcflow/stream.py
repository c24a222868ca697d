"""The ChangeStreamClient protocol: the seam between the engine and Spanner.

This module imports nothing of google-cloud-spanner. The real implementation lives in
``cdcflow.spanner.client``; ``cdcflow.testing.ScriptedChangeStream`` is its in-memory twin.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol, runtime_checkable

import attrs

from cdcflow.model import ChangeRecord

__all__ = ["ChangeStreamClient", "ChangeStreamQuery", "StreamInfo"]


@attrs.frozen
class ChangeStreamQuery:
    """Read one partition over positions ``start <= ts < end`` (nanoseconds, half-open).

    ``partition_token`` None is the root query, which returns the stream's first child
    partitions. The change stream function's bounds are inclusive, so a client passes
    ``end_timestamp = end - 1 ns``: consecutive slices neither gap nor overlap.
    """

    stream: str
    partition_token: str | None
    start: int
    end: int
    heartbeat_millis: int = 1000


@attrs.frozen
class StreamInfo:
    name: str
    partition_mode: Literal["IMMUTABLE_KEY_RANGE", "MUTABLE_KEY_RANGE"] = "IMMUTABLE_KEY_RANGE"
    dialect: Literal["GOOGLE_STANDARD_SQL", "POSTGRESQL"] = "GOOGLE_STANDARD_SQL"
    retention_ns: int | None = None


@runtime_checkable
class ChangeStreamClient(Protocol):
    """Reads change-stream partitions.

    Contract of ``read``: yields the partition's records with ``start <= position < end``
    in the order the stream returns them (non-decreasing commit timestamp per partition);
    records of the root query carry ``INITIAL_PARTITION_TOKEN``. Transient errors are
    retried inside with bounded backoff; the iterator raises only when retries are spent
    (:class:`~cdcflow.errors.TransientError`) or on a permanent error.
    """

    def describe_stream(self, stream: str) -> StreamInfo:
        """Check that the stream exists; raise StreamNotFoundError naming the fix if not."""
        ...

    def read(self, query: ChangeStreamQuery) -> Iterator[ChangeRecord]: ...

    def close(self) -> None: ...
