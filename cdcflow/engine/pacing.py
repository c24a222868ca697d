"""How much commit time a batch plans: its span, paced by what tasks read.

:func:`~cdcflow.engine.lifecycle.plan_batch` ends a batch at ``T = min(now, low watermark +
span)``. Without ``max_task_bytes`` the span is ``max_batch_span``. With it the span follows
the data, so that the busiest task of a batch reads about ``max_task_bytes``: after each
batch the next span is ``max_task_bytes`` over the fastest rate a task read at (its bytes
over the commit time its slice covered), at most twice the span before it, never more than
``max_batch_span`` nor less than a millisecond. A pipeline's first batch spans
``FIRST_SPAN_NS`` (10 s, or ``max_batch_span`` if that is shorter), and the spans double
from there while tasks read little, up to ``max_batch_span`` (60 s by default). On a first
run the first batch queries only the stream's root partition (which names the first
partitions), so the first changes of a backlog of unknown density come in a 20 s span.
Fewer, wider batches are what make a sparse backlog fast: each batch queries every
partition again (on the emulator 0.3 to 1.5 CPU s a batch), so 40,000 single-row
transactions (a minute of commits) caught up in 9.1 to 9.5 s, against 13.8 s with a 10 s
cap (the emulator's CPU 9.5 to 10.3 s against 17.4 s, about what a reader that queries
every partition once costs it). A dense backlog is paced by its bytes either way.

A BatchStep (GroupTransactions, SchemaChanges) keeps what the low watermark has not passed,
and a partition that splits holds the watermark back at the split until its children are
read in the next batch: the state then holds the other partitions' changes since the split,
up to a whole batch of them. In a pipeline with BatchSteps the span is therefore also paced
so that all tasks of a batch read about ``STEP_BATCH_BYTES`` (32 MiB) together: the span is
at most that over the sum of the tasks' rates, which keeps the state well within what the
stores keep at the rates seen, however wide a sparse backlog's spans grow. Both aims follow
the rates of the batches before: a burst after a quiet spell passes them, by as much as
the span (grown while quiet) holds of it; ``max_batch_span`` bounds that.

The batch log keeps the span each batch left for the next, and the lease token of the run
that committed it. A run goes on from the last span, so a run that stopped and resumed
plans the same batches as one that did not; after a crash it halves the span once for each
run that crashed since that batch: the runs that owned the pipeline since and committed
nothing (their lease tokens lie between), and the run before when it did not release its
lease. A batch's plan is written only once its tasks have returned
(:mod:`cdcflow.engine.batch`), so the batch a run was reading when it died is planned
afresh, half as wide, and a batch that takes longer to read than runs live (a supervisor
that kills them every few seconds) gets narrower until one commits it; the spans then
double back, batch by batch, as they grow after a quiet spell. A span fixed by
``max_task_bytes=None`` is halved and doubles back the same way, up to ``max_batch_span``.

Why the span and not a cut inside a task: every partition of a batch is read up to the same
end T, which keeps a key's changes in order where keys move between live partitions
(MUTABLE_KEY_RANGE streams, the emulator), and a replay re-reads exactly the slices of its
plan. Bounding T bounds a batch (the work its replay repeats after a crash, the files it
writes, the time to its commit) with both rules intact: paced, a backlog of large changes
commits in batches of about ``max_task_bytes`` a task, and narrowed after crashes, in
batches that runs live to commit. The bound is an aim, not a cap: a span holds
what was committed in it (one commit timestamp is never split), and the rate can change.
"""

from __future__ import annotations

from collections.abc import Sequence

from cdcflow.engine.runner import TaskResult
from cdcflow.model import BatchPlan, BatchRecord, is_snapshot_token

__all__ = ["FIRST_SPAN_NS", "MIN_SPAN_NS", "STEP_BATCH_BYTES", "Pacer"]

