"""WriteTables: change data landed per table in object storage (any fsspec URL), in files
near a target size, exactly once.

Layout under ``url``::

    <table>/_schema/v<k>.json                                 columns, types, keys, checksum
    <table>/[date=YYYY-MM-DD/[hour=HH/]]part-<first>-<last>-<k>.<parquet|jsonl|csv>
    _cdcflow/durable.json                                     {"durable_batch": D,
                                                               "pipeline": name, ...}
    _cdcflow/claims/<table>/[<partition>/]<first>.json        a file being uploaded:
                                                              {"first", "last", "version"}

A *key* is one (table, date partition) directory. Each key has at most one open file,
staged in the driver's spool (memory, spilling to local disk past ``spool_memory``; see
``_tablespool``); a file holds **whole batches** of its key, ``first..last``, and
``k`` is the schema version its rows follow (``v<k>.json`` is written before any file of
version ``k``).

Why this is exactly-once (the two-stage ack of ``cdcflow.engine.durability``):

1. ``commit(b)`` stages batch ``b``'s rows in the open file of each key it touches. A key's
   file is cut (written out) at a batch boundary when it reaches ``file_size`` (or, at
   least half full, before a batch that would take it further past the target than it
   lacks), when ``flush_interval`` has passed since it was opened, before its table's
   schema changes, or at ``flush()``. A cut file is queued for the upload thread, which
   writes files in cut order; an upload is one PUT of the final name (locally: a temporary
   name, then an atomic rename): an object store has no atomic rename, but a PUT is
   atomic, so the final name is either absent or whole.
2. The names are deterministic and say which batches a key has made durable: the largest
   ``last`` among a key's files. After a crash the engine replays the batches above the
   sink's durable mark; the sink reads each key's largest ``last`` from the listing and
   skips, for that key, every replayed batch at or below it (its rows are in a file
   already), and stages the others. Files of a key are contiguous in batch order, so a
   replay neither repeats nor drops a row, whatever the cut points of the replay (which
   may differ: ``flush_interval`` is wall-clock time).
3. A file is claimed before its upload (``_tablestorage``): a stale run's upload that was
   on the wire when it lost the pipeline lands a file the run that took over writes too,
   with the same name and rows, because that run cuts its file where the claim says.
4. ``durable_batch()`` is ``B`` only when every key's open file and every file waiting
   for its upload holds batches above ``B`` (the minimum of their ``first - 1``; with
   none, the last batch staged). When the upload queue empties it is also written to
   ``_cdcflow/durable.json`` (after the data), so a restart finds a lower bound of it in
   the output itself.

Tasks build their rows column-wise (``_tabletask``, ``_tablebuild``, ``_tablejsonl``): per
(table, column list) one Arrow RecordBatch or one block of JSON lines, so the driver only
conforms a batch to the table's current schema version and appends it (CSV: encodes it).
A batch's work follows the keys it staged, not the open files (see ``_due``).

A schema change cuts every open file of the table, waits for the uploads (the drain),
writes ``v<k+1>.json``, then stages the batch in new files. ``ADD COLUMN`` shows as a
record with a column (or type) the current version lacks, ``DROP COLUMN`` as a record that
carries every tracked column (an INSERT) without it, newer than the version's ``since``;
docs/architecture.md ("Sink durability") explains the rule and why late records of an
older shape fit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from cdcflow.durations import parse_size, positive_seconds
from cdcflow.errors import (
    PipelineDefinitionError,
    SinkError,
    SinkIOError,
    SinkSetupError,
    TransientError,
)
from cdcflow.model import DataChangeRecord
from cdcflow.transforms._fileio import local_prefix, sweep
from cdcflow.transforms._tablebuild import conform
from cdcflow.transforms._tablecast import recast
from cdcflow.transforms._tableread import file_schema, table_schema
from cdcflow.transforms._tablerows import Format, RowStyle, Schema, Unit
from cdcflow.transforms._tablespool import (
    Cut,
    Key,
    OpenFile,
    Uploader,
    Usage,
    encode,
    storage_cause,
)
from cdcflow.transforms._tablestorage import TableStorage
from cdcflow.transforms._tabletask import Group, TaskRows, Writer, next_version
from cdcflow.transforms.base import Sink, SinkContext, SinkWriter, WriterContext

__all__ = ["TaskRows", "WriteTables", "file_schema", "parse_size", "table_schema"]

_log = logging.getLogger("cdcflow.sinks")
#: The longest a commit waits for uploads to drain a full spool before it raises
#: SinkIOError (the engine retries the batch, which waits again).
FULL_SPOOL_WAIT = 600.0
#: Once the run is asked to stop, the longest its end waits for an upload that does not
#: finish (the storage does not answer) before giving the uploads up.
STOP_PATIENCE = 5.0


def _never() -> bool:
    return False


def _free() -> None:
    return None


class WriteTables(Sink[DataChangeRecord, TaskRows]):
    """Lands DataChangeRecords under ``url`` per table, in files near ``file_size``
    (see the module docstring for the layout and why it is exactly-once).

    ``url``: a local path (relative to the pipeline file), ``memory://...`` or any fsspec
    URL such as ``s3://bucket/prefix``; ``storage_options`` go to fsspec (e.g.
    ``{"client_kwargs": {"endpoint_url": ...}}``). ``format``: ``"parquet"`` (Arrow types
    from the column types), ``"jsonl"`` (the change stream's JSON forms: timestamps as
    RFC 3339 text, NUMERIC as text, BYTES as base64) or ``"csv"`` (a header line; the
    Parquet values as text, BYTES as base64, JSON and ARRAY as JSON text, NULL an empty
    field and an empty string ``""``; Debezium rows flattened to ``before.<column>``,
    ``after.<column>``, ``op``, ``source.<field>``, ``ts_ms``; the schema file lists the
    columns with their types, see :func:`file_schema`). ``file_size``: cut a table's file
    near this size (files hold whole batches: a file passes it by at most one batch of its
    table, or is cut short of it by less than half of one).
    ``flush_interval``: cut a file this long after it was opened, whatever its size.
    ``partition_by``: ``"none"``, ``"day"`` or ``"hour"`` of the commit timestamp (UTC).
    ``rows``: ``"flat"`` (the row's columns plus ``_op``, ``_commit_ts``, ``_txn``,
    ``_seq``, ``_table``; a DELETE carries keys and old values) or ``"debezium"``
    (``before``, ``after``, ``op`` c/u/d or r for a snapshot row, ``source`` with
    ``table``, ``commit_timestamp``, ``transaction_id``, ``record_sequence`` and
    ``partition``, and ``ts_ms``, the commit time in milliseconds). ``spool_size``: a task
    keeps this many bytes of records (``payload_size`` of every record) in memory and
    spools the rest to a local temporary file whose path it sends to the driver, when it
    runs on the driver's machine (in-memory runner, Spark local modes); the commit then
    stages the file a chunk at a time; elsewhere, and with ``None``, every row travels in
    the commit message.
    ``timestamp_unit``: Parquet timestamps in ``"ns"`` (TIMESTAMP(NANOS), every digit
    Spanner gives, years 1677 to 2262) or ``"us"`` (TIMESTAMP(MICROS): for readers that
    refuse nanoseconds, such as Spark 4, and for values up to 9999-12-31; the digits below
    a microsecond are dropped).

    The driver's spool (see ``_tablespool``): staged rows and cut files waiting for
    upload stay in memory up to ``spool_memory`` (the high watermark); past it the largest
    open files, then the queued cut files, spill to a local directory (under ``local_dir``,
    a directory of this host, the temporary directory by default; made at the first
    spill, removed at close, and removed by the next run if this one is killed) until
    memory is back at half of it (the low watermark). Uploads run on one background
    thread, in cut order, so a slow store does not stall reading: ``commit`` waits only
    when memory and disk together pass ``spool_memory + spool_disk``, until the uploads
    drain the spool to half of that. A storage failure during an upload is retried with
    backoff (the file stays spooled and the durable mark does not pass it), so during an
    outage a full spool makes ``commit`` wait until uploads succeed again: the spool stays
    in bounds and reading waits behind it. ``commit`` raises
    :class:`~cdcflow.errors.SinkIOError` (the batch is retried, and waits again) when the
    run is asked to stop meanwhile or after ``FULL_SPOOL_WAIT`` seconds.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        format: Format = "parquet",
        file_size: str | int = "64MiB",
        flush_interval: str | float = "60s",
        partition_by: Literal["none", "day", "hour"] = "none",
        rows: RowStyle = "flat",
        *,
        storage_options: Mapping[str, Any] | None = None,
        spool_size: str | int | None = "4MiB",
        spool_memory: str | int = "256MiB",
        spool_disk: str | int = "8GiB",
        local_dir: str | None = None,
        timestamp_unit: Literal["ns", "us"] = "ns",
    ) -> None:
        self.url = os.fspath(url)
        if not self.url:
            msg = "WriteTables needs a URL, e.g. WriteTables('s3://bucket/cdc')"
            raise PipelineDefinitionError(msg)
        for name, value, allowed in (("format", format, ("parquet", "jsonl", "csv")),
                                     ("partition_by", partition_by, ("none", "day", "hour")),
                                     ("rows", rows, ("flat", "debezium")),
                                     ("timestamp_unit", timestamp_unit, ("ns", "us"))):
            if value not in allowed:
                msg = f"WriteTables({name}={value!r}): use one of {', '.join(allowed)}"
                raise PipelineDefinitionError(msg)
        self.format: Format = format
        self.file_size = parse_size(file_size, "WriteTables(file_size=...)")
        self.flush_interval = positive_seconds(
            flush_interval, "WriteTables(flush_interval=...)", "60s")
        self.partition_by = partition_by
        self.rows: RowStyle = rows
        self.storage_options = dict(storage_options or {})
        self.spool_size = (None if spool_size is None
                           else parse_size(spool_size, "WriteTables(spool_size=...)"))
        self.spool_memory = parse_size(spool_memory, "WriteTables(spool_memory=...)")
        self.spool_disk = parse_size(spool_disk, "WriteTables(spool_disk=...)")
        self.local_dir = local_dir
        self.timestamp_unit = timestamp_unit
        self._reset()

    def _reset(self) -> None:
        self._stopping: Callable[[], bool] = _never
        self._guard: Callable[[], None] = _free  # may this run still write (see setup)
        self._out: TableStorage | None = None  # the output location (set up by setup)
        self._stage_dir: str | None = None
        # open files in the order they were opened: by `opened` and by `first`
        self._open: dict[Key, OpenFile] = {}
        self._usage = Usage()  # bytes of the open files
        self._flushed: dict[Key, int] = {}  # a key's largest `last` in storage
        # a key's files claimed by an earlier run and not uploaded: {first: (last, version)}
        self._claims: dict[Key, dict[int, tuple[int, int]]] = {}
        self._schemas: dict[str, Schema] = {}
        self._staged_through = 0
        self._durable: int | None = None
        self._owned = 0  # the durable batch durable.json held for this pipeline at claim
        # parquet: encoded / in-memory bytes per table (measured, then of the last file cut)
        self._ratios: dict[str, float] = {}
        self._files = 0
        self._cuts: Counter[str] = Counter()  # files cut, by reason (metrics)
        self._uploads: Uploader | None = None
        self._driver_host: str | None = None  # where setup ran: tasks there may spool
        self._driver_pid: int | None = None  # whose process reads (and sweeps) their spool
        self._pipeline = ""  # the pipeline whose output the URL holds (set up by setup)

    _DRIVER_STATE = ("_out", "_open", "_usage", "_flushed", "_claims", "_schemas", "_uploads",
                     "_stopping", "_guard")

    def __getstate__(self) -> dict[str, Any]:
        # Tasks need the configuration only; the driver's staging state stays on the driver.
        state = self.__dict__.copy()
        for name in self._DRIVER_STATE:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._out, self._open, self._flushed, self._schemas = None, {}, {}, {}
        self._claims = {}
        self._uploads, self._usage = None, Usage()
        self._stopping, self._guard = _never, _free

    def describe_params(self) -> str:
        return f"{self.url} ({self.format}, {self.rows})"

    # -- tasks -------------------------------------------------------------------------------

    def open_writer(self, ctx: WriterContext) -> SinkWriter[DataChangeRecord, TaskRows]:
        # A task spools to local disk only on the driver's machine, the one place the
        # driver can read the file from; elsewhere (a cluster's executors) rows travel in
        # the commit message.
        local = self._driver_host is None or socket.gethostname() == self._driver_host
        return Writer(self.rows, self.format, self.partition_by,
                      self.spool_size if local else None, local_prefix(self._driver_pid),
                      self._unit)

    # -- driver ------------------------------------------------------------------------------

    def setup(self, ctx: SinkContext) -> None:
        url = self.url
        if "://" not in url:
            url = os.path.abspath(os.path.join(ctx.base_dir, os.path.expanduser(url)))
        self._out = TableStorage(url, self.url, self.storage_options, self.format, self._unit)
        # Claimed when first asked for its durable batch (the engine asks right after it has
        # checked the pipeline's sinks against each other): a pipeline refused at start
        # leaves no claim behind.
        self._pipeline = ctx.pipeline
        self._stopping = ctx.stopping
        self._guard = ctx.guard
        self._driver_host = socket.gethostname()
        self._driver_pid = os.getpid()
        if self.local_dir is not None:
            self._check_local_dir(self.local_dir)
        sweep(self.local_dir)  # what runs that died left behind (spilled rows)
        if self.local_dir is not None:
            sweep(None)  # the tasks' spool files
        self._uploads = Uploader(self._upload, self._uploaded, self.url)

    def _check_local_dir(self, path: str) -> None:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            msg = (f"WriteTables(local_dir={path!r}) cannot be made: {exc.strerror or exc}; "
                   "point local_dir at a directory of this machine it can write")
            raise SinkSetupError(msg) from exc
        if not os.access(path, os.W_OK | os.X_OK):
            msg = (f"WriteTables(local_dir={path!r}) is not writable; point local_dir at a "
                   "directory of this machine it can write")
            raise SinkSetupError(msg)

    def _storage(self) -> TableStorage:
        if self._out is None:
            msg = "WriteTables was not set up: the engine must call setup() before commits"
            raise SinkError(msg)
        return self._out

    def _queue(self) -> Uploader:
        if self._uploads is None:
            msg = "WriteTables was not set up: the engine must call setup() before commits"
            raise SinkError(msg)
        return self._uploads

    def output_location(self) -> str:
        return self._storage().location()

    def durable_batch(self) -> int:
        if self._durable is None:
            if self._out is None:
                return 0  # asked before setup(): whether this sink stages, not where it is
            self._durable, self._owned = self._out.claim(self._pipeline)
            self._staged_through = max(self._staged_through, self._durable)
        if self._uploads is not None:
            self._uploads.check()
        return self._mark()

    def _mark(self) -> int:
        """The batch through which everything is in storage: below the first batch of every
        open file and of every cut file not yet uploaded."""
        firsts = [] if (first := self._first_open()) is None else [first]
        if self._uploads is not None:
            with self._uploads.lock:
                firsts += [c.first for c in self._uploads.queue]
        if not firsts:
            return max(self._durable or 0, self._staged_through)
        return min(firsts) - 1

    def _first_open(self) -> int | None:
        """The smallest ``first`` of the open files: the first one's, as files are opened in
        batch order."""
        while True:
            try:
                for file in self._open.values():
                    return file.first
                return None
            except RuntimeError:  # changed by the driver while the upload thread looked
                continue

    def owned_batch(self) -> int:
        """The durable batch ``durable.json`` held for this pipeline before this run (0 when
        it was claimed now, or named no pipeline)."""
        self.durable_batch()  # claims the URL, once
        return self._owned

    def last_committed_batch(self) -> int:
        out = self._storage()
        return max(self.durable_batch(), out.last_batch(), out.last_claimed())

    def _key_flushed(self, key: Key) -> int:
        """The key's largest ``last`` in storage; with it, read once, the files of the key
        an earlier run claimed and did not upload (this run writes them as claimed)."""
        if key not in self._flushed:
            out = self._storage()
            flushed, claims = out.key_state(*key)
            self._flushed[key] = flushed
            if claims:
                self._claims[key] = claims
                _log.info("WriteTables: %s: an earlier run claimed %s and did not upload "
                          "it (it may still, if it lost the pipeline while uploading): this "
                          "run writes it as claimed", "/".join(p for p in key if p),
                          ", ".join(f"batches {f}..{last}" for f, (last, _) in
                                    sorted(claims.items())))
        return self._flushed[key]

    def _claimed(self, file: OpenFile) -> tuple[int, int] | None:
        """The (last batch, version) an earlier run claimed for ``file`` (None: none)."""
        claims = self._claims.get(file.key)
        return None if not claims else claims.get(file.first)

    def _schema(self, table: str) -> Schema | None:
        if table not in self._schemas:
            schema = self._storage().latest_schema(table)
            if schema is None:
                return None
            self._schemas[table] = schema
        return self._schemas[table]

    def commit(self, batch_id: int, messages: Sequence[TaskRows]) -> None:
        """Stage ``batch_id`` (skipped at or below the durable batch, and per key at or below
        the key's last file); cut the files that are due; keep the spool in bounds. The
        tasks' spool files are removed once read, or at once when the batch is not staged."""
        if batch_id <= self.durable_batch():  # a replay of what storage holds
            self._drop_spools(messages)
            return
        if batch_id <= self._staged_through:  # a retry, after this commit raised: the
            self._drop_spools(messages)
            self._bound(batch_id)  # spool is checked again, so its bound holds
            return
        self._checkpoint("stage", batch_id)
        # The plan, from the groups' heads (no rows): a key whose file holding the batch
        # exists is a replay, its rows skipped before they can start a schema version (a
        # replayed batch from before a DROP COLUMN would otherwise add the dropped column
        # back); then each table's schema version.
        by_key: dict[Key, list[Group]] = {}
        for message in messages:
            for g in message.described():
                by_key.setdefault((g.table, g.directory), []).append(g)
        by_key = {k: gs for k, gs in by_key.items() if batch_id > self._key_flushed(k)}
        by_table: dict[str, list[Group]] = {}
        for key, groups in by_key.items():
            by_table.setdefault(key[0], []).extend(groups)
        for table, groups in by_table.items():
            self._evolve(table, groups, batch_id)
        # The rows, a task's spooled chunk at a time, spilling past spool_memory as they
        # come: a batch larger than memory is never held whole.
        incoming = {k: sum(g.nbytes for g in gs) for k, gs in by_key.items()}
        try:
            for message in messages:
                for chunk in message.chunks():
                    for g in chunk:
                        if (key := (g.table, g.directory)) in by_key:
                            self._stage(key, g, batch_id, incoming)
                    self._spill_memory()
                if message.spool is not None:
                    with contextlib.suppress(OSError):
                        os.remove(message.spool)
        except (OSError, SinkIOError) as exc:
            # Part of the batch is staged, so a retry would stage that part twice: the run
            # stops instead (its open files are dropped), and the next run replays the
            # batches above the durable mark.
            msg = (f"{self._local_error(exc)}; batch {batch_id} was staged in part, so the "
                   "run stops: the next run replays it")
            self._drop_spools(messages)
            raise SinkError(msg) from exc
        self._staged_through = batch_id
        due = self._due(by_key)
        for reason in ("size", "interval", "claim"):
            self._cut([k for k, why in due.items() if why == reason], batch_id, reason)
        self._bound(batch_id)

    def _due(self, staged: Mapping[Key, object]) -> dict[Key, str]:
        """The open files to cut, with why: those that grew past ``file_size`` (only files
        staged to can have), and those opened ``flush_interval`` ago or more (the first ones
        in ``_open``, which holds them in the order they were opened); a file an earlier
        run claimed, once it holds the claimed batches, and not before. The work follows
        the tables with data, not the open files."""
        due = {k: "size" for k in staged if (o := self._open.get(k)) is not None
               and self._claimed(o) is None and o.size(self._ratio(o)) >= self.file_size}
        now = time.monotonic()
        for key, file in self._open.items():
            if now - file.opened < self.flush_interval:
                break
            if self._claimed(file) is None:
                due.setdefault(key, "interval")
        if self._claims:  # a claimed file is cut where the claim says, and only there
            for key in staged:
                if (o := self._open.get(key)) is not None and (
                        claim := self._claimed(o)) is not None and o.last >= claim[0]:
                    due[key] = "claim"
        return due

    def _evolve(self, table: str, groups: Sequence[Group], batch_id: int) -> None:
        """Write the table's next schema version first if this batch's rows need one: a
        column the current version lacks (or has with another type), or a column dropped
        (a row carrying every tracked column lacks it, that row is newer than the version,
        and no row of the batch carries it)."""
        new = next_version(table, self._schema(table), groups)
        if new is None:
            return
        # Drain: every earlier row of the table is in storage before the new version.
        self._cut([k for k in self._open if k[0] == table], batch_id, "schema")
        self.drain()
        out = self._storage()
        out.put(out.path(table, "_schema", f"v{new.version}.json"),
                new.to_json(self.rows, self.format, self.partition_by, self._unit))
        self._schemas[table] = new

    def _stage(self, key: Key, group: Group, batch_id: int, incoming: dict[Key, int]) -> None:
        """Add a group of the batch's rows of ``key`` to its open file (opened if none).
        A file comes as near ``file_size`` as whole batches let it: at the key's first
        group of the batch (``incoming`` holds the Arrow or JSON bytes of all its groups
        until then), a file at least half full that would pass the target by more with
        this batch than it lacks without it is cut first."""
        file = self._open.get(key)
        schema = self._schemas[key[0]]
        arrow = (file.arrow if file is not None else None if self.format == "jsonl"
                 else schema.arrow(self.rows, self.format, self._unit))
        data = recast(group.data, group.columns, schema, self.format, self.rows)
        chunk, nbytes = encode(data if arrow is None else conform(data, arrow),
                               self.format == "csv")
        raw = incoming.pop(key, None)
        if file is not None and raw is not None and self._claimed(file) is None:
            ratio = self._ratio(file)
            size = file.size(ratio)
            batch = raw * nbytes / max(1, group.nbytes)  # as this group encodes
            after = size + batch * (1.0 if file.text else ratio)
            if 2 * size >= self.file_size and after - self.file_size > self.file_size - size:
                self._cut([key], batch_id, "size")
                file = None
        if file is None:
            self._check_claims(key, batch_id, schema.version)
            self._files += 1
            number = self._files
            file = OpenFile(key, schema, arrow,
                            lambda: os.path.join(self._spill_dir(), f"{number}.part"),
                            batch_id, time.monotonic(),
                            self._parquet_options(), csv=self.format == "csv",
                            usage=self._usage)
            self._open[key] = file
        file.append(chunk, nbytes, batch_id)

    def _check_claims(self, key: Key, batch_id: int, version: int) -> None:
        """A file of ``key`` opening at ``batch_id`` must start where a claim of the key
        starts, or past every claim (the replay reads what the claiming run read)."""
        for first, (last, claimed) in self._claims.get(key, {}).items():
            if first < batch_id <= last or (first == batch_id and claimed != version):
                where = "/".join(p for p in key if p)
                msg = (f"WriteTables: {where}: an earlier run claimed the file of batches "
                       f"{first}..{last} (schema v{claimed}), which this run cannot write "
                       f"as claimed (its file opens at batch {batch_id}, schema v{version}); "
                       "remove that claim under _cdcflow/claims once no earlier run can "
                       "write, then run again")
                raise SinkError(msg)

    def _spill_dir(self) -> str:
        """The local directory rows spill to, made at the first spill (under ``local_dir``,
        named by this process: ``sweep`` removes it once the process is gone)."""
        if self._stage_dir is None:
            self._stage_dir = tempfile.mkdtemp(prefix=local_prefix(), dir=self.local_dir)
        return self._stage_dir

    def _ratio(self, file: OpenFile) -> float:
        """The encoding ratio of a parquet file's table: measured by encoding the rows of the
        table's first file once they reach a quarter of ``file_size`` (so the first file
        after a start is cut near the target too), then that of the table's last file cut;
        1.0 before (a file below a quarter of the target is not due)."""
        table = file.key[0]
        ratio = self._ratios.get(table)
        if ratio is None:
            if file.text or file.memory < self.file_size // 4:
                return 1.0
            ratio = self._ratios[table] = file.ratio()
        return ratio

    @property
    def _unit(self) -> Unit:
        """The unit of the files' timestamps (Parquet's may be microseconds)."""
        return self.timestamp_unit if self.format == "parquet" else "ns"

    def _parquet_options(self) -> dict[str, Any]:
        # "us": Parquet TIMESTAMP(MICROS), which every reader takes (Spark refuses NANOS);
        # the nanoseconds below a microsecond are dropped.
        if self.timestamp_unit == "us":
            return {"coerce_timestamps": "us", "allow_truncated_timestamps": True}
        return {}

    def _cut(self, keys: Sequence[Key], batch_id: int, reason: str) -> None:
        """Close the open files of ``keys`` and queue them for upload; ``reason``: size,
        interval, schema, spool or flush."""
        uploads = self._queue()
        self._cuts[reason] += len(keys)
        for key in keys:
            file = self._open[key]
            name = f"part-{file.first}-{file.last}-{file.schema.version}.{self.format}"
            raw = file.memory + file.spilled_raw
            cut = file.finish(name, batch_id)
            if not file.text and raw:
                self._ratios[key[0]] = max(0.01, cut.size / raw)
            uploads.submit(cut)
            del self._open[key]

    def _spill_memory(self) -> None:
        """Past ``spool_memory`` in memory, spill to local disk down to half of it: the
        largest open files first, then cut files waiting for their upload. A local disk
        that fails raises SinkIOError naming it."""
        low = self.spool_memory // 2
        if self._memory() <= self.spool_memory:
            return
        try:
            for file in sorted(self._open.values(), key=lambda o: -o.memory):
                if self._memory() <= low:
                    break
                file.spill()
            if self._memory() > low:
                self._queue().spill(self._spill_dir(), max(0, low - self._open_memory()))
        except OSError as exc:
            raise SinkIOError(self._local_error(exc)) from exc

    def _local_error(self, exc: BaseException) -> str:
        where = self.local_dir or tempfile.gettempdir()
        if not isinstance(exc, OSError):
            return str(exc)
        return (f"WriteTables cannot spill rows to {where}: {exc.strerror or exc}; free space "
                "there, or set local_dir to a directory with room")

    def _bound(self, batch_id: int) -> None:
        """Keep the spool under its watermarks (see the class docstring)."""
        uploads = self._queue()
        self._spill_memory()
        limit = self.spool_memory + self.spool_disk
        if self._memory() + self._disk() <= limit:
            return
        target = limit // 2
        open_bytes = self._usage.memory + self._usage.disk
        if open_bytes > target:  # the open files alone hold it: cut the largest
            free = [o for o in self._open.values() if self._claimed(o) is None]
            self._cut([o.key for o in sorted(free, key=lambda o: -(o.memory + o.disk))][
                :max(1, len(free) // 2)], batch_id, "spool")
        # Until the uploads drained the spool to the target, or have nothing left to upload
        # (what the open files hold then stays: waiting longer would not free it). Failing
        # uploads are retried until the storage is back, so the commit (and reading behind
        # it) waits out an outage with the spool in bounds; uploads that fail for good
        # raise here, and a stop request ends the wait.
        if uploads.error is not None:
            _log.warning("WriteTables: the spool is full (%d bytes) while uploads to %s fail "
                         "(%s): commits wait until they succeed again", limit, self.url,
                         storage_cause(uploads.error))
        drained = uploads.wait(lambda: self._memory() + self._disk() <= target
                               or (not uploads.queue and not uploads.busy())
                               or self._stopping(), timeout=FULL_SPOOL_WAIT)
        if self._memory() + self._disk() > limit and (not drained or self._stopping()):
            cause = "" if uploads.error is None else f" while uploads fail ({uploads.error})"
            msg = (f"WriteTables: the spool is full ({limit} bytes){cause}; raise "
                   "spool_disk or fix the storage")
            raise SinkIOError(msg)

    def _open_memory(self) -> int:
        return self._usage.memory

    def _memory(self) -> int:
        return self._usage.memory + self._queue().memory

    def _disk(self) -> int:
        return self._usage.disk + self._queue().disk

    def metrics(self) -> dict[str, float]:
        """Files cut by reason, files and bytes uploaded, upload seconds and failed tries
        (running totals); the spool's bytes in memory and on disk, files open and queued,
        and the durable batch (now)."""
        uploads = self._queue()
        with uploads.lock:
            numbers: dict[str, float] = {
                "files_uploaded_total": uploads.uploaded,
                "uploaded_bytes_total": uploads.uploaded_bytes,
                "upload_seconds_total": uploads.upload_seconds,
                "upload_errors_total": uploads.errors, "uploads_queued": len(uploads.queue)}
        numbers.update({f"files_cut_{why}_total": self._cuts[why]
                        for why in ("size", "interval", "schema", "spool", "flush", "claim")})
        numbers.update(spool_memory_bytes=self._memory(), spool_disk_bytes=self._disk(),
                       open_files=len(self._open), durable_batch=self.durable_batch())
        return numbers

    def _upload(self, cut: Cut) -> None:
        """Runs on the upload thread: one file to storage, claimed first (a stale run's
        upload of other batches from the same first batch then never lands beside it; see
        ``_tablestorage``), its claim removed once it is there."""
        out = self._storage()
        table, directory = cut.key
        self._may_write()
        out.claim_file(table, directory, cut.name)
        self._may_write()  # the claim may have waited on the storage: asked again
        out.put(out.path(table, directory, cut.name), data=cut.data, local=cut.local)
        out.release_claim(table, directory, cut.first)

    def _may_write(self) -> None:
        """Before each upload: whether this run may still write (``SinkContext.guard``). A
        run that another took over writes nothing more (the guard's error stops the upload
        thread): the new run writes these rows again from the batches it replays, and a
        late file of this run's would hold them twice. While the lease has run out (the
        process was paused, the store did not answer the renewals) uploads wait, as on a
        storage failure, until it is renewed."""
        try:
            self._guard()
        except TransientError as exc:
            msg = f"this run's lease ran out, so uploads wait until it is renewed ({exc})"
            raise SinkIOError(msg) from exc

    def _uploaded(self, cut: Cut) -> None:
        """Runs on the upload thread after ``cut`` is in storage: the key's durable point,
        then (when no upload is left) the durable mark in ``_cdcflow/durable.json``."""
        if cut.local is not None:
            with contextlib.suppress(OSError):
                os.remove(cut.local)
        self._flushed[cut.key] = max(self._flushed.get(cut.key, 0), cut.last)
        if (claims := self._claims.get(cut.key)) is not None:
            claims.pop(cut.first, None)  # written as claimed
        uploads = self._queue()
        with uploads.lock:
            more = bool(uploads.queue)
        if more:
            return
        self._checkpoint("uploaded", cut.batch_id)
        durable = self._mark()
        self._may_write()
        self._storage().mark(self._pipeline, durable)
        self._durable = max(self._durable or 0, durable)
        self._checkpoint("marked", cut.batch_id)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every cut file is in storage (and the durable mark written after
        it); raises SinkIOError while uploads fail past ``timeout``."""
        uploads = self._queue()
        if not uploads.wait(lambda: not uploads.queue and not uploads.busy(), timeout):
            msg = (f"WriteTables: uploads did not finish ({uploads.error or 'still running'});"
                   " the batch is retried")
            raise SinkIOError(msg)

    def flush(self) -> None:
        """Write every open file and wait for the uploads (the run ends gracefully). When
        the run was asked to stop (a signal), failing uploads are not waited for: raises
        SinkIOError once they failed twice in a row, or an upload has not finished after
        :data:`STOP_PATIENCE` seconds (a storage that does not answer fails no call); the
        next run writes the rows again."""
        # a claimed file not complete yet stays open (not durable): the next run replays it
        self._cut([k for k, o in self._open.items() if (c := self._claimed(o)) is None
                   or o.last >= c[0]], self._staged_through, "flush")
        uploads = self._queue()
        with uploads.lock:
            waiting = len(uploads.queue)
        if waiting:
            _log.info("WriteTables: waiting for %d file(s) to reach %s (a flush)", waiting,
                      self.url)

        def given_up() -> bool:
            failing = uploads.error is not None and uploads.failures >= 2
            return self._stopping() and (failing or uploads.running_for() > STOP_PATIENCE)

        uploads.wait(lambda: (not uploads.queue and not uploads.busy()) or given_up())
        if uploads.queue or uploads.busy():
            cause = ("no answer" if uploads.error is None
                     else storage_cause(uploads.error))
            msg = (f"WriteTables: the run was asked to stop while uploads to {self.url} fail "
                   f"({cause}); {len(uploads.queue)} file(s) not durable")
            raise SinkIOError(msg)

    def abort(self, batch_id: int, messages: Sequence[TaskRows]) -> None:
        self._drop_spools(messages)

    @staticmethod
    def _drop_spools(messages: Sequence[TaskRows]) -> None:
        """Remove the tasks' spool files of ``messages`` (those still there)."""
        for message in messages:
            if message.spool is not None:
                with contextlib.suppress(OSError):
                    os.remove(message.spool)

    def close(self) -> None:
        """Stop the upload thread and drop what is staged (idempotent)."""
        if self._uploads is not None:
            self._uploads.close()
            self._uploads = None
        for file in self._open.values():
            file.discard()
        self._open = {}
        if self._stage_dir is not None:
            shutil.rmtree(self._stage_dir, ignore_errors=True)
            self._stage_dir = None

    def _checkpoint(self, step: str, batch_id: int) -> None:
        """Called at each step of a commit ("stage" on the driver; "uploaded" and "marked"
        on the upload thread, after the last queued file): a seam for crash tests; does
        nothing."""
        return None
