"""SpannerStore: the production MetadataStore, in a Cloud Spanner database.

URL: ``spanner://projects/P/instances/I/databases/D[?table=NAME]``. The database must exist;
against the emulator (``SPANNER_EMULATOR_HOST`` set) a missing instance and database are
created. Two tables are created on first use, or by :func:`init_store` (``cdcflow metadata
init URL``):

- ``NAME`` (default ``CdcflowPartitions``): Beam's PartitionMetadata columns keyed by
  ``(PipelineName, PartitionToken)``, commit-timestamp ``*At`` columns, a ROW DELETION
  POLICY that drops a partition one day after ``FinishedAt``, and Beam's two indexes on
  ``(State, Watermark)`` and ``(CreatedAt, StartTimestamp)``.
- ``NAME_Batches``: the batch log keyed by ``(PipelineName, BatchId)``.

Every write is one read-write transaction. Retries: every operation (opening, schema,
reads, transactions) goes through one :class:`~cdcflow.backoff.RetryPolicy` whose predicate
is :func:`~cdcflow.spanner.retry.is_transient` (ABORTED: Spanner aborts one of two
transactions that conflict and the emulator any that overlap; UNAVAILABLE,
DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED), and every RPC has a deadline of ``call_timeout``
seconds and none of the stock client's own retries (only the emulator's instance and
database creation keep them). When the policy gives up, or on a permanent error, the
operation raises :class:`~cdcflow.errors.StoreError`.

A retried write may follow an attempt whose outcome is unknown (it committed, but the
answer was lost), so every write is safe to repeat: ``write_plan`` of the plan that is
pending already succeeds without changes, ``commit_batch`` of a committed batch returns
False (also when the lost attempt was the one that committed it), inserts skip present
tokens and deletes skip absent rows (their counts then miss the rows the lost attempt
changed), ``reset`` and the schema statements are idempotent.

The times the store stamps itself (scheduled, running, finished, committed) are Spanner
commit timestamps. google-cloud-spanner is imported lazily.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import StoreError
from cdcflow.metadata import _rules
from cdcflow.model import (
    BatchPlan,
    BatchRecord,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
)
from cdcflow.spanner import _store_schema as schema
from cdcflow.spanner._store_schema import DEFAULT_TABLE, parse_spanner_url, to_ns, to_spanner
from cdcflow.spanner.retry import status_name

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_RETRY",
    "DEFAULT_TABLE",
    "SpannerStore",
    "init_store",
    "parse_spanner_url",
]

#: Retries of every store operation. Many short first waits, because the emulator aborts
#: any overlapping transactions; at most 40 attempts, none starting after 120 s.
DEFAULT_RETRY = RetryPolicy(attempts=40, initial=0.01, maximum=1.0, deadline=120.0)
#: Deadline of each RPC in seconds; a call that exceeds it fails with DEADLINE_EXCEEDED and
#: is retried like any transient error.
DEFAULT_CALL_TIMEOUT = 30.0

# Stands for "the commit timestamp" among the integer times _rules.transition assigns.
_COMMIT_NOW = -(1 << 62) - 7

_T = TypeVar("_T")


def _at(ns: int | None, commit_ts: Any, ceiling: int | None = None) -> Any:
    """A time for a commit-timestamp column: the commit timestamp for _COMMIT_NOW, else the
    value, lowered to ``ceiling`` (Spanner's clock) since such columns refuse future times."""
    if ns is None:
        return None
    if ns == _COMMIT_NOW:
        return commit_ts
    return to_spanner(ns if ceiling is None else min(ns, ceiling))


class SpannerStore:
    """A :class:`~cdcflow.metadata.base.MetadataStore` in a Cloud Spanner database.

    ``database`` is ``projects/P/instances/I/databases/D``. ``client`` replaces the
    ``google.cloud.spanner.Client`` built for the project (which honours
    ``SPANNER_EMULATOR_HOST``). The batch log keeps the newest ``batch_log_size`` entries
    per pipeline. ``retry`` is the policy of every operation and ``call_timeout`` the
    deadline of every RPC (see the module docstring). ``aborted_attempts`` counts
    transaction attempts that Spanner aborted and this store retried.
    """

    def __init__(
        self,
        database: str,
        *,
        table: str = DEFAULT_TABLE,
        client: Any = None,
        batch_log_size: int = _rules.DEFAULT_BATCH_LOG_SIZE,
        retry: RetryPolicy = DEFAULT_RETRY,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        if not call_timeout > 0:
            msg = f"SpannerStore(call_timeout={call_timeout}): use a positive number of seconds"
            raise ValueError(msg)
        m = schema.DATABASE_PATH.match(database)
        if m is None or schema.TABLE_NAME.match(table) is None:
            raise _rules.url_error(
                f"spanner://{database}?table={table}",
                "write the database as projects/PROJECT/instances/INSTANCE/databases/DATABASE "
                "and the table as a Spanner identifier",
            )
        self._project, self._instance_id, self._database_id = m.groups()
        self.database_path = database
        self.table = table
        self.batch_table = schema.batch_table(table)
        self.retry = retry
        self.call_timeout = float(call_timeout)
        self.aborted_attempts = 0
        self._batch_log_size = _rules.check_log_size(batch_log_size)
        self._client = client
        self._db: Any = None
        self._schema_ready = False

    @classmethod
    def from_url(cls, url: str) -> SpannerStore:
        """``spanner://projects/P/instances/I/databases/D[?table=NAME]``."""
        path, table = parse_spanner_url(url)
        return cls(path, table=table)

    @property
    def url(self) -> str:
        query = "" if self.table == DEFAULT_TABLE else f"?table={self.table}"
        return f"spanner://{self.database_path}{query}"

    # -- retries -----------------------------------------------------------------------

    def _retrying(
        self,
        what: str,
        fn: Callable[[], _T],
        *,
        retry_if: Callable[[BaseException], bool] = schema.transient,
        fix: str = "",
    ) -> _T:
        """``fn()`` under the store's retry policy; an RPC error it gives up on becomes a
        StoreError saying ``what`` failed (and ``fix``, for permanent errors). StoreErrors
        (the contract's refusals) pass through at once; so do errors that are not RPC
        errors (bugs)."""
        from google.api_core.exceptions import GoogleAPICallError

        failed = 1

        def retried(retry: int, exc: BaseException, delay: float) -> None:
            nonlocal failed
            failed = retry + 1
            if status_name(exc) == "ABORTED":
                self.aborted_attempts += 1

        try:
            return self.retry.call(fn, retry_if=retry_if, on_retry=retried)
        except (GoogleAPICallError, schema.BrokenCall) as e:
            cause = e.error if isinstance(e, schema.BrokenCall) else e
            text = str(getattr(cause, "message", None) or cause)
            where = f"the Spanner store {self.url}: {what}"
            if not retry_if(e):
                msg = f"{where} failed: {text}"
                raise StoreError(f"{msg}; {fix}" if fix else msg) from e
            if status_name(e) == "ABORTED":
                msg = (
                    f"{where} was aborted {failed} times in a row by concurrent transactions; "
                    "make sure one run drives each pipeline, then retry"
                )
            else:
                msg = (
                    f"{where} kept failing after {failed} attempts "
                    f"({status_name(cause) or type(cause).__name__}: {text}); check that "
                    "Spanner is reachable and within its quota, then retry"
                )
            raise StoreError(msg) from e

    # -- connection and schema ---------------------------------------------------------

    def _database(self) -> Any:
        if self._db is None:
            self._db = self._retrying("connecting", self._open, fix="check the URL and access")
        return self._db

    def _open(self) -> Any:
        schema.use_session_pool_on_emulator()
        if self._client is None:
            from google.cloud import spanner

            self._client = spanner.Client(project=self._project, disable_builtin_metrics=True)
        db = self._client.instance(self._instance_id).database(self._database_id)
        admin = self._client.database_admin_api
        if not schema.database_exists(admin, self.database_path, self.call_timeout):
            if not os.environ.get("SPANNER_EMULATOR_HOST"):
                msg = (
                    f"the Spanner database {self.database_path} does not exist; create it "
                    f"(gcloud spanner databases create {self._database_id} "
                    f"--instance={self._instance_id}) or fix the store URL"
                )
                raise StoreError(msg)
            db = self._create_on_emulator()
        schema.bound_rpcs(db, self.call_timeout)
        return db

    def _create_on_emulator(self) -> Any:
        # Emulator only (tests, the demo): the stock calls and their own retries suffice.
        from google.api_core.exceptions import AlreadyExists

        config = f"{self._client.project_name}/instanceConfigs/emulator-config"
        instance = self._client.instance(
            self._instance_id, configuration_name=config, display_name=self._instance_id,
            node_count=1,
        )
        if not instance.exists():
            with contextlib.suppress(AlreadyExists):
                instance.create().result(120)
        db = instance.database(self._database_id)
        with contextlib.suppress(AlreadyExists):  # created meanwhile by another store
            db.create().result(120)
        return db

    def ensure_schema(self) -> list[str]:
        """Create the tables and indexes that are missing; return the names created."""
        db = self._database()
        admin = self._client.database_admin_api

        def busy(e: BaseException) -> bool:
            # Another store is changing the schema right now (the emulator refuses a second
            # concurrent schema change with FAILED_PRECONDITION); every statement is IF NOT
            # EXISTS, so trying again after it finished is safe.
            return schema.transient(e) or (
                status_name(e) == "FAILED_PRECONDITION" and "in progress" in str(e)
            )

        created = self._retrying(
            "creating the metadata tables",
            lambda: schema.ensure_schema(
                db, admin, self.database_path, self.table, self.call_timeout
            ),
            retry_if=busy,
            fix="the store needs a GoogleSQL-dialect database and permission to change its "
                "schema",
        )
        self._schema_ready = True
        return created

    def _ready(self) -> Any:
        db = self._database()
        if not self._schema_ready:
            self.ensure_schema()
        return db

    # -- transactions and queries ------------------------------------------------------

    def _transact(self, what: str, func: Callable[..., _T], *args: Any) -> _T:
        """``func(transaction, *args)`` in one read-write transaction, under the policy.

        ``func`` may run several times (a retry after ABORTED, or after an unknown
        outcome), so it must read what it depends on within the transaction. The client's
        own abort loop is switched off (``timeout_secs=0``). Metadata writes are excluded
        from change streams that allow it.
        """
        db = self._ready()

        def once() -> _T:
            result: _T = db.run_in_transaction(
                func, *args, timeout_secs=0, exclude_txn_from_change_streams=True
            )
            return result

        return self._retrying(what, once)

    def _query(self, what: str, sql: str, pipeline: str | None = None,
               limit: int | None = None) -> list[Any]:
        db = self._ready()
        from google.cloud.spanner import param_types

        params: dict[str, Any] = {}
        types: dict[str, Any] = {}
        if pipeline is not None:
            params["p"], types["p"] = pipeline, param_types.STRING
        if limit is not None:
            params["n"], types["n"] = limit, param_types.INT64

        def once() -> list[Any]:
            with db.snapshot() as snap:
                return list(snap.execute_sql(sql, params=params, param_types=types))

        return self._retrying(what, once)

    @staticmethod
    def _keys(pipeline: str, tokens: Iterable[str]) -> Any:
        from google.cloud.spanner import KeySet

        return KeySet(keys=[[pipeline, t] for t in tokens])  # type: ignore[no-untyped-call]

    def _read_partitions(
        self, txn: Any, pipeline: str, tokens: Iterable[str]
    ) -> dict[str, PartitionMetadata]:
        keys = list(dict.fromkeys(tokens))
        if not keys:
            return {}
        rows = txn.read(self.table, schema.PARTITION_COLUMNS[1:], self._keys(pipeline, keys))
        return {row[0]: schema.row_to_partition(row) for row in rows}

    def _put(self, txn: Any, pipeline: str, rows: Sequence[PartitionMetadata]) -> None:
        """Write the mutable columns of existing partitions."""
        from google.cloud.spanner import COMMIT_TIMESTAMP

        if rows:
            txn.update(
                self.table,
                ["PipelineName", "PartitionToken", "Watermark", "State", "ScheduledAt",
                 "RunningAt", "FinishedAt"],
                [(pipeline, p.token, to_spanner(p.watermark), str(p.state),
                  _at(p.scheduled_at, COMMIT_TIMESTAMP), _at(p.running_at, COMMIT_TIMESTAMP),
                  _at(p.finished_at, COMMIT_TIMESTAMP)) for p in rows],
            )

    # -- reads ---------------------------------------------------------------------------

    def partitions(self, pipeline: str) -> list[PartitionMetadata]:
        """All stored partitions of the pipeline, ordered by (start, token)."""
        sql = (
            f"SELECT {', '.join(schema.PARTITION_COLUMNS[1:])} FROM {self.table} "
            "WHERE PipelineName = @p ORDER BY StartTimestamp, PartitionToken"
        )
        rows = self._query("reading the partitions", sql, pipeline)
        return [schema.row_to_partition(row) for row in rows]

    def pending_plan(self, pipeline: str) -> BatchPlan | None:
        sql = (
            "SELECT BatchId, EndTimestamp, SliceTokens, SliceStarts, SliceEnds, PlannedAt "
            f"FROM {self.batch_table} WHERE PipelineName = @p AND CommittedAt IS NULL "
            "ORDER BY BatchId DESC LIMIT 1"
        )
        rows = self._query("reading the pending plan", sql, pipeline)
        return schema.row_to_plan(*rows[0]) if rows else None

    def last_batch_id(self, pipeline: str) -> int:
        sql = f"SELECT MAX(BatchId) FROM {self.batch_table} WHERE PipelineName = @p"
        rows = self._query("reading the last batch id", sql, pipeline)
        return int(rows[0][0]) if rows and rows[0][0] is not None else 0

    def batches(self, pipeline: str, limit: int = 20) -> list[BatchRecord]:
        """The newest ``limit`` entries of the batch log, newest first."""
        sql = (
            "SELECT BatchId, EndTimestamp, PlannedAt, CommittedAt, SliceCount, Records "
            f"FROM {self.batch_table} WHERE PipelineName = @p ORDER BY BatchId DESC LIMIT @n"
        )
        return [
            BatchRecord(int(b), to_ns(end), to_ns(planned), schema.opt_ns(committed), int(n),
                        int(r))
            for b, end, planned, committed, n, r in self._query(
                "reading the batch log", sql, pipeline, max(0, limit)
            )
        ]

    def pipelines(self) -> list[str]:
        sql = (
            f"SELECT PipelineName FROM {self.table} UNION DISTINCT "
            f"SELECT PipelineName FROM {self.batch_table}"
        )
        return sorted(row[0] for row in self._query("listing the pipelines", sql))

    # -- writes --------------------------------------------------------------------------

    def insert_partitions(self, pipeline: str, partitions: Sequence[PartitionMetadata]) -> int:
        """Insert the partitions whose tokens are absent; return how many were inserted."""
        if not partitions:
            return 0
        return self._transact("inserting partitions", self._insert, pipeline, partitions)

    def _insert(self, txn: Any, pipeline: str, partitions: Sequence[PartitionMetadata]) -> int:
        from google.cloud.spanner import COMMIT_TIMESTAMP, param_types

        tokens = list(dict.fromkeys(p.token for p in partitions))
        if not tokens:
            return 0
        # One round trip: the tokens already stored and Spanner's clock, which bounds the
        # caller's times (a client clock running ahead must not make the write fail).
        sql = (
            f"SELECT CURRENT_TIMESTAMP(), ARRAY(SELECT PartitionToken FROM {self.table} "
            "WHERE PipelineName = @p AND PartitionToken IN UNNEST(@t))"
        )
        strings = param_types.Array(param_types.STRING)  # type: ignore[no-untyped-call]
        ((now, stored),) = list(txn.execute_sql(
            sql, params={"p": pipeline, "t": tokens},
            param_types={"p": param_types.STRING, "t": strings},
        ))
        present, ceiling, rows = set(stored), to_ns(now), []
        for p in partitions:
            if p.token in present:
                continue
            present.add(p.token)
            rows.append((
                pipeline, p.token, list(p.parent_tokens), to_spanner(p.start), to_spanner(p.end),
                p.heartbeat_millis, str(p.state), to_spanner(p.watermark),
                _at(p.created_at, COMMIT_TIMESTAMP, ceiling),
                _at(p.scheduled_at, COMMIT_TIMESTAMP, ceiling),
                _at(p.running_at, COMMIT_TIMESTAMP, ceiling),
                _at(p.finished_at, COMMIT_TIMESTAMP, ceiling),
            ))
        if rows:
            txn.insert(self.table, schema.PARTITION_COLUMNS, rows)
        return len(rows)

    def write_plan(
        self,
        pipeline: str,
        plan: BatchPlan,
        transitions: Mapping[str, PartitionState],
    ) -> None:
        """Log the plan and apply the state transitions in one transaction (write-ahead).

        PlanConflictError if a batch is pending or ``plan.batch_id`` is not above every
        logged id, unless the pending plan equals ``plan`` (then nothing changes: a retry
        after a lost answer); StoreError for an unknown partition or a backward transition.
        A plan without ``planned_at`` is stamped with this host's clock, once, before any
        attempt, so that retries write the same plan.
        """
        if not plan.planned_at:
            plan = attrs.evolve(plan, planned_at=time.time_ns())
        self._transact("writing the plan", self._write_plan, pipeline, plan, dict(transitions))

    def _write_plan(
        self, txn: Any, pipeline: str, plan: BatchPlan, transitions: dict[str, PartitionState]
    ) -> None:
        from google.cloud.spanner import KeyRange, KeySet, param_types

        # The newest logged id, the pending one, and the oldest id that the batch log keeps
        # once this plan is added (older entries, all committed, are pruned).
        sql = (
            "SELECT MAX(BatchId), MAX(IF(CommittedAt IS NULL, BatchId, NULL)), "
            f"(SELECT BatchId FROM {self.batch_table} WHERE PipelineName = @p "
            "ORDER BY BatchId DESC LIMIT 1 OFFSET @k) "
            f"FROM {self.batch_table} WHERE PipelineName = @p"
        )
        ((last, pending, prune_to),) = list(txn.execute_sql(
            sql, params={"p": pipeline, "k": self._batch_log_size - 1},
            param_types={"p": param_types.STRING, "k": param_types.INT64},
        ))
        if pending is not None and _rules.is_pending(plan, self._logged(txn, pipeline, pending)):
            return
        _rules.check_new_plan(pipeline, plan, int(last or 0), pending)
        stored = self._read_partitions(txn, pipeline, transitions)
        changed = []
        for token, state in transitions.items():
            current = stored.get(token)
            if current is None:
                raise _rules.unknown_partition(pipeline, token)
            moved = _rules.transition(pipeline, current, state, _COMMIT_NOW)
            if moved != current:
                changed.append(moved)
        self._put(txn, pipeline, changed)
        if prune_to is not None:
            old = KeyRange(start_closed=[pipeline], end_closed=[pipeline, prune_to])  # type: ignore[no-untyped-call]
            txn.delete(self.batch_table, KeySet(ranges=[old]))  # type: ignore[no-untyped-call]
        txn.insert(self.batch_table, schema.BATCH_COLUMNS, [(
            pipeline, plan.batch_id, to_spanner(plan.end),
            [s.token for s in plan.slices], [to_spanner(s.start) for s in plan.slices],
            [to_spanner(s.end) for s in plan.slices], len(plan.slices),
            to_spanner(plan.planned_at), None, 0,
        )])

    def _logged(self, txn: Any, pipeline: str, batch_id: int) -> BatchPlan | None:
        """The plan logged as batch ``batch_id``, if any."""
        from google.cloud.spanner import KeySet

        key = KeySet(keys=[[pipeline, batch_id]])  # type: ignore[no-untyped-call]
        columns = ["BatchId", "EndTimestamp", "SliceTokens", "SliceStarts", "SliceEnds",
                   "PlannedAt"]
        rows = list(txn.read(self.batch_table, columns, key))
        return schema.row_to_plan(*rows[0]) if rows else None

    def commit_batch(
        self,
        pipeline: str,
        batch_id: int,
        updates: Sequence[PartitionUpdate],
        children: Sequence[PartitionMetadata],
        records: int = 0,
    ) -> bool:
        """Apply a batch's progress in one transaction; False if it was already committed
        (also when an attempt whose answer was lost committed it: it is applied once)."""
        return self._transact(
            "committing the batch", self._commit_batch, pipeline, batch_id, updates, children,
            records,
        )

    def _commit_batch(
        self,
        txn: Any,
        pipeline: str,
        batch_id: int,
        updates: Sequence[PartitionUpdate],
        children: Sequence[PartitionMetadata],
        records: int,
    ) -> bool:
        from google.cloud.spanner import COMMIT_TIMESTAMP, KeySet

        key = KeySet(keys=[[pipeline, batch_id]])  # type: ignore[no-untyped-call]
        log = list(txn.read(self.batch_table, ["CommittedAt"], key))
        if not log:
            raise _rules.not_planned(pipeline, batch_id)
        if log[0][0] is not None:
            return False
        rows = self._read_partitions(txn, pipeline, (u.token for u in updates))
        before = dict(rows)
        for u in updates:
            current = rows.get(u.token)
            if current is None:
                raise _rules.unknown_partition(pipeline, u.token)
            if u.watermark < current.watermark:
                raise _rules.regression(pipeline, u.token, current.watermark, u.watermark)
            current = attrs.evolve(current, watermark=u.watermark)
            if u.finished:
                current = _rules.transition(pipeline, current, PartitionState.FINISHED,
                                            _COMMIT_NOW)
            rows[u.token] = current
        self._put(txn, pipeline, [p for t, p in rows.items() if p != before[t]])
        self._insert(txn, pipeline, children)
        txn.update(self.batch_table, ["PipelineName", "BatchId", "CommittedAt", "Records"],
                   [(pipeline, batch_id, COMMIT_TIMESTAMP, records)])
        return True

    def delete_partitions(self, pipeline: str, tokens: Sequence[str]) -> int:
        """Remove the named partitions; return how many existed."""
        if not tokens:
            return 0
        return self._transact("deleting partitions", self._delete, pipeline, tokens)

    def _delete(self, txn: Any, pipeline: str, tokens: Sequence[str]) -> int:
        present = self._read_partitions(txn, pipeline, tokens)
        if present:
            txn.delete(self.table, self._keys(pipeline, present))
        return len(present)

    def reset(self, pipeline: str) -> None:
        """Forget everything stored for the pipeline."""
        self._transact("resetting the pipeline", self._reset, pipeline)

    def _reset(self, txn: Any, pipeline: str) -> None:
        from google.cloud.spanner import KeyRange, KeySet

        # A key range over the PipelineName prefix is one mutation, whatever the row count.
        prefix = KeyRange(start_closed=[pipeline], end_closed=[pipeline])  # type: ignore[no-untyped-call]
        everything = KeySet(ranges=[prefix])  # type: ignore[no-untyped-call]
        txn.delete(self.table, everything)
        txn.delete(self.batch_table, everything)

    def close(self) -> None:
        # Database.close() joins a maintenance thread that sleeps for minutes and Client has
        # no close(); the client's threads are daemons, so dropping the references suffices.
        self._db = None
        self._client = None

    def __repr__(self) -> str:
        return f"SpannerStore({self.url!r})"


def init_store(url: str) -> str:
    """Create the tables and indexes of the store at ``url`` if missing (idempotent).

    Returns a one-line account of what was done, for ``cdcflow metadata init URL``.
    """
    store = SpannerStore.from_url(url)
    try:
        created = store.ensure_schema()
    finally:
        store.close()
    if created:
        return f"created {', '.join(created)} in {store.database_path}"
    return f"{store.table} and {store.batch_table} already exist in {store.database_path}"
