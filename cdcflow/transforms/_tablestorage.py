"""Where a WriteTables sink's output lives: an fsspec filesystem and the URL's root, and
every read and write the sink makes there (the layout is in ``tables``'s docstring).

A write is atomic: one PUT on an object store, a temporary name and a rename on local disk
(where a reader could see a half-written file). The claim (``_cdcflow/durable.json``, which
names the pipeline whose output the URL holds) is an exclusive create: a link on local
disk, a conditional PUT where the store has one (S3's If-None-Match), so of two pipelines
claiming an empty URL at once one is refused.

Each file is claimed the same way before its upload (``_cdcflow/claims/<table>/
[<partition>/]<first>.json`` names its batches ``first..last`` and schema version): of two
runs about to write files starting at one batch of a key, a stale one (paused past its
lease while its upload was on the wire) and the one that took over, one claim wins; the
other run's file is never uploaded, or follows the claim to the same name (``tables``).
A claim is removed once its file is uploaded: the file's name then says the same.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any

import fsspec
import orjson

from cdcflow.errors import OutputConflictError, SinkError, SinkIOError, SinkSetupError
from cdcflow.model import Timestamp
from cdcflow.transforms._fileio import create_exclusive, quiet_cut_requests
from cdcflow.transforms._tablerows import Schema
from cdcflow.transforms._tablespool import storage_errors

__all__ = ["TableStorage"]

_PART = re.compile(r"part-(\d+)-(\d+)-(\d+)\.(parquet|jsonl|csv)$")
_VERSION = re.compile(r"v(\d+)\.json$")
_CLAIM = re.compile(r"/(\d+)\.json$")
#: How often a claim that another run removes while this one looks is looked at again.
_LOOKS = 5
#: fsspec protocols of object stores: no directories to make (on S3, makedirs is a request)
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"})


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _lasts(names: list[str]) -> int:
    """The largest ``last`` among the part files ``names`` (0: none)."""
    return max((int(m.group(2)) for n in names
                if "/_cdcflow/" not in n and (m := _PART.search(n))), default=0)


#: The longest a run waits at start for an object store's first answer (its bucket): a
#: storage that takes connections and never answers would hold the run silent for minutes
#: (the storage client's timeouts and retries), where one that refuses them is said at once.
FIRST_ANSWER_SECONDS = 30.0


def _answered(call: Callable[[], Any], shown: str) -> Any:
    """``call()``, or SinkSetupError when it has not returned in FIRST_ANSWER_SECONDS (the
    call goes on, on a thread of its own, and ends with the storage client's timeouts)."""
    out: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # raised in the caller
            out["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="cdcflow-storage-check", daemon=True).start()
    if not done.wait(FIRST_ANSWER_SECONDS):
        msg = (f"WriteTables: the storage of {shown} did not answer in "
               f"{FIRST_ANSWER_SECONDS:.0f}s; check that it is up and that the URL (and "
               "its endpoint, such as AWS_ENDPOINT_URL) points at it")
        raise SinkSetupError(msg)
    if "error" in out:
        raise out["error"]
    return out.get("value")


class TableStorage:
    """The output location of one WriteTables sink on the driver. ``url`` is absolute (a
    local path made absolute, or any fsspec URL); ``shown`` is the URL as the user gave it,
    for messages. Opening it checks that it can be written (raises SinkSetupError naming
    the fix): a local root is made, an object store's bucket must exist (it is never made:
    on S3, makedirs would create a bucket a typo names)."""

    def __init__(self, url: str, shown: str, storage_options: Mapping[str, Any],
                 format: str = "parquet", unit: str = "ns") -> None:
        self.shown = shown
        self.format = format  # of the files written here: the durable mark names it
        self.unit = unit  # of their timestamps, in Parquet: the durable mark names it too
        self._made: set[str] = set()  # directories made in storage
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
            self.root: str = root.rstrip("/")
            quiet_cut_requests(self.fs)
            if self._object_store:
                bucket = self.root.split("/", 1)[0]
                try:
                    _answered(lambda: self.fs.info(bucket), shown)
                except FileNotFoundError:
                    msg = (f"WriteTables: the bucket {bucket!r} of {shown} does not exist "
                           "(or these credentials cannot see it); create it, or fix the URL")
                    raise SinkSetupError(msg) from None
            else:
                self.fs.makedirs(self.root, exist_ok=True)
        except storage_errors(SinkIOError, ValueError, ImportError) as exc:
            raise self._setup_error(exc) from exc
        if self._local and not os.access(self.root, os.W_OK | os.X_OK):
            msg = (f"WriteTables cannot write in {self.root} (a read-only filesystem or no "
                   "permission); choose a writable path")
            raise SinkSetupError(msg)

    @property
    def _local(self) -> bool:
        return "file" in _protocols(self.fs)

    @property
    def _object_store(self) -> bool:
        return bool(_OBJECT_STORES & set(_protocols(self.fs)))

    def _setup_error(self, exc: BaseException) -> SinkSetupError:
        if isinstance(exc, SinkSetupError):
            return exc
        return SinkSetupError(
            f"WriteTables cannot open {self.shown}: {type(exc).__name__}: {exc}; check the "
            "URL, that the storage answers, and the credentials")

    def _listed(self) -> Any:
        """The filesystem, its listings cache emptied first: every listing here must see
        what other runs wrote meanwhile. fsspec's object stores (s3fs, gcsfs) serve a
        directory listed once from a cache until this process writes into that very
        directory, so a run that took over listed the lake at start and missed the file
        the run before it uploaded just then, and wrote its batches again."""
        self.fs.invalidate_cache()
        return self.fs

    def _glob(self, pattern: str) -> list[str]:
        """The paths matching ``pattern``, listed afresh (:meth:`_listed`): none where the
        directory is not there, SinkIOError when the storage fails."""
        try:
            names: list[str] = self._listed().glob(pattern)
        except FileNotFoundError:
            return []
        except storage_errors() as exc:
            msg = f"WriteTables cannot list {pattern}: {exc}"
            raise SinkIOError(msg) from exc
        return names

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *[p for p in parts if p]])

    def location(self) -> str:
        return f"{_protocols(self.fs)[0]}://{self.root}/"

    # -- the claim and the durable mark ------------------------------------------------------

    def claim(self, pipeline: str) -> tuple[int, int]:
        """Make the URL ``pipeline``'s; returns (its durable batch, the durable batch the
        mark held for this pipeline before: 0 when claimed now or when the mark named no
        pipeline). Another pipeline's output there is refused (OutputConflictError: its
        batch ids are not this pipeline's, so a replay would skip this pipeline's rows as
        written), and so are files of another format (a file an earlier run claimed would
        land twice, once in each format, and a schema version names one format), and
        Parquet files with timestamps in another unit (a table's schema names one unit)."""
        path = self.path("_cdcflow", "durable.json")
        owned = 0
        try:
            data = self.read(path)
            if data is None:
                try:
                    self.create(path, self._mark_doc(pipeline, 0))
                    return 0, 0
                except FileExistsError:  # another run claimed it since we looked
                    data = self.read(path)
            doc = orjson.loads(data) if data else {}
            owner, durable = doc.get("pipeline"), int(doc.get("durable_batch", 0))
            written, unit = doc.get("format"), doc.get("timestamp_unit")
            if owner is None:  # written before marks named their pipeline
                self.put(path, self._mark_doc(pipeline, durable))
            else:
                owned = durable  # this pipeline's own durable output (checked below)
        except storage_errors(SinkIOError) as exc:
            raise self._setup_error(exc) from exc
        if owner is not None and owner != pipeline:
            msg = (f"WriteTables: {self.shown} holds the output of pipeline {owner!r}, not "
                   f"{pipeline!r}; give each pipeline its own URL (for a renamed "
                   "pipeline, write its new name in _cdcflow/durable.json there)")
            raise OutputConflictError(msg)
        if written is not None and written != self.format:
            msg = (f"WriteTables: {self.shown} holds {written} files of pipeline "
                   f"{pipeline!r}, and this sink writes {self.format}: a URL holds one "
                   f"format; keep format={written!r}, or write {self.format} to another URL")
            raise OutputConflictError(msg)
        if unit is not None and self.format == "parquet" and unit != self.unit:
            msg = (f"WriteTables: {self.shown} holds Parquet files of pipeline {pipeline!r} "
                   f"with timestamps in {unit}, and this sink writes them in {self.unit}: a "
                   f"URL holds one timestamp unit (a table's schema names it); keep "
                   f"timestamp_unit={unit!r}, or write {self.unit} to another URL")
            raise OutputConflictError(msg)
        return durable, owned

    def mark(self, pipeline: str, durable: int) -> None:
        """Write the durable mark (after the data it covers)."""
        self.put(self.path("_cdcflow", "durable.json"), self._mark_doc(pipeline, durable))

    def _mark_doc(self, pipeline: str, durable: int) -> bytes:
        doc = {"durable_batch": durable, "pipeline": pipeline, "format": self.format}
        if self.format == "parquet":
            doc["timestamp_unit"] = self.unit
        return orjson.dumps({**doc, "at": str(Timestamp.now())})

    # -- file claims -------------------------------------------------------------------------

    def _claim_path(self, table: str, directory: str, first: int) -> str:
        return self.path("_cdcflow", "claims", table, directory, f"{first}.json")

    def _claim_doc(self, path: str) -> dict[str, Any] | None:
        """A claim's contents (None when it is gone meanwhile)."""
        data = self.read(path)
        if data is None:
            return None
        try:
            doc = orjson.loads(data)
            if not isinstance(doc, dict):
                raise TypeError(type(doc).__name__)
            for key in ("first", "last", "version"):  # the sink writes all three
                if key not in doc:
                    msg = f"it has no {key}"
                    raise ValueError(msg)
                if type(doc[key]) is not int or doc[key] < (1 if key == "version" else 0):
                    msg = f"its {key} is {doc[key]!r}, not a batch or schema version number"
                    raise TypeError(msg)
            named = _CLAIM.search(path)
            first = doc["first"]
            if named is not None and first != int(named.group(1)):
                msg = f"its first batch is {first}, not the {named.group(1)} of its name"
                raise ValueError(msg)
            if doc["last"] < first:
                msg = f"its last batch {doc['last']} is before its first, {first}"
                raise ValueError(msg)
            return doc
        except (TypeError, ValueError) as exc:
            msg = (f"WriteTables: {path} is not a claim this sink wrote ({exc}); remove it "
                   "once no earlier run of the pipeline can still write, then run again")
            raise SinkSetupError(msg) from exc

    def key_state(self, table: str, directory: str) -> tuple[int, dict[int, tuple[int, int]]]:
        """The largest ``last`` of the part files of (table, directory), and the files of it
        claimed but not uploaded above that: {first: (last, schema version)}. Claims at or
        below it, whose files are there, are removed. A claim removed between the listing
        and its read was an upload that landed meanwhile: both are looked at again."""
        for _ in range(_LOOKS):
            flushed = self.last_of(table, directory)
            found = self._claims(table, directory, flushed)
            if found is not None:
                return flushed, found
        msg = (f"WriteTables: the claims of {table}/{directory} changed at each of "
               f"{_LOOKS} looks: another run writes there at the same time")
        raise SinkIOError(msg)

    def _claims(self, table: str, directory: str, above: int
                ) -> dict[int, tuple[int, int]] | None:
        """The claims of (table, directory) above ``above`` (see :meth:`key_state`); None
        when one of them was removed while this looked."""
        found: dict[int, tuple[int, int]] = {}
        for name in self._glob(self.path("_cdcflow", "claims", table, directory, "*.json")):
            if (m := _CLAIM.search(name)) is None:
                continue
            if (first := int(m.group(1))) <= above:
                # its file is there (a run stopped between the upload and the removal)
                self.release_claim(table, directory, first)
                continue
            doc = self._claim_doc(self._claim_path(table, directory, first))
            if doc is None:
                return None  # uploaded and released meanwhile
            found[first] = (doc["last"], doc["version"])
        return found

    def claim_file(self, table: str, directory: str, file: str) -> None:
        """Claim the file named ``file`` (``part-<first>-<last>-<version>.<ext>``) of
        (table, directory) before its upload. Raises SinkError when another run claimed
        other batches from ``first`` (its claim won), or when a file of other batches from
        ``first`` on is there already: a claim is removed once its file is uploaded, so a
        stale run's claim that was on the wire meanwhile can be created after that; the
        file it would duplicate then says so."""
        where = "/".join(p for p in (table, directory) if p)
        part = _PART.search(file)
        assert part is not None, file  # the sink names its files so
        first, last, version = (int(part.group(i)) for i in (1, 2, 3))
        name = file.rsplit(".", 1)[0]
        path = self._claim_path(table, directory, first)
        for look in range(_LOOKS):
            try:
                self.create(path, orjson.dumps({"first": first, "last": last,
                                                "version": version}))
                break
            except FileExistsError:
                doc = self._claim_doc(path)
                if doc is None:  # its file was uploaded and the claim released meanwhile
                    if look < _LOOKS - 1:
                        continue
                    msg = (f"WriteTables: the claim {path} was there and gone at each of "
                           f"{_LOOKS} looks: another run writes there at the same time")
                    raise SinkIOError(msg) from None
                theirs = (doc.get("last"), doc.get("version"))
                if theirs != (last, version):
                    msg = (f"WriteTables: {where}: another run claimed the file of batches "
                           f"{first}..{theirs[0]} (schema v{theirs[1]}) before this run "
                           f"could upload {name}: a run that lost the pipeline may still "
                           "write it, so this run stops writing; the next run writes that "
                           "file as claimed")
                    raise SinkError(msg) from None
                break  # this file's claim (an earlier try, or the claim this run followed)
        others = [n for n in self._parts(table, directory)
                  if (m := _PART.search(n)) is not None and not n.rsplit("/", 1)[-1]
                  .startswith(name + ".") and int(m.group(1)) <= last
                  and int(m.group(2)) >= first]
        if others:
            self.release_claim(table, directory, first)
            msg = (f"WriteTables: {where}: {others[0].rsplit('/', 1)[-1]} holds batches of "
                   f"{name}, written by another run: this run lost the pipeline, and stops "
                   "writing")
            raise SinkError(msg)

    def _parts(self, table: str, directory: str) -> list[str]:
        return self._glob(self.path(table, directory, "part-*"))

    def release_claim(self, table: str, directory: str, first: int) -> None:
        """Remove the claim of an uploaded file (best effort: a claim left behind is one
        whose file exists, which a later run passes over)."""
        path = self._claim_path(table, directory, first)
        with contextlib.suppress(*storage_errors()):
            self.fs.rm_file(path)

    def last_claimed(self) -> int:
        """The largest batch a claim names (0: none): a run with a new store numbers its
        batches above it, so it never follows a claim of other data."""
        lasts = [0]
        for name in self._glob(self.path("_cdcflow", "claims", "**", "*.json")):
            doc = self._claim_doc(name)
            lasts.append(0 if doc is None else doc["last"])
        return max(lasts)

    # -- listings ----------------------------------------------------------------------------

    def last_batch(self) -> int:
        """The largest batch any part file under the root holds (0: none)."""
        try:
            fs = self._listed()
            names = fs.find(self.root) if fs.exists(self.root) else []
        except storage_errors() as exc:
            msg = f"WriteTables cannot list {self.root}: {exc}"
            raise SinkIOError(msg) from exc
        return _lasts(names)

    def last_of(self, table: str, directory: str) -> int:
        """The largest batch a part file of this (table, partition directory) holds."""
        return _lasts(self._parts(table, directory))

    def latest_schema(self, table: str) -> Schema | None:
        """The table's newest ``_schema/v<k>.json`` (None: the table has none yet)."""
        names = self._glob(self.path(table, "_schema", "v*.json"))
        versions = sorted(int(m.group(1)) for n in names if (m := _VERSION.search(n)))
        if not versions:
            return None
        path = self.path(table, "_schema", f"v{versions[-1]}.json")
        data = self.read(path)
        try:
            return Schema.parse(data or b"")
        except (KeyError, TypeError, ValueError) as exc:
            msg = (f"WriteTables: {path} is not a schema this sink wrote ({exc}); restore "
                   "it or write to another URL")
            raise SinkSetupError(msg) from exc

    # -- reads and writes --------------------------------------------------------------------

    def read(self, path: str) -> bytes | None:
        try:
            data: bytes = self.fs.cat_file(path)
            return data
        except FileNotFoundError:
            return None
        except storage_errors() as exc:
            msg = f"WriteTables cannot read {path}: {exc}"
            raise SinkIOError(msg) from exc

    def put(self, path: str, data: bytes | None = None, local: str | None = None) -> None:
        """One atomic write of ``path``, of ``data`` or of the local file ``local``."""
        fs = self.fs
        parent = path.rsplit("/", 1)[0]
        try:
            target = path
            if self._local:
                target = parent + "/." + path.rsplit("/", 1)[1] + ".tmp"
            if parent not in self._made and not self._object_store:
                fs.makedirs(parent, exist_ok=True)  # once per directory
                self._made.add(parent)
            if local is not None:
                fs.put_file(local, target)
            else:
                fs.pipe_file(target, data)
            if target != path:
                fs.mv(target, path)
        except storage_errors() as exc:
            self._made.discard(parent)  # made again at the next try (removed meanwhile?)
            msg = f"WriteTables cannot write {path}: {exc}"
            raise SinkIOError(msg) from exc

    def create(self, path: str, data: bytes) -> None:
        """Write ``path`` only if it does not exist (FileExistsError if it does)."""
        if self._local:
            temp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            if not create_exclusive(path, temp, data):
                raise FileExistsError(path)
            return
        try:
            self.fs.pipe_file(path, data, mode="create")
        except TypeError:  # a filesystem that has no exclusive write
            self.put(path, data)
        except FileExistsError:
            raise
        except storage_errors() as exc:
            msg = f"WriteTables cannot write {path}: {exc}"
            raise SinkIOError(msg) from exc
