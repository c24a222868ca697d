"""WriteTables file claims: a run that lost the pipeline while its upload was on the wire
(paused past its lease) and the run that took over never both land the same batches.

Run A cuts batches 8..11 of table T and claims the file; its upload hangs (the storage, or
the process, stalled). Run B takes over from the durable mark (7) and replays 8..22."""

from __future__ import annotations

import re
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pyarrow.parquet as pq
import pytest

from cdcflow.errors import OutputConflictError, SinkError, SinkSetupError
from tests.transforms.test_tables import T0, _close_sinks, _commit, _record, _sink, s3

# the autouse fixture that closes the sinks these tests set up, and the S3 server
__all__ = ["_close_sinks", "s3"]


def _batch(b: int) -> list[Any]:
    return [_record("T", 10 * b + i, at=T0 + 10 * b + i) for i in range(2)]


def _ids(out: Path) -> Counter[int]:
    files = sorted((out / "T").glob("part-*"))
    return Counter(i for f in files for i in pq.read_table(f).column("id").to_pylist())


def _parts(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "T").glob("part-*"))


def _stale_run(out: Path) -> tuple[Any, threading.Event, threading.Thread]:
    """Run A: batches 1..7 durable, then 8..11 cut and claimed, its upload held until the
    event is set (the thread flushing it ends then)."""
    a = _sink(str(out), flush_interval="1h")
    for b in range(1, 8):
        _commit(a, b, _batch(b))
    a.flush()
    assert a.durable_batch() == 7
    for b in range(8, 12):
        _commit(a, b, _batch(b))
    held = threading.Event()
    put = a._out.put

    def stalled_put(path: str, *args: Any, **kwargs: Any) -> None:
        if "part-8-11-" in path:
            held.wait(30)
        put(path, *args, **kwargs)

    a._out.put = stalled_put
    flushing = threading.Thread(target=a.flush, daemon=True)
    flushing.start()
    claim = out / "_cdcflow" / "claims" / "T" / "8.json"
    for _ in range(500):
        if claim.exists():
            break
        threading.Event().wait(0.01)
    assert claim.exists()
    return a, held, flushing


def test_the_run_that_took_over_writes_the_stale_runs_claimed_file_as_claimed(
    tmp_path: Path,
) -> None:
    """B finds A's claim of 8..11, cuts its file there too: A's late upload is the same
    file with the same rows. Without claims B wrote 8..22 in one file, and A's file landed
    beside it: batches 8..11 twice in the lake."""
    _, held, flushing = _stale_run(tmp_path)
    b = _sink(str(tmp_path), flush_interval="1h")
    assert b.durable_batch() == 7
    for batch in range(8, 23):
        _commit(b, batch, _batch(batch))
    b.flush()
    assert _parts(tmp_path) == ["part-1-7-1.parquet", "part-12-22-1.parquet",
                                "part-8-11-1.parquet"]
    held.set()  # A goes on: its upload lands
    flushing.join(30)
    assert _parts(tmp_path) == ["part-1-7-1.parquet", "part-12-22-1.parquet",
                                "part-8-11-1.parquet"]
    ids = _ids(tmp_path)
    assert set(ids.values()) == {1} and len(ids) == 2 * 22
    assert not list((tmp_path / "_cdcflow" / "claims").rglob("*.json"))  # all uploaded


def test_a_claim_of_the_stale_run_that_wins_stops_the_run_that_took_over(
    tmp_path: Path,
) -> None:
    """A's claim lands after B looked (its request was on the wire): B's own claim of a
    file from batch 8 loses, so B stops without uploading it; the next run follows A's
    claim."""
    a, held, flushing = _stale_run(tmp_path)
    claim = tmp_path / "_cdcflow" / "claims" / "T" / "8.json"
    text = claim.read_bytes()
    claim.unlink()  # as if not there yet when B looks
    b = _sink(str(tmp_path), flush_interval="1h")
    assert b.durable_batch() == 7
    for batch in range(8, 13):
        _commit(b, batch, _batch(batch))
    claim.write_bytes(text)  # A's claim lands
    with pytest.raises(SinkError, match=r"another run claimed the file of batches 8\.\.11"):
        b.flush()
    assert "part-8-12-1.parquet" not in _parts(tmp_path)
    held.set()
    flushing.join(30)
    assert "part-8-11-1.parquet" in _parts(tmp_path)  # A's upload landed
    c = _sink(str(tmp_path), flush_interval="1h")  # the next run
    for batch in range(c.durable_batch() + 1, 23):  # 8, or 12 after A's durable mark
        _commit(c, batch, _batch(batch))
    c.flush()
    ids = _ids(tmp_path)
    assert set(ids.values()) == {1} and len(ids) == 2 * 22
    a.close()


