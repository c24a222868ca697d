"""open_store: URL forms, plugin schemes, and errors that show the valid forms."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import cdcflow.metadata as metadata
from cdcflow.errors import PluginError, StoreURLError, UserInputError
from cdcflow.metadata import MemoryStore, MetadataStore, SQLiteStore, open_store, sqlite_url
from cdcflow.plugins import available


def test_memory_urls() -> None:
    assert isinstance(open_store("memory://"), MemoryStore)
    assert open_store("memory://a-b.c_1") is open_store("memory://a-b.c_1")
    assert open_store("memory://") is not open_store("memory://")


def test_a_relative_sqlite_path_is_taken_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store("sqlite:///state/meta.db")
    assert isinstance(store, SQLiteStore)
    assert (tmp_path / "state" / "meta.db").is_file()
    # The store's URL is absolute, so it reopens the same file from anywhere.
    assert store.url == "sqlite:///" + str(tmp_path / "state" / "meta.db")
    assert store.url.startswith("sqlite:////")
    store.close()


def test_an_absolute_sqlite_path_has_four_slashes(tmp_path: Path) -> None:
    path = tmp_path / "abs.db"
    store = open_store(f"sqlite:///{path}")  # path starts with "/": four slashes in all
    assert isinstance(store, SQLiteStore) and store.path == path
    assert store.url == sqlite_url(path) == f"sqlite:///{path}"
    store.close()


def test_surrounding_whitespace_is_ignored(tmp_path: Path) -> None:
    store = open_store(f"  sqlite:///{tmp_path / 'w.db'}\n")
    assert isinstance(store, SQLiteStore)
    store.close()


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("", "not a metadata store URL"),
        ("state.db", "not a metadata store URL"),
        ("/abs/state.db", "not a metadata store URL"),
        ("SQLite:///x.db", "not a metadata store URL"),
        ("sqlite://state.db", "three slashes before a relative path"),
        ("sqlite:///", "names no file"),
        ("sqlite:///x.db?mode=ro", "no query parameters"),
        ("sqlite:///:memory:", "use memory://"),
        ("memory://a/b", "letters, digits"),
        ("memory://a b", "letters, digits"),
    ],
)
def test_a_malformed_url_shows_the_valid_forms(url: str, why: str) -> None:
    with pytest.raises(StoreURLError, match=why) as info:
        open_store(url)
    message = str(info.value)
    assert "sqlite:////absolute/path.db" in message
    assert "memory://NAME" in message
    assert "spanner://projects/P/instances/I/databases/D" in message
    assert isinstance(info.value, UserInputError)  # the CLI exits with code 2


def test_an_unknown_scheme_names_the_installed_ones() -> None:
    with pytest.raises(StoreURLError, match=r"unknown metadata store scheme 'redis'") as info:
        open_store("redis://localhost/0")
    assert "installed: memory, " in str(info.value) and "sqlite" in str(info.value)
    assert "sqlite:///relative/path.db" in str(info.value)


class _FakeStore:
    opened: list[str] = []

    @classmethod
    def from_url(cls, url: str) -> MemoryStore:
        cls.opened.append(url)
        return MemoryStore()


def test_other_schemes_come_from_the_plugin_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded: list[tuple[str, str]] = []

    def load_plugin(group: str, name: str) -> Any:
        loaded.append((group, name))
        return _FakeStore

    monkeypatch.setattr(metadata, "available", lambda group: ["fake", "memory", "sqlite"])
    monkeypatch.setattr(metadata, "load_plugin", load_plugin)
    store = open_store("fake://somewhere/db?table=T")
    assert isinstance(store, MetadataStore)
    assert loaded == [("cdcflow.metadata", "fake")]
    assert _FakeStore.opened == ["fake://somewhere/db?table=T"]


class _CarefulStore:
    """A plugin store that creates what it lacks, unless opened with create=False."""

    opened: list[tuple[str, bool]] = []

    @classmethod
    def from_url(cls, url: str, *, create: bool = True) -> MemoryStore:
        cls.opened.append((url, create))
        return MemoryStore()


def test_create_false_reaches_only_the_plugins_that_take_it(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    plugins: dict[str, Any] = {"fake": _FakeStore, "careful": _CarefulStore}
    monkeypatch.setattr(metadata, "available", lambda group: [*plugins, "memory", "sqlite"])
    monkeypatch.setattr(metadata, "load_plugin", lambda group, name: plugins[name])
    monkeypatch.setattr(_FakeStore, "opened", [])
    open_store("careful://x", create=False)
    open_store("careful://y")
    open_store("fake://z", create=False)
    assert _CarefulStore.opened == [("careful://x", False), ("careful://y", True)]
    assert _FakeStore.opened == ["fake://z"]  # from_url(url), as the plugin contract says


def test_a_broken_plugin_is_reported_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    def load_plugin(group: str, name: str) -> Any:
        msg = f"plugin {name!r} failed to load: ImportError: no module"
        raise PluginError(msg)

    monkeypatch.setattr(metadata, "available", lambda group: ["broken"])
    monkeypatch.setattr(metadata, "load_plugin", load_plugin)
    with pytest.raises(PluginError, match="failed to load"):
        open_store("broken://x")


def test_the_spanner_scheme_is_registered() -> None:
    assert "spanner" in available("cdcflow.metadata")


def test_importing_the_stores_does_not_import_the_spanner_client() -> None:
    code = (
        "import sys, cdcflow.metadata; "
        "print(sorted(m for m in sys.modules if m.startswith('google.cloud')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
