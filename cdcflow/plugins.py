"""Entry-point registry for third-party transforms, sinks, runners and metadata stores.

A package registers under one of the groups in ``GROUPS``, e.g. in its pyproject.toml::

    [project.entry-points."cdcflow.sinks"]
    kafka = "my_pkg.sinks:KafkaSink"

A plugin that fails to import gives a warning, not a crash. The names cdcflow registers
itself (the ``memory`` and ``spark`` runners, the ``memory``, ``sqlite`` and ``spanner``
stores) are its own: another package's entry point under one of them is ignored, with a
warning, and ``cdcflow plugins`` lists it as broken.
"""

from __future__ import annotations

import logging
import warnings
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import attrs

from cdcflow.errors import PluginError

__all__ = ["GROUPS", "PluginInfo", "available", "is_own", "list_plugins", "load_plugin",
           "warn_shadowed"]

_log = logging.getLogger("cdcflow.plugins")

GROUPS = ("cdcflow.transforms", "cdcflow.sinks", "cdcflow.runners", "cdcflow.metadata")
#: What a group's entry points make, for messages.
_KINDS = {"cdcflow.transforms": "transform", "cdcflow.sinks": "sink",
          "cdcflow.runners": "runner", "cdcflow.metadata": "metadata store"}


@attrs.frozen
class PluginInfo:
    group: str
    name: str
    value: str  # "module:attr"
    distribution: str
    error: str | None = None  # why it failed to load, when it did


def is_own(obj: object) -> bool:
    """Whether ``obj`` is of a class of cdcflow's own (not a plugin's, nor a user's): what
    cdcflow's own runners and stores raise says where it comes from already."""
    return type(obj).__module__.split(".")[0] == "cdcflow"


def _entry_points(group: str) -> list[EntryPoint]:
    if group not in GROUPS:
        msg = f"unknown plugin group {group!r}; use one of {', '.join(GROUPS)}"
        raise PluginError(msg)
    return sorted(entry_points(group=group), key=lambda ep: ep.name)


def available(group: str) -> list[str]:
    """Names registered under ``group``."""
    return sorted({ep.name for ep in _entry_points(group)})


def _dist(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "?"


#: The distribution whose entry points are cdcflow's own.
_OWN = "cdcflow"


def _shadowing(ep: EntryPoint, registered: list[EntryPoint]) -> str | None:
    """Why ``ep`` is ignored (it takes a name cdcflow registers itself), or None."""
    if _dist(ep) == _OWN or not any(
            o.name == ep.name and _dist(o) == _OWN for o in registered):
        return None
    return (f"{ep.name!r} is the name of cdcflow's own {_KINDS[ep.group]}, so "
            f"this entry point of {_dist(ep)} is ignored: register it under another name")


_warned: set[tuple[str, str]] = set()  # (group, entry point) said to be ignored


def warn_shadowed(group: str, name: str) -> list[EntryPoint]:
    """Warn (once per process) about another package's entry point under ``name``, a name
    of cdcflow's own under ``group``; the entry points under ``name`` that count."""
    registered = _entry_points(group)
    counted = []
    for ep in (ep for ep in registered if ep.name == name):
        why = _shadowing(ep, registered)
        if why is None:
            counted.append(ep)
        elif (group, ep.value) not in _warned:
            _warned.add((group, ep.value))
            _log.warning("plugin %s: %s", ep.value, why)
    return counted


def load_plugin(group: str, name: str) -> Any:
    """The object registered as ``name`` under ``group``; PluginError names what exists."""
    eps = warn_shadowed(group, name)
    if not eps:
        names = ", ".join(available(group)) or "none"
        msg = f"no {_KINDS[group]} named {name!r} is installed (installed: {names})"
        raise PluginError(msg)
    if len({ep.value for ep in eps}) > 1:
        which = "; ".join(sorted({f"{_dist(ep)} ({ep.value})" for ep in eps}))
        msg = (f"{len(eps)} installed packages register {name!r} under {group}: {which}; "
               "uninstall all but one")
        raise PluginError(msg)
    try:
        return eps[0].load()
    except Exception as e:  # a broken plugin must not take the CLI down with a traceback
        msg = (f"plugin {name!r} ({eps[0].value}, package {_dist(eps[0])}) failed to load: "
               f"{type(e).__name__}: {e}; reinstall that package, or uninstall it")
        raise PluginError(msg) from e


def _misfit(group: str, obj: Any) -> str | None:
    """Why ``obj``, loaded from an entry point of ``group``, cannot be what the group holds
    (None when it can): every group holds something to call (a class or factory), and a
    metadata store a class with ``from_url``."""
    if group.endswith(".metadata"):
        if not callable(getattr(obj, "from_url", None)):
            return f"{obj!r} has no from_url(url) classmethod"
        return None
    return None if callable(obj) else f"{obj!r} is not a class or factory"


def list_plugins(load: bool = True) -> list[PluginInfo]:
    """Every registered plugin; with ``load``, each is imported and failures are reported
    in ``error`` (and warned about) instead of raised."""
    out: list[PluginInfo] = []
    for group in GROUPS:
        registered = _entry_points(group)
        for ep in registered:
            dist = _dist(ep)
            error = _shadowing(ep, registered)
            others = {o.value for o in registered if o.name == ep.name
                      and _shadowing(o, registered) is None} - {ep.value}
            if error is None and others:
                error = f"{ep.name!r} is also registered as {', '.join(sorted(others))}"
            if load and error is None:
                try:
                    error = _misfit(group, ep.load())
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
                if error is not None:
                    warnings.warn(f"cdcflow plugin {ep.name!r} ({ep.value}) is broken: {error}",
                                  stacklevel=2)
            out.append(PluginInfo(group, ep.name, ep.value, dist, error))
    return out
