"""What PySpark and py4j print on the driver when Spark's JVM dies, kept out of a run's
output: the runner already says it in one line ("Spark's JVM is gone ...").

Two printers, depending on the moment the JVM dies:

- py4j logs the failed call with ``logging.exception`` on the *root* logger (a traceback
  under ``ERROR root: Exception while sending command.``); a filter on the root logger
  (which sees only records logged to it directly) moves py4j's to DEBUG;
- PySpark's accumulator server, whose connection from the JVM breaks, prints the
  handler's ``EOFError`` traceback through ``socketserver``'s ``handle_error``; the
  session's server gets a quiet one (a DEBUG line).
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["quiet_jvm_death"]

_log = logging.getLogger("cdcflow.spark")


class _Py4jRootRecords(logging.Filter):
    """Records py4j logs on the root logger, lowered to DEBUG (shown with --debug)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and "py4j" in record.pathname.replace("\\", "/"):
            _log.debug("py4j: %s", record.getMessage(), exc_info=record.exc_info)
            return False
        return True


_FILTER = _Py4jRootRecords()


def _quiet_handle_error(request: Any, client_address: Any) -> None:
    _log.debug("Spark's accumulator server lost its connection from the JVM", exc_info=True)


def quiet_jvm_death(spark_context: Any) -> None:
    """Install both for this process and ``spark_context``'s accumulator server (idempotent;
    PySpark internals that are missing are left alone)."""
    root = logging.getLogger()
    if _FILTER not in root.filters:
        root.addFilter(_FILTER)
    server = getattr(spark_context, "_accumulatorServer", None)
    if server is not None and hasattr(server, "handle_error"):
        server.handle_error = _quiet_handle_error
