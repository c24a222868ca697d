"""WriteFiles: each batch as JSONL or Parquet files, exactly once, never over output it did
not commit.

Names in the output directory (``<d>``):

- ``<prefix>-<batch id, 10 digits>-<sha1 of the partition token, 16 hex>.<format>``: the
  committed files, one per (batch, partition) that had output. Stable across replays and
  readable; the naming scope ``<d>/<prefix>-*.<format>`` is what
  :meth:`WriteFiles.output_location` returns.
- ``_cdcflow/tmp/<batch id, 10 digits>/.<final name>.<label scope>.<sha1 of the task
  attempt, 16 hex>.tmp``: a task attempt's file until the batch commits, in a directory of
  its batch (so a commit looks only at its own batch's temporary files, whatever the
  output directory holds; the commit removes the directory once it is empty). The label
  scope is the sink's label made file-safe plus a digest of the label, so two sinks never
  share a temporary name, even in one directory.
- ``_cdcflow/<prefix>.<format>/batch-<batch id>.json``: the manifest of the newest batch
  that had files — the pipeline, the sink's label, and per committed file the slice
  (partition token, slice start, slice end) it came from. Keyed by the naming scope, not
  the label: whoever writes these final names checks the same manifests. Older manifests
  are deleted once a newer one is written (see :meth:`WriteFiles.commit`).
- ``_cdcflow/owner.json``: the pipeline whose output the directory holds
  (``{"pipeline": name}``), claimed with an exclusive create by the first pipeline that
  asks for its committed batches (or commits) there; a sink of another pipeline is
  refused (its batch ids are not the owner's: it would write the same changes again next
  to the owner's, and be refused batch by batch only where ids happen to collide; and
  ``_watermark.json`` is one pipeline's). Sinks of one pipeline may share the directory
  with different prefixes or formats.
- ``_watermark.json``: the pipeline's low watermark after the last commit.

Readers (Spark, pyarrow, pandas) skip names starting with ``.`` or ``_``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Sequence
from typing import Any, Literal

import attrs
import orjson

from cdcflow.errors import (
    OutputConflictError,
    PipelineDefinitionError,
    SinkError,
    SinkSetupError,
)
from cdcflow.model import Timestamp
from cdcflow.processes import process_alive
from cdcflow.transforms._fileio import (
    JsonlWriter,
    ParquetWriter,
    WrittenFile,
    create_exclusive,
    fsync_dir,
    storage,
    write_atomic,
)
from cdcflow.transforms.base import Sink, SinkContext, SinkWriter, WriterContext

__all__ = ["WriteFiles", "WrittenFile"]

_log = logging.getLogger("cdcflow.sinks")

_FORMATS = ("jsonl", "parquet")
_MANIFESTS = "_cdcflow"
_TEMPS = "tmp"  # under _MANIFESTS: a directory per batch of the task attempts' files
_MANIFEST_VERSION = 1
_MANIFEST_NAME = re.compile(r"batch-(\d{10,})\.json")
_OWNER = "owner.json"


def _read_if_there(path: str) -> bytes | None:
    """The bytes of ``path``, or None if there is no such file (other failures: SinkIOError)."""
    with storage("read", path):
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _label_scope(label: str) -> str:
    """``label`` as a file-name part without dots: readable, and distinct per label."""
    readable = re.sub(r"[^A-Za-z0-9_-]+", "_", label).strip("_")[:40] or "sink"
    return f"{readable}-{_digest(label)[:10]}"


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


@attrs.frozen
class _Entry:
    """One committed file of a manifest and the slice it came from."""

    name: str
    partition_token: str
    slice_start: int
    slice_end: int
    count: int

    @property
    def slice(self) -> tuple[str, int, int]:
        return self.partition_token, self.slice_start, self.slice_end


@attrs.frozen
class _Manifest:
    """What one batch committed under one naming scope."""

    pipeline: str
    sink: str
    batch: int
    files: tuple[_Entry, ...]

    def to_json(self) -> bytes:
        return orjson.dumps(
            {"version": _MANIFEST_VERSION, "pipeline": self.pipeline, "sink": self.sink,
             "batch": self.batch, "files": [attrs.asdict(e) for e in self.files]},
            option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE,
        )

    @classmethod
    def parse(cls, data: bytes) -> _Manifest:
        """Raises ValueError, KeyError or TypeError for anything but a version-1 manifest."""
        doc = orjson.loads(data)
        if doc["version"] != _MANIFEST_VERSION:
            msg = f"manifest version {doc['version']!r}"
            raise ValueError(msg)
        files = tuple(
            _Entry(str(f["name"]), str(f["partition_token"]), int(f["slice_start"]),
                   int(f["slice_end"]), int(f["count"]))
            for f in doc["files"]
        )
        return cls(str(doc["pipeline"]), str(doc["sink"]), int(doc["batch"]), files)


# A URL (s3://bucket/x, file:///x), not a path: WriteFiles would make a directory of it.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


class WriteFiles(Sink[Any, WrittenFile]):
    """Writes each batch to files under ``path``, exactly once per batch.

    Every task writes one file per (batch id, partition token) under a hidden temporary
    name unique to the sink and the task attempt; the driver renames it to its final name
    when the batch commits (see the module docstring for every name). Tasks that wrote
    nothing produce no file, and a batch without files writes no manifest.

    How a commit stays exactly-once, and why in this order:

    1. Read the batch's manifest and refuse output this run did not commit
       (:class:`~cdcflow.errors.OutputConflictError`, nothing changed): a manifest of
       another pipeline or sink, or whose files share no slice with this commit or come
       from other slices; or a final name that exists while no manifest claims it. A
       replay of the batch (the same slices) passes: that is the engine's crash recovery.
    2. Write the manifest atomically (and fsync it) before any rename. Once a final name
       can be visible a manifest claims it, so a crash anywhere after this step leaves
       output that the replay recognises as its own and completes (step 1 passes, step 3
       renames identical bytes), that any other run is refused instead of overwriting,
       and that :meth:`last_committed_batch` counts. Renaming first would leave, after a
       crash between the two, visible files no manifest claims, which the run's own
       replay could not tell from another run's.
    3. Rename each temporary file to its final name (atomic per file).
    4. Delete the batch's temporary files left by failed attempts (and their directory);
       fsync the directory; delete the manifests of earlier batches. Only the newest one
       is ever read again: a replay reads its own batch's, and the engine commits batch N
       in a sink only after the store has committed N-1, so the batch a crash leaves
       pending is always the newest; the owner inference and :meth:`owned_batch` read the
       newest. So the directory holds one manifest, not one per batch for ever.

    Two WriteFiles sinks may share a directory when their naming scopes
    (``prefix`` and ``format``) differ, e.g. a jsonl and a parquet sink, or a dead-letter
    sink with ``prefix="failed"``: temporary names and manifests are per sink and scope, so
    they never touch each other's files. Two sinks with the same directory, prefix and
    format would write the same final names: their :meth:`output_location` is equal and
    the engine refuses the pipeline; if both commit anyway, the second one's commit is
    refused (step 1) before it overwrites anything.

    A directory holds one pipeline's output (its sinks may share it with other prefixes):
    ``_cdcflow/owner.json`` names it, claimed (an exclusive create) when the engine first
    asks for :meth:`last_committed_batch` — at start, after it has checked the pipeline's
    sinks against each other, so a pipeline refused there claims nothing. A sink of another
    pipeline is refused there (:class:`~cdcflow.errors.OutputConflictError`, nothing
    written): its batch ids are not the owner's, so it would add the same changes again
    under other batch ids. Output written before owners were recorded belongs to the
    pipeline its newest manifest names (or, without manifests, to the first pipeline that
    runs). The same pipeline restarting, with ``--reset`` or a new store, goes on.

    ``format="jsonl"``: one JSON object per line; elements are records, attrs or dataclass
    instances, or dicts (see :mod:`cdcflow.serialize`). ``format="parquet"``: elements become
    rows the same way; nested values (dicts, lists, mods) are stored as JSON text,
    timestamps as RFC 3339 text, and a column whose values are all null in a file as
    string. A column keeps one type within a file: an element whose value has another
    type fails at ``write`` (a SinkError the error policy retries or skips to the
    dead-letter sink) and the other rows are written. A parquet writer writes its file
    when the task ends; until then it keeps at most 50,000 rows or 2 MiB of their payload
    in memory (less when more Parquet writers are open in the process: 8 MiB among
    them) and spills the rest to local disk. A storage failure (``OSError``) in a writer or a
    commit raises :class:`~cdcflow.errors.SinkIOError`: the batch is retried.

    After each commit ``_watermark.json`` holds the pipeline's low watermark
    (``{"low_watermark": RFC 3339, "ns": int}``): every record with a commit timestamp below
    it is in the committed files.

    A relative ``path`` resolves against the pipeline file's directory. On a cluster,
    ``path`` must be on a filesystem shared by the driver and every executor. ``fsync=False``
    trades durability after a machine crash for speed.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        format: Literal["jsonl", "parquet"] = "jsonl",
        prefix: str = "part",
        fsync: bool = True,
    ) -> None:
        if not isinstance(path, str | os.PathLike):
            msg = f"WriteFiles({path!r}): pass a directory path, e.g. WriteFiles('out/orders')"
            raise PipelineDefinitionError(msg)
        path = os.fspath(path)
        if not path:
            msg = "WriteFiles needs a directory path, e.g. WriteFiles('out/orders')"
            raise PipelineDefinitionError(msg)
        if _URL.match(path):
            msg = (f"WriteFiles({path!r}): WriteFiles writes to a local or shared directory; "
                   "for object storage use WriteTables (s3://, gs://, ...), or give a path")
            raise PipelineDefinitionError(msg)
        if format not in _FORMATS:
            msg = f"WriteFiles(format={format!r}): use one of {', '.join(_FORMATS)}"
            raise PipelineDefinitionError(msg)
        if not prefix or prefix.startswith((".", "_")) or os.sep in prefix or "/" in prefix:
            msg = (
                f"WriteFiles(prefix={prefix!r}): use a plain file name prefix such as 'part' "
                "(no path separators, not starting with '.' or '_')"
            )
            raise PipelineDefinitionError(msg)
        self.path = path
        self.format = format
        self.prefix = prefix
        self.fsync = fsync
        expanded = os.path.expanduser(path)
        # absolute paths need no setup; relative ones are resolved by setup() on the driver
        self.directory: str | None = os.path.abspath(expanded) if os.path.isabs(expanded) else None
        self._pipeline: str | None = None
        self._label: str | None = None
        self._last_watermark: int | None = None
        self._claimed = False
        self._owned_before = False
        self._manifests: set[int] | None = None  # the scope's manifest batch ids, once listed

    def describe_params(self) -> str:
        return f"{self.path} ({self.format})"

    # -- where output goes ------------------------------------------------------------------

    def setup(self, ctx: SinkContext) -> None:
        expanded = os.path.expanduser(self.path)
        self.directory = os.path.abspath(os.path.join(ctx.base_dir, expanded))
        self._pipeline, self._label = ctx.pipeline, ctx.sink_label
        # The naming scope is claimed when the engine first asks for the committed batches
        # (right after it has checked the pipeline's sinks against each other): a pipeline
        # refused at start leaves no claim behind.
        self._claimed = False
        self._owned_before = False
        self._manifests = None
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            msg = (f"WriteFiles cannot create {self.directory}: {exc.strerror or exc}; "
                   "choose a writable path")
            raise SinkSetupError(msg) from exc
        if not os.access(self.directory, os.W_OK | os.X_OK):  # also a read-only mount
            msg = (f"WriteFiles cannot write in {self.directory} (a read-only filesystem or "
                   "no permission); choose a writable path")
            raise SinkSetupError(msg)
        self._sweep_watermark_temps()

    def _sweep_watermark_temps(self) -> None:
        """Remove this sink's ``_watermark.json`` temporary files that a killed run left
        (named by the writing process: only a dead one's are removed)."""
        assert self.directory is not None
        pattern = re.compile(
            re.escape(f"._watermark.json.{_label_scope(self._label or '')}.") + r"(\d+)\.tmp")
        for name in _listdir(self.directory):
            m = pattern.fullmatch(name)
            if m is not None and not process_alive(int(m.group(1))):
                with contextlib.suppress(OSError):  # another run took it first
                    os.remove(os.path.join(self.directory, name))

    def _dir(self) -> str:
        if self.directory is None:
            msg = (
                f"WriteFiles({self.path!r}) was not set up: the runner must call setup() "
                "before tasks run (or pass an absolute path)"
            )
            raise SinkError(msg)
        return self.directory

    def _identity(self) -> tuple[str, str]:
        if self._pipeline is None or self._label is None:
            msg = (
                f"WriteFiles({self.path!r}) was not set up: the engine must call setup() on "
                "the driver before it commits, aborts or asks for committed batches"
            )
            raise SinkError(msg)
        return self._pipeline, self._label

    def output_location(self) -> str:
        """``<directory>/<prefix>-*.<format>``: the final names this sink writes (after setup).

        Sinks with different prefixes or formats in one directory are safe together (see
        the class docstring); equal locations mean the same final names.
        """
        return os.path.join(self._dir(), f"{self.prefix}-*.{self.format}")

    def final_name(self, batch_id: int, partition_token: str) -> str:
        """The committed file name for a batch and partition (stable across replays)."""
        return f"{self.prefix}-{batch_id:010d}-{_digest(partition_token)}.{self.format}"

    def temp_name(self, ctx: WriterContext) -> str:
        """The hidden name a writer for ``ctx`` writes until the batch commits: unique per
        sink label and task attempt."""
        final = self.final_name(ctx.batch_id, ctx.partition_token)
        return f".{final}.{_label_scope(ctx.sink_label)}.{_digest(ctx.attempt)}.tmp"

    def _temp_dir(self, batch_id: int) -> str:
        """Where the task attempts of ``batch_id`` write (see the module docstring)."""
        return os.path.join(self._dir(), _MANIFESTS, _TEMPS, f"{batch_id:010d}")

    def _temps(self, batch_id: int) -> list[str]:
        """This sink's temporary files of ``batch_id`` (every attempt's, spill files too):
        one listing of the batch's own directory."""
        _, label = self._identity()
        pattern = re.compile(
            re.escape(f".{self.prefix}-{batch_id:010d}-") + "[0-9a-f]{16}"
            + re.escape(f".{self.format}.{_label_scope(label)}.") + r"[0-9a-f]{16}\.tmp"
            + r"(?:\.\d+\.spill)?"  # a Parquet writer's spilled rows
        )
        directory = self._temp_dir(batch_id)
        with storage("list", directory):
            names = _listdir(directory)
        return [os.path.join(directory, n) for n in names if pattern.fullmatch(n)]

    def _drop_temps(self, batch_id: int, known: Sequence[str] = ()) -> None:
        """Delete the batch's temporary files (``known`` ones and any other attempt's),
        then its directory once no sink has a file left there."""
        for temp in {*known, *self._temps(batch_id)}:
            with storage("delete", temp), contextlib.suppress(FileNotFoundError):
                os.remove(temp)
        with contextlib.suppress(OSError):  # another sink's files, or already gone
            os.rmdir(self._temp_dir(batch_id))

    def _manifest_dir(self) -> str:
        return os.path.join(self._dir(), _MANIFESTS, f"{self.prefix}.{self.format}")

    def owned_batch(self) -> int:
        """The highest batch among this naming scope's manifests when the directory was
        this pipeline's before this run (its owner record, or its newest manifest, named
        it), else 0 (after setup). Claims the naming scope first (see :meth:`_claim`)."""
        self._claim()
        return self._highest(manifests_only=True) if self._owned_before else 0

    def last_committed_batch(self) -> int:
        """The highest batch id among this naming scope's manifests and final file names
        (files written before manifests existed count too), or 0 (after setup).

        Claims the naming scope for this sink's pipeline first (see :meth:`_claim`).
        """
        self._claim()
        return self._highest(manifests_only=False)

    def _highest(self, manifests_only: bool) -> int:
        final = re.compile(
            re.escape(f"{self.prefix}-") + r"(\d{10,})-[0-9a-f]{16}" + re.escape(f".{self.format}")
        )
        places = [(self._manifest_dir(), _MANIFEST_NAME)]
        if not manifests_only:
            places.append((self._dir(), final))
        best = 0
        for directory, pattern in places:
            with storage("list", directory):
                names = _listdir(directory)
            found = {int(m.group(1)) for m in map(pattern.fullmatch, names) if m}
            if pattern is _MANIFEST_NAME:
                self._manifests = found  # what the next commit prunes
            best = max([best, *found])
        return best

    def _owner_path(self) -> str:
        return os.path.join(self._dir(), _MANIFESTS, _OWNER)

    def _claim(self) -> None:
        """Make the directory this pipeline's, or raise OutputConflictError (nothing
        written) when it holds another pipeline's output. Once per setup.

        The owner is ``owner.json``; without one (an empty directory, or output of a version
        that recorded no owner) the pipeline of the newest manifest, if any; without that
        this pipeline, which then creates ``owner.json`` exclusively: of two pipelines
        claiming at once, one wins and the other reads the winner's name and is refused.
        """
        if self._claimed:
            return
        pipeline, _ = self._identity()
        path = self._owner_path()
        owner = self._read_owner(path)
        self._owned_before = owner == pipeline
        if owner is None:
            found = self._newest_manifest_pipeline()
            self._owned_before = found == pipeline
            owner = found or pipeline
            if owner == pipeline:
                try:
                    self._create_owner(path, pipeline)
                except FileExistsError:  # another run claimed it since we looked
                    owner = self._read_owner(path) or pipeline
        if owner != pipeline:
            if self._holds_output():
                msg = (
                    f"WriteFiles {self._dir()} holds the output of pipeline {owner!r}, not "
                    f"{pipeline!r}; nothing was written: give each pipeline its own "
                    f"directory, or, for a renamed pipeline, write its new name in {path}"
                )
            else:  # claimed by a run that wrote nothing (it failed at start, say)
                msg = (
                    f"WriteFiles {self._dir()} was claimed by pipeline {owner!r} ({path}), "
                    f"which wrote no output there; nothing was written: if no run of "
                    f"{owner!r} writes there, delete {path} (or write {pipeline!r} in it), "
                    "or give this pipeline its own directory"
                )
            raise OutputConflictError(msg)
        self._claimed = True

    def _holds_output(self) -> bool:
        """Whether the directory holds anything but its ``_cdcflow`` records, or a
        manifest of a committed batch."""
        with storage("list", self._dir()):
            names = _listdir(self._dir())
        if any(not name.startswith((_MANIFESTS, ".")) for name in names):
            return True
        with storage("list", self._manifest_dir()):
            return any(map(_MANIFEST_NAME.fullmatch, _listdir(self._manifest_dir())))

    def _read_owner(self, path: str) -> str | None:
        data = _read_if_there(path)
        if data is None:
            return None
        try:
            doc = orjson.loads(data)
            return str(doc["pipeline"])
        except (ValueError, KeyError, TypeError) as exc:
            msg = (
                f"WriteFiles {self._dir()}: {path} is not one cdcflow wrote "
                f"({type(exc).__name__}: {exc}); write {{\"pipeline\": \"<name>\"}} in it, "
                "naming the pipeline whose output the directory holds"
            )
            raise OutputConflictError(msg) from exc

    def _newest_manifest_pipeline(self) -> str | None:
        """The pipeline named by the scope's newest manifest (output written before owners
        were recorded), or None: no manifest, or not one this version reads."""
        directory = self._manifest_dir()
        with storage("list", directory):
            names = _listdir(directory)
        batches = [int(m.group(1)) for m in map(_MANIFEST_NAME.fullmatch, names) if m]
        if not batches:
            return None
        try:
            manifest = self._read_manifest(max(batches))
        except OutputConflictError:
            return None  # a commit of that batch id refuses it; no owner to infer here
        return None if manifest is None else manifest.pipeline

    def _create_owner(self, path: str, pipeline: str) -> None:
        """Write ``path`` only if it does not exist (FileExistsError if it does)."""
        _, label = self._identity()
        body = orjson.dumps({"pipeline": pipeline}, option=orjson.OPT_APPEND_NEWLINE)
        temp = os.path.join(
            os.path.dirname(path),
            f".{_OWNER}.{_label_scope(label)}.{os.getpid()}.{threading.get_ident()}.tmp",
        )
        if not create_exclusive(path, temp, body, self.fsync):
            raise FileExistsError(path)

    # -- tasks -------------------------------------------------------------------------------

    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, WrittenFile]:
        directory = self._dir()
        final = os.path.join(directory, self.final_name(ctx.batch_id, ctx.partition_token))
        temp = os.path.join(self._temp_dir(ctx.batch_id), self.temp_name(ctx))
        if self.format == "parquet":
            return ParquetWriter(temp, final, ctx, self.fsync)
        return JsonlWriter(temp, final, ctx, self.fsync)

    # -- the driver ---------------------------------------------------------------------------

    def commit(self, batch_id: int, messages: Sequence[WrittenFile]) -> None:
        """Make the batch's files visible in the four steps of the class docstring;
        idempotent for ``batch_id`` (a replay with the same slices changes nothing).

        Raises OutputConflictError for output this run did not commit (nothing changed),
        SinkError when a message's file is nowhere (the path is not shared), SinkIOError
        on a storage failure.
        """
        directory = self._dir()
        if messages:
            self._claim()
            # 1. what the directory holds of this batch, and of later ones
            existing = self._read_manifest(batch_id)
            manifest = self._merge(batch_id, existing, messages)
            claimed = set() if existing is None else {e.name for e in existing.files}
            try:
                pending = [m for m in messages if self._pending(batch_id, m, claimed)]
            except SinkError:
                # A file gone: another run committing here may have swept it.
                self._check_other_run(batch_id, existing, messages)
                raise
            self._check_no_later_batch(batch_id)
            # 2. the manifest, before any final name can appear
            if manifest != existing:
                self._write_manifest(manifest)
            # 3. the renames
            for message in pending:
                self._rename(batch_id, message)
        # 4. leftovers of failed attempts; durable renames; earlier manifests
        self._drop_temps(batch_id)
        if self.fsync and messages:
            with storage("sync", directory):
                fsync_dir(directory)
        if messages:
            self._prune_manifests(batch_id)
        elif self._manifests is not None and not self._manifests and self._claimed:
            # The scope's first commit, with no file (its manifests were listed, the
            # directory claimed, at setup): a manifest all the same (once), so that a later
            # run knows this sink was the pipeline's already and does not warn that a sink
            # new to it misses what was committed before.
            pipeline, label = self._identity()
            self._write_manifest(_Manifest(pipeline, label, batch_id, ()))
            self._manifests = {batch_id}

    def _check_no_later_batch(self, batch_id: int) -> None:
        """Raise OutputConflictError when the scope holds the manifest of a batch after
        ``batch_id``: another run of the pipeline commits here too (started on another
        metadata store, say, with --reset), and every change would be written twice.
        Commits come in batch order, so none of this run's own comes later."""
        try:
            names = _listdir(self._manifest_dir())
        except OSError:
            return
        # the scope's manifests as they are: what this commit prunes (step 4)
        self._manifests = {int(m.group(1)) for m in map(_MANIFEST_NAME.fullmatch, names) if m}
        later = max(self._manifests, default=0)
        if later > batch_id:
            raise self._two_runs(later, batch_id)

    def _check_other_run(self, batch_id: int, seen: _Manifest | None,
                         messages: Sequence[WrittenFile]) -> None:
        """Raise OutputConflictError when another run commits here: a later batch, or
        this batch's manifest changed since this commit looked or lacks this commit's files
        (both runs at one batch id: its commit sweeps the batch's temporary files, this
        run's too; a replay of this run's own names them all)."""
        self._check_no_later_batch(batch_id)
        now = self._read_manifest(batch_id)
        names = {os.path.basename(m.final) for m in messages}
        if now != seen or (now is not None and not names <= {e.name for e in now.files}):
            raise self._two_runs(batch_id, batch_id)

    def _two_runs(self, theirs: int, ours: int) -> OutputConflictError:
        pipeline, _ = self._identity()
        msg = (
            f"WriteFiles {self._dir()}: batch {theirs} was committed here by another run "
            f"while this run commits batch {ours}: two runs of pipeline {pipeline!r} "
            "write this output (each with its own metadata store?); nothing of this "
            "batch was written: stop the run whose store is not the pipeline's"
        )
        return OutputConflictError(msg)

    def _conflict(self, batch_id: int, why: str) -> OutputConflictError:
        msg = (
            f"WriteFiles {self._dir()}: batch {batch_id} already holds output this run did not "
            f"commit ({why}); nothing was overwritten: write to a new path, resume with the "
            "metadata store that wrote it, or delete that output"
        )
        return OutputConflictError(msg)

    def _merge(
        self, batch_id: int, existing: _Manifest | None, messages: Sequence[WrittenFile]
    ) -> _Manifest:
        """The manifest after this commit; raises OutputConflictError if ``existing`` is
        not an earlier commit of the same batch (same pipeline, sink and slices)."""
        pipeline, label = self._identity()
        entries = {
            os.path.basename(m.final): _Entry(
                os.path.basename(m.final), m.partition_token, m.slice_start, m.slice_end, m.count
            )
            for m in messages
        }
        if existing is not None and (existing.pipeline, existing.sink) != (pipeline, label):
            why = f"by sink {existing.sink!r} of pipeline {existing.pipeline!r}"
            raise self._conflict(batch_id, why)
        if existing is None or not existing.files:  # nothing committed yet, or no file
            return _Manifest(pipeline, label, batch_id, tuple(entries[n] for n in sorted(entries)))
        # The same pipeline and sink, other partitions or slices: the batch was planned
        # anew elsewhere (a replay plans the same slices).
        old = {e.name: e for e in existing.files}
        shared = [name for name in entries if name in old]
        if not shared or any(entries[n].slice != old[n].slice for n in shared):
            pipeline, _ = self._identity()
            msg = (
                f"WriteFiles {self._dir()}: batch {batch_id} already holds output this run "
                f"did not commit (pipeline {pipeline!r} read other partitions or slices for "
                "it): another run of the pipeline writes here with its own metadata store, "
                "or this run's store is not the one that wrote it; nothing was overwritten: "
                "stop the run whose store is not the pipeline's, resume with the metadata "
                "store that wrote it, or write to a new path"
            )
            raise OutputConflictError(msg)
        # A replay names the same files; keep any the first commit had beyond them.
        merged = {**old, **entries}
        return attrs.evolve(existing, files=tuple(merged[n] for n in sorted(merged)))

    def _pending(self, batch_id: int, message: WrittenFile, claimed: set[str]) -> bool:
        """Whether ``message`` still needs its rename; refuses a final file nobody claims."""
        name = os.path.basename(message.final)
        has_temp, has_final = os.path.exists(message.temp), os.path.exists(message.final)
        if has_final and name not in claimed:
            why = f"{name} exists and no manifest of this sink claims it"
            raise self._conflict(batch_id, why)
        if not has_temp and not has_final:
            msg = (
                f"batch {batch_id}: neither {message.temp} nor {message.final} exists; the "
                "path must be shared by the driver and every executor (the batch will be "
                "replayed)"
            )
            raise SinkError(msg)
        return has_temp

    def _rename(self, batch_id: int, message: WrittenFile) -> None:
        with storage("rename", message.temp):
            try:
                os.replace(message.temp, message.final)
            except FileNotFoundError:
                if not os.path.exists(message.final):
                    raise

    def _prune_manifests(self, newest: int) -> None:
        """Delete the scope's manifests of batches before ``newest``, whose manifest is
        written (step 4 of :meth:`commit`), as the commit's check for later batches listed
        them (listed here when it could not: the scope's first). Best effort: the batch is
        committed whatever happens here, and a manifest that cannot be deleted now is tried
        again at the next commit."""
        if self._manifests is None:
            try:
                names = _listdir(self._manifest_dir())
            except OSError:
                return
            self._manifests = {int(m.group(1)) for m in map(_MANIFEST_NAME.fullmatch, names) if m}
        for batch in sorted(b for b in self._manifests if b < newest):
            try:
                os.remove(self._manifest_path(batch))
            except FileNotFoundError:
                pass
            except OSError as exc:
                _log.warning("WriteFiles %s: cannot delete the old manifest of batch %d: %s",
                             self._dir(), batch, exc.strerror or exc)
                continue
            self._manifests.discard(batch)
        self._manifests.add(newest)

    def _manifest_path(self, batch_id: int) -> str:
        return os.path.join(self._manifest_dir(), f"batch-{batch_id:010d}.json")

    def _read_manifest(self, batch_id: int) -> _Manifest | None:
        path = self._manifest_path(batch_id)
        data = _read_if_there(path)
        if data is None:
            return None
        try:
            return _Manifest.parse(data)
        except (ValueError, KeyError, TypeError) as exc:
            msg = (
                f"WriteFiles {self._dir()}: batch {batch_id}'s manifest {path} is not one "
                f"cdcflow wrote ({type(exc).__name__}: {exc}); write to a new path, or "
                "delete the directory's output"
            )
            raise OutputConflictError(msg) from exc

    def _write_manifest(self, manifest: _Manifest) -> None:
        directory = self._manifest_dir()
        with storage("create", directory):
            os.makedirs(directory, exist_ok=True)
        path = self._manifest_path(manifest.batch)
        _, label = self._identity()
        temp = os.path.join(directory, f".{os.path.basename(path)}.{_label_scope(label)}.tmp")
        write_atomic(path, temp, manifest.to_json(), self.fsync)

    def abort(self, batch_id: int, messages: Sequence[WrittenFile]) -> None:
        """Delete the batch's temporary files of this sink; committed files and manifests
        are left alone."""
        self._drop_temps(batch_id, [m.temp for m in messages])

    def on_watermark(self, watermark_ns: int) -> None:
        """Atomically write ``_watermark.json``; a value no larger than the one there is
        ignored (a run that starts over, with ``--reset`` or a ``memory://`` store, begins
        below it, and what the file says still holds: the earlier output is there)."""
        if self._last_watermark is None:
            self._last_watermark = self._stored_watermark()
        if self._last_watermark is not None and watermark_ns <= self._last_watermark:
            return
        directory = self._dir()
        body = orjson.dumps(
            {"low_watermark": Timestamp.from_ns(watermark_ns).rfc3339(), "ns": watermark_ns}
        )
        scope = _label_scope(self._label or "")
        temp = os.path.join(directory, f"._watermark.json.{scope}.{os.getpid()}.tmp")
        write_atomic(os.path.join(directory, "_watermark.json"), temp, body, self.fsync)
        self._last_watermark = watermark_ns

    def _stored_watermark(self) -> int | None:
        """The ``ns`` of the directory's ``_watermark.json`` (None: none, or unreadable)."""
        data = _read_if_there(os.path.join(self._dir(), "_watermark.json"))
        try:
            return None if data is None else int(orjson.loads(data)["ns"])
        except (ValueError, KeyError, TypeError):
            return None
