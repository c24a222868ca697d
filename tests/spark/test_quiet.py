"""cdcflow.spark._quiet: what PySpark and py4j print when Spark's JVM dies stays out of a
run's output (the runner says it in one line; tests/spark/test_runner.py kills a JVM)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from cdcflow.spark import _quiet
from cdcflow.spark.runner import SparkRunner


class _Server:
    def handle_error(self, request: Any, client_address: Any) -> None:
        raise AssertionError("the loud handler ran")


class _Context:
    def __init__(self) -> None:
        self._accumulatorServer = _Server()


def test_py4j_records_on_the_root_logger_go_to_debug(caplog: pytest.LogCaptureFixture) -> None:
    context = _Context()
    _quiet.quiet_jvm_death(context)
    _quiet.quiet_jvm_death(context)  # once is enough: no second filter
    root = logging.getLogger()
    assert root.filters.count(_quiet._FILTER) == 1
    py4j = logging.LogRecord("root", logging.ERROR, "/x/site-packages/py4j/java_gateway.py", 1,
                             "Exception while sending command.", None, None)
    ours = logging.LogRecord("root", logging.ERROR, "/x/app.py", 1, "an app's own", None, None)
    with caplog.at_level(logging.DEBUG, logger="cdcflow.spark"):
        assert root.filter(py4j) is False and root.filter(ours) is True
    assert [r.getMessage() for r in caplog.records] == [
        "py4j: Exception while sending command."]
    context._accumulatorServer.handle_error(None, None)  # quiet now: no AssertionError


def test_the_runners_session_gets_the_quiet_accumulator_server(
    spark_runner: SparkRunner,
) -> None:
    server = spark_runner.session.sparkContext._accumulatorServer
    assert server.handle_error is _quiet._quiet_handle_error