def test_a_claim_left_behind_by_a_run_stopped_after_its_upload_is_removed(
    tmp_path: Path,
) -> None:
    """A run stopped between an upload and the removal of its claim: the next run passes
    over that claim (its file is there) and removes it."""
    a = _sink(str(tmp_path), flush_interval="1h")
    for b in range(1, 4):
        _commit(a, b, _batch(b))
    a.flush()
    claim = tmp_path / "_cdcflow" / "claims" / "T" / "1.json"
    claim.parent.mkdir(parents=True, exist_ok=True)
    claim.write_text('{"first": 1, "last": 3, "version": 1}')
    b = _sink(str(tmp_path), flush_interval="1h")
    for batch in range(4, 6):
        _commit(b, batch, _batch(batch))
    b.flush()
    assert not claim.exists()
    assert _parts(tmp_path) == ["part-1-3-1.parquet", "part-4-5-1.parquet"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_stale_claim_made_after_the_new_runs_file_was_uploaded_uploads_nothing(
    tmp_path: Path, request: pytest.FixtureRequest, where: str,
) -> None:
    """A's claim was on the wire while B claimed, uploaded 8..22 and removed its claim:
    A's exclusive create then succeeds, but B's file holds A's batches, so A stops before
    its upload (and removes its claim). Without that look A uploaded part-8-11 whenever it
    had not yet learnt that it lost the pipeline: batches 8..11 twice. On S3 the two runs
    are two processes (a filesystem instance each): A had listed the table's directory
    before B's upload, and s3fs served that listing from its cache, without B's file,
    until listings were made fresh."""
    if where == "s3":
        request.getfixturevalue("s3")
        url, options = "s3://bucket/lake", {"storage_options": {"skip_instance_cache": True}}
        fs = fsspec.filesystem("s3", skip_instance_cache=True)

        def parts() -> list[str]:
            fs.invalidate_cache()
            return sorted(n.rsplit("/", 1)[-1] for n in fs.glob("bucket/lake/T/part-*"))

        def ids() -> Counter[int]:
            fs.invalidate_cache()
            return Counter(i for n in sorted(fs.glob("bucket/lake/T/part-*"))
                           for i in pq.read_table(n, filesystem=fs).column("id").to_pylist())

        def claims() -> list[str]:
            fs.invalidate_cache()
            return fs.glob("bucket/lake/_cdcflow/claims/**/*.json")
    else:
        url, options = str(tmp_path), {}

        def parts() -> list[str]:
            return _parts(tmp_path)

        def ids() -> Counter[int]:
            return _ids(tmp_path)

        def claims() -> list[str]:
            return [str(p) for p in (tmp_path / "_cdcflow" / "claims").rglob("*.json")]

    a = _sink(url, flush_interval="1h", **options)
    for b in range(1, 8):
        _commit(a, b, _batch(b))
    a.flush()
    for b in range(8, 12):
        _commit(a, b, _batch(b))
    held, holding = threading.Event(), threading.Event()
    create = a._out.create

    def stalled_create(path: str, data: bytes) -> None:
        if path.endswith("/claims/T/8.json"):
            holding.set()
            held.wait(30)
        create(path, data)

    a._out.create = stalled_create
    failed: list[BaseException] = []

    def flush() -> None:
        try:
            a.flush()
        except BaseException as exc:  # the uploader's error, raised by the flush
            failed.append(exc)

    flushing = threading.Thread(target=flush, daemon=True)
    flushing.start()
    assert holding.wait(10)
    b = _sink(url, flush_interval="1h", **options)
    for batch in range(8, 23):
        _commit(b, batch, _batch(batch))
    b.flush()
    assert parts() == ["part-1-7-1.parquet", "part-8-22-1.parquet"]
    held.set()
    flushing.join(30)
    assert failed and "part-8-22-1.parquet holds batches of part-8-11-1" in str(failed[0])
    assert parts() == ["part-1-7-1.parquet", "part-8-22-1.parquet"]
    counted = ids()
    assert set(counted.values()) == {1} and len(counted) == 2 * 22
    assert not claims()


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '{"first": 8, "last": "x"}',
                                  '{"first": 8, "last": 9, "version": -1}',
                                  '{"first": 7, "last": 9, "version": 1}',
                                  '{"first": 8, "last": 6, "version": 1}', "{}",
                                  '{"first": 8, "last": 9}',
                                  '{"first": 8, "last": 9, "version": 0}'])
