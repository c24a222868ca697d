"""Batch steps: transforms that see a whole batch on the driver and keep state across
batches, with the state carried in the batch commit.

A :class:`~cdcflow.transforms.base.BatchStep` (``GroupTransactions`` is one) cannot run in
a task: its input spans every partition of the batch, and its state spans batches. Tasks
run the chain up to the step and return the elements that reached it
(``TaskResult.step_inputs``). On the driver, after the tasks and before the sinks commit
(step 3a), :meth:`BatchSteps.fold` calls each step's ``process_batch`` with

- the elements of every task, concatenated in the order of the batch's slices;
- the step's state as of the last committed batch;
- the low watermark the batch will have once it commits (computed from the stored
  partitions and the tasks' reports, before the store commit: the fold is pure);

and pushes the outputs through the step's downstream ParDos and sinks on the driver (a
:class:`~cdcflow.engine.chain.Chain` of its own, whose writers' commit messages join the
tasks' messages at 3a). The new states are pickled into the store's batch commit (3b) and
become current only once it has committed, so a batch that is replayed — a retry, or a
pending plan after a crash anywhere before 3b — starts from the same state with the same
elements and watermark, and gives the same outputs: exactly once, as for any other output.

Both runners fold on the driver. A shuffle (Spark) would need the same state persisted per
key and the same determinism; on the driver the fold is exact and simple, and its cost is
bounded by what is incomplete: a step keeps only what the low watermark has not passed yet,
at most ``max_batch_span`` of changes (plus an idle partition's wait, see
:mod:`cdcflow.engine.partitions`).

A staging sink (two-stage ack) downstream of a step is refused: its recovery re-delivers
committed batches, which would need each step's state as of the batch before, and the
store keeps only the current one.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import cloudpickle

from cdcflow.dag import Dag
from cdcflow.engine.chain import Chain
from cdcflow.engine.lifecycle import BatchOutcome, fold, low_watermark
from cdcflow.engine.program import TaskProgram
from cdcflow.engine.runner import Task, TaskResult, add_counters
from cdcflow.errors import PipelineDefinitionError
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import BatchPlan, PartitionMetadata, PartitionState, Slice, Timestamp
from cdcflow.transforms.base import BatchStep, Sink

__all__ = ["STEP_TOKEN_PREFIX", "BatchSteps", "Folded", "low_after"]

#: The partition token of the slice a BatchStep's downstream writers see (WriterContext):
#: this prefix and the step's label.
STEP_TOKEN_PREFIX = "batch-step:"


@attrs.define
class Folded:
    """The fold of one batch: the driver-side writers' commit messages per sink, each
    step's new state, all states pickled for the store, and the chains' counters."""

    messages: dict[str, list[Any]] = attrs.field(factory=dict)
    states: dict[str, Any] = attrs.field(factory=dict)
    state: bytes = b""
    counters: dict[str, int] = attrs.field(factory=dict)


class BatchSteps:
    """The BatchSteps of one run: each one's driver-side program (what lies downstream of
    it) and its state as of the last committed batch. Empty (false) when the pipeline has
    none."""

    def __init__(self, pipeline: Dag, labels: Sequence[str] = ()) -> None:
        self._pipeline = pipeline
        self.programs = {label: TaskProgram.for_step(pipeline, label) for label in labels}
        self._states: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return bool(self.programs)

    def check_sinks(self, sinks: Mapping[str, Sink[Any, Any]]) -> None:
        """Refuse a staging sink downstream of a step (see the module docstring); call
        after the sinks' setup."""
        for step, program in self.programs.items():
            for label in program.sink_labels:
                if sinks[label].durable_batch() is not None:
                    msg = (
                        f"sink {label!r} stages batches (two-stage ack) and is fed by the "
                        f"BatchStep {step!r}, which cdcflow does not support: write the "
                        "step's output to a sink that commits per batch (such as WriteFiles), "
                        "or move the staging sink off the step's path"
                    )
                    raise PipelineDefinitionError(msg)

    def load(self, store: MetadataStore) -> None:
        """Read the states as of the last committed batch (a step new to the pipeline, or
        any after a reset, starts from its initial state)."""
        blob = store.step_state(self._pipeline.name) if self.programs else None
        stored: dict[str, Any] = {} if blob is None else pickle.loads(blob)
        self._states = {label: s for label, s in stored.items() if label in self.programs}

    def fold(
        self, plan: BatchPlan, parts: Sequence[PartitionMetadata], results: Sequence[TaskResult]
    ) -> Folded:
        """Fold every step over the batch and run its downstream chain (see the module
        docstring). ``parts``: the stored partitions before the batch. Changes nothing of
        this object: :meth:`committed` does, once the store has the states."""
        low = Timestamp.from_ns(low_after(parts, fold({p.token: p for p in parts}, results, 0)))
        start = min((s.start for s in plan.slices), default=plan.end)
        folded = Folded()
        counters: dict[str, int] = {}
        for label, program in self.programs.items():
            step = self._pipeline.transform(label)
            assert isinstance(step, BatchStep)
            elements = [
                element for r in results if label in r.step_inputs
                for element in pickle.loads(r.step_inputs[label])
            ]
            before = self._states[label] if label in self._states else step.initial_state()
            state, emitted = step.process_batch(before, elements, low)
            outputs = list(emitted)
            folded.states[label] = state
            # Counted like a chain's steps, so elements_total{step} accounts for what the
            # step took and emitted (records read = its input in a pipeline through it).
            add_counters(counters, {f"elements_in/{label}": len(elements),
                                    f"elements_out/{label}": len(outputs)})
            # The downstream runs like a task of its own, with a slice of its own (the same
            # on every replay, so sinks that record slices see no conflict).
            task = Task(self._pipeline.name, plan.batch_id,
                        Slice(f"{STEP_TOKEN_PREFIX}{label}", start, plan.end))
            chain = Chain(program, task)
            try:
                for element in outputs:
                    chain.push_element(element)
                done = chain.finish()
            except BaseException:
                chain.abort()
                raise
            for sink_label, message in done.items():
                if message is not None:
                    folded.messages.setdefault(sink_label, []).append(message)
            add_counters(counters, chain.counters())
        folded.counters = counters
        folded.state = cloudpickle.dumps(folded.states)
        return folded

    def committed(self, folded: Folded) -> None:
        """The store committed the batch with ``folded.state``: its states are current."""
        self._states = dict(folded.states)


def low_after(parts: Sequence[PartitionMetadata], outcome: BatchOutcome) -> int:
    """The low watermark once ``outcome`` is committed over ``parts`` (the stored
    partitions before the batch), computed before the commit."""
    after = {p.token: p for p in parts}
    for u in outcome.updates:
        p = after[u.token]
        after[u.token] = attrs.evolve(
            p, watermark=u.watermark, state=PartitionState.FINISHED if u.finished else p.state
        )
    for child in outcome.children:
        after.setdefault(child.token, child)
    return low_watermark(after.values())
