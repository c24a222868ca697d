"""Session fixtures shared by the whole suite.

The Cloud Spanner emulator is started once per test session on a free loopback port, with
fast partition churn. If it is not installed, emulator tests fail with install
instructions; they are never skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cdcflow.spanner.emulator import Emulator


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