def test_a_claim_that_is_not_one_is_named(tmp_path: Path, text: str) -> None:
    a = _sink(str(tmp_path), flush_interval="1h")
    _commit(a, 1, _batch(1))
    a.flush()
    claim = tmp_path / "_cdcflow" / "claims" / "T" / "8.json"
    claim.parent.mkdir(parents=True, exist_ok=True)
    claim.write_text(text)
    b = _sink(str(tmp_path), flush_interval="1h")
    # a file that breaks the sink's storage: a bad environment, named with its fix (exit 2)
    with pytest.raises(SinkSetupError,
                       match=r"8\.json is not a claim this sink wrote .*remove it"):
        b.last_committed_batch()  # at start
    with pytest.raises(SinkSetupError,
                       match=r"8\.json is not a claim this sink wrote .*remove it"):
        _commit(b, 2, _batch(2))


def test_a_schema_file_that_is_not_one_is_named(tmp_path: Path) -> None:
    a = _sink(str(tmp_path), flush_interval="1h")
    _commit(a, 1, _batch(1))
    a.flush()
    (tmp_path / "T" / "_schema" / "v1.json").write_text("[1, 2]")
    b = _sink(str(tmp_path), flush_interval="1h")
    where = re.escape(f"{tmp_path}/T/_schema/v1.json")  # in full: which URL holds it
    with pytest.raises(SinkSetupError, match=where + r" is not a schema this sink wrote .*"
                       r"restore it or write to another URL"):
        _commit(b, 2, _batch(2))


def test_a_url_holds_one_format_so_a_claimed_file_never_lands_in_two(tmp_path: Path) -> None:
    """Run A (Parquet) claimed batches 8..11 and its upload hangs; a run restarted with
    JSON lines would write the claimed batches as a .jsonl file while A's late .parquet
    file lands too: both formats' readers then see them twice. The URL's durable mark
    names its format, and another format is refused at start."""
    a = _sink(str(tmp_path), flush_interval="1h")
    for b in range(1, 8):
        _commit(a, b, _batch(b))
    a.flush()
    b = _sink(str(tmp_path), flush_interval="1h", format="jsonl")
    with pytest.raises(OutputConflictError, match=r"holds parquet files of pipeline 'p', and "
                       r"this sink writes jsonl: .*keep format='parquet', or write jsonl to "
                       r"another URL"):
        b.durable_batch()
    assert _sink(str(tmp_path), flush_interval="1h").durable_batch() == 7  # the same format


