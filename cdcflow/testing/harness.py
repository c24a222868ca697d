"""``cdcflow.testing.run``: run a pipeline to its end in one call, for unit tests.

::

    def test_orders_become_rows() -> None:
        stream = ScriptedChangeStream("Orders", origin=T0)
        stream.write("Orders", {"id": 1}, "INSERT", {"total": 5}, at=T0 + 1_000)
        out = Collect()
        pipeline = cf.Pipeline("rows")
        (pipeline
         | ReadChangeStream(stream="Orders", start_at=T0, end_at=T0 + 10_000, client=stream)
         | Map(to_row)
         | out)
        cdcflow.testing.run(pipeline)
        assert out.items == [...]
"""

from __future__ import annotations

from typing import Any

from cdcflow.dag import Dag
from cdcflow.engine.listener import EngineListener, RunSummary
from cdcflow.errors import PipelineDefinitionError, UserInputError
from cdcflow.launch import run_pipeline
from cdcflow.transforms.source import DetectPartitions

__all__ = ["run"]

# Chosen here, not by the caller: a test run is always private and in-process.
_FIXED = ("runner", "metadata", "on_engine")


def run(pipeline: Dag, *, listener: EngineListener | None = None, **options: Any) -> RunSummary:
    """Run ``pipeline`` until its end and return the summary.

    The run uses the in-memory runner (which pickles every task, as Spark would), a private
    ``memory://`` store that is gone when the call returns, and no pause between batches
    (``batch_interval=0`` and ``idle_read_interval=0`` unless given). ``options`` are those
    of ``pipeline.run()``
    (``max_batches=3``, ``max_batch_span="1s"``, ``workers=1``, ...).

    The pipeline must end: its DetectPartitions (or ReadChangeStream) needs an ``end_at``,
    or ``options`` a ``max_batches`` or ``duration``; otherwise PipelineDefinitionError
    says so before anything runs. An ``end_at`` ahead of the clock makes the run follow the
    clock until it passes ``end_at``, in many small batches; a ScriptedChangeStream scripted
    in the past runs as fast as it reads.
    """
    if not isinstance(pipeline, Dag):
        msg = (f"cdcflow.testing.run takes a Pipeline, got {type(pipeline).__name__} "
               f"{pipeline!r}: pass the cf.Pipeline your steps were added to")
        raise UserInputError(msg)
    fixed = [key for key in _FIXED if key in options]
    if fixed:
        msg = (
            f"cdcflow.testing.run chooses {', '.join(fixed)} itself (the memory runner and a "
            "private memory:// store); call pipeline.run(...) to choose them"
        )
        raise UserInputError(msg)
    pipeline.validate()
    (label,) = pipeline.labels_of_kind("Source")
    source = pipeline.transform(label)
    bounded = isinstance(source, DetectPartitions) and source.end_at is not None
    limited = options.get("max_batches") is not None or options.get("duration") is not None
    if not (bounded or limited):
        msg = (
            f"pipeline {pipeline.name!r} has no end, so cdcflow.testing.run would never "
            f"return: give {label!r} an end_at (e.g. just after the last scripted change), "
            "or pass max_batches=N or duration='5s' to cdcflow.testing.run"
        )
        raise PipelineDefinitionError(msg)
    options.setdefault("batch_interval", 0)
    options.setdefault("idle_read_interval", 0)  # every partition every batch: no waits
    return run_pipeline(pipeline, "memory", "memory://", listener=listener, **options)
