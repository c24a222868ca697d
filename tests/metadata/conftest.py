"""The stores the metadata contract suite runs against.

To run the suite against another store, add one entry to ``STORE_FACTORIES``: a callable
``(request, tmp_path) -> store`` returning a new, empty store whose ``url`` reopens the same
state through ``open_store(url)`` after ``close()``, plus the pytest marks it needs (e.g.
``pytest.mark.emulator``; fixtures such as ``spanner_emulator`` are reachable through
``request.getfixturevalue``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from cdcflow.metadata import MetadataStore, open_store, sqlite_url

StoreFactory = Callable[[pytest.FixtureRequest, Path], MetadataStore]


@attrs.frozen
class StoreCase:
    make: StoreFactory
    marks: tuple[pytest.MarkDecorator, ...] = ()


def _memory(request: pytest.FixtureRequest, tmp_path: Path) -> MetadataStore:
    # A named store, so reopening its URL finds the same state.
    return open_store(f"memory://contract-{uuid.uuid4().hex}")


def _sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> MetadataStore:
    return open_store(sqlite_url(tmp_path / "state" / "metadata.db"))


def _dropped_after(request: pytest.FixtureRequest, emulator: Any, name: str) -> None:
    # The emulator holds at most 100 databases per instance, fewer than the tests create.
    def drop() -> None:
        with contextlib.suppress(Exception):  # never created: nothing to drop
            emulator.client().instance("test-instance").database(name).drop()

    request.addfinalizer(drop)


def _spanner(request: pytest.FixtureRequest, tmp_path: Path) -> MetadataStore:
    # A fresh emulator database per test isolates the tests; the store creates its tables.
    emulator = request.getfixturevalue("spanner_emulator")
    name = f"meta-{uuid.uuid4().hex[:20]}"
    _dropped_after(request, emulator, name)
    return open_store(f"spanner://{emulator.database_path(name)}")


def _spanner_pg(request: pytest.FixtureRequest, tmp_path: Path) -> MetadataStore:
    # The store never creates a PostgreSQL-dialect database; it finds an empty one (as a
    # user's database beside their data) and creates its tables in that dialect.
    emulator = request.getfixturevalue("spanner_emulator")
    name = f"meta-pg-{uuid.uuid4().hex[:20]}"
    _dropped_after(request, emulator, name)
    emulator.create_database(name, dialect="POSTGRESQL")
    return open_store(f"spanner://{emulator.database_path(name)}")


STORE_FACTORIES: dict[str, StoreCase] = {
    "memory": StoreCase(_memory),
    "sqlite": StoreCase(_sqlite),
    "spanner": StoreCase(_spanner, (pytest.mark.emulator,)),
    "spanner-pg": StoreCase(_spanner_pg, (pytest.mark.emulator,)),
}


@pytest.fixture(
    params=[pytest.param(name, id=name, marks=case.marks) for name, case in STORE_FACTORIES.items()]
)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MetadataStore]:
    """A new, empty store of each kind in STORE_FACTORIES."""
    s = STORE_FACTORIES[request.param].make(request, tmp_path)
    yield s
    s.close()


@pytest.fixture
def reopen(store: MetadataStore) -> Iterator[Callable[[], MetadataStore]]:
    """Close the store and open its URL again (what a restarted process does)."""
    opened: list[MetadataStore] = []

    def _reopen() -> MetadataStore:
        (opened[-1] if opened else store).close()
        opened.append(open_store(store.url))
        return opened[-1]

    yield _reopen
    for s in opened:
        s.close()
