"""The connection a Spanner API calls through, replaced when a call passes its deadline.

An open TCP connection can carry nothing for good: a peer or a middlebox went away without
a word (no FIN, no RST). gRPC notices only through keepalive, if the channel has it (the
stock client's channel to Spanner pings every 2 minutes; its channel to the emulator never
does), and until then every retry goes out on the same dead connection. Worse, gRPC gives
the channels of equal arguments one shared connection: a new client does not help.

:class:`Connection` keeps the API calls go through. When a call on it ends with
``DEADLINE_EXCEEDED`` (a stalled stream, an RPC that got no answer), :meth:`Connection.failed`
retires it: the next call opens a new API whose channel has an argument of its own
(:func:`connection_api`: a number no other channel of the process has), hence a new
connection. Calls still running on a retired API go on (a stalled one ends at its own
deadline); the first call after every call it carried is past its deadline closes it.
Retiring a healthy connection costs one new connection, nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cdcflow.errors import describe
from cdcflow.spanner.retry import status_name

__all__ = ["STREAM_WINDOW", "Connection", "connection_api", "past_deadline"]

_log = logging.getLogger("cdcflow.spanner")
#: Numbers the channels of connection_api apart (next() is atomic in CPython).
_SERIAL = itertools.count(1)
#: What a query may receive ahead of its reader: gRPC's window for each stream, fixed at
#: this size. gRPC otherwise grows windows by its bandwidth probe, and a reader that waits
#: for a slow sink (the byte quota holds it) had tens of MB of large records received
#: ahead on its stream, beside the quota: with 4 MB records and an 8 MiB quota, peak RSS
#: 207-243 MB against 162-166 MB with this window (three runs each, side by side); the
#: emulator catch-up read as fast (4 MiB a round trip is 4 GB/s at 1 ms).
STREAM_WINDOW = 4 << 20
_FLOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", STREAM_WINDOW)]


def past_deadline(exc: BaseException) -> bool:
    """Whether ``exc`` is DEADLINE_EXCEEDED (an api_core or a grpc error)."""
    return status_name(exc) == "DEADLINE_EXCEEDED"


def connection_api(client: Any, emulator: str | None, admin: bool = False) -> Any:
    """A Spanner API (GAPIC ``SpannerClient``; with ``admin``, ``DatabaseAdminClient``)
    for ``client`` (a ``google.cloud.spanner.Client``) on a connection of its own: its
    channel's arguments hold a number no other channel of the process has, so gRPC does
    not hand it another channel's connection, and a stream window of
    :data:`STREAM_WINDOW`. Otherwise it is built as the stock client builds its own
    (endpoint, credentials, options)."""
    import grpc
    from google.cloud.spanner_v1.services.spanner.transports.base import DEFAULT_CLIENT_INFO

    api_class, transport_class = _classes(admin)
    mark = ("cdcflow.connection", next(_SERIAL))
    client_info: Any = getattr(client, "_client_info", None) or DEFAULT_CLIENT_INFO
    if emulator is not None:
        channel = grpc.insecure_channel(emulator, options=[mark, *_FLOW])
        return api_class(client_info=client_info, transport=transport_class(channel=channel))

    def new_channel(host: str, **kwargs: Any) -> Any:
        kwargs["options"] = [*kwargs.get("options", ()), mark, *_FLOW]
        return transport_class.create_channel(host, **kwargs)

    from google.auth.credentials import Scoped
    from google.cloud.spanner_v1.database import SPANNER_DATA_SCOPE

    credentials = client.credentials
    if not admin and isinstance(credentials, Scoped):  # as Database.spanner_api scopes them
        credentials = credentials.with_scopes((SPANNER_DATA_SCOPE,))  # type: ignore[no-untyped-call]
    return api_class(
        credentials=credentials, client_info=client_info,
        client_options=getattr(client, "_client_options", None),
        transport=functools.partial(transport_class, channel=new_channel),
    )


def _classes(admin: bool) -> tuple[Any, Any]:
    """The GAPIC client and gRPC transport classes of the data or the admin API."""
    if admin:
        from google.cloud.spanner_admin_database_v1.services.database_admin import (
            DatabaseAdminClient,
        )
        from google.cloud.spanner_admin_database_v1.services.database_admin.transports import (
            grpc as admin_grpc,
        )

        return DatabaseAdminClient, admin_grpc.DatabaseAdminGrpcTransport
    from google.cloud.spanner_v1.services.spanner import SpannerClient
    from google.cloud.spanner_v1.services.spanner.transports.grpc import SpannerGrpcTransport

    return SpannerClient, SpannerGrpcTransport


def _close(api: Any) -> None:
    with contextlib.suppress(Exception):
        api.transport.close()


class Connection:
    """The API calls go through: ``open_api(n)`` builds the one on connection ``n`` (0 the
    first, the stock client's unless ``owns_first``). Thread-safe. ``what`` names the caller
    in the log line of a replacement."""

    def __init__(self, open_api: Callable[[int], Any], what: str, longest_call: float,
                 owns_first: bool = False) -> None:
        self._open = open_api
        self._owns_first = owns_first
        self._what = what
        self._lock = threading.Lock()
        self._api: Any = None
        self.replaced = 0  # how many connections were retired
        self._retired: list[tuple[float, Any]] = []  # (when, API)
        self._longest_call = longest_call  # the longest deadline of a call, in seconds

    def api(self) -> Any:
        """The current API (opened now if there is none)."""
        expired: list[Any] = []
        with self._lock:
            if self._api is None:
                self._api = self._open(self.replaced)
            api = self._api
            if self._retired:
                expired = self._expired(time.monotonic())
        for old in expired:
            _close(old)
        return api

    def _expired(self, now: float) -> list[Any]:
        """The retired APIs every call of which is past its deadline, taken off the list
        to be closed (not the current one: an ``open_api`` that cannot make a new API
        gives the retired one again); called with the lock held."""
        kept = [(at, a) for at, a in self._retired if now - at <= self._longest_call]
        expired = [a for at, a in self._retired
                   if now - at > self._longest_call and a is not self._api]
        self._retired = kept
        return expired

    @property
    def current(self) -> Any:
        """The current API, or None (opens nothing)."""
        return self._api

    def deadline(self, seconds: float) -> None:
        """A call with a deadline of ``seconds`` is going out."""
        if seconds > self._longest_call:
            self._longest_call = seconds

    def failed(self, api: Any, exc: BaseException) -> None:
        """A call on ``api`` raised ``exc``: past its deadline, ``api`` is retired."""
        if not past_deadline(exc):
            return
        with self._lock:
            if api is not self._api:
                return  # retired already, by another call that failed on it
            self.replaced += 1
            self._api = None
            self._retired.append((time.monotonic(), api))  # closed by a later api()
        _log.info("%s: a call passed its deadline (%s); the next calls go out on a new "
                  "connection", self._what, describe(exc)[:300])

    def close(self) -> None:
        """Close the APIs retired here and the current one if it was opened here (the
        first one, while current, is left to whoever built it, unless ``owns_first``)."""
        with self._lock:
            own = {id(api): api for _, api in self._retired}
            if (self.replaced or self._owns_first) and self._api is not None:
                own[id(self._api)] = self._api
            self._retired = []
            self._api = None
        for api in own.values():
            _close(api)
