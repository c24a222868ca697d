"""The connection a Spanner API calls through, replaced when a call passes its deadline.

An open TCP connection can carry nothing for good: a peer or a middlebox went away without
a word (no FIN, no RST). gRPC notices only through keepalive, if the channel has it (the
stock client's channel to Spanner pings every 2 minutes; its channel to the emulator never
does), and until then every retry goes out on the same dead connection. Worse, gRPC gives
the channels of equal arguments one shared connection: a new client does not help.

:class:`Connection` keeps the API calls go through. When a call on it ends with
``DEADLINE_EXCEEDED`` (a stalled stream, an RPC that got no answer), :meth:`Connection.failed`
retires it: the next call opens a new API whose channel has an argument of its own
(:func:`connection_api`), hence a new connection. Calls still running on a retired API go on
(a stalled one ends at its own deadline); the API is closed once every call it carried is
past its deadline. Retiring a healthy connection costs one new connection, nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cdcflow.errors import describe

__all__ = ["Connection", "connection_api", "past_deadline"]

_log = logging.getLogger("cdcflow.spanner")


def past_deadline(exc: BaseException) -> bool:
    """Whether ``exc`` is DEADLINE_EXCEEDED (an api_core or a grpc error)."""
    code = getattr(exc, "grpc_status_code", None)
    if code is None:
        code = getattr(exc, "code", None)
        if callable(code):
            try:
                code = code()
            except Exception:
                return False
    return getattr(code, "name", None) == "DEADLINE_EXCEEDED"


def connection_api(client: Any, emulator: str | None, connection: int) -> Any:
    """A Spanner API (GAPIC ``SpannerClient``) for ``client`` (a
    ``google.cloud.spanner.Client``) on a connection of its own: its channel's arguments
    name ``connection``, so gRPC does not hand it another channel's connection. Otherwise
    it is built as the stock client builds its own (endpoint, credentials, options)."""
    import grpc
    from google.cloud.spanner_v1.services.spanner import SpannerClient
    from google.cloud.spanner_v1.services.spanner.transports.base import DEFAULT_CLIENT_INFO
    from google.cloud.spanner_v1.services.spanner.transports.grpc import SpannerGrpcTransport

    mark = ("cdcflow.connection", connection)
    client_info: Any = getattr(client, "_client_info", None) or DEFAULT_CLIENT_INFO
    if emulator is not None:
        channel = grpc.insecure_channel(emulator, options=[mark])
        return SpannerClient(client_info=client_info,
                             transport=SpannerGrpcTransport(channel=channel))

    def new_channel(host: str, **kwargs: Any) -> Any:
        kwargs["options"] = [*kwargs.get("options", ()), mark]
        return SpannerGrpcTransport.create_channel(host, **kwargs)

    from google.auth.credentials import Scoped
    from google.cloud.spanner_v1.database import SPANNER_DATA_SCOPE

    credentials = client.credentials
    if isinstance(credentials, Scoped):
        credentials = credentials.with_scopes((SPANNER_DATA_SCOPE,))  # type: ignore[no-untyped-call]
    return SpannerClient(
        credentials=credentials, client_info=client_info,
        client_options=getattr(client, "_client_options", None),
        transport=functools.partial(SpannerGrpcTransport, channel=new_channel),
    )


def _close(api: Any) -> None:
    with contextlib.suppress(Exception):
        api.transport.close()


class Connection:
    """The API calls go through: ``open_api(n)`` builds the one on connection ``n`` (0 the
    first, usually the stock client's). Thread-safe. ``what`` names the caller in the log
    line of a replacement."""

    def __init__(self, open_api: Callable[[int], Any], what: str, longest_call: float) -> None:
        self._open = open_api
        self._what = what
        self._lock = threading.Lock()
        self._api: Any = None
        self.replaced = 0  # how many connections were retired
        self._retired: list[tuple[float, Any]] = []  # (when, API)
        self._longest_call = longest_call  # the longest deadline of a call, in seconds

    def api(self) -> Any:
        """The current API (opened now if there is none)."""
        with self._lock:
            if self._api is None:
                self._api = self._open(self.replaced)
            return self._api

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
            now = time.monotonic()
            expired = [a for at, a in self._retired if now - at > self._longest_call]
            self._retired = [(at, a) for at, a in self._retired
                             if now - at <= self._longest_call]
            self._retired.append((now, api))
        for old in expired:
            _close(old)
        _log.info("%s: a call passed its deadline (%s); the next calls go out on a new "
                  "connection", self._what, describe(exc)[:300])

    def close(self) -> None:
        """Close the APIs retired here and the current one if it was opened here (the
        first one, while current, is left to whoever built it)."""
        with self._lock:
            own = [api for _, api in self._retired]
            if self.replaced and self._api is not None:
                own.append(self._api)
            self._retired = []
            self._api = None
        for api in own:
            _close(api)
