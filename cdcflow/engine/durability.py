"""Two-stage acks: sinks whose output becomes durable after their commit.

Most sinks make a batch durable in ``commit`` (the batch is done when the store commits
it). A *staging* sink (``Sink.durable_batch()`` is not None) takes the batch in
``commit`` and makes it durable later, in a flush of its own choosing — to cut files near
a target size across batches, say. The engine then keeps, per staging sink, the batch
through which its output is durable (a *mark*, stored with each batch commit), and the
batch log keeps every batch above the smallest mark. After a crash, :meth:`replays`
lists the logged batches above a sink's mark, and the engine runs each again — the
deterministic slices make that exact — delivering it only to the sinks that had not made
it durable, and flushes them after each (so a run that dies during the replay leaves the
next one less to replay). Nothing a sink had made durable is delivered twice; nothing it
had not is lost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from cdcflow.errors import OwedOutputError, StoreError
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import BatchPlan
from cdcflow.transforms.base import Sink

__all__ = ["StagedSinks"]


class StagedSinks:
    """The staging sinks of one run and their durable marks (see the module docstring).

    ``fence`` returns the run's fencing token for the store writes.
    """

    def __init__(
        self, store: MetadataStore, pipeline: str, sinks: Mapping[str, Sink[Any, Any]],
        fence: Callable[[], int],
    ) -> None:
        self.store = store
        self.pipeline = pipeline
        self.fence = fence
        self.sinks = {label: s for label, s in sinks.items() if s.durable_batch() is not None}

    def marks(self) -> dict[str, int]:
        """What each staging sink reports as durable now (to store with a batch commit)."""
        return {label: _durable(s) for label, s in self.sinks.items()}

    def _committed_through(self) -> int:
        last = self.store.last_batch_id(self.pipeline)
        return last - 1 if self.store.pending_plan(self.pipeline) is not None else last

    def replays(self) -> Iterator[tuple[BatchPlan, tuple[str, ...]]]:
        """The committed batches some staging sink has not made durable, oldest first, each
        with the sinks to deliver it to. A sink new to the pipeline starts at the last
        committed batch (it takes new batches only)."""
        if not self.sinks:
            return
        through = self._committed_through()
        stored = self.store.durable_marks(self.pipeline)
        new = {label: through for label in self.sinks if label not in stored}
        _check_owed(self.pipeline, stored, new, set(self.sinks), through)
        if new:
            self.store.mark_durable(self.pipeline, new, fence=self.fence())
        durable = {label: max(stored.get(label, through), _durable(s))
                   for label, s in self.sinks.items()}
        oldest = min(durable.values())
        for batch_id in range(oldest + 1, through + 1):
            targets = tuple(sorted(label for label, d in durable.items() if d < batch_id))
            plan = self.store.logged_plan(self.pipeline, batch_id)
            if plan is None:
                msg = (
                    f"pipeline {self.pipeline!r}: sink(s) {', '.join(targets)} had made output "
                    f"durable only through batch {batch_id - 1}, and the batch log no longer "
                    f"holds batch {batch_id} to deliver it again; their output lacks batches "
                    f"{batch_id}..{through}: reset the pipeline, or restore the store"
                )
                raise StoreError(msg)
            yield plan, targets

    def record(self) -> None:
        """Store what every staging sink reports as durable now."""
        if self.sinks:
            self.store.mark_durable(self.pipeline, self.marks(), fence=self.fence())

    def flush(self, labels: Iterable[str] | None = None) -> None:
        """Make everything staged durable and record it (the run ends gracefully; or, with
        ``labels``, those sinks after a batch replayed to them)."""
        for label, sink in self.sinks.items():
            if labels is None or label in labels:
                sink.flush()
        self.record()


def _check_owed(pipeline: str, stored: Mapping[str, int], new: Mapping[str, int],
                current: set[str], through: int) -> None:
    """Refuse a staging sink new to the pipeline while one that left it is owed batches:
    a renamed label would otherwise start at the last committed batch and leave the
    batches its old label had staged out of the output for good (:class:`OwedOutputError`).
    A sink that left and is owed nothing, or that comes back under its label (it gets what
    it missed), is fine."""
    owed = {label: mark for label, mark in stored.items()
            if label not in current and mark < through}
    if not new or not owed:
        return
    gone = ", ".join(f"{label!r} (batches {mark + 1}..{through})"
                     for label, mark in sorted(owed.items()))
    msg = (f"pipeline {pipeline!r}: sink {', '.join(map(repr, sorted(new)))} is new to the "
           f"pipeline, while {gone} left it before those committed batches were durable in "
           "its output; if you renamed a sink, give it its old label back and run once (a "
           "graceful end makes its output durable), then rename it; to leave those batches "
           "out, start over with --reset")
    raise OwedOutputError(msg)


def _durable(sink: Sink[Any, Any]) -> int:
    mark = sink.durable_batch()
    if mark is None:
        msg = f"{type(sink).__name__}.durable_batch() turned None after a first int"
        raise StoreError(msg)
    return mark
