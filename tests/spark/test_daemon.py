"""The Python worker daemon Spark starts (``spark.python.daemon.module``): PySpark's, with
a worker whose socket the JVM closed at shutdown ending quietly (no traceback on the
driver's terminal after a run that went well)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from cdcflow.spark import daemon
from cdcflow.spark.runner import SparkRunner


@pytest.mark.parametrize("error", [BrokenPipeError(32, "Broken pipe"), ConnectionResetError()])
def test_a_closed_socket_ends_the_worker_quietly(
    monkeypatch: pytest.MonkeyPatch, error: OSError
) -> None:
    def closed(sock: Any, authenticated: bool) -> int:
        raise error

    monkeypatch.setattr(daemon, "_worker", closed)
    assert daemon.worker(object(), True) == 1  # as killed: not reused, no traceback


def test_other_outcomes_are_pysparks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "_worker", lambda sock, authenticated: 0)
    assert daemon.worker(object(), True) == 0

    def broken(sock: Any, authenticated: bool) -> int:
        raise ValueError("a bug")

    monkeypatch.setattr(daemon, "_worker", broken)
    with pytest.raises(ValueError, match="a bug"):
        daemon.worker(object(), True)


def test_sessions_start_this_daemon() -> None:
    settings = SparkRunner(master="local[1]")._settings("app")
    assert settings["spark.python.daemon.module"] == "cdcflow.spark.daemon"


def test_the_daemon_imports_the_task_code_but_not_grpc_before_it_forks() -> None:
    # Workers are forked from the daemon: they start with the task code imported, and
    # gRPC's core (which must not start before a fork) is not there yet.
    code = ("import sys; from cdcflow.spark import daemon; daemon._preload(); "
            "print('cdcflow.engine.task' in sys.modules, 'grpc' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.split() == ["True", "False"]
