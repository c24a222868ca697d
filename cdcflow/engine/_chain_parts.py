"""The parts of a task's fused chain (:mod:`cdcflow.engine.chain`) that are not the chain
itself: what travels through it (a skipped element, a failure delivered in order, one
record's evaluation), and its shape, the same for every task of a program and computed
once per process: its ends, counter names, bundle size, order, and whether it is one line
ReadPartition -> ParDos -> one sink."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from cdcflow.engine.program import TaskProgram
from cdcflow.transforms.base import DoFn, ParDo, Sink, SinkWriter

__all__ = [
    "Delivery", "Evaluated", "Failure", "Item", "Line", "LineStep", "Path", "Shape",
    "Skipped", "shape_of", "top_down",
]


class Skipped:
    """An element the error policy skipped, with the last error as text."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class Failure:
    """An exception raised in the pool, delivered in record order."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


Delivery = tuple[str, Any]  # (sink label, element)
Path = tuple[int, ...]  # an element's way from its record: (successor, output, ...) indices
Item = tuple[int, Path, Any]  # (record's index in the bundle, path, element)


class Evaluated:
    """One record's trip through the ParDos: what reaches sinks, and per-step counts."""

    __slots__ = ("counts", "deliveries")

    def __init__(self, deliveries: list[Delivery], counts: dict[str, int]) -> None:
        self.deliveries = deliveries
        self.counts = counts


class LineStep:
    """A ParDo of a chain that is one line, and what it took, gave and skipped."""

    __slots__ = ("fn", "function", "given", "label", "normalized", "skipped", "taken")

    def __init__(
        self, label: str, fn: DoFn[Any, Any], normalized: Callable[[Any], Sequence[Any]],
    ) -> None:
        self.label = label
        self.fn = fn
        self.function: Callable[[Any], Any] | None = None  # fn.as_function(), after setup
        self.normalized = normalized  # the DoFn's process, its outputs as a sequence
        self.taken = 0
        self.given = 0
        self.skipped = 0  # elements the error policy skipped here (no output counted)


class Line:
    """A chain that is one line: ReadPartition -> its ParDos -> one sink."""

    __slots__ = ("sink", "sink_key", "steps", "writer", "writes")

    def __init__(self, steps: tuple[LineStep, ...], sink: str, sink_key: str) -> None:
        self.steps = steps
        self.sink = sink
        self.sink_key = sink_key
        self.writer: SinkWriter[Any, Any] | None = None  # opened on the first element
        self.writes = 0


class Shape:
    """What a program's chain is, the same for every task of it (computed once per process
    from one unpickled copy, see :func:`shape_of`): its ends, counter names, bundle size,
    order, and for each set of sinks a task writes, whether the chain is one line."""

    __slots__ = ("bundle_size", "counter_keys", "ends", "lines", "order", "sinks", "steps")

    def __init__(self, program: TaskProgram) -> None:
        nodes: dict[str, ParDo[Any, Any] | Sink[Any, Any]] = pickle.loads(program.chain)
        self.steps = frozenset(program.step_labels)
        self.sinks = frozenset(label for label, node in nodes.items() if isinstance(node, Sink))
        self.ends = self.steps | self.sinks
        # made once per step: they serve every element
        self.counter_keys = {
            label: (f"elements_in/{label}", f"elements_out/{label}", f"sink_writes/{label}")
            for label in nodes
        }
        self.bundle_size = max(
            [n.fn.bundle_size for n in nodes.values() if isinstance(n, ParDo)] or [1]
        )
        self.order = top_down(program.read_label, program.successors)
        self.lines: dict[frozenset[str] | None, tuple[tuple[str, ...], str] | None] = {}

    def line(
        self, program: TaskProgram, wanted: Collection[str] | None
    ) -> tuple[tuple[str, ...], str] | None:
        """(the ParDos' labels, the sink's) when the chain is one line ReadPartition ->
        ParDo ... -> sink, and a task writing ``wanted`` writes that sink; else None."""
        key = None if wanted is None else frozenset(wanted)
        if key not in self.lines:
            self.lines[key] = self._line(program, key)
        return self.lines[key]

    def _line(
        self, program: TaskProgram, wanted: frozenset[str] | None
    ) -> tuple[tuple[str, ...], str] | None:
        steps: list[str] = []
        label = program.read_label
        while True:
            successors = program.successors.get(label, ())
            if len(successors) != 1:
                return None
            label = successors[0]
            if label in self.steps or label not in self.counter_keys:
                return None
            if label in self.sinks:
                return None if wanted is not None and label not in wanted else (
                    tuple(steps), label)
            steps.append(label)


# The shapes of the programs this process ran last, by their chain's bytes (the object: a
# cached program keeps it, so its id stays its own while it is here).
_shapes: dict[int, tuple[bytes, Shape]] = {}
_shapes_lock = threading.Lock()
_MAX_SHAPES = 8


def shape_of(program: TaskProgram) -> Shape:
    key = id(program.chain)
    with _shapes_lock:
        cached = _shapes.get(key)
        if cached is not None and cached[0] is program.chain:
            return cached[1]
    shape = Shape(program)
    with _shapes_lock:
        while len(_shapes) >= _MAX_SHAPES:
            del _shapes[next(iter(_shapes))]
        _shapes[key] = (program.chain, shape)
    return shape



def top_down(root: str, successors: Mapping[str, tuple[str, ...]]) -> list[str]:
    """The labels below ``root``, each after the one that feeds it (every transform has
    one input)."""
    order: list[str] = []
    todo = list(successors.get(root, ()))
    while todo:
        label = todo.pop(0)
        order.append(label)
        todo.extend(successors.get(label, ()))
    return order
