"""Which Spanner errors are transient: the predicate for cdcflow's one retry policy.

How long to wait and how often to try is :class:`cdcflow.backoff.RetryPolicy` (capped
exponential backoff, full jitter, bounded attempts), re-exported here for older imports.
cdcflow never relies on the stock client's own retry loops (its ``ServiceUnavailable``
restart loop has neither a bound nor a delay); callers pass :func:`is_transient` as
``retry_if``.
"""

from __future__ import annotations

from cdcflow.backoff import RetryPolicy

__all__ = ["TRANSIENT_CODES", "RetryPolicy", "is_transient", "status_name"]

#: gRPC status codes worth retrying: the server may well answer next time.
TRANSIENT_CODES = frozenset({"UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"})

#: INTERNAL errors that are really a broken HTTP/2 stream (what the stock client also resumes).
_RESUMABLE_INTERNAL = (
    "RST_STREAM",
    "Received unexpected EOS on DATA frame from server",
    "stream terminated by RST_STREAM",
    "Received RST_STREAM",
)


def status_name(exc: BaseException) -> str | None:
    """The gRPC status name of an api_core or grpc error (``"UNAVAILABLE"``), else None."""
    code = getattr(exc, "grpc_status_code", None)
    if code is None:
        code_fn = getattr(exc, "code", None)
        if callable(code_fn):
            try:
                code = code_fn()
            except Exception:
                code = None
    name = getattr(code, "name", None)
    return name if isinstance(name, str) else None


def _message(exc: BaseException) -> str:
    text = getattr(exc, "message", None)
    if isinstance(text, str):
        return text
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            return str(details())
        except Exception:
            return str(exc)
    return str(exc)


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry may cure: UNAVAILABLE, ABORTED, DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED, and INTERNAL errors caused by a reset HTTP/2 stream."""
    name = status_name(exc)
    if name in TRANSIENT_CODES:
        return True
    if name == "INTERNAL":
        text = _message(exc)
        return any(marker in text for marker in _RESUMABLE_INTERNAL)
    return False
