"""Transform kinds: PTransform (composite), and the primitives runners execute.

Runners know five primitive kinds and raise on anything else:

- ``Source`` (DetectPartitions): where partitions come from.
- ``Read`` (ReadPartition): reads partitions; emits DataChangeRecords.
- ``ParDo``: element-wise user code (a :class:`DoFn`); Map, FlatMap, Filter are ParDos.
- ``BatchStep``: sees the elements of every task of a batch at once, on the driver, and
  keeps state across batches in the batch commit (GroupTransactions is one).
- ``Sink``: terminal; writers in tasks, commit on the driver, once per batch.

A composite transform overrides :meth:`PTransform.expand` and applies other transforms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import attrs

from cdcflow.model import Timestamp

__all__ = [
    "BatchStep",
    "DoFn",
    "PCollection",
    "PTransform",
    "ParDo",
    "PrimitiveTransform",
    "Sink",
    "SinkContext",
    "SinkWriter",
    "WriterContext",
]


InT = TypeVar("InT")
OutT = TypeVar("OutT")
T = TypeVar("T")
U = TypeVar("U")
E = TypeVar("E")  # a sink's element type
M = TypeVar("M")  # a sink's commit message type
E_contra = TypeVar("E_contra", contravariant=True)
M_co = TypeVar("M_co", covariant=True)
S = TypeVar("S")  # a batch step's state


class _Graph(Protocol):
    """What a PCollection needs of the pipeline it belongs to (cdcflow.dag.Dag)."""

    def apply(self, transform: PTransform[Any, U], pcoll: PCollection[Any]) -> PCollection[U]: ...

    def add_primitive(
        self, transform: PrimitiveTransform[Any, U], pcoll: PCollection[Any]
    ) -> PCollection[U]: ...


class PCollection(Generic[T]):
    """The output of a transform, a stream of ``T``; apply more transforms to it with ``|``."""

    def __init__(self, pipeline: _Graph, producer: str | None) -> None:
        self.pipeline = pipeline
        self.producer = producer  # full label of the producing node; None for the pipeline root

    def __or__(self, transform: PTransform[T, U]) -> PCollection[U]:
        return self.pipeline.apply(transform, self)

    def __repr__(self) -> str:
        return f"PCollection({self.producer or '<root>'})"


class PTransform(Generic[InT, OutT]):
    """A step of a pipeline, from ``PCollection[InT]`` to ``PCollection[OutT]``.

    ``"label" >> transform`` names it; ``pcoll | transform`` applies it. Subclasses that are
    composites override :meth:`expand` and apply other transforms to the input
    PCollection, returning the output PCollection.
    """

    label: str | None = None

    def default_label(self) -> str:
        """The label used when none is given: the class name."""
        return type(self).__name__

    def with_label(self, label: str) -> PTransform[InT, OutT]:
        """A shallow copy of this transform carrying ``label``."""
        if not isinstance(label, str) or not label.strip():
            msg = f"a label must be a non-empty string, got {label!r}"
            raise TypeError(msg)
        # A plain shallow copy that shares state with the original (not copy.copy, which
        # goes through pickling hooks): `out = Collect(); ... | "x" >> out` must fill `out`.
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.label = label
        return clone

    def __rrshift__(self, label: str) -> PTransform[InT, OutT]:
        return self.with_label(label)

    def expand(self, pcoll: PCollection[InT]) -> PCollection[OutT]:
        """Apply this transform to ``pcoll``. Composites override this."""
        msg = f"{type(self).__name__} is neither a primitive nor a composite: override expand()"
        raise NotImplementedError(msg)


class PrimitiveTransform(PTransform[InT, OutT]):
    """A transform that runners execute directly; ``kind`` is one of the primitive kinds."""

    kind: str = ""

    def expand(self, pcoll: PCollection[InT]) -> PCollection[OutT]:
        return pcoll.pipeline.add_primitive(self, pcoll)

    def describe_params(self) -> str:
        """A short text of the parameters, shown by ``cdcflow graph``."""
        return ""

    def check_upstream(self, path: Sequence[PrimitiveTransform[Any, Any]]) -> None:
        """Called by pipeline validation, before any run, with the transforms from
        DetectPartitions down to this transform's input (DetectPartitions first,
        ReadPartition second). A transform may adapt to them (GroupTransactions checks
        exact counts only when nothing filters records before it; LookupRows rolls rows
        forward only when it sees every record) or raise PipelineDefinitionError naming
        the fix. The default accepts any."""
        return None


class DoFn(Generic[InT, OutT]):
    """Element-wise user code from ``InT`` to zero or more ``OutT``.

    ``process`` returns (or yields) the outputs of one element. ``setup`` runs once per
    task before the first element, ``teardown`` after the last (also when the task fails).
    A DoFn is pickled into every task: keep clients and pools out of ``__init__``.

    Threads. With ``ReadPartition(max_inflight=N)``, N > 1, the task calls ``process`` of
    one instance from up to N threads at once (for different records): it must be
    thread-safe. Keep per-call state in locals, and state that is not safe to share (a
    connection without its own pool, a buffer) in a ``threading.local`` made in ``setup``.
    ``setup`` and ``teardown`` run once per task, on one thread.

    Bundles. A DoFn that can do better with many elements at once (one query for many
    keys) sets ``bundle_size`` above 1 and overrides :meth:`process_bundle`. The task then
    cuts its records into bundles of consecutive records (at most the largest
    ``bundle_size`` of its DoFns, at most a quarter of the byte quota; a heartbeat, a
    quota running short and the end of the slice end a bundle early) and hands each
    bundling DoFn the elements that reached it from one bundle, in record order, at most
    ``bundle_size`` at a time. Outputs keep record order, and progress still advances
    only through what the sinks took.
    """

    #: Elements :meth:`process_bundle` takes at once; 1 (the default): one at a time.
    bundle_size: int = 1

    def setup(self) -> None:
        return None

    def process(self, element: InT) -> Iterable[OutT]:
        msg = f"{type(self).__name__} must override process(element) and return its outputs"
        raise NotImplementedError(msg)

    def process_bundle(self, elements: Sequence[InT]) -> Sequence[Iterable[OutT]]:
        """The outputs of each of ``elements`` (consecutive elements of one task, in order):
        one iterable per element, in order, the same outputs :meth:`process` gives for it.

        If it raises, the task calls :meth:`process` on each element instead, under the
        pipeline's error policy, so a failure is retried, skipped or stops the run per
        element exactly as without bundles. The default calls :meth:`process`."""
        return [self.process(element) for element in elements]

    def teardown(self) -> None:
        return None

    def as_function(self) -> Callable[[InT], OutT] | None:
        """A function giving the one output :meth:`process` gives for each element, when
        that is all the DoFn does (``Map``'s does); a task may call it in place of
        ``process``. None (the default) when there is no such function. Asked once per
        task, after :meth:`setup`."""
        return None


class ParDo(PrimitiveTransform[InT, OutT]):
    """Apply a :class:`DoFn` to every element: ``PCollection[InT]`` to ``PCollection[OutT]``."""

    kind = "ParDo"

    def __init__(self, fn: DoFn[InT, OutT]) -> None:
        if not isinstance(fn, DoFn):
            msg = f"ParDo takes a DoFn instance, got {fn!r}; subclass cdcflow.DoFn"
            raise TypeError(msg)
        self.fn = fn

    def default_label(self) -> str:
        return type(self.fn).__name__


class BatchStep(PrimitiveTransform[InT, OutT], Generic[InT, OutT, S]):
    """A step that sees every element of a batch at once and keeps state across batches.

    Tasks run the chain up to the step and return the elements that reached it; on the
    driver, after the batch's tasks and before its sinks commit, the engine calls
    :meth:`process_batch` once per batch with the elements of every task (concatenated in
    the order of the batch's slices, each task's in record order), the step's state as of
    the previous committed batch, and the low watermark the batch will have once it
    commits. The outputs run through the step's downstream ParDos and sinks on the driver
    and commit with the batch; the new state is stored in the same store transaction as
    the batch's progress, so a replayed batch starts from the same state.

    Contract: ``process_batch`` is deterministic given ``state``, ``elements`` and
    ``low_watermark`` (a replay must produce the same outputs and state) and must not
    change ``state`` in place (return a new one, or the same one unchanged). The state is
    pickled into every batch commit: keep it small (what is still incomplete, not
    history). A pipeline has at most one BatchStep on any path, downstream of
    ReadPartition.
    """

    kind = "BatchStep"

    def initial_state(self) -> S:
        """The state before the first batch (and after a reset)."""
        msg = f"{type(self).__name__} must override initial_state()"
        raise NotImplementedError(msg)

    def process_batch(
        self, state: S, elements: Sequence[InT], low_watermark: Timestamp
    ) -> tuple[S, Iterable[OutT]]:
        """Fold one batch: the new state and the outputs to emit downstream, in order.

        ``low_watermark``: every change committed before it has been read once this batch
        commits (all partitions' elements up to it are in this or an earlier batch)."""
        msg = f"{type(self).__name__} must override process_batch(state, elements, low_watermark)"
        raise NotImplementedError(msg)


@attrs.frozen
class WriterContext:
    """Where a sink writer runs: one task, i.e. one slice of one batch."""

    pipeline: str
    sink_label: str
    batch_id: int
    partition_token: str
    slice_start: int
    slice_end: int
    attempt: str  # unique per execution attempt of the task (retries get a new one)
    #: Raises when the run may no longer act (its lease ran out or was lost, or it was
    #: aborted): a writer making side effects outside the batch's commit (Consume) calls
    #: it before each one. Where the driver's run is not in this process it does nothing.
    guard: Callable[[], None] = attrs.field(default=lambda: None, eq=False, repr=False)
    #: The pipeline's :class:`~cdcflow.policy.ErrorPolicy` (without its dead-letter sink),
    #: for a writer that decides about failed calls itself (Consume) and has no policy of
    #: its own; None: the default policy.
    error_policy: Any = attrs.field(default=None, eq=False, repr=False)
    #: Whether the pipeline has a dead-letter sink: a writer that skips elements itself
    #: hands them over through ``dead_letters()`` (see Consume).
    dead_letter: bool = False
    #: A writer that keeps elements after ``write`` returns (Consume's queue) holds their
    #: bytes against the process's byte quota: ``hold(n)`` in ``write`` (at once, never
    #: blocking: the reader gives the element's bytes back right after, and reading
    #: blocks while the writer holds them), ``let_go(n)`` once it is done with them (at
    #: the latest when it closes or aborts). Outside the engine both do nothing.
    hold: Callable[[int], None] = attrs.field(default=lambda n: None, eq=False, repr=False)
    #: True once the run was asked to stop after the current batch (a signal, ``--for``):
    #: a writer retrying failed calls gives the batch up then (it is replayed by the next
    #: run) instead of retrying on. Always False where the run is not in this process.
    stopping: Callable[[], bool] = attrs.field(default=lambda: False, eq=False, repr=False)
    let_go: Callable[[int], None] = attrs.field(default=lambda n: None, eq=False, repr=False)
    #: A writer that makes its task wait (a full queue, a drain at ``close``) calls
    #: ``holding_back(True)`` when it starts waiting and ``holding_back(False)`` when it
    #: stops: a partition that does not advance meanwhile is then reported as held back by
    #: this sink, not as a read that hangs. Outside the engine it does nothing.
    holding_back: Callable[[bool], None] = attrs.field(
        default=lambda waiting: None, eq=False, repr=False)


def _no_stop(reason: str) -> None:
    msg = f"this sink asked to stop the run ({reason}), but nothing runs it"
    raise RuntimeError(msg)


@attrs.frozen
class SinkContext:
    """What a sink learns on the driver before the first batch.

    ``request_stop(reason)`` ends the run gracefully after the current batch commits (for
    example when the sink's consumer went away); ``reason`` becomes the run summary's.
    ``stopping()`` is True once the run was asked to stop (a signal, a stop request): a
    staging sink whose ``flush`` at the run's end waits on a storage that fails may then
    give up with SinkIOError (what is not durable is written again by the next run).
    ``guard()`` raises once this run may no longer act on the world: its lease ran out
    (:class:`~cdcflow.errors.LeaseExpiredError`, transient: it holds again once renewed) or
    another run took the pipeline over (the error that says so, for good). A sink that
    writes on the driver outside ``commit`` (a staging sink's background uploads) checks it
    before each write: the run that took over writes that output again, and a late write of
    this run's would repeat it.
    """

    pipeline: str
    sink_label: str
    base_dir: str  # directory of the pipeline file; relative paths resolve against it
    request_stop: Callable[[str], None] = attrs.field(default=_no_stop, eq=False, repr=False)
    stopping: Callable[[], bool] = attrs.field(default=lambda: False, eq=False, repr=False)
    guard: Callable[[], None] = attrs.field(default=lambda: None, eq=False, repr=False)


@runtime_checkable
class SinkWriter(Protocol[E_contra, M_co]):
    """Writes one task's elements of type ``E``; ``close`` gives its commit message ``M``.

    Runs where the task runs (an executor on Spark). A writer is used by one task, from
    one thread: ``write`` for every element, then exactly one of ``close`` (the task
    succeeded) or ``abort`` (it failed). A writer that applies an error policy of its own
    (``Consume``) may also have ``policy_counters() -> {"skipped": n, "retries": n}``,
    read after ``close`` and counted with the task's (summary, status, metrics).
    """

    def write(self, element: E_contra) -> None: ...

    def close(self) -> M_co | None:
        """Finish writing; return a small picklable commit message, or None when the
        writer has nothing to commit (a None is not passed to :meth:`Sink.commit`)."""
        ...

    def abort(self) -> None:
        """Discard what was written; called when the task fails."""
        ...


class Sink(PrimitiveTransform[E, None], Generic[E, M]):
    """A terminal transform taking elements ``E``, whose writers' commit messages are ``M``.

    Two stages, as in a two-phase commit:

    1. ``open_writer`` in every task; the writer's ``close`` returns a commit message.
    2. ``commit`` on the driver with every message of the batch, before the store commits
       the batch's progress. ``commit`` must be idempotent for a batch id: a crash between
       sink commit and store commit replays the batch with the same slices and calls
       ``commit`` again for the same id. Such a sink gives exactly-once output.

    After the store commits, ``on_watermark`` tells the sink that every record with
    commit timestamp below ``watermark_ns`` has been delivered and committed.
    """

    kind = "Sink"

    def setup(self, ctx: SinkContext) -> None:
        """Driver-side preparation before the first batch (resolve paths, create tables)."""
        return None

    def open_writer(self, ctx: WriterContext) -> SinkWriter[E, M]:
        """A writer for one task (one slice of one batch); called where the task runs."""
        msg = f"{type(self).__name__} must override open_writer(ctx) and return a SinkWriter"
        raise NotImplementedError(msg)

    def commit(self, batch_id: int, messages: Sequence[M]) -> None:
        """Make batch ``batch_id`` durable and visible.

        ``messages`` are the non-None results of ``close`` of the batch's writers, in the
        order of the batch's slices, then those of the writers that ran on the driver (a
        sink downstream of a :class:`BatchStep`); a batch where no writer had output gives
        an empty sequence. Called again with the same id when the batch is replayed: the second
        call must not repeat output.
        """
        msg = (
            f"{type(self).__name__} must override commit(batch_id, messages); make it "
            "idempotent per batch id"
        )
        raise NotImplementedError(msg)

    def abort(self, batch_id: int, messages: Sequence[M]) -> None:
        """Discard the batch's uncommitted output (the batch will be replayed).

        ``messages`` may be empty even when writers wrote (the engine aborts after failed
        tasks, whose messages it never got): find what the batch left by its id.
        """
        return None

    def on_watermark(self, watermark_ns: int) -> None:
        return None

    def durable_batch(self) -> int | None:
        """Two-stage ack. ``None`` (the default): ``commit`` has made a batch durable when it
        returns.

        A sink that *stages* batches — ``commit`` takes the batch, a later flush makes it
        durable (to cut files near a target size across batches, say) — returns the batch
        id through which its output is durable (0: nothing yet). The engine records it with
        each batch and, after a crash, replays the batches above it from the batch log to
        this sink only (the deterministic slices make the replay exact). Contract: after a
        restart the sink finds its durable batch in its own storage, and ``commit`` skips
        a batch at or below it (its output exists already).
        """
        return None

    def flush(self) -> None:
        """Make every staged batch durable; called on the driver when a run ends gracefully.
        Sinks that do not stage (``durable_batch() is None``) have nothing to do."""
        return None

    def owned_batch(self) -> int:
        """The highest batch that this sink's pipeline itself committed where the sink
        writes, in an earlier run, by the sink's own records of it (an owner record naming
        the pipeline, its manifests, a durable mark), or 0: none, or it cannot tell (the
        default). Called on the driver after :meth:`setup`, like
        :meth:`last_committed_batch` (output it cannot attribute, such as files of an older
        version, counts there, not here).

        A pipeline that starts afresh in its metadata store while a sink reports one has
        lost its progress (a deleted state file, another store): the engine refuses to
        start it over unless the run resets (``--reset``), so that nothing is delivered
        twice, or skipped, without the user asking for it.
        """
        return 0

    def last_committed_batch(self) -> int:
        """The highest batch id whose output this sink finds already where it writes, or 0
        when it finds none or cannot tell (the default).

        Called on the driver after :meth:`setup`, before the first batch is planned; reads
        only, and is cheap enough to call once per run. The engine plans new batches above
        it (a pending plan still replays with its own id), so a sink that names output by
        batch id never reuses an id whose output exists, also after ``--reset``, with a
        deleted or new metadata store.
        """
        return 0

    def output_location(self) -> str | None:
        """Where this sink's output lives, as text compared for equality, or None when the
        sink writes nowhere of its own (the default: Collect, Print).

        Called on the driver after :meth:`setup`. Two sinks of one pipeline (the dead-letter
        sink included) that return equal locations would overwrite each other's output: the
        engine must refuse such a pipeline before the first batch, naming both labels. A
        sink whose output can safely share a place with others' (distinct file names)
        includes what keeps it distinct, so only real duplicates compare equal.
        """
        return None

    def metrics(self) -> Mapping[str, float]:
        """Numbers an operator watches, by name (the default: none). Called on the driver
        after each batch commits; served as ``cdcflow_sink_<name>{pipeline, sink}``: a name
        ending in ``_total`` is a counter (a running total since the sink's setup), any other
        a gauge (its value now). Names are lower-case letters, digits and underscores.
        """
        return {}

    def close(self) -> None:
        return None
