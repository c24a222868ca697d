"""SpannerStore: the production MetadataStore, in a Cloud Spanner database.

URL: ``spanner://projects/P/instances/I/databases/D[?table=NAME]``. The database must exist;
against the emulator (``SPANNER_EMULATOR_HOST`` set) a missing instance and database are
created. GoogleSQL and PostgreSQL-dialect databases both work: the store reads the dialect
from the database and speaks it (:mod:`cdcflow.spanner._store_sql`). Four tables are
created on first use, or by :func:`init_store` (``cdcflow metadata init URL``); a store
made with ``create=False`` (``cdcflow status``) creates and changes nothing, on the
emulator too: its first operation raises StoreNotFoundError when the instance, the
database or the tables are missing, and StoreSetupError when they are of an earlier
version (``check_schema``).

- ``NAME`` (default ``CdcflowPartitions``): Beam's PartitionMetadata columns keyed by
  ``(PipelineName, PartitionToken)``, commit-timestamp ``*At`` columns, Beam's two indexes
  on ``(State, Watermark)`` and ``(CreatedAt, StartTimestamp)``, and a row deletion policy
  (TTL) on the nullable ``GcAfter`` column.
- ``NAME_Batches``: the batch log keyed by ``(PipelineName, BatchId)``, with each
  committed batch's statistics (``Stats``, JSON text).
- ``NAME_Pipelines``: one record per pipeline: the ownership lease and its fencing token,
  the batch id floor kept across resets, the source definition, each sink's durable batch
  (two-stage ack; the batch log keeps every batch above the smallest mark).
- ``NAME_StepState``: the BatchSteps' state of each pipeline as of its last committed
  batch, in chunks of 8 MiB keyed by ``(PipelineName, Chunk)`` (created on open in a
  database of an earlier version).

A database of an earlier version is upgraded in place when a store opens it (missing
tables and columns added, the TTL moved to ``GcAfter``; see ``ensure_schema``).

The TTL never deletes what resumption needs. Beam's table drops every FINISHED row a day
after it finished, the leaves of a finished pipeline included, so re-running a completed
bounded pipeline would start it over. Here the policy is on ``GcAfter``, which no store
operation sets: the engine collects garbage itself (``delete_partitions``, called with
``engine.lifecycle.gc_candidates``, which always keeps the partitions that read furthest),
and deletes them at once. ``GcAfter`` is for operators: setting it on rows (e.g. every row
of an abandoned pipeline) has Spanner remove them a day later in the background, outside
any transaction's mutation limit. docs/spanner-store.md explains the choice.

Mutation limit. Spanner refuses a commit of more than 80,000 mutations. Every transaction
of this store is kept under ``mutation_budget`` (default 40,000) counted by the rule in
:mod:`cdcflow.spanner._store_limits`. An operation that would exceed it runs as several
transactions: ``insert_partitions``, ``delete_partitions`` (idempotent per row) and
``reset`` (which marks the pipeline as resetting until it is done, so a half-reset
pipeline is refused, not resumed) simply continue where the previous one stopped;
``write_plan`` and ``commit_batch`` first apply their partition updates in several
transactions and then log the plan / mark the batch committed in a final one that checks
the fence and the batch's state again. Those updates are idempotent (states and watermarks
only move forward, children are inserted if absent) and the batch stays pending until the
final transaction, so a crash in between is repaired by the replay that a pending batch
causes anyway. docs/spanner-store.md has the arithmetic and the argument.

Retries: every operation goes through one :class:`~cdcflow.backoff.RetryPolicy` whose
predicate is :func:`~cdcflow.spanner.retry.is_transient` (ABORTED, which the emulator
answers to any overlapping transactions, UNAVAILABLE, DEADLINE_EXCEEDED,
RESOURCE_EXHAUSTED); every RPC has a deadline of ``call_timeout`` seconds (the lease's
operations: ``LEASE_CALL_TIMEOUT``, so that a dead connection is replaced before the lease
lapses) and none of the stock client's own retries; a lease renewal or release retries for
at most ``LEASE_RETRY_DEADLINE``. Once the run using the store is stopping, a failed call
is not retried and a call that does not answer is given up after ``STOP_PATIENCE``
(:mod:`cdcflow.spanner._store_retry`). When the policy gives up, or on a
permanent error, the operation raises :class:`~cdcflow.errors.StoreError`.

A retried write may follow an attempt whose outcome is unknown (it committed, but the
answer was lost), so every write is safe to repeat: ``write_plan`` of the plan that is
pending already succeeds without changes, ``commit_batch`` of a committed batch returns
False (also when the lost attempt was the one that committed it), inserts skip present
tokens and deletes skip absent rows (their counts then miss the rows the lost attempt
changed), ``reset`` and the schema statements are idempotent, and a lease acquired by a
lost attempt is the caller's own (same run id), so the retry takes it again.

The times the store stamps itself (scheduled, running, finished, committed) are Spanner
commit timestamps; lease times are Spanner's clock (``CURRENT_TIMESTAMP``), so every host
judges a lease's expiry by the same clock. google-cloud-spanner is imported lazily.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import StoreError, StoreNotFoundError, StoreSetupError
from cdcflow.metadata import _rules
from cdcflow.model import (
    BatchPlan,
    BatchRecord,
    Lease,
    PartitionMetadata,
    PartitionState,
    PartitionUpdate,
)
from cdcflow.spanner import _store_limits as limits
from cdcflow.spanner import _store_schema as schema
from cdcflow.spanner import _store_txn as steps
from cdcflow.spanner._store_retry import StoreRetries
from cdcflow.spanner._store_schema import DEFAULT_TABLE, parse_spanner_url, to_ns
from cdcflow.spanner._store_sql import Dialect, StoreSql, Tables
from cdcflow.spanner.connection import Connection, connection_api
from cdcflow.spanner.retry import status_name
from cdcflow.spanner.translate import error_text, unreachable
from cdcflow.spanner.transport import emulator_host, endpoint, new_client

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_MUTATION_BUDGET",
    "DEFAULT_RETRY",
    "DEFAULT_TABLE",
    "SpannerStore",
    "init_store",
    "parse_spanner_url",
]

#: Retries of every store operation. Many short first waits, because the emulator aborts
#: any overlapping transactions; none starting after 120 s (the deadline is the bound: 40
#: attempts of full-jitter backoff capped at 1 s last only about 20 s, less than an outage
#: the store should ride out).
DEFAULT_RETRY = RetryPolicy(attempts=1000, initial=0.01, maximum=1.0, deadline=120.0)
#: Seconds a refused connection is retried at the first contact before the store gives up.
CONNECT_PATIENCE = 3.0
#: Deadline of each RPC in seconds; a call that exceeds it fails with DEADLINE_EXCEEDED and
#: is retried like any transient error.
DEFAULT_CALL_TIMEOUT = 30.0
#: Deadline of each RPC of the lease's operations (a row read, a one-row commit): a lease
#: renewed every third of its time to live (10 s of the default 30 s) must notice a dead
#: connection and go out on a new one before it lapses, not after ``call_timeout``.
LEASE_CALL_TIMEOUT = 5.0
#: How long a lease renewal or release retries (at most; the store's policy may be
#: shorter): a renewal that fails is tried again at the next heartbeat, and a release that
#: fails leaves the lease to lapse by itself. Neither keeps a run that ends waiting on a
#: store that does not answer for the policy's whole deadline.
LEASE_RETRY_DEADLINE = 10.0
#: Mutations one transaction may use (Spanner allows 80,000 per commit).
DEFAULT_MUTATION_BUDGET = limits.DEFAULT_MUTATION_BUDGET

_T = TypeVar("_T")

# Set while this thread renews or releases a lease (LEASE_RETRY_DEADLINE applies).
_LEASE_OP = threading.local()

_log = logging.getLogger("cdcflow.store")


@contextlib.contextmanager
def _lease_op() -> Iterator[None]:
    _LEASE_OP.active = True
    try:
        yield
    finally:
        _LEASE_OP.active = False



class SpannerStore:
    """A :class:`~cdcflow.metadata.base.MetadataStore` in a Cloud Spanner database.

    ``database`` is ``projects/P/instances/I/databases/D``. ``client`` replaces the
    ``google.cloud.spanner.Client`` built for the project (which honours
    ``SPANNER_EMULATOR_HOST``). The batch log keeps the newest ``batch_log_size`` entries
    per pipeline. ``retry`` is the policy of every operation and ``call_timeout`` the
    deadline of every RPC; ``mutation_budget`` bounds the mutations of every transaction
    (see the module docstring). ``aborted_attempts`` counts transaction attempts that
    Spanner aborted and this store retried; ``transactions`` counts the read-write
    transactions it committed. ``create=False``: the store creates nothing (no instance,
    database, table or column) and requires them all (see the module docstring).
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
        mutation_budget: int = DEFAULT_MUTATION_BUDGET,
        create: bool = True,
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
        self.tables = Tables.named(table)
        self.batch_table = self.tables.batches
        self.pipeline_table = self.tables.pipelines
        self.retry = retry
        self.call_timeout = float(call_timeout)
        self.mutation_budget = limits.check_budget(mutation_budget)
        self.create = create
        self.transactions = 0
        self._batch_log_size = _rules.check_log_size(batch_log_size)
        self._client = client
        self._own_client = client is None  # made from the environment (see _open)
        self._db: Any = None
        self._data: Connection | None = None  # what data RPCs go out on (bound_rpcs)
        self._admin: Connection | None = None  # the database admin API (schema changes)
        self._sql: StoreSql | None = None
        self._schema_ready = False
        self._retries = StoreRetries(self.url)

    @classmethod
    def from_url(cls, url: str, *, create: bool = True) -> SpannerStore:
        """``spanner://projects/P/instances/I/databases/D[?table=NAME]``; ``create``: as the
        constructor's."""
        path, table = parse_spanner_url(url)
        return cls(path, table=table, create=create)

    @property
    def url(self) -> str:
        query = "" if self.table == DEFAULT_TABLE else f"?table={self.table}"
        return f"spanner://{self.database_path}{query}"

    # -- retries -----------------------------------------------------------------------

    @property
    def aborted_attempts(self) -> int:
        return self._retries.aborted_attempts

    def set_stopping(self, stopping: Callable[[], bool] | None) -> None:
        """While ``stopping()`` is True (a run was asked to stop), an operation that fails
        is not tried again: it raises its StoreError at once, so that a stop during an
        outage does not wait out the retry policy (up to its deadline). None: always
        retry. The engine sets it for the length of a run."""
        self._retries.set_stopping(stopping)

    def _retrying(
        self, what: str, fn: Callable[[], _T], *,
        retry_if: Callable[[BaseException], bool] = schema.transient, fix: str = "",
        quiet_if: Callable[[BaseException], bool] = lambda exc: False,
    ) -> _T:
        """``fn()`` under the store's retry policy (see :mod:`._store_retry`)."""
        policy = self.retry
        if getattr(_LEASE_OP, "active", False):
            deadline = min(LEASE_RETRY_DEADLINE, self.retry.deadline or math.inf)
            policy = attrs.evolve(policy, deadline=deadline)
        return self._retries.call(policy, what, fn, retry_if=retry_if, fix=fix,
                                  quiet_if=quiet_if)

    # -- connection and schema ---------------------------------------------------------

    def _database(self) -> Any:
        if self._db is None:
            began = time.monotonic()

            def refused(e: BaseException) -> bool:
                return unreachable(e.error if isinstance(e, schema.BrokenCall) else e)

            def retry_if(e: BaseException) -> bool:
                # a server that refuses for seconds at the first contact is not there
                if refused(e) and time.monotonic() - began > CONNECT_PATIENCE:
                    return False
                return schema.transient(e)

            try:
                # (no warning of retries while it refuses: it comes up, or that is the error)
                self._db = self._retrying("connecting", self._open, retry_if=retry_if,
                                          fix="check the URL and access", quiet_if=refused)
            except StoreSetupError:
                raise
            except StoreError as e:  # the first contact: the store cannot be used at all
                cause = e.__cause__
                if isinstance(cause, schema.BrokenCall):
                    cause = cause.error
                if cause is not None and unreachable(cause) and self._own_client:
                    msg = (f"the Spanner store {self.url}: cannot reach {endpoint()}: "
                           f"{error_text(cause)[:160]}; is it running, and is the host:port "
                           "right?")
                    raise StoreSetupError(msg) from cause
                raise StoreSetupError(str(e)) from cause
        return self._db

    def _open(self) -> Any:
        schema.use_session_pool_on_emulator()
        if self._client is None:
            self._client = new_client(self._project)  # no credentials: one line, exit 2
        db = self._client.instance(self._instance_id).database(self._database_id)
        missing = self._admin_call(
            lambda admin: schema.missing_database(admin, self.database_path, self.call_timeout)
        )
        if missing is not None:
            if not self.create:
                raise self._not_found(missing)
            if emulator_host() is None:
                msg = (
                    f"the Spanner database {self.database_path} does not exist; create it "
                    f"(gcloud spanner databases create {self._database_id} "
                    f"--instance={self._instance_id}) or fix the store URL"
                )
                raise StoreError(msg)
            db = self._create_on_emulator()
        if self._data is None:  # kept across attempts: a retry goes out on a new one
            self._data = schema.data_connection(db, self._client, f"the Spanner store {self.url}",
                                                self.call_timeout)
        schema.bound_rpcs(db, self.call_timeout, self._data)
        self._sql = StoreSql(schema.detect_dialect(db), self.tables)
        return db

    def _admin_call(self, fn: Callable[[Any], _T]) -> _T:
        """``fn(admin API)``; a call past its deadline retires the admin API's connection
        (see :mod:`cdcflow.spanner.connection`), as the data RPCs' (``bound_rpcs``)."""
        client = self._client
        if self._admin is None:
            emulator = client.instance(self._instance_id).emulator_host

            def open_admin(n: int) -> Any:
                if n == 0:
                    return client.database_admin_api
                return connection_api(client, emulator, admin=True)

            self._admin = Connection(open_admin, f"the Spanner store {self.url} (schema)",
                                     self.call_timeout)
        admin = self._admin.api()
        try:
            return fn(admin)
        except Exception as exc:
            self._admin.failed(admin, exc)
            raise

    def _create_on_emulator(self) -> Any:
        # Emulator only (tests, the demo): the stock calls and their own retries suffice.
        from google.api_core.exceptions import AlreadyExists

        config = f"{self._client.project_name}/instanceConfigs/emulator-config"
        instance = self._client.instance(
            self._instance_id, configuration_name=config, display_name=self._instance_id,
            node_count=1,
        )
        made = []
        if not instance.exists():
            with contextlib.suppress(AlreadyExists):
                instance.create().result(120)
                made.append(f"instance {self._instance_id!r}")
        db = instance.database(self._database_id)
        with contextlib.suppress(AlreadyExists):  # created meanwhile by another store
            db.create().result(120)
            made.append(f"database {self._database_id!r}")
        if made:  # a typo in the URL would otherwise give an empty store without a word
            # a new instance is the likelier typo: said louder
            _log.log(logging.WARNING if len(made) == 2 else logging.INFO,
                     "the metadata store %s did not exist on the emulator at %s: created its "
                     "%s (Cloud Spanner refuses a missing instance or database)", self.url,
                     emulator_host(), " and ".join(made))
        return db

    def _not_found(self, missing: str) -> StoreNotFoundError:
        """The error of a store made with ``create=False`` whose ``missing`` part (an
        instance, a database, a table) is not there."""
        if missing == "instance":
            instance = self.database_path.rsplit("/databases/", 1)[0]
            return StoreNotFoundError(
                f"{self.url}: the Spanner instance {instance} does not exist (nothing was "
                "created); check the URL")
        if missing == "database":
            return StoreNotFoundError(
                f"{self.url}: the Spanner database {self.database_path} does not exist "
                "(nothing was created); check the URL, or create the store with `cdcflow "
                f"metadata init {self.url}` (or a run of a pipeline)")
        return StoreNotFoundError(
            f"{self.url} holds no cdcflow metadata (no table {missing}): check the URL and "
            f"its table= prefix, or run a pipeline (or `cdcflow metadata init {self.url}`) to "
            "create it")

    @property
    def dialect(self) -> Dialect:
        """The database's dialect, ``GOOGLE_STANDARD_SQL`` or ``POSTGRESQL`` (connects)."""
        return self._statements().dialect

    def _statements(self) -> StoreSql:
        self._database()
        assert self._sql is not None
        return self._sql

    def ensure_schema(self) -> list[str]:
        """Create the tables and indexes that are missing and upgrade those of an earlier
        version; return what was created (tables, indexes, columns, the policy)."""
        db = self._database()
        sql = self._statements()

        def busy(e: BaseException) -> bool:
            # Another store is changing the schema right now (the emulator refuses a second
            # concurrent schema change with FAILED_PRECONDITION); every statement is
            # idempotent, so trying again after it finished is safe.
            return schema.transient(e) or (
                status_name(e) == "FAILED_PRECONDITION" and "in progress" in str(e)
            )

        created = self._retrying(
            "creating the metadata tables",
            lambda: self._admin_call(lambda admin: schema.ensure_schema(
                db, admin, self.database_path, sql, self.call_timeout)),
            retry_if=busy,
            fix="the store needs permission to change the database's schema",
        )
        self._schema_ready = True
        return created

    def check_schema(self) -> None:
        """Make sure the tables and indexes exist as this version writes them, changing
        nothing: StoreNotFoundError when the partition table is missing (the URL names
        another database, or a ``?table=`` nothing was stored under), StoreSetupError
        naming the upgrade when only parts are (tables of an earlier version)."""
        db = self._database()
        sql = self._statements()
        _, lacking = self._retrying(
            "reading the metadata tables",
            lambda: schema.schema_changes(db, self.database_path, sql),
            fix="the store needs permission to read the database's information schema",
        )
        if self.tables.partitions in lacking:
            raise self._not_found(self.tables.partitions)
        if lacking:
            msg = (f"{self.url} holds cdcflow metadata of an earlier version, or in part (it "
                   f"lacks {', '.join(lacking)}): complete it with `cdcflow metadata init "
                   f"{self.url}` (or a run of a pipeline), then try again")
            raise StoreSetupError(msg)
        self._schema_ready = True

    def _ready(self) -> tuple[Any, StoreSql]:
        db = self._database()
        if not self._schema_ready:
            if self.create:
                self.ensure_schema()
            else:
                self.check_schema()
        return db, self._statements()

    # -- transactions and queries ------------------------------------------------------

    def _transact(self, what: str, func: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``func(transaction, sql, *args, **kwargs)`` in one read-write transaction, under
        the policy.

        ``func`` may run several times (a retry after ABORTED, or after an unknown
        outcome), so it must read what it depends on within the transaction. The client's
        own abort loop is switched off (``timeout_secs=0``). Metadata writes are excluded
        from change streams that allow it.
        """
        db, sql = self._ready()

        def once() -> _T:
            # The client library marks a per-thread "transaction running" flag before it
            # checks out a session, outside its try/finally: a session checkout that fails
            # (a reset connection) leaves the flag set, and every later transaction on this
            # thread fails with "Spanner does not support nested transactions". This store
            # never nests transactions, so the flag is stale whenever we get here.
            local = getattr(db, "_local", None)
            if local is not None:
                local.transaction_running = False
            result: _T = db.run_in_transaction(
                func, sql, *args, timeout_secs=0, exclude_txn_from_change_streams=True,
                **kwargs,
            )
            return result

        result = self._retrying(what, once)
        self.transactions += 1
        return result

    def _read(self, what: str, func: Callable[[Any, StoreSql], _T]) -> _T:
        """``func(snapshot, sql)`` on one consistent snapshot, under the policy."""
        db, sql = self._ready()

        def once() -> _T:
            with db.snapshot(multi_use=True) as snap:
                return func(snap, sql)

        return self._retrying(what, once)

    def _rows(self, what: str, query: Callable[[StoreSql], Any]) -> list[Any]:
        rows: list[Any] = self._read(what, lambda snap, sql: query(sql).run(snap))
        return rows

    # -- reads ---------------------------------------------------------------------------

    def partitions(self, pipeline: str) -> list[PartitionMetadata]:
        """All stored partitions of the pipeline, ordered by (start, token).

        Raises StoreError while a reset of the pipeline is unfinished (see ``reset``)."""
        rows = self._rows("reading the partitions",
                          lambda sql: sql.partitions(pipeline, schema.PARTITION_COLUMNS[1:]))
        if any(row[-1] for row in rows):
            raise steps.resetting_error(pipeline)
        return [schema.row_to_partition(row[:-1]) for row in rows]

    def pending_plan(self, pipeline: str) -> BatchPlan | None:
        rows = self._rows("reading the pending plan", lambda sql: sql.pending_plan(pipeline))
        return schema.row_to_plan(*rows[0]) if rows else None

    def last_batch_id(self, pipeline: str) -> int:
        """The largest batch id the pipeline ever logged, resets included (0: none)."""
        ((last, floor),) = self._rows("reading the last batch id",
                                      lambda sql: sql.last_batch_id(pipeline))
        return max(int(last or 0), int(floor or 0))

    def batches(self, pipeline: str, limit: int = 20) -> list[BatchRecord]:
        """The newest ``limit`` entries of the batch log, newest first."""
        rows = self._rows("reading the batch log",
                          lambda sql: sql.batches(pipeline, max(0, limit)))
        return [
            BatchRecord(int(b), to_ns(end), to_ns(planned), schema.opt_ns(committed), int(n),
                        int(r), _rules.parse_stats(stats))
            for b, end, planned, committed, n, r, stats in rows
        ]

    def pipelines(self) -> list[str]:
        """Pipelines with partitions, a batch log or a record (a lease, a batch id floor, a
        source definition), sorted."""
        return sorted(row[0] for row in self._rows("listing the pipelines",
                                                    lambda sql: sql.pipelines()))

    def lease(self, pipeline: str) -> Lease | None:
        """The pipeline's current lease (alive or not), None if it never had one."""
        with schema.call_deadline(LEASE_CALL_TIMEOUT):
            return self._read("reading the lease",
                              lambda snap, sql: steps.read_record(snap, sql, pipeline).lease)

    def source(self, pipeline: str) -> str | None:
        """The stored source definition (None before the first run or after a reset)."""
        return self._read("reading the source definition",
                          lambda snap, sql: steps.read_record(snap, sql, pipeline).source)

    # -- writes --------------------------------------------------------------------------

    def insert_partitions(self, pipeline: str, partitions: Sequence[PartitionMetadata]) -> int:
        """Insert the partitions whose tokens are absent; return how many were inserted.

        Many partitions take several transactions (each inserts a part, skipping present
        tokens, so a retry after a crash inserts what is left)."""
        unique: dict[str, PartitionMetadata] = {}
        for p in partitions:
            unique.setdefault(p.token, p)
        runs = limits.chunks([(p, limits.INSERT_PARTITION) for p in unique.values()],
                             self.mutation_budget)
        return sum(
            self._transact("inserting partitions", steps.insert, pipeline, run)
            for run in runs if run
        )

    def write_plan(
        self,
        pipeline: str,
        plan: BatchPlan,
        transitions: Mapping[str, PartitionState],
        *,
        fence: int | None = None,
    ) -> None:
        """Log the plan and apply the state transitions (write-ahead).

        PlanConflictError if a batch is pending or ``plan.batch_id`` is not above every
        logged id (or the floor), unless the pending plan equals ``plan`` (then nothing
        changes: a retry after a lost answer); StoreError for an unknown partition or a
        backward transition; FencedError unless ``fence`` is None or the current lease
        token. A plan without ``planned_at`` is stamped with this host's clock, once,
        before any attempt, so that retries write the same plan.

        One transaction, unless the transitions exceed the mutation budget: then they are
        applied in several transactions, each checking the fence and the log again, and
        the plan is logged by the last (see the module docstring).
        """
        if not plan.planned_at:
            plan = attrs.evolve(plan, planned_at=time.time_ns())
        moves = dict(transitions)
        runs = limits.chunks([(t, limits.UPDATE_PARTITION) for t in moves],
                             self.mutation_budget - limits.LOG_PLAN)
        for i, run in enumerate(runs):
            # The first step validates every transition, so a refusal changes nothing.
            checked = moves if i == 0 else {t: moves[t] for t in run}
            go_on = self._transact(
                "writing the plan", steps.plan_step, self._batch_log_size, pipeline, plan,
                checked, set(run), final=i == len(runs) - 1, fence=fence,
            )
            if not go_on:
                return

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
    ) -> bool:
        """Apply a batch's progress, and raise the sinks' ``durable`` marks and replace the
        BatchSteps' ``state`` with it; False if it was already committed (also when an
        attempt whose answer was lost committed it: it is applied once).

        The state is stored in chunks of 8 MiB (a BYTES cell holds at most 10 MiB) in the
        final transaction; a state over 64 MiB is refused with a StoreError before anything
        is written (Spanner refuses commits over 100 MB).

        One transaction, unless the progress exceeds the mutation budget: then the
        partition updates and children are written in several transactions while the batch
        stays pending, and the last marks it committed (see the module docstring). Every
        transaction checks the fence, so a fenced-out run stops at its next step and the
        batch stays pending for the run that owns the pipeline.
        """
        items: list[tuple[PartitionUpdate | PartitionMetadata, int]] = [
            (u, limits.UPDATE_PARTITION) for u in updates
        ]
        items += [(c, limits.INSERT_PARTITION) for c in children]
        reserved = limits.MARK_COMMITTED
        if state is not None:
            reserved += limits.state_mutations(pipeline, len(state))
        runs = limits.chunks(items, self.mutation_budget - reserved)
        for i, run in enumerate(runs):
            mine = [u for u in run if isinstance(u, PartitionUpdate)]
            born = [c for c in run if isinstance(c, PartitionMetadata)]
            done = self._transact(
                "committing the batch", steps.commit_step, pipeline, batch_id,
                list(updates) if i == 0 else mine, {u.token for u in mine}, born, records,
                final=i == len(runs) - 1, fence=fence, durable=dict(durable or {}),
                state=state, stats=_rules.stats_text(stats),
            )
            if done is not None:
                return done
        msg = "the last step of commit_batch marks the batch"
        raise AssertionError(msg)

    def delete_partitions(self, pipeline: str, tokens: Sequence[str]) -> int:
        """Remove the named partitions; return how many existed."""
        runs = limits.chunks([(t, limits.DELETE_PARTITION) for t in dict.fromkeys(tokens)],
                             self.mutation_budget)
        return sum(
            self._transact("deleting partitions", steps.delete, pipeline, run)
            for run in runs if run
        )

    def reset(self, pipeline: str) -> None:
        """Forget the pipeline's partitions, batch log, source and durable marks; keep its
        lease and raise its batch id floor to the last batch id, so batch ids are never
        reused.

        More partitions than one transaction can delete take several; until the last, the
        pipeline is marked as resetting and ``partitions`` and the writes refuse it with a
        StoreError saying to run the reset again (it goes on where it stopped)."""
        rows = (self.mutation_budget - limits.PIPELINE_ROW - 2) // limits.DELETE_PARTITION
        while not self._transact("resetting the pipeline", steps.reset_step, pipeline, rows):
            pass

    # -- ownership and the source definition -----------------------------------------------

    def acquire_lease(
        self, pipeline: str, owner: str, run_id: str, ttl_ns: int, *, replace: int | None = None
    ) -> Lease:
        """Take the pipeline's lease (see the protocol); LeaseHeldError names a live holder."""
        with schema.call_deadline(LEASE_CALL_TIMEOUT):
            return self._transact("taking the lease", steps.acquire_lease, pipeline, owner,
                                  run_id, ttl_ns, replace)

    def renew_lease(self, pipeline: str, lease: Lease, ttl_ns: int) -> Lease:
        """Extend ``lease`` by ``ttl_ns``; FencedError when it is no longer current."""
        with schema.call_deadline(LEASE_CALL_TIMEOUT), _lease_op():
            return self._transact("renewing the lease", steps.renew_lease, pipeline, lease,
                                  ttl_ns)

    def release_lease(self, pipeline: str, lease: Lease) -> None:
        """End ``lease`` (expiry 0, token kept) if it is current; else do nothing."""
        with schema.call_deadline(LEASE_CALL_TIMEOUT), _lease_op():
            self._transact("releasing the lease", steps.release_lease, pipeline, lease)

    def set_source(self, pipeline: str, source: str) -> None:
        self._transact("storing the source definition", steps.set_source, pipeline, source)

    # -- sink durability (two-stage ack) ---------------------------------------------------

    def durable_marks(self, pipeline: str) -> dict[str, int]:
        """Sink label -> the batch through which that sink's output is durable."""
        return self._read("reading the durable marks",
                          lambda snap, sql: steps.read_record(snap, sql, pipeline).durable)

    def mark_durable(
        self, pipeline: str, marks: Mapping[str, int], *, fence: int | None = None
    ) -> None:
        """Raise the sinks' durable marks (a smaller value is ignored); FencedError unless
        ``fence`` is None or the current lease token. The batch log keeps every batch above
        the smallest mark, so recovery can replay it to the sinks that lack it."""
        self._transact("recording durable marks", steps.mark_durable, pipeline, dict(marks),
                       fence)

    def step_state(self, pipeline: str) -> bytes | None:
        """The BatchSteps' state stored with the last committed batch that carried one."""
        return self._read("reading the step state",
                          lambda snap, sql: steps.step_state(snap, sql, pipeline))

    def logged_plan(self, pipeline: str, batch_id: int) -> BatchPlan | None:
        """The plan of a logged batch (None when it was never logged or is pruned)."""
        return self._read("reading a logged plan",
                          lambda snap, sql: steps.logged(snap, sql, pipeline, batch_id))

    def close(self) -> None:
        # Database.close() joins a maintenance thread that sleeps for minutes and Client has
        # no close(); the client's threads are daemons, so dropping the references suffices.
        for connection in (self._data, self._admin):
            if connection is not None:
                connection.close()
        self._db = self._data = self._admin = None
        self._client = None

    def __repr__(self) -> str:
        return f"SpannerStore({self.url!r})"


def init_store(url: str) -> str:
    """Create or upgrade the tables and indexes of the store at ``url`` (idempotent).

    Returns a one-line account of what was done, for ``cdcflow metadata init URL``.
    """
    store = SpannerStore.from_url(url)
    try:
        created = store.ensure_schema()
    finally:
        store.close()
    t = store.tables
    if created:
        return f"created {', '.join(created)} in {store.database_path}"
    return (f"{t.partitions}, {t.batches}, {t.pipelines} and {t.step_state} already exist in "
            f"{store.database_path}")
