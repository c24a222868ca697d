"""Transforms and sinks a pipeline is built from, and :func:`plugin` for third-party ones."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from cdcflow.errors import PluginError
from cdcflow.transforms.base import BatchStep, DoFn, ParDo, PTransform, Sink
from cdcflow.transforms.consume import Consume, Consumed, idempotency_key
from cdcflow.transforms.core import Filter, FlatMap, Map
from cdcflow.transforms.sinks import Collect, Print, WriteFiles
from cdcflow.transforms.source import DetectPartitions, ReadChangeStream, ReadPartition
from cdcflow.transforms.transactions import (
    GroupTransactions,
    IncompleteTransactionError,
    Transaction,
)

if TYPE_CHECKING:
    from cdcflow.transforms.rows import Rows
    from cdcflow.transforms.schemas import SchemaChange, SchemaChanges
    from cdcflow.transforms.tables import WriteTables

# Typed rows need pyarrow: these load it on first use, so a pipeline without them never
# does (about 40 MB of a process's memory).
_LAZY = {
    "Rows": "cdcflow.transforms.rows",
    "SchemaChange": "cdcflow.transforms.schemas",
    "SchemaChanges": "cdcflow.transforms.schemas",
    "WriteTables": "cdcflow.transforms.tables",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        msg = f"module 'cdcflow.transforms' has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(importlib.import_module(module), name)


__all__ = [
    "BatchStep",
    "Collect",
    "Consume",
    "Consumed",
    "DetectPartitions",
    "DoFn",
    "Filter",
    "FlatMap",
    "GroupTransactions",
    "IncompleteTransactionError",
    "Map",
    "PTransform",
    "ParDo",
    "Print",
    "ReadChangeStream",
    "ReadPartition",
    "Rows",
    "SchemaChange",
    "SchemaChanges",
    "Sink",
    "Transaction",
    "WriteFiles",
    "WriteTables",
    "idempotency_key",
    "plugin",
]

_PLUGIN_GROUPS = ("cdcflow.transforms", "cdcflow.sinks")


def plugin(name: str, *args: Any, **kwargs: Any) -> PTransform[Any, Any]:
    """Build the transform or sink a third-party package registered as ``name``.

    Looks ``name`` up under the entry-point groups ``cdcflow.transforms`` and
    ``cdcflow.sinks``, and calls what is registered with ``*args`` and ``**kwargs``::

        pipeline | ... | plugin("counting", "out/counts")

    Raises PluginError listing what is installed when ``name`` is not registered, when it
    is registered in both groups, or when it fails to load or does not build a transform.
    """
    from cdcflow import plugins  # importlib.metadata is only needed here

    found = [g for g in _PLUGIN_GROUPS if name in plugins.available(g)]
    if not found:
        installed = "; ".join(
            f"{g.split('.')[1]}: {', '.join(plugins.available(g)) or 'none'}"
            for g in _PLUGIN_GROUPS
        )
        msg = (
            f"no transform or sink plugin named {name!r} is installed ({installed}); "
            "install the package that provides it, or check the name"
        )
        raise PluginError(msg)
    if len(found) > 1:
        msg = (
            f"{name!r} is registered both as a transform and as a sink plugin; import the "
            "class from its package instead of using plugin()"
        )
        raise PluginError(msg)
    factory = plugins.load_plugin(found[0], name)
    if not callable(factory):
        msg = f"plugin {name!r} in {found[0]} is {factory!r}, not a transform class or factory"
        raise PluginError(msg)
    transform = factory(*args, **kwargs)
    if found[0] == "cdcflow.sinks":
        if not isinstance(transform, Sink):
            msg = (
                f"plugin {name!r} is registered under cdcflow.sinks but built {transform!r}, "
                "which is not a Sink; its package must register a Sink subclass there"
            )
            raise PluginError(msg)
        return transform
    if not isinstance(transform, PTransform):
        msg = (
            f"plugin {name!r} in {found[0]} built {transform!r}, not a transform; its package "
            "must register a PTransform subclass there (or a function returning one)"
        )
        raise PluginError(msg)
    return transform
