"""Fixtures of the Spanner store's tests: databases on the session's emulator."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator

import pytest

from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.store import SpannerStore


@pytest.fixture
def name(spanner_emulator: Emulator) -> Iterator[str]:
    """A new database name; the database is dropped after the test (the emulator holds at
    most 100 databases per instance, fewer than the tests create)."""
    name = f"meta-{uuid.uuid4().hex[:20]}"
    yield name
    with contextlib.suppress(Exception):  # never created: nothing to drop
        spanner_emulator.client().instance("test-instance").database(name).drop()


@pytest.fixture
def database(spanner_emulator: Emulator, name: str) -> str:
    """The path of a database that does not exist yet (the store creates it)."""
    return spanner_emulator.database_path(name)


@pytest.fixture
def stores() -> Iterator[Callable[[str], SpannerStore]]:
    opened: list[SpannerStore] = []

    def _open(url: str) -> SpannerStore:
        opened.append(SpannerStore.from_url(url))
        return opened[-1]

    yield _open
    for s in opened:
        s.close()
