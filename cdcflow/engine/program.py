"""The task program: everything a task needs besides its slice, built once per run.

The driver builds it from the pipeline's DAG, pickles it once, and every task (a thread of
the in-memory runner, a Python worker of a Spark executor) unpickles its own copy.
"""

from __future__ import annotations

import pickletools
import sys
from collections.abc import Mapping
from typing import Any

import attrs
import cloudpickle

from cdcflow.dag import Dag
from cdcflow.errors import CdcflowError, PipelineDefinitionError
from cdcflow.policy import ErrorPolicy
from cdcflow.transforms.base import BatchStep, ParDo, Sink
from cdcflow.transforms.source import DetectPartitions, ReadPartition

__all__ = ["DEAD_LETTER_LABEL", "TaskProgram"]

#: Label of the error policy's dead-letter sink when it has none of its own.
DEAD_LETTER_LABEL = "dead-letter"


@attrs.frozen
class TaskProgram:
    """Everything a task needs besides its slice; built once per run on the driver.

    ``chain`` holds the cloudpickled transforms downstream of ReadPartition (ParDos and
    sinks, plus the dead-letter sink), keyed by label; every task unpickles its own copy,
    so DoFns never share state across concurrent tasks. ``successors`` maps the read
    label and every chain label to the labels it feeds.

    ``step_labels``: the BatchSteps the chain feeds. A task does not run them: it returns
    the elements that reached each one (``TaskResult.step_inputs``), and the engine folds
    them on the driver. What lies downstream of a BatchStep is not in ``chain``; it runs on
    the driver in a program of its own (:meth:`for_step`), whose ``read_label`` is the
    step's label.
    """

    pipeline: str
    source: DetectPartitions
    read_label: str
    heartbeat_millis: int
    max_inflight: int
    max_inflight_bytes: int | None  # None: the process's default quota
    chain: bytes
    successors: Mapping[str, tuple[str, ...]]
    policy: ErrorPolicy
    sink_labels: tuple[str, ...]
    dead_letter_label: str | None = None
    step_labels: tuple[str, ...] = ()

    @classmethod
    def from_pipeline(cls, pipeline: Dag) -> TaskProgram:
        """Build the program of a validated pipeline; raise PipelineDefinitionError on a
        transform kind the runners do not execute."""
        (read_label,) = pipeline.labels_of_kind("Read")
        return cls._build(pipeline, read_label)

    @classmethod
    def for_step(cls, pipeline: Dag, step_label: str) -> TaskProgram:
        """The driver-side program of what lies downstream of BatchStep ``step_label``: its
        ParDos and sinks (and the dead-letter sink), fed the step's outputs."""
        return cls._build(pipeline, step_label)

    @classmethod
    def _build(cls, pipeline: Dag, root: str) -> TaskProgram:
        (source_label,) = pipeline.labels_of_kind("Source")
        (read_label,) = pipeline.labels_of_kind("Read")
        source = pipeline.transform(source_label)
        read = pipeline.transform(read_label)
        assert isinstance(source, DetectPartitions) and isinstance(read, ReadPartition)
        reached = _descendants(pipeline, root)
        nodes: dict[str, ParDo[Any, Any] | Sink[Any, Any]] = {}
        steps: list[str] = []
        beyond: set[str] = set()  # downstream of a BatchStep: another program runs them
        for label, t in pipeline.nodes():
            if label not in reached or label in beyond:
                continue
            if isinstance(t, BatchStep):
                steps.append(label)
                beyond |= _descendants(pipeline, label)
                continue
            if not isinstance(t, ParDo | Sink):
                msg = (
                    f"{label!r} is a {type(t).__name__} of kind {t.kind!r}; tasks execute "
                    "ParDo and Sink transforms after ReadPartition (subclass ParDo or Sink)"
                )
                raise PipelineDefinitionError(msg)
            nodes[label] = t
        successors = {label: tuple(pipeline.downstream(label)) for label in (root, *nodes)}
        sink_labels = tuple(label for label, t in nodes.items() if isinstance(t, Sink))
        policy = pipeline.error_policy
        dead_label = None
        if policy.dead_letter is not None:
            dead_label = policy.dead_letter.label or DEAD_LETTER_LABEL
            if pipeline.graph.has_node(dead_label):
                msg = (
                    f"the dead-letter sink's label {dead_label!r} is also a step of the "
                    "pipeline; give it another label, e.g. ErrorPolicy(dead_letter="
                    '"failed" >> WriteFiles(...))'
                )
                raise PipelineDefinitionError(msg)
            nodes[dead_label] = policy.dead_letter
            sink_labels = (*sink_labels, dead_label)
        return cls(
            pipeline=pipeline.name,
            source=source,
            read_label=root,
            heartbeat_millis=read.heartbeat_millis,
            # A driver-side program runs its chain on the driver's thread, in output order.
            max_inflight=read.max_inflight if root == read_label else 1,
            max_inflight_bytes=read.max_inflight_bytes,
            chain=_pickled(nodes),
            successors=successors,
            policy=attrs.evolve(policy, dead_letter=None),  # the sink travels in ``chain``
            sink_labels=sink_labels,
            dead_letter_label=dead_label,
            step_labels=tuple(steps),
        )


def _descendants(pipeline: Dag, label: str) -> set[str]:
    found: set[str] = set()
    todo = list(pipeline.downstream(label))
    while todo:
        nxt = todo.pop()
        if nxt not in found:
            found.add(nxt)
            todo.extend(pipeline.downstream(nxt))
    return found


def _pickled(nodes: dict[str, Any]) -> bytes:
    """The chain's steps as tasks receive them; PipelineDefinitionError naming the step
    when one cannot be pickled (a lock, a client, an open file among what it uses)."""
    try:
        data: bytes = cloudpickle.dumps(nodes)
    except CdcflowError:
        raise  # a step that refuses to travel says why itself
    except Exception as exc:
        failing = []
        for label, node in nodes.items():
            try:
                cloudpickle.dumps(node)
            except Exception:
                failing.append(label)
        msg = (
            f"step {', '.join(map(repr, failing)) or 'of the pipeline'} cannot be sent to its "
            f"tasks ({type(exc).__name__}: {exc}): a function or object it uses holds what "
            "cannot be pickled, such as a lock, a client or an open file; make that in a "
            "DoFn's setup(), or inside the function"
        )
        raise PipelineDefinitionError(msg) from exc
    _check_not_importing(data)
    return data


def _check_not_importing(data: bytes) -> None:
    """Refuse a chain whose steps a task would load from a module still being imported
    (``pipeline.run()`` at the top level of a module that another one imports): the task's
    thread would wait for that import, which waits for the run, for ever."""
    initializing = {name for name, module in list(sys.modules.items())
                    if getattr(getattr(module, "__spec__", None), "_initializing", False)}
    if not initializing:  # the usual case: no import under way, nothing to read
        return
    named: set[str] = set()
    strings: list[str] = []
    for op, arg, _ in pickletools.genops(data):
        if isinstance(arg, str) and "UNICODE" in op.name:
            strings.append(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            named.add(strings[-2])
        elif op.name == "GLOBAL" and isinstance(arg, str):
            named.add(arg.split(" ", 1)[0])
    importing = sorted(named & initializing)
    if importing:
        msg = (
            f"the pipeline runs while module {importing[0]!r}, whose functions its steps use, "
            "is still being imported (pipeline.run() at its top level): its tasks would wait "
            "for that import for ever. Call run() under `if __name__ == \"__main__\":`, or "
            "from a function called once the import is done"
        )
        raise PipelineDefinitionError(msg)
