"""WriteSpark: write each batch with Spark's own DataFrameWriter, exactly once per batch.

How a batch gets written exactly once:

1. In every task (an executor's Python worker) the writer stages its rows as one JSONL file
   under ``staging``, in a directory of the batch, under a name unique to the task attempt,
   and returns the file's path as its commit message. Failed attempts leave files nobody
   names.
2. ``commit`` on the driver reads exactly the staged files the batch's messages name into a
   DataFrame (with the declared ``schema``, or an inferred one), adds the batch id as a
   column (``_batch_id``) and writes it partitioned by that column with dynamic partition
   overwrite: a replayed batch (same slices, same rows) replaces the partition
   ``_batch_id=N`` instead of adding to it. Then the batch's staging directory is deleted.

Targets:

- ``path=`` — any file-based format (parquet, json, orc, csv, avro, ...): exactly once.
- ``table=`` — a catalog table, created on the first batch (partitioned by ``_batch_id``),
  then ``insertInto(..., overwrite=True)`` with dynamic partition overwrite: exactly once
  for tables that support partition overwrite (file-source and Hive tables).
- neither (e.g. ``format="jdbc"`` with ``url``/``dbtable`` options) — appended: a replayed
  batch can repeat rows (at-least-once); deduplicate downstream on ``_batch_id``.

The staging directory must be reachable by the driver and every executor (on a cluster a
shared mount or an object store URI such as ``s3://bucket/tmp``; ``s3a://`` is read by
Spark and written through pyarrow as ``s3://``). By default it is ``<path>/_cdcflow_staging``
— Spark ignores directories whose names start with ``_`` and have no ``=`` when it reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from typing import IO, Any

import attrs

from cdcflow.errors import PipelineDefinitionError, SinkError, SinkIOError
from cdcflow.transforms.base import Sink, SinkContext, SinkWriter, WriterContext

__all__ = ["StagedFile", "WriteSpark"]

_OVERWRITE_MODE = "spark.sql.sources.partitionOverwriteMode"


@attrs.frozen
class StagedFile:
    """The commit message of a WriteSpark writer: one staged JSONL file of a task attempt."""

    path: str  # as the driver and executors open it (a local path or a URI)
    rows: int


def _quote(column: str) -> str:
    return "`" + column.replace("`", "``") + "`"


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _has_scheme(path: str) -> bool:
    head, sep, _ = path.partition("://")
    return bool(sep) and head.isidentifier() and len(head) > 1


def _for_spark(path: str) -> str:
    """A location as Spark should read it: local paths become ``file:`` URIs, so a cluster
    whose default filesystem is HDFS does not look for them there."""
    return path if _has_scheme(path) else "file://" + os.path.abspath(path)


def _for_arrow(uri: str) -> str:
    # pyarrow names Hadoop's S3A connector's scheme plain s3
    return "s3://" + uri[len("s3a://") :] if uri.startswith("s3a://") else uri


def _open_output(path: str) -> IO[bytes]:
    if not _has_scheme(path) or path.startswith("file://"):
        local = path.removeprefix("file://")
        os.makedirs(os.path.dirname(local), exist_ok=True)
        return open(local, "wb")  # the caller closes it
    from pyarrow import fs

    filesystem, inner = fs.FileSystem.from_uri(_for_arrow(path))
    stream: IO[bytes] = filesystem.open_output_stream(inner)
    return stream


def _list_dirs(path: str) -> list[str]:
    """Names of the directories directly under ``path``; none when it does not exist."""
    if not _has_scheme(path) or path.startswith("file://"):
        try:
            entries = list(os.scandir(path.removeprefix("file://")))
        except FileNotFoundError:
            return []
        return [e.name for e in entries if e.is_dir()]
    from pyarrow import fs

    filesystem, inner = fs.FileSystem.from_uri(_for_arrow(path))
    infos = filesystem.get_file_info(fs.FileSelector(inner, allow_not_found=True))
    return [i.base_name for i in infos if i.type == fs.FileType.Directory]


def _remove_tree(path: str) -> None:
    """Delete a staging directory; a missing one is fine."""
    if not _has_scheme(path) or path.startswith("file://"):
        shutil.rmtree(path.removeprefix("file://"), ignore_errors=True)
        return
    from pyarrow import fs

    filesystem, inner = fs.FileSystem.from_uri(_for_arrow(path))
    with contextlib.suppress(FileNotFoundError, OSError):
        filesystem.delete_dir(inner)


def _storage_error(action: str, path: str, exc: OSError) -> SinkIOError:
    reason = f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else str(exc)
    msg = (
        f"WriteSpark cannot {action} {path}: {reason}; free space, fix permissions or the "
        "staging filesystem"
    )
    return SinkIOError(msg)


class _StagingWriter:
    """Streams a task's rows as JSONL into its staged file, opened on the first row.

    An element that cannot be serialized raises SinkError before anything is written (the
    error policy retries or skips it). A storage failure (``OSError``) raises SinkIOError
    and breaks the writer: every later ``write`` and ``close`` raises it again, so the task
    fails and the engine retries the batch instead of committing a torn file.
    """

    def __init__(self, path: str) -> None:
        self._path = path
        self._file: IO[bytes] | None = None
        self._rows = 0
        self._broken: SinkIOError | None = None

    def _fail(self, action: str, exc: OSError) -> SinkIOError:
        self._broken = _storage_error(action, self._path, exc)
        return self._broken

    def write(self, element: Any) -> None:
        from cdcflow.serialize import dumps_line

        if self._broken is not None:
            raise SinkIOError(str(self._broken))
        line = dumps_line(element)
        try:
            if self._file is None:
                self._file = _open_output(self._path)
            self._file.write(line)
        except OSError as exc:
            raise self._fail("write", exc) from exc
        self._rows += 1

    def close(self) -> StagedFile | None:
        if self._broken is not None:
            raise SinkIOError(str(self._broken))
        if self._file is None:
            return None
        f, self._file = self._file, None
        try:
            f.close()
        except OSError as exc:
            raise self._fail("write", exc) from exc
        return StagedFile(self._path, self._rows)

    def abort(self) -> None:
        if self._file is not None:
            with contextlib.suppress(Exception):
                self._file.close()
            self._file = None
        # the staged file stays unnamed by any message; commit/abort delete the batch's dir


class WriteSpark(Sink[Any, StagedFile]):
    """Writes each batch with Spark's DataFrameWriter in any installed ``format``.

    Exactly one of ``path`` (a directory; relative paths resolve against the pipeline
    file's directory) or ``table`` (a catalog table name), or neither for formats that
    name their target in ``options`` (e.g. jdbc; at-least-once, see the module doc).
    ``options`` go to the writer (``.options(**options)``). ``schema`` — a DDL string
    (``"id BIGINT, name STRING, ts TIMESTAMP"``) or a ``StructType`` — types the rows; without
    it Spark infers one per batch from the JSON, so declare it for stable column types.
    Elements become rows with :func:`cdcflow.serialize.to_json_dict` (records keep their
    field names; timestamps are RFC 3339 text, which a TIMESTAMP column parses).
    ``batch_column`` names the batch id column the output is partitioned by, followed by
    ``partition_by``. ``staging`` is where tasks stage rows (see the module doc).

    Needs a SparkSession on the driver: run the pipeline with the Spark runner.
    """

    def __init__(
        self,
        format: str,
        *,
        path: str | os.PathLike[str] | None = None,
        table: str | None = None,
        options: Mapping[str, str] | None = None,
        schema: Any = None,
        staging: str | os.PathLike[str] | None = None,
        batch_column: str = "_batch_id",
        partition_by: Sequence[str] = (),
    ) -> None:
        if not isinstance(format, str) or not format:
            msg = "WriteSpark needs a format, e.g. WriteSpark('parquet', path='out/orders')"
            raise PipelineDefinitionError(msg)
        if path is not None and table is not None:
            msg = "WriteSpark takes path= or table=, not both: choose where the batches go"
            raise PipelineDefinitionError(msg)
        if table is not None and staging is None:
            msg = (
                f"WriteSpark(table={table!r}) needs staging=: a directory the driver and every "
                "executor can reach, where tasks stage rows before the commit"
            )
            raise PipelineDefinitionError(msg)
        if path is None and table is None and staging is None:
            msg = (
                f"WriteSpark({format!r}) without path= needs staging=: a directory the driver "
                "and every executor can reach, where tasks stage rows before the commit"
            )
            raise PipelineDefinitionError(msg)
        if not batch_column or batch_column in partition_by:
            msg = f"WriteSpark(batch_column={batch_column!r}): use a column name of its own"
            raise PipelineDefinitionError(msg)
        self.format = format
        self.path = None if path is None else os.fspath(path)
        self.table = table
        self.options = dict(options or {})
        self.schema = schema
        self.staging = None if staging is None else os.fspath(staging)
        self.batch_column = batch_column
        self.partition_by = tuple(partition_by)
        self._stage_root: str | None = None

    def describe_params(self) -> str:
        where = self.path or self.table or self.options.get("dbtable", "options")
        return f"{self.format} -> {where}"

    @property
    def exactly_once(self) -> bool:
        """True when a replayed batch overwrites its output (path= or table=)."""
        return self.path is not None or self.table is not None

    def _resolve(self, base_dir: str) -> None:
        if self.path is not None and not _has_scheme(self.path):
            self.path = os.path.abspath(os.path.join(base_dir, os.path.expanduser(self.path)))
        if self.staging is None:
            assert self.path is not None
            self.staging = self.path.rstrip("/") + "/_cdcflow_staging"
        elif not _has_scheme(self.staging):
            self.staging = os.path.abspath(os.path.join(base_dir, os.path.expanduser(self.staging)))

    def setup(self, ctx: SinkContext) -> None:
        self._resolve(ctx.base_dir)
        assert self.staging is not None
        self._stage_root = (
            f"{self.staging.rstrip('/')}/{_digest(ctx.pipeline)}-{_digest(ctx.sink_label)}"
        )

    def output_location(self) -> str | None:
        """The resolved ``path`` (``file://`` prefix and trailing ``/`` dropped), or
        ``table:<name>`` in lower case (Spark's catalog ignores case), or None for targets
        named only in ``options`` (appends, which overwrite nothing). Sinks with equal
        locations would overwrite each other's ``<batch column>=N`` partitions."""
        if self.table is not None:
            return f"table:{self.table.lower()}"
        if self.path is None:
            return None
        return self._resolved_path().removeprefix("file://").rstrip("/") or "/"

    def _resolved_path(self) -> str:
        assert self.path is not None
        if not _has_scheme(self.path) and not os.path.isabs(os.path.expanduser(self.path)):
            msg = (
                f"WriteSpark(path={self.path!r}) was not set up: the engine must call setup() "
                "to resolve a relative path"
            )
            raise SinkError(msg)
        return self.path

    def last_committed_batch(self) -> int:
        """For ``path=``: the highest ``<batch column>=N`` partition under the path, or 0.
        A table or an ``options`` target answers 0 (this sink does not know)."""
        if self.table is not None or self.path is None:
            return 0
        pattern = re.compile(re.escape(self.batch_column) + r"=(\d+)")
        path = self._resolved_path()
        try:
            names = _list_dirs(path)
        except OSError as exc:
            raise _storage_error("list", path, exc) from exc
        ids = [int(m.group(1)) for m in map(pattern.fullmatch, names) if m]
        return max(ids, default=0)

    def _root(self) -> str:
        if self._stage_root is None:
            msg = "WriteSpark was not set up: the runner must call setup() before tasks run"
            raise SinkError(msg)
        return self._stage_root

    def _batch_dir(self, batch_id: int) -> str:
        return f"{self._root()}/batch={batch_id:010d}"

    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, StagedFile]:
        name = f"{_digest(ctx.partition_token)}-{_digest(ctx.attempt)}.jsonl"
        return _StagingWriter(f"{self._batch_dir(ctx.batch_id)}/{name}")

    def commit(self, batch_id: int, messages: Sequence[StagedFile]) -> None:
        """Write the batch's staged rows; a second commit of ``batch_id`` overwrites the
        first (same rows, same partition), so replays do not duplicate output."""
        if messages:
            try:
                self._write(batch_id, [m.path for m in messages])
            except SinkError:
                raise
            except Exception as exc:
                msg = (
                    f"WriteSpark({self.describe_params()}) failed to write batch {batch_id}: "
                    f"{type(exc).__name__}: {str(exc)[:300]}; the batch will be replayed — "
                    "check the format, options and schema"
                )
                raise SinkError(msg) from exc
        _remove_tree(self._batch_dir(batch_id))

    def abort(self, batch_id: int, messages: Sequence[StagedFile]) -> None:
        _remove_tree(self._batch_dir(batch_id))

    def _session(self) -> Any:
        from cdcflow.spark.runner import active_session  # the module that imports pyspark

        session = active_session()
        if session is None:
            msg = (
                "WriteSpark commits with Spark on the driver and found no SparkSession: run "
                "the pipeline with the Spark runner (cdcflow run --runner spark)"
            )
            raise SinkError(msg)
        return session

    def _write(self, batch_id: int, paths: list[str]) -> None:
        spark = self._session()
        reader = spark.read
        if self.schema is not None:
            reader = reader.schema(self.schema)
        df = reader.json([_for_spark(p) for p in paths])
        df = df.selectExpr("*", f"CAST({int(batch_id)} AS BIGINT) AS {_quote(self.batch_column)}")
        if self.table is not None:
            self._write_table(spark, df)
            return
        writer = df.write.format(self.format).options(**self.options)
        if self.path is None:
            writer.mode("append").save()
            return
        writer = writer.partitionBy(self.batch_column, *self.partition_by)
        writer.mode("overwrite").option("partitionOverwriteMode", "dynamic").save(
            _for_spark(self.path)
        )

    def _write_table(self, spark: Any, df: Any) -> None:
        assert self.table is not None
        if not spark.catalog.tableExists(self.table):
            (
                df.write.format(self.format)
                .options(**self.options)
                .partitionBy(self.batch_column, *self.partition_by)
                .saveAsTable(self.table)
            )
            return
        fields = spark.table(self.table).schema.fields
        columns = [f.name for f in fields]
        missing = [c for c in df.columns if c not in columns]
        if missing:
            msg = (
                f"WriteSpark(table={self.table!r}): the batch has columns {missing} the table "
                "lacks; declare schema= so every batch has the table's columns"
            )
            raise SinkError(msg)
        # insertInto is positional: line the batch's columns up with the table's
        aligned = df.selectExpr(
            *[
                _quote(f.name)
                if f.name in df.columns
                else f"CAST(NULL AS {f.dataType.simpleString()}) AS {_quote(f.name)}"
                for f in fields
            ]
        )
        previous = spark.conf.get(_OVERWRITE_MODE)
        spark.conf.set(_OVERWRITE_MODE, "dynamic")
        try:
            aligned.write.insertInto(self.table, overwrite=True)
        finally:
            spark.conf.set(_OVERWRITE_MODE, previous)
