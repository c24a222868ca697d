"""A shop database and a random workload over it, recording the ground truth.

For end-to-end tests and the demo: :func:`create_shop_database` creates an ``Orders`` table
(keyed by the integer ``OrderId``, with a JSON column) and the change stream
``OrdersStream`` over it, in GoogleSQL or PostgreSQL; :class:`Workload` commits random
inserts, updates and deletes in single- and multi-row transactions at a given rate and
records, for each committed transaction, its commit timestamp and its changes. A pipeline
reading the stream must deliver exactly those changes.

Both dialects use the same (quoted, in PostgreSQL) table and column names, so the recorded
changes read the same; PostgreSQL folds the unquoted stream name to ``ordersstream``, which
the reader matches case-insensitively. google-cloud-spanner is imported lazily.

    db = create_shop_database(emulator)
    workload = Workload(db, rate=50, seed=1)
    thread = workload.start(seconds=5)          # or workload.run(count=100) in this thread
    ...
    workload.stop()                             # joins; raises what the thread raised
    workload.changes                            # [CommittedChange(...), ...]
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from typing import Any, Literal, get_args

import attrs

from cdcflow.backoff import RetryPolicy
from cdcflow.errors import CdcflowError
from cdcflow.model import ModType, Timestamp, ValueCaptureType

__all__ = [
    "SHOP_COLUMNS",
    "SHOP_KEY",
    "SHOP_STREAM",
    "SHOP_TABLE",
    "CommittedChange",
    "CommittedTransaction",
    "Dialect",
    "Workload",
    "create_shop_database",
    "shop_ddl",
]

Dialect = Literal["GOOGLE_STANDARD_SQL", "POSTGRESQL"]

SHOP_TABLE = "Orders"
SHOP_KEY = "OrderId"
SHOP_STREAM = "OrdersStream"
#: The non-key columns, in table order.
SHOP_COLUMNS = ("Customer", "Status", "Quantity", "Price", "Details")

_CUSTOMERS = ("ada", "grace", "alan", "edsger", "barbara", "donald", "frances", "ken")
_STATUSES = ("NEW", "PAID", "SHIPPED", "DELIVERED", "CANCELLED")

#: Retries of a commit that Spanner aborted (the emulator aborts overlapping ones).
_ABORTED_RETRY = RetryPolicy(attempts=20, initial=0.01, maximum=1.0)


def shop_ddl(
    dialect: Dialect = "GOOGLE_STANDARD_SQL",
    value_capture_type: ValueCaptureType = "OLD_AND_NEW_VALUES",
) -> list[str]:
    """The statements creating ``Orders`` and ``OrdersStream`` in ``dialect``."""
    if dialect not in get_args(Dialect):
        msg = f"dialect {dialect!r}: use GOOGLE_STANDARD_SQL or POSTGRESQL"
        raise ValueError(msg)
    if value_capture_type not in get_args(ValueCaptureType):
        msg = (
            f"value_capture_type {value_capture_type!r}: use one of "
            f"{', '.join(get_args(ValueCaptureType))}"
        )
        raise ValueError(msg)
    options = f"value_capture_type = '{value_capture_type}', retention_period = '1d'"
    if dialect == "POSTGRESQL":
        return [
            f'CREATE TABLE "{SHOP_TABLE}" ("{SHOP_KEY}" bigint NOT NULL PRIMARY KEY, '
            '"Customer" varchar, "Status" varchar(16), "Quantity" bigint, "Price" float8, '
            '"Details" jsonb)',
            f'CREATE CHANGE STREAM {SHOP_STREAM} FOR "{SHOP_TABLE}" WITH ({options})',
        ]
    return [
        f"CREATE TABLE {SHOP_TABLE} ({SHOP_KEY} INT64 NOT NULL, Customer STRING(MAX), "
        "Status STRING(16), Quantity INT64, Price FLOAT64, Details JSON) "
        f"PRIMARY KEY ({SHOP_KEY})",
        f"CREATE CHANGE STREAM {SHOP_STREAM} FOR {SHOP_TABLE} OPTIONS ({options})",
    ]


def create_shop_database(
    emulator_or_client: Any,
    database: str = "shop",
    dialect: Dialect = "GOOGLE_STANDARD_SQL",
    value_capture_type: ValueCaptureType = "OLD_AND_NEW_VALUES",
    *,
    instance: str = "test-instance",
) -> Any:
    """Create the shop database; return its ``google.cloud.spanner`` Database handle.

    With an :class:`~cdcflow.spanner.emulator.Emulator` the instance is created if needed
    and an existing database of that name is recreated. With a ``spanner.Client`` the
    instance must exist and the database must not (an existing one is never dropped).
    """
    ddl = shop_ddl(dialect, value_capture_type)
    from cdcflow.spanner.emulator import Emulator

    if isinstance(emulator_or_client, Emulator):
        return emulator_or_client.create_database(
            database, ddl, instance=instance, dialect=dialect
        )
    from google.cloud.spanner_admin_database_v1 import DatabaseDialect

    inst = emulator_or_client.instance(instance)
    if not inst.exists():
        msg = f"the Spanner instance {instance!r} does not exist; create it first"
        raise CdcflowError(msg)
    db = inst.database(database, database_dialect=getattr(DatabaseDialect, dialect))
    if db.exists():
        msg = f"the database {database!r} already exists; choose another name or drop it"
        raise CdcflowError(msg)
    db.create().result(300)
    db.update_ddl(ddl).result(300)
    return db


@attrs.frozen
class CommittedChange:
    """One row changed by a committed transaction: what a change stream must report.

    ``new_values`` are the columns the transaction wrote (all of them for an INSERT, the
    updated ones for an UPDATE, none for a DELETE); JSON values are plain Python values.
    """

    table: str
    keys: Mapping[str, Any]
    mod_type: ModType
    new_values: Mapping[str, Any]
    commit_ns: int
    transaction: int  # index of the transaction in the workload, from 0


@attrs.frozen
class CommittedTransaction:
    index: int
    commit_ns: int
    changes: tuple[CommittedChange, ...]

    @property
    def commit_timestamp(self) -> Timestamp:
        return Timestamp.from_ns(self.commit_ns)


def _to_cell(column: str, value: Any) -> Any:
    # JSON columns take their text in a mutation (in both dialects).
    if column == "Details":
        import json

        return json.dumps(value, sort_keys=True)
    return value


class Workload:
    """Random changes to ``Orders``, committed at ``rate`` transactions per second.

    Each transaction changes 1 row, or with probability ``multi_row_share`` 2 to
    ``max_rows`` distinct rows, each an INSERT of a new key, or an UPDATE or DELETE of a
    live key (the workload assumes it is the only writer; it loads the live keys when it
    starts). ``rate`` None commits as fast as possible. ``seed`` makes the sequence of
    choices repeatable. Aborted commits are retried as ``retry`` says (by default up to
    20 attempts, waiting at most 1 s). Safe to read :attr:`committed` and :attr:`changes`
    from another thread while it runs.
    """

    def __init__(
        self,
        database: Any,
        *,
        rate: float | None = 20.0,
        max_rows: int = 4,
        multi_row_share: float = 0.3,
        seed: int | None = None,
        key_space: int = 1 << 31,
        retry: RetryPolicy = _ABORTED_RETRY,
    ) -> None:
        if rate is not None and rate <= 0:
            msg = f"Workload(rate={rate}): use a positive number of transactions per second"
            raise ValueError(msg)
        if max_rows < 1 or not 0 <= multi_row_share <= 1 or key_space < 2:
            msg = ("Workload: max_rows must be >= 1, multi_row_share within 0..1 and "
                   "key_space >= 2 (keys are 1 .. key_space - 1)")
            raise ValueError(msg)
        self.database = database
        self.rate = rate
        self.max_rows = max_rows
        self.multi_row_share = multi_row_share
        self.key_space = key_space
        self.retry = retry
        self.aborted_attempts = 0
        self.error: BaseException | None = None
        self._rng = random.Random(seed)
        self._live: set[int] | None = None
        self._lock = threading.Lock()
        self._committed: list[CommittedTransaction] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- results -----------------------------------------------------------------------

    @property
    def committed(self) -> list[CommittedTransaction]:
        """The committed transactions so far, in commit order."""
        with self._lock:
            return list(self._committed)

    @property
    def changes(self) -> list[CommittedChange]:
        """Every committed change so far, in commit order."""
        return [c for tx in self.committed for c in tx.changes]

    @property
    def transactions(self) -> int:
        """How many transactions have committed."""
        with self._lock:
            return len(self._committed)

    @property
    def live_keys(self) -> set[int]:
        """The keys of the rows that exist now (as far as this workload knows)."""
        with self._lock:
            return set(self._live or ())

    # -- running -----------------------------------------------------------------------

    def run(
        self,
        stop: threading.Event | None = None,
        *,
        seconds: float | None = None,
        count: int | None = None,
    ) -> list[CommittedTransaction]:
        """Commit transactions until ``stop`` is set, ``seconds`` pass or ``count`` commit
        (whichever comes first; with none of them, until :meth:`stop`). Returns the
        transactions this call committed."""
        stop = stop or self._stop
        began = time.monotonic()
        deadline = None if seconds is None else began + seconds
        done: list[CommittedTransaction] = []
        while not stop.is_set() and (count is None or len(done) < count):
            if self.rate is not None:
                due = began + len(done) / self.rate  # a schedule, so delays do not add up
                wait = due - time.monotonic()
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                if wait > 0 and stop.wait(wait):
                    break
            if deadline is not None and time.monotonic() >= deadline:
                break
            done.append(self.step())
        return done

    def start(self, *, seconds: float | None = None, count: int | None = None
              ) -> threading.Thread:
        """Run in a daemon thread; :meth:`stop` ends it (and re-raises its error, if any)."""
        if self._thread is not None and self._thread.is_alive():
            msg = "this workload is already running"
            raise CdcflowError(msg)
        self._stop.clear()

        def target() -> None:
            try:
                self.run(self._stop, seconds=seconds, count=count)
            except BaseException as e:  # handed to the thread that calls stop()
                self.error = e

        self._thread = threading.Thread(target=target, name="workload", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread that :meth:`start` began, wait for it, re-raise its error."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                msg = f"the workload thread did not stop within {timeout:.0f}s"
                raise CdcflowError(msg)
        if self.error is not None:
            raise self.error

    # -- one transaction ---------------------------------------------------------------

    def step(self) -> CommittedTransaction:
        """Commit one random transaction now and record it."""
        live = self._load_live_keys()
        rows = 1
        if self.max_rows > 1 and self._rng.random() < self.multi_row_share:
            rows = self._rng.randint(2, self.max_rows)
        planned: list[tuple[ModType, int, dict[str, Any]]] = []
        touched: set[int] = set()
        for _ in range(min(rows, self.key_space - 1)):  # each key at most once
            planned.append(self._choose(live, touched))
        commit_ns = self._commit(planned)
        with self._lock:
            index = len(self._committed)
            changes = tuple(
                CommittedChange(SHOP_TABLE, {SHOP_KEY: key}, mod_type, values, commit_ns, index)
                for mod_type, key, values in planned
            )
            for mod_type, key, _ in planned:
                (live.discard if mod_type == "DELETE" else live.add)(key)
            tx = CommittedTransaction(index, commit_ns, changes)
            self._committed.append(tx)
        return tx

    def _load_live_keys(self) -> set[int]:
        if self._live is None:
            from google.cloud.spanner import KeySet

            everything = KeySet(all_=True)  # type: ignore[no-untyped-call]
            with self.database.snapshot() as snap:
                keys = {int(row[0]) for row in snap.read(SHOP_TABLE, [SHOP_KEY], everything)}
            with self._lock:
                self._live = keys
        return self._live

    def _choose(self, live: set[int], touched: set[int]) -> tuple[ModType, int, dict[str, Any]]:
        # A key is changed at most once per transaction, so each change is its own mod.
        candidates = sorted(live - touched)
        roll = self._rng.random()
        if candidates and roll < 0.45:
            key = self._rng.choice(candidates)
            touched.add(key)
            chosen = self._rng.sample(SHOP_COLUMNS, self._rng.randint(1, len(SHOP_COLUMNS)))
            values = self._values()
            return "UPDATE", key, {c: values[c] for c in SHOP_COLUMNS if c in chosen}
        if candidates and roll < 0.6:
            key = self._rng.choice(candidates)
            touched.add(key)
            return "DELETE", key, {}
        if len(live | touched) >= self.key_space - 1:  # no key left to insert: delete one
            key = self._rng.choice(candidates)
            touched.add(key)
            return "DELETE", key, {}
        while True:
            key = self._rng.randrange(1, self.key_space)
            if key not in live and key not in touched:
                touched.add(key)
                return "INSERT", key, self._values()

    def _values(self) -> dict[str, Any]:
        rng = self._rng
        items = [
            {"sku": f"SKU-{rng.randrange(1000):03d}", "qty": rng.randint(1, 5)}
            for _ in range(rng.randint(1, 3))
        ]
        return {
            "Customer": rng.choice(_CUSTOMERS),
            "Status": rng.choice(_STATUSES),
            "Quantity": sum(i["qty"] for i in items),
            "Price": round(rng.uniform(1, 500), 2),
            "Details": {"items": items, "gift": rng.random() < 0.2},
        }

    def _commit(self, planned: list[tuple[ModType, int, dict[str, Any]]]) -> int:
        from google.api_core.exceptions import Aborted

        def once() -> int:
            with self.database.batch() as batch:
                for mod_type, key, values in planned:
                    self._mutate(batch, mod_type, key, values)
            return Timestamp.from_datetime(batch.committed).ns

        def aborted(retry: int, exc: BaseException, delay: float) -> None:
            self.aborted_attempts += 1

        # Only ABORTED: it guarantees that nothing was applied. After UNAVAILABLE or a
        # timeout the commit may have landed, and a second one would add changes that the
        # recorded ground truth does not have.
        before = self.aborted_attempts
        try:
            return self.retry.call(
                once, retry_if=lambda e: isinstance(e, Aborted), on_retry=aborted
            )
        except Aborted as e:
            self.aborted_attempts += 1
            times = self.aborted_attempts - before
            msg = f"the workload's commit was aborted {times} times in a row; retry later"
            raise CdcflowError(msg) from e

    @staticmethod
    def _mutate(batch: Any, mod_type: ModType, key: int, values: Mapping[str, Any]) -> None:
        if mod_type == "DELETE":
            from google.cloud.spanner import KeySet

            batch.delete(SHOP_TABLE, KeySet(keys=[[key]]))  # type: ignore[no-untyped-call]
            return
        columns = [SHOP_KEY, *values]
        row = [key, *(_to_cell(c, v) for c, v in values.items())]
        (batch.insert if mod_type == "INSERT" else batch.update)(SHOP_TABLE, columns, [row])
