"""cdcflow's optional compiled hot loops: :mod:`cdcflow._speedups`, built from
``_speedups.c`` when cdcflow is installed (``setup.py``; without a C compiler the install
goes on without it).

What it speeds up stays written in Python, which is the reference: the GoogleSQL
decoder's record making (:mod:`cdcflow.spanner.records`) and the JSON writer's check for
floats that are not finite and its orjson default (:mod:`cdcflow.serialize`). Each
caller asks :func:`speedups` and falls back to its Python code when it gets None, or when
the compiled code declines an input. ``CDCFLOW_PURE_PYTHON=1`` in the environment turns
it off (read when cdcflow is imported).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["speedups"]


def _load() -> ModuleType | None:
    if os.environ.get("CDCFLOW_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        # by name: the extension module imports nothing of cdcflow, and a "from cdcflow
        # import" would read as importing the package (the layers contract refuses that)
        return importlib.import_module("cdcflow._speedups")
    except ImportError:
        return None


_SPEEDUPS = _load()


def speedups() -> ModuleType | None:
    """The compiled module, or None (not built, or ``CDCFLOW_PURE_PYTHON`` is set)."""
    return _SPEEDUPS
