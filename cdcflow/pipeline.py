"""Pipeline: the DAG a user builds, and ``pipeline.run()``.

A :class:`Pipeline` is a :class:`~cdcflow.dag.Dag` (compose it with ``|``) that can run
itself; the engine only needs the Dag, so the arrows point one way (pipeline -> launch ->
engine -> dag).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cdcflow.dag import PRIMITIVE_KINDS, Dag
from cdcflow.engine.listener import EngineListener, RunSummary
from cdcflow.engine.loop import Engine
from cdcflow.engine.runner import Runner
from cdcflow.launch import run_pipeline
from cdcflow.metadata.base import MetadataStore
from cdcflow.transforms.base import PCollection

__all__ = ["PRIMITIVE_KINDS", "PCollection", "Pipeline"]


class Pipeline(Dag):
    """A named DAG of transforms. The name keys all stored progress of the pipeline."""

    def run(
        self,
        runner: str | Runner = "memory",
        metadata: str | MetadataStore | None = None,
        *,
        listener: EngineListener | None = None,
        on_engine: Callable[[Engine], None] | None = None,
        **options: Any,
    ) -> RunSummary:
        """Run this pipeline until its end, a limit, or a stop request; return the summary.

        ``runner``: ``"memory"``, ``"spark"``, any installed runner plugin's name, or a
        :class:`~cdcflow.engine.runner.Runner` instance. ``metadata``: a store URL
        (``sqlite:///state.db``, ``spanner://...``), opened and closed by this call, or a
        store object, left open for its owner. The default keeps state in
        ``.cdcflow/state.db`` under the current directory (``cdcflow run FILE`` keeps it
        next to FILE instead). ``options`` are :class:`~cdcflow.engine.loop.RunOptions`
        fields (``max_batches=3``, ``duration="30s"`` or ``30``, ``reset=True``, ...), the
        runner's own keyword arguments (``workers=4``, ``master="local[2]"``), or the
        observers' options: ``metrics_port=9464`` serves Prometheus metrics while the run
        lasts (0: a free port, whose URL goes to ``on_metrics=callable`` or the log),
        ``metrics_host="0.0.0.0"`` listens on every address (default 127.0.0.1), and
        ``stuck_after="5m"`` is how long a partition may go without progress before it is
        reported stuck (default 10 heartbeats, at least 30 s).
        ``listener`` observes the run; ``on_engine`` gets the engine before it runs (call
        its ``request_stop()`` from another thread to end the run after the current
        batch). Errors in what was given raise :class:`~cdcflow.errors.UserInputError`
        naming the fix, before anything runs. Same path as ``cdcflow run``
        (:func:`cdcflow.launch.run_pipeline`).
        """
        return run_pipeline(
            self, runner, metadata, listener=listener, on_engine=on_engine, **options
        )
