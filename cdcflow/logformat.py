"""How cdcflow's log lines look, in the driver and in worker processes.

:class:`PlainFormatter`: plain text dated in UTC with milliseconds; :class:`JsonFormatter`:
one JSON object per line for log shippers. The driver's
:func:`cdcflow.progress.configure_logging` picks one and passes the choice to worker
processes through the environment (:func:`pass_to_workers`); a worker (a Spark
executor's Python worker) calls :func:`configure_worker_logging` to log the same way.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime
from typing import Literal

__all__ = [
    "LOG_FORMATS",
    "WORKER_LOG_ENV",
    "JsonFormatter",
    "LogFormat",
    "PlainFormatter",
    "configure_worker_logging",
    "pass_to_workers",
    "utc_stamp",
]

#: What ``--log-format`` takes.
LOG_FORMATS = ("plain", "json")
LogFormat = Literal["plain", "json"]


def utc_stamp(created: float) -> str:
    """ISO-8601 in UTC with milliseconds: ``2024-05-01T12:00:00.123Z``."""
    stamp = datetime.fromtimestamp(created, UTC)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.") + f"{stamp.microsecond // 1000:03d}Z"


class PlainFormatter(logging.Formatter):
    """``2024-05-01T12:00:00.123Z WARNING cdcflow.stuck: message`` (UTC, milliseconds)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_stamp(record.created)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``time`` (as :class:`PlainFormatter`
    dates it), ``level``, ``logger``, ``message``, ``pipeline`` (the run's pipeline, or
    null), and ``exception`` (the traceback text) when there is one."""

    def __init__(self, pipeline: str | None = None) -> None:
        super().__init__()
        self.pipeline = pipeline

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "time": utc_stamp(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pipeline": getattr(record, "pipeline", self.pipeline),
        }
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            doc["exception"] = record.exc_text
        return json.dumps(doc, ensure_ascii=False, default=str)


_WORKER_FORMAT = "CDCFLOW_LOG_FORMAT"
_WORKER_PIPELINE = "CDCFLOW_LOG_PIPELINE"
#: What a driver that called configure_logging passes to its worker processes.
WORKER_LOG_ENV = (_WORKER_FORMAT, _WORKER_PIPELINE)


def pass_to_workers(format: str, pipeline: str | None) -> None:
    """Let worker processes started from now on log as :func:`configure_worker_logging`
    says: in ``format``, naming ``pipeline``."""
    os.environ[_WORKER_FORMAT] = format
    os.environ[_WORKER_PIPELINE] = pipeline or ""


def configure_worker_logging() -> None:
    """In a worker process (a Spark executor's Python worker), log cdcflow's records the
    way the driver's :func:`configure_logging` does (plain or JSON lines, to stderr), once
    per process; without a driver's setting, or with handlers already set, do nothing."""
    format = os.environ.get(_WORKER_FORMAT)
    logger = logging.getLogger("cdcflow")
    if format not in LOG_FORMATS or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    pipeline = os.environ.get(_WORKER_PIPELINE) or None
    handler.setFormatter(JsonFormatter(pipeline) if format == "json" else PlainFormatter())
    logger.addHandler(handler)
    logger.propagate = False
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