#: The shortest span a paced batch plans.
MIN_SPAN_NS = 1_000_000
#: The span of a paced pipeline's first batch (at most ``max_batch_span``).
FIRST_SPAN_NS = 10_000_000_000
#: What all tasks of a batch read together, at most, in a pipeline with BatchSteps: half
#: the state the Spanner store keeps (``_store_limits.MAX_STATE_BYTES``).
STEP_BATCH_BYTES = 32 << 20


class Pacer:
    """The span of the next batch (see the module docstring); ``max_bytes`` None keeps it at
    ``max_span_ns``."""

    def __init__(self, max_span_ns: int, max_bytes: int | None = None,
                 span_ns: int | None = None, batch_bytes: int | None = None) -> None:
        if max_span_ns <= 0:
            msg = f"max_span_ns must be positive, got {max_span_ns}"
            raise ValueError(msg)
        if max_bytes is not None and max_bytes < 1:
            msg = f"max_bytes must be 1 or more (or None), got {max_bytes}"
            raise ValueError(msg)
        self.max_span_ns = max_span_ns
        self.max_bytes = max_bytes
        self.batch_bytes = batch_bytes
        if max_bytes is None:
            self.span_ns = max_span_ns
        elif span_ns is None:
            self.span_ns = min(max_span_ns, FIRST_SPAN_NS)
        else:
            self.span_ns = min(max_span_ns, max(MIN_SPAN_NS, span_ns))

    @classmethod
    def resume(cls, max_span_ns: int, max_bytes: int | None, log: Sequence[BatchRecord],
               batch_bytes: int | None = None, lease_token: int | None = None,
               crashed: bool = False) -> Pacer:
        """The pacer of a run whose pipeline has the batch ``log`` (newest first): it goes
        on from the span the newest committed batch left (a first batch's without one),
        halved once for every run that crashed since that batch (see the module
        docstring): the runs that owned the pipeline since and committed nothing
        (``lease_token``, this run's, against the one the batch was committed with), and
        the last run when it did not release its lease (``crashed``). ``batch_bytes``: what
        all tasks of a batch read together, at most (None: no bound; STEP_BATCH_BYTES for a
        pipeline with BatchSteps)."""
        for entry in log:
            if entry.committed_at is not None:
                left = entry.stats.get("next_span_ns")
                pacer = cls(max_span_ns, max_bytes, None if left is None else int(left),
                            batch_bytes)
                committed_with = entry.stats.get("lease_token")
                if lease_token is not None and committed_with is not None:
                    # the runs between, which committed nothing, ended by a crash too
                    pacer.narrow(lease_token - int(committed_with) - 1 + crashed)
                return pacer
        return cls(max_span_ns, max_bytes, batch_bytes=batch_bytes)

    def narrow(self, runs: int) -> None:
        """Halve the span once for each of ``runs`` runs that committed nothing (at least
        :data:`MIN_SPAN_NS`); :meth:`observe` grows it again."""
        if runs > 0:
            self.span_ns = max(MIN_SPAN_NS, self.span_ns >> min(runs, 62))

    def observe(self, plan: BatchPlan, results: Sequence[TaskResult]) -> None:
        """Set the next span from what ``plan``'s tasks read (``results``). Snapshot tasks
        (a table's rows, not commit time) do not count."""
        if self.max_bytes is None:  # a fixed span (narrowed after runs that failed)
            self.span_ns = min(self.max_span_ns, 2 * self.span_ns)
            return
        starts = {s.token: s.start for s in plan.slices if not is_snapshot_token(s.token)}
        read, covered = 0, 1  # the fastest task's bytes and commit time (ns)
        rates = 0.0  # all tasks' bytes per ns of commit time
        for r in results:
            start = starts.get(r.token)
            if start is None or r.position <= start:
                continue
            rates += r.bytes / (r.position - start)
            if r.bytes * covered > read * (r.position - start):
                read, covered = r.bytes, r.position - start
        grown = 2 * self.span_ns
        span = grown if read == 0 else min(grown, self.max_bytes * covered // read)
        if self.batch_bytes is not None and rates > 0:
            span = min(span, round(self.batch_bytes / rates))
        self.span_ns = min(self.max_span_ns, max(MIN_SPAN_NS, span))
