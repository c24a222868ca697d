"""Test doubles and helpers for pipelines.

- :class:`ScriptedChangeStream`: an in-memory change stream you script (the
  ``ChangeStreamClient`` seam), with the ground truth to assert against.
- :class:`ScriptedMutableStream`: the same for a MUTABLE_KEY_RANGE stream (partitions
  announced mid-stream, key ranges moving, partitions ending without children).
- :class:`ScriptedTransport`: a wire-level twin of Spanner for the real reader (the
  ``Transport`` seam of :class:`~cdcflow.spanner.client.SpannerChangeStreamClient`).
- :func:`run`: run a pipeline to its end in one call (memory runner, private store).
"""

from cdcflow.testing.harness import run
from cdcflow.testing.mutable import ScriptedMutableStream
from cdcflow.testing.scripted import ScriptedChange, ScriptedChangeStream, ScriptedTransaction
from cdcflow.testing.transport import ScriptedQuery, ScriptedTransport

__all__ = [
    "ScriptedChange",
    "ScriptedChangeStream",
    "ScriptedMutableStream",
    "ScriptedQuery",
    "ScriptedTransaction",
    "ScriptedTransport",
    "run",
]
