"""Session fixtures shared by the whole suite.

The Cloud Spanner emulator is started once per test session on a free loopback port, with
fast partition churn. If it is not installed, emulator tests fail with install
instructions; they are never skipped.

``runner`` runs a test once per runner (ids ``memory`` and ``spark``), as bytewax's
conftest runs every test under every execution mode. The Spark case carries the ``spark``
marker (``-m "not spark"`` deselects it) and shares one ``local[2]`` session for the whole
test session: an Engine opens and closes its runner on every run, and a Spark start costs
seconds, so the runner a test gets leaves the shared session running when it is closed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import pytest

from cdcflow.engine.runner import Runner
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.spanner.emulator import Emulator
from cdcflow.spark.runner import SparkRunner

#: The runner names the ``runner`` fixture runs a test under, in order.
RUNNERS = ("memory", "spark")


@pytest.fixture(scope="session")
def spanner_emulator() -> Iterator[Emulator]:
    """A running emulator whose partitions live 2-4 s; SPANNER_EMULATOR_HOST is set for it."""
    emu = Emulator(partition_alive_seconds=2).start()
    old = os.environ.get("SPANNER_EMULATOR_HOST")
    os.environ["SPANNER_EMULATOR_HOST"] = emu.host
    try:
        yield emu
    finally:
        if old is None:
            os.environ.pop("SPANNER_EMULATOR_HOST", None)
        else:
            os.environ["SPANNER_EMULATOR_HOST"] = old
        emu.stop()


@pytest.fixture(scope="session")
def spark_runner() -> Iterator[SparkRunner]:
    """An open ``SparkRunner("local[2]")`` whose session lives until the test session ends.

    Runners built by tests (``SparkRunner()``) find this session active and use it without
    owning it, so their ``close`` leaves it running too.
    """
    runner = SparkRunner("local[2]")
    runner.open("cdcflow-tests")
    try:
        yield runner
    finally:
        runner.close()


class _SharedSparkRunner:
    """A Runner over the session-wide SparkRunner: ``close`` ends nothing.

    Between ``open`` and ``close`` it is the shared runner (same ``name``, same
    ``run_tasks``). Outside them it refuses what an unopened SparkRunner refuses, by asking
    one: the shared runner itself is always open and would accept anything.
    """

    def __init__(self, shared: SparkRunner) -> None:
        self._shared = shared
        self._open = False

    @property
    def name(self) -> str:
        return self._shared.name

    def open(self, app_name: str) -> None:
        self._shared.open(app_name)  # a no-op on the open runner; kept for its checks
        self._open = True

    def run_tasks(self, program: bytes, tasks: Sequence[bytes]) -> list[bytes]:
        if not self._open:
            unopened = SparkRunner(self._shared.master, self._shared.conf)
            return unopened.run_tasks(program, tasks)
        return self._shared.run_tasks(program, tasks)

    def close(self) -> None:
        # The session belongs to the spark_runner fixture, which stops it at session end.
        self._open = False

    def __repr__(self) -> str:
        state = "open" if self._open else "closed"
        return f"<shared {self._shared.name} runner {self._shared.master}, {state}>"


@pytest.fixture(params=[RUNNERS[0], pytest.param(RUNNERS[1], marks=pytest.mark.spark)])
def runner(request: pytest.FixtureRequest) -> Iterator[Runner]:
    """A fresh, unopened runner of each kind: ``InMemoryRunner(workers=4)``, or Spark
    (``local[2]``) over the session's shared SparkSession. Engines open and close it per run.
    """
    if request.param == "memory":
        memory = InMemoryRunner(workers=4)
        try:
            yield memory
        finally:
            memory.close()
        return
    shared: SparkRunner = request.getfixturevalue("spark_runner")
    spark = _SharedSparkRunner(shared)
    try:
        yield spark
    finally:
        spark.close()
