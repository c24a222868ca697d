"""The MetadataStore protocol: partitions, watermarks and the batch log of pipelines.

State is keyed by pipeline name, so one store serves many pipelines. Positions are integer
nanoseconds since the epoch. Implementations: ``memory://`` (tests), ``sqlite:///path``
(embedded default), ``spanner://projects/P/instances/I/databases/D[?table=NAME]``.
Every implementation passes the contract suite in ``tests/metadata/test_contract.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from cdcflow.model import (
    BatchPlan,
    BatchRecord,
    Lease,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
)

__all__ = ["MetadataStore"]


@runtime_checkable
class MetadataStore(Protocol):
    """Durable progress of pipelines.

    Contract:
    - ``insert_partitions`` inserts each partition only if its token is absent for the
      pipeline (a merge child reported by several parents is stored once).
    - ``write_plan`` is the write-ahead step: in one transaction it logs the plan and applies
      the state transitions (setting ``scheduled_at`` / ``running_at``). It raises
      :class:`~cdcflow.errors.PlanConflictError` if another batch is pending (planned and not
      committed) or if ``plan.batch_id`` is not greater than every logged batch id (ids start
      at 1), except that writing the plan that is pending already (equal in every field,
      ``planned_at`` included) succeeds and changes nothing: a retry after an answer was lost
      stays correct. A plan with ``planned_at == 0`` is logged with the store's clock.
      States only move forward; a transition stamps the timestamps of the states it reaches
      (a jump from CREATED to RUNNING sets both); an unknown token or a backward transition
      raises :class:`~cdcflow.errors.StoreError` and nothing changes.
    - ``commit_batch`` applies a batch's progress in one transaction: watermarks (a smaller
      watermark than stored raises :class:`~cdcflow.errors.WatermarkRegressionError` and
      changes nothing), FINISHED states with ``finished_at``, insert-if-absent children, and
      marks the batch committed. Committing an already committed batch changes nothing and
      returns False (replay after a crash between store commit and the caller noticing).
      A batch never planned, or an update of an unknown partition, raises StoreError and
      nothing changes.
    - ``delete_partitions`` removes rows (garbage collection of finished partitions).

    Ownership (one run per pipeline; see :class:`~cdcflow.model.Lease`):

    - ``acquire_lease`` takes the pipeline's lease in one transaction and returns it with a
      fencing token larger than every token the pipeline had. It raises
      :class:`~cdcflow.errors.LeaseHeldError` naming the holder when the current lease is
      alive (not released, not expired by the store's clock), belongs to another run, and
      its token is not ``replace`` (``replace`` is how a caller that has confirmed the
      holder is gone takes over: only that exact lease is replaced, so two runs racing to
      take over cannot both win).
    - ``renew_lease`` extends the lease when its token is still current, else raises
      :class:`~cdcflow.errors.FencedError`; ``release_lease`` ends it (expiry 0, token kept)
      when current, and does nothing otherwise.
    - ``write_plan`` and ``commit_batch`` with ``fence=token`` raise FencedError and change
      nothing unless ``token`` is the pipeline's current lease token (checked in the same
      transaction as the write). ``fence=None`` checks nothing (tools and tests).
    - ``reset`` forgets partitions, the batch log and the stored source, but keeps the lease
      and the batch id floor: ``last_batch_id`` never goes back for a pipeline, so batch ids
      are never reused (sinks name output by them).
    - ``source`` / ``set_source``: the pipeline's source definition as text (JSON), stored on
      the first run so a later run can tell that the pipeline file changed.

    Sink durability (two-stage ack): a sink that stages batches before making them durable
    reports the batch through which its output is durable. ``commit_batch(durable=...)``
    and ``mark_durable`` record such marks (sink label -> batch id; a mark never goes back,
    a smaller value is ignored); ``durable_marks`` returns them. The batch log keeps every
    batch above the smallest mark (pruning skips them), so recovery can replay them to the
    sinks that had not made them durable (``logged_plan``). ``reset`` forgets the marks.

    Batch statistics: ``commit_batch(stats=...)`` stores what the engine measured of the
    batch (names in :data:`~cdcflow.model.BATCH_STATS`) with the batch log entry;
    ``batches`` returns them in :attr:`BatchRecord.stats`.

    Batch steps: ``commit_batch(state=...)`` stores the pipeline's BatchStep state (opaque
    bytes, the engine's pickle) in the same transaction as the batch's progress, replacing
    the stored one; ``state=None`` leaves it as it is. ``step_state`` returns it (None when
    none was stored). Committing an already committed batch does not store its state.
    ``reset`` forgets it.
    """

    @property
    def url(self) -> str: ...

    def partitions(self, pipeline: str) -> list[PartitionMetadata]:
        """All stored partitions of the pipeline, ordered by (start, token)."""
        ...

    def insert_partitions(self, pipeline: str, partitions: Sequence[PartitionMetadata]) -> int:
        """Insert the partitions whose tokens are absent; return how many were inserted."""
        ...

    def pending_plan(self, pipeline: str) -> BatchPlan | None:
        """The planned batch that has not been committed, if any."""
        ...

    def last_batch_id(self, pipeline: str) -> int:
        """The largest batch id the pipeline ever logged, resets included (0: none)."""
        ...

    def write_plan(
        self,
        pipeline: str,
        plan: BatchPlan,
        transitions: Mapping[str, PartitionState],
        *,
        fence: int | None = None,
    ) -> None: ...

    def commit_batch(
        self,
        pipeline: str,
        batch_id: int,
        updates: Sequence[PartitionUpdate],
        children: Sequence[PartitionMetadata],
        records: int = 0,
        *,
        fence: int | None = None,
        durable: Mapping[str, int] | None = None,
        state: bytes | None = None,
        stats: Mapping[str, float] | None = None,
    ) -> bool: ...

    def step_state(self, pipeline: str) -> bytes | None:
        """The BatchStep state stored with the last committed batch that carried one."""
        ...

    def delete_partitions(self, pipeline: str, tokens: Sequence[str]) -> int: ...

    def lease(self, pipeline: str) -> Lease | None:
        """The pipeline's current lease (alive or not), None if it never had one."""
        ...

    def acquire_lease(
        self, pipeline: str, owner: str, run_id: str, ttl_ns: int, *, replace: int | None = None
    ) -> Lease: ...

    def renew_lease(self, pipeline: str, lease: Lease, ttl_ns: int) -> Lease: ...

    def release_lease(self, pipeline: str, lease: Lease) -> None: ...

    def durable_marks(self, pipeline: str) -> dict[str, int]:
        """Sink label -> the batch through which that sink's output is durable."""
        ...

    def mark_durable(
        self, pipeline: str, marks: Mapping[str, int], *, fence: int | None = None
    ) -> None: ...

    def logged_plan(self, pipeline: str, batch_id: int) -> BatchPlan | None:
        """The plan of a logged batch (None when it was never logged or is pruned)."""
        ...

    def source(self, pipeline: str) -> str | None:
        """The stored source definition (None before the first run or after a reset)."""
        ...

    def set_source(self, pipeline: str, source: str) -> None: ...

    def batches(self, pipeline: str, limit: int = 20) -> list[BatchRecord]:
        """The newest ``limit`` entries of the batch log, newest first."""
        ...

    def pipelines(self) -> list[str]:
        """Names of the pipelines with stored state (a lease counts), sorted."""
        ...

    def reset(self, pipeline: str) -> None:
        """Forget everything stored for the pipeline (``cdcflow run --reset``)."""
        ...

    def close(self) -> None: ...
