"""Test doubles and helpers for pipelines.

- :class:`ScriptedChangeStream`: an in-memory change stream you script (the
  ``ChangeStreamClient`` seam), with the ground truth to assert against.
- :class:`ScriptedTransport`: a wire-level twin of Spanner for the real reader (the
  ``Transport`` seam of :class:`~cdcflow.spanner.client.SpannerChangeStreamClient`).
- :func:`run`: run a pipeline to its end in one call (memory runner, private store).
"""

from cdcflow.testing.harness import run
from cdcflow.testing.scripted import ScriptedChange, ScriptedChangeStream, ScriptedTransaction
from cdcflow.testing.transport import ScriptedQuery, ScriptedTransport

__all__ = [
    "ScriptedChange",
    "ScriptedChangeStream",
    "ScriptedQuery",
    "ScriptedTransaction",
    "ScriptedTransport",
    "run",
]
