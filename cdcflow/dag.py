"""The DAG of a pipeline: composing transforms with ``|``, labels, validation.

Labels are stable identities (they key state), so they are unique within a pipeline.
Composite transforms nest their parts' labels under their own (``"outer/inner"``).
The graph is a networkx DiGraph whose nodes are full labels carrying the transform.

:class:`Dag` is what the engine runs; :class:`cdcflow.pipeline.Pipeline` is a Dag that
can also run itself (``pipeline.run()``), which keeps the arrows one way: pipeline ->
engine -> dag.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, TypeVar

import networkx as nx

from cdcflow import graphviz
from cdcflow.errors import DuplicateLabelError, PipelineDefinitionError
from cdcflow.policy import ErrorPolicy
from cdcflow.transforms.base import PCollection, PrimitiveTransform, PTransform

__all__ = ["PRIMITIVE_KINDS", "Dag"]

U = TypeVar("U")

#: The primitive kinds every runner executes (see cdcflow.transforms.base).
PRIMITIVE_KINDS = ("Source", "Read", "ParDo", "BatchStep", "Sink")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class Dag:
    """A named DAG of transforms. The name keys all stored progress of the pipeline."""

    def __init__(self, name: str, *, error_policy: ErrorPolicy | None = None) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            msg = (
                f"pipeline name {name!r} is not valid: use 1-128 letters, digits, '_', '.' or "
                "'-', starting with a letter or digit (it keys stored progress)"
            )
            raise PipelineDefinitionError(msg)
        if error_policy is not None and not isinstance(error_policy, ErrorPolicy):
            msg = (f"Pipeline({name!r}, error_policy={error_policy!r}): pass an ErrorPolicy, "
                   "e.g. cf.ErrorPolicy(then='skip')")
            raise PipelineDefinitionError(msg)
        self.name = name
        self.error_policy = error_policy or ErrorPolicy()
        self.graph: nx.DiGraph = nx.DiGraph()
        self._scope: list[str] = []
        self._composite_labels: set[str] = set()
        self._root: PCollection[None] = PCollection(self, None)

    # -- composing -------------------------------------------------------------------------

    def __or__(self, transform: PTransform[None, U]) -> PCollection[U]:
        return self.apply(transform, self._root)

    def apply(self, transform: PTransform[Any, U], pcoll: PCollection[Any]) -> PCollection[U]:
        """Apply ``transform`` to ``pcoll`` (what ``|`` does)."""
        if not isinstance(transform, PTransform):
            msg = (
                f"cannot apply {transform!r}: expected a transform such as Map(fn) or "
                "WriteFiles(path); wrap plain functions in Map, FlatMap or Filter"
            )
            raise PipelineDefinitionError(msg)
        if pcoll.pipeline is not self:
            msg = "a PCollection of one pipeline was applied to a transform of another pipeline"
            raise PipelineDefinitionError(msg)
        if pcoll.producer is not None:
            producer = self.graph.nodes[pcoll.producer]["transform"]
            if getattr(producer, "kind", "") == "Sink":
                msg = (
                    f"{pcoll.producer!r} is a sink and sinks are terminal; apply "
                    f"{transform.label or transform.default_label()!r} to the PCollection "
                    "before the sink instead (a PCollection can feed several transforms)"
                )
                raise PipelineDefinitionError(msg)
        label = self._full_label(transform)
        if isinstance(transform, PrimitiveTransform):
            return self.add_primitive(transform, pcoll)
        self._claim_label(label, transform)
        self._scope.append(transform.label or transform.default_label())
        try:
            out = transform.expand(pcoll)
        finally:
            self._scope.pop()
        if not isinstance(out, PCollection):
            msg = f"{label!r}: expand() must return the output PCollection, got {out!r}"
            raise PipelineDefinitionError(msg)
        return out

    def _full_label(self, transform: PTransform[Any, Any]) -> str:
        return "/".join([*self._scope, transform.label or transform.default_label()])

    def _claim_label(self, label: str, transform: PTransform[Any, Any]) -> None:
        if label in self.graph or label in self._composite_labels:
            leaf = label.rsplit("/", 1)[-1]  # inside a composite, the user names the leaf
            msg = (
                f"duplicate label {label!r} in pipeline {self.name!r}: labels key stored state "
                f'and must be unique; name this step, e.g. "{leaf} 2" >> '
                f"{type(transform).__name__}(...)"
            )
            raise DuplicateLabelError(msg)
        self._composite_labels.add(label)

    def add_primitive(
        self, transform: PrimitiveTransform[Any, U], pcoll: PCollection[Any]
    ) -> PCollection[U]:
        """Add ``transform`` as a node fed by ``pcoll`` (PrimitiveTransform.expand)."""
        label = self._full_label(transform)
        if label in self.graph or label in self._composite_labels:
            self._claim_label(label, transform)  # raises DuplicateLabelError
        self.graph.add_node(label, transform=transform, kind=transform.kind)
        if pcoll.producer is not None:
            self.graph.add_edge(pcoll.producer, label)
        return PCollection(self, label)

    # -- reading the graph -----------------------------------------------------------------

    def transform(self, label: str) -> PrimitiveTransform[Any, Any]:
        t: PrimitiveTransform[Any, Any] = self.graph.nodes[label]["transform"]
        return t

    def nodes(self) -> Iterator[tuple[str, PrimitiveTransform[Any, Any]]]:
        """(label, transform) in topological order (ties broken by label for stability)."""
        for label in nx.lexicographical_topological_sort(self.graph):
            yield label, self.graph.nodes[label]["transform"]

    def labels_of_kind(self, kind: str) -> list[str]:
        return [label for label, t in self.nodes() if t.kind == kind]

    def upstream(self, label: str) -> str | None:
        preds = list(self.graph.predecessors(label))
        return preds[0] if preds else None

    def downstream(self, label: str) -> list[str]:
        return sorted(self.graph.successors(label))

    # -- validation ------------------------------------------------------------------------

    def validate(self, known_kinds: tuple[str, ...] = PRIMITIVE_KINDS) -> None:
        """Check the graph before any run; raise PipelineDefinitionError naming the fix."""
        if self.graph.number_of_nodes() == 0:
            msg = f"pipeline {self.name!r} is empty: start it with pipeline | DetectPartitions(...)"
            raise PipelineDefinitionError(msg)
        for label, t in self.nodes():
            if t.kind not in known_kinds:
                msg = (
                    f"{label!r} is a {type(t).__name__} of kind {t.kind!r}, which the runner "
                    f"does not execute (known kinds: {', '.join(known_kinds)}); build it from "
                    "ParDo/Map/FlatMap/Filter or Sink, or make it a composite with expand()"
                )
                raise PipelineDefinitionError(msg)
            up = self.upstream(label)
            up_kind = self.transform(up).kind if up else None
            if t.kind == "Source" and up is not None:
                msg = f"{label!r}: DetectPartitions must be applied to the pipeline itself"
                raise PipelineDefinitionError(msg)
            if t.kind != "Source" and up is None:
                after = "DetectPartitions" if t.kind == "Read" else "ReadPartition"
                msg = (
                    f"{label!r} has no input: apply it after {after}, e.g. "
                    "pipeline | DetectPartitions(...) | ReadPartition() | ..."
                )
                raise PipelineDefinitionError(msg)
            if t.kind == "Read" and up_kind != "Source":
                msg = (
                    f"{label!r}: ReadPartition reads DetectPartitions' output; apply it "
                    "right after DetectPartitions"
                )
                raise PipelineDefinitionError(msg)
            if t.kind in ("ParDo", "BatchStep", "Sink") and up_kind == "Source":
                msg = (
                    f"{label!r} is applied to DetectPartitions' output (partitions, not "
                    "records): put ReadPartition() between them"
                )
                raise PipelineDefinitionError(msg)
        self._validate_batch_steps()
        sources = self.labels_of_kind("Source")
        if len(sources) != 1:
            msg = (
                f"pipeline {self.name!r} has {len(sources)} DetectPartitions; a pipeline reads "
                "exactly one change stream (run one pipeline per stream)"
            )
            raise PipelineDefinitionError(msg)
        reads = self.labels_of_kind("Read")
        if len(reads) != 1:
            msg = f"pipeline {self.name!r} needs exactly one ReadPartition after DetectPartitions"
            raise PipelineDefinitionError(msg)
        if not self.labels_of_kind("Sink"):
            msg = (
                f"pipeline {self.name!r} has no sink, so nothing would be written: end it "
                "with a sink such as WriteFiles(path), Print() or Collect()"
            )
            raise PipelineDefinitionError(msg)
        self._check_upstreams()

    def _validate_batch_steps(self) -> None:
        # The engine folds one BatchStep per path on the driver after the tasks; a second
        # one downstream would need the first one's outputs carried into another fold.
        for label in self.labels_of_kind("BatchStep"):
            before = sorted(
                a for a in nx.ancestors(self.graph, label)
                if self.transform(a).kind == "BatchStep"
            )
            if before:
                msg = (
                    f"{label!r} is a BatchStep downstream of the BatchStep {before[0]!r}; a "
                    "pipeline may have at most one BatchStep on any path: merge the two "
                    "steps into one, or turn the later one into a ParDo (Map/FlatMap)"
                )
                raise PipelineDefinitionError(msg)

    def _check_upstreams(self) -> None:
        # Every transform below the source may inspect (and adapt to) what feeds it.
        for label, t in self.nodes():
            if t.kind == "Source":
                continue
            path: list[PrimitiveTransform[Any, Any]] = []
            up = self.upstream(label)
            while up is not None:
                path.insert(0, self.transform(up))
                up = self.upstream(up)
            t.check_upstream(path)

    def describe(self, format: str = "text") -> str:
        """The DAG as indented text or as Graphviz DOT."""
        return graphviz.describe(self, format)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.graph.number_of_nodes()} transforms)"