def test_a_url_holds_one_timestamp_unit(tmp_path: Path) -> None:
    """Parquet files in nanoseconds, then a run with timestamp_unit="us" (the advice of the
    error a year-9999 timestamp gives in nanoseconds): it would write version 1's next
    files in microseconds under a schema that says nanoseconds, and the table would no
    longer read back with its schema. It is refused at start, as another format is."""
    a = _sink(str(tmp_path), flush_interval="1h")
    for b in range(1, 4):
        _commit(a, b, _batch(b))
    a.flush()
    assert orjson.loads((tmp_path / "_cdcflow" / "durable.json").read_bytes())[
        "timestamp_unit"] == "ns"
    b = _sink(str(tmp_path), flush_interval="1h", timestamp_unit="us")
    with pytest.raises(OutputConflictError, match=r"holds Parquet files of pipeline 'p' with "
                       r"timestamps in ns, and this sink writes them in us: .*keep "
                       r"timestamp_unit='ns', or write us to another URL"):
        b.durable_batch()
    assert _sink(str(tmp_path), flush_interval="1h").durable_batch() == 3  # the same unit
    # a mark written before it named the unit: taken as it is, and named from then on
    mark = tmp_path / "_cdcflow" / "durable.json"
    doc = orjson.loads(mark.read_bytes())
    del doc["timestamp_unit"]
    mark.write_bytes(orjson.dumps(doc))
    c = _sink(str(tmp_path), flush_interval="1h", timestamp_unit="us")
    assert c.durable_batch() == 3
    _commit(c, 4, _batch(4))
    c.flush()
    assert orjson.loads(mark.read_bytes())["timestamp_unit"] == "us"


def test_a_run_on_s3_sees_the_file_an_earlier_run_uploaded_after_it_listed_the_lake(
    s3: str,
) -> None:
    """The run that takes over lists the lake at start (``last_committed_batch``), then
    the earlier run, still owning the pipeline, uploads batches 8..11. Every later listing
    of the new run must see that file: s3fs served the table's directory from its start
    listing, so the new run wrote 8..11 again in part-8-22."""
    url, options = "s3://bucket/lake", {"skip_instance_cache": True}
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    a = _sink(url, flush_interval="1h", storage_options=options)
    for b in range(1, 8):
        _commit(a, b, _batch(b))
    a.flush()
    for b in range(8, 12):
        _commit(a, b, _batch(b))
    b = _sink(url, flush_interval="1h", storage_options=options)
    assert b.last_committed_batch() == 7  # the lake as the new run found it at start
    a.flush()  # the earlier run's last upload lands now
    for batch in range(8, 23):
        _commit(b, batch, _batch(batch))
    b.flush()
    fs.invalidate_cache()
    names = sorted(fs.glob("bucket/lake/T/part-*"))
    assert [n.rsplit("/", 1)[-1] for n in names] == [
        "part-1-7-1.parquet", "part-12-22-1.parquet", "part-8-11-1.parquet"]
    ids = Counter(i for n in names
                  for i in pq.read_table(n, filesystem=fs).column("id").to_pylist())
    assert set(ids.values()) == {1} and len(ids) == 2 * 22


def test_a_claim_released_while_the_new_run_looks_is_its_uploaded_file(tmp_path: Path) -> None:
    """The new run lists the key's files (largest last 7) and its claims (8.json); before
    it reads the claim, the earlier run's upload of 8..11 lands and the claim is removed.
    The new run looks again and finds the file: it took the vanished claim for one of
    schema v0 and stopped, telling the operator to remove a claim that was not there."""
    a = _sink(str(tmp_path), flush_interval="1h")
    for b in range(1, 8):
        _commit(a, b, _batch(b))
    a.flush()
    for b in range(8, 12):
        _commit(a, b, _batch(b))
    b = _sink(str(tmp_path), flush_interval="1h")
    out = b._storage()
    claim = tmp_path / "_cdcflow" / "claims" / "T" / "8.json"
    claim.parent.mkdir(parents=True, exist_ok=True)
    claim.write_text('{"first": 8, "last": 11, "version": 1}')  # A's, its upload on the wire
    read = out.read

    def landing(path: str) -> bytes | None:
        if path.endswith("/claims/T/8.json") and claim.exists():
            a.flush()  # A's file lands now, and A removes its claim
            assert not claim.exists()
        return read(path)

    out.read = landing  # type: ignore[method-assign]
    assert out.key_state("T", "") == (11, {})
    assert _parts(tmp_path) == ["part-1-7-1.parquet", "part-8-11-1.parquet"]
