"""A scripted transaction and a scripted change: :class:`ScriptedTransaction` collects the
mods of one transaction of a :class:`~cdcflow.testing.ScriptedChangeStream`;
:class:`ScriptedChange` is one of them as the stream's ground truth reports it."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol

import attrs

from cdcflow.model import ModType
from cdcflow.stream import MOD_TYPES

__all__ = ["ScriptedChange", "ScriptedTransaction"]

_MOD_TYPES = MOD_TYPES


@attrs.frozen
class ScriptedChange:
    """One scripted row change, the ground truth independent of partitions.

    ``transaction`` is the server transaction id the change's records carry; ``index`` is
    the change's place in script order (ties in commit time keep it).
    """

    commit_ns: int
    transaction: str
    index: int
    table: str
    keys: Mapping[str, Any]
    mod_type: ModType
    new_values: Mapping[str, Any]
    old_values: Mapping[str, Any]

    @property
    def key(self) -> tuple[str, tuple[tuple[str, Any], ...]]:
        """A hashable identity of the row: (table, sorted key items)."""
        return self.table, tuple(sorted(self.keys.items()))


@attrs.define
class _Txn:
    at: int
    seq: int
    tag: str
    changes: list[tuple[str, dict[str, Any], ModType, dict[str, Any], dict[str, Any]]]


class _Stream(Protocol):
    """What a transaction needs of its stream (ScriptedChangeStream imports this module)."""

    def _add_txn(self, txn: _Txn) -> None: ...


class ScriptedTransaction:
    """Collects the mods of one transaction; committed when the ``with`` block exits."""

    def __init__(self, stream: _Stream, at: int, tag: str) -> None:
        self._stream = stream
        self._txn = _Txn(at=at, seq=-1, tag=tag, changes=[])
        self._done = False

    def write(
        self,
        table: str,
        key: Mapping[str, Any] | Any,
        mod_type: ModType = "INSERT",
        new_values: Mapping[str, Any] | None = None,
        old_values: Mapping[str, Any] | None = None,
    ) -> ScriptedTransaction:
        """Add a mod. ``key`` is a dict of primary-key columns, or a value for column "id"."""
        if self._done:
            msg = "this transaction was already committed; start a new stream.transaction()"
            raise RuntimeError(msg)
        if mod_type not in _MOD_TYPES:
            msg = f"mod_type must be one of {', '.join(_MOD_TYPES)}, got {mod_type!r}"
            raise ValueError(msg)
        keys = dict(key) if isinstance(key, Mapping) else {"id": key}
        self._txn.changes.append(
            (table, keys, mod_type, dict(new_values or {}), dict(old_values or {}))
        )
        return self

    def commit(self) -> None:
        if self._done:
            return
        self._done = True
        if self._txn.changes:
            self._stream._add_txn(self._txn)

    def __enter__(self) -> ScriptedTransaction:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.commit()


