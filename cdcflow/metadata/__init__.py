"""Metadata stores: durable progress of pipelines, selected by URL.

>>> store = open_store("sqlite:///state.db")   # doctest: +SKIP

``memory://`` and ``memory://NAME`` (in-process), ``sqlite:///relative.db`` and
``sqlite:////absolute.db`` (embedded default), and any scheme registered under the
``cdcflow.metadata`` entry-point group, such as
``spanner://projects/P/instances/I/databases/D[?table=NAME]``. A plugin store class provides
``from_url(url) -> store``.

Commands that only read (``cdcflow status``) open with ``create=False``: a store that is
not there is reported (:class:`~cdcflow.errors.StoreNotFoundError`), never created. A
plugin whose ``from_url`` takes a ``create`` keyword is given it; any other is opened with
``from_url(url)`` as always.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, cast

from cdcflow.errors import CdcflowError, PluginError, StoreSetupError, StoreURLError
from cdcflow.metadata._rules import URL_FORMS
from cdcflow.metadata.base import MetadataStore
from cdcflow.metadata.memory import MemoryStore
from cdcflow.metadata.sqlite import SQLiteStore, sqlite_url
from cdcflow.plugins import available, is_own, load_plugin, warn_shadowed

__all__ = [
    "URL_FORMS", "MemoryStore", "MetadataStore", "SQLiteStore", "open_store", "sqlite_url",
]

_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://")
_GROUP = "cdcflow.metadata"


def _takes_create(from_url: Any) -> bool:
    """Whether a plugin's ``from_url`` accepts ``create=`` (a parameter of that name)."""
    try:
        parameter = inspect.signature(from_url).parameters.get("create")
    except (TypeError, ValueError):  # no signature to inspect: called as the contract says
        return False
    return parameter is not None and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def open_store(url: str, *, create: bool = True) -> MetadataStore:
    """Open the metadata store named by ``url``.

    ``create=False`` opens only a store that is there, and changes nothing on the way: no
    file, directory, instance, database, table or column is created or upgraded. A URL that
    names no store raises :class:`~cdcflow.errors.StoreNotFoundError` (the Spanner store,
    which connects on first use, raises it from its first operation); a store of an
    earlier version raises :class:`~cdcflow.errors.StoreSetupError` naming the upgrade.
    The memory store holds nothing to create. A plugin store is given ``create=False``
    only when its ``from_url`` takes that keyword.

    Raises :class:`~cdcflow.errors.StoreURLError` for a malformed URL or an unknown scheme,
    with the valid forms in the message. Stores other than memory and SQLite are loaded
    through the plugin registry only when their scheme is used (the Spanner store's client
    library is imported on first use).
    """
    m = _SCHEME.match(url.strip())
    if m is None:
        msg = f"not a metadata store URL: {url!r}; valid forms: {URL_FORMS}"
        raise StoreURLError(msg)
    url = url.strip()
    scheme = m.group(1)
    if scheme in ("memory", "sqlite"):
        warn_shadowed(_GROUP, scheme)  # another package's store of that name is not used
    if scheme == "memory":
        return MemoryStore.from_url(url)
    if scheme == "sqlite":
        return SQLiteStore.from_url(url, create=create)
    if scheme not in available(_GROUP):
        installed = ", ".join(sorted({"memory", "sqlite", *available(_GROUP)}))
        msg = (
            f"unknown metadata store scheme {scheme!r} in {url!r} (installed: {installed}); "
            f"valid forms: {URL_FORMS}"
        )
        raise StoreURLError(msg)
    cls: Any = load_plugin(_GROUP, scheme)
    from_url = getattr(cls, "from_url", None)
    if not callable(from_url):
        msg = (f"the metadata store plugin {scheme!r} ({cls!r}) has no from_url(url) "
               "classmethod: a store plugin is opened with StoreClass.from_url(url)")
        raise PluginError(msg)
    try:
        store: MetadataStore = (
            from_url(url) if create or not _takes_create(from_url) else from_url(url, create=False)
        )
    except CdcflowError:
        raise
    except Exception as e:  # the plugin's own failure to open
        msg = f"the metadata store {url} could not be opened: {type(e).__name__}: {e}"
        raise StoreSetupError(msg) from e
    if not isinstance(store, MetadataStore):
        msg = (f"the metadata store plugin {scheme!r}: {cls!r}.from_url({url!r}) returned "
               f"{type(store).__name__}, not a MetadataStore (the methods of "
               "cdcflow.metadata.base.MetadataStore); fix the plugin")
        raise PluginError(msg)
    if is_own(store):
        return store
    return cast(MetadataStore, _PluginStore(store, scheme))


class _PluginStore:
    """A third-party store whose own errors say where they came from: what a method raises
    that is not cdcflow's carries the note ``in <method>() of the <scheme>:// metadata
    store (a plugin)``, which the one-line error report shows. Everything else is the
    store's own."""

    def __init__(self, store: Any, scheme: str) -> None:
        self._store = store
        self._where = f"of the {scheme}:// metadata store (a plugin)"

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._store, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            except CdcflowError:
                raise
            except Exception as exc:
                exc.add_note(f"in {name}() {self._where}")
                raise

        return call

    def __repr__(self) -> str:
        return repr(self._store)
