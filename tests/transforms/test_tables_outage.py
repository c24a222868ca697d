"""WriteTables when its storage fails: a real S3 API server (moto) on loopback behind a TCP
gate that can refuse connections. A refused upload mid-run is retried until the server is
back (nothing lost, nothing twice); storage that cannot be reached at start, or no
credentials, is one line and exit 2; a second pipeline writing the same URL is refused."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import orjson
import pyarrow.dataset as ds
import pytest

import cdcflow as cf
from cdcflow.engine.listener import EngineListener
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.errors import OutputConflictError, PipelineDefinitionError, SinkSetupError
from cdcflow.metadata import SQLiteStore
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms._tablestorage import TableStorage
from cdcflow.transforms.base import SinkContext
from cdcflow.transforms.tables import WriteTables

S = 1_000_000_000
T0 = 1_700_000_000 * S

_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # one attempt per call: an outage reaches the sink instead of botocore's own retries
        "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard",
        "AWS_EC2_METADATA_DISABLED": "true"}


class Gate:
    """A TCP proxy on loopback to ``target``; ``close()`` refuses connections (and cuts the
    open ones) until ``open()``."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._cutting = False

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Accept connections and close them at once (and cut the open ones) until
        ``heal()``: a proxy whose upstream is gone."""
        self._cutting = True
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def heal(self) -> None:
        self._cutting = False

    def close(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, []
        if listener is not None:
            listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            if self._cutting:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Gate]]:
    """A moto server behind an open gate: the endpoint URL (through the gate) and the gate."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    gate = Gate((host, port))
    gate.open()
    endpoint = f"http://127.0.0.1:{gate.port}"
    for name, value in {**_AWS, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)
    # fsspec caches filesystems by their arguments, not the environment: one made for an
    # earlier test's server would go on calling that server
    type(fsspec.filesystem("s3")).clear_instance_cache()
    # moto keeps its buckets per process: another test's server may have made this one
    fsspec.filesystem("s3", skip_instance_cache=True).makedirs("outages", exist_ok=True)
    yield endpoint, gate
    gate.close()
    server.stop()


def _stream(n: int) -> ScriptedChangeStream:
    stream = ScriptedChangeStream("S", partitions=2, origin=T0)
    for i in range(n):
        stream.write("A" if i % 3 else "B", i, "INSERT", {"v": i}, at=T0 + (i + 1) * S // 10)
    return stream


def _pipeline(name: str, stream: ScriptedChangeStream, n: int, url: str
              ) -> tuple[cf.Pipeline, WriteTables]:
    p = cf.Pipeline(name)
    sink = WriteTables(url, file_size="1KiB", flush_interval="1h")
    (p | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + (n // 10 + 2) * S,
                             client=stream)
     | cf.ReadPartition()
     | sink)
    return p, sink


def _values(url: str) -> list[int]:
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    root = url.removeprefix("s3://")
    files = [f for f in fs.find(root) if "/part-" in f]
    table = ds.dataset(files, filesystem=fs, format="parquet").to_table(columns=["v"])
    return sorted(table["v"].to_pylist())


@pytest.mark.parametrize("outage", ["refused", "cut"])
def test_uploads_refused_mid_run_are_retried_until_the_storage_is_back(
    s3: tuple[str, Gate], tmp_path: Path, caplog: pytest.LogCaptureFixture, outage: str
) -> None:
    """Connections refused, or accepted and closed at once (a proxy whose upstream is
    gone): retried until the storage is back, nothing lost or twice."""
    _, gate = s3
    n = 150
    stream = _stream(n)
    reopened = threading.Event()
    errors: list[float] = []

    class Outage(EngineListener):
        """Closes the gate after batch 3, opens it again 3 s later."""

        def on_batch(self, stats: Any) -> None:
            errors.extend(m["upload_errors_total"] for m in stats.sink_metrics.values())
            if stats.batch_id == 3:
                down, up = (gate.close, gate.open) if outage == "refused" else (gate.cut,
                                                                                gate.heal)
                down()
                timer = threading.Timer(3.0, lambda: (up(), reopened.set()))
                timer.daemon = True
                timer.start()

    url = f"s3://outages/{uuid.uuid4().hex}"
    pipeline, _ = _pipeline("outage", stream, n, url)
    store = SQLiteStore(tmp_path / "s.db")
    try:
        summary = Engine(pipeline, store, InMemoryRunner(workers=2),
                         RunOptions(batch_interval=0, max_batch_span=1.0), Outage()).run()
    finally:
        store.close()
    assert reopened.is_set()
    assert summary.reason == "end reached"
    failed_tries = [r for r in caplog.records
                    if r.name == "cdcflow.sinks" and "fail (" in r.getMessage()]
    # (the metric is sampled per batch: a failure between the last two may not show there)
    assert max(errors) > 0 or failed_tries, "the outage never reached an upload"
    assert _values(url) == list(range(n))
    # the HTTP client's requests cut by the outage are not tracebacks in the run's log
    leftovers = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= 30]
    assert leftovers == [], [r.getMessage() for r in leftovers]


_PIPELINE = textwrap.dedent('''
    import cdcflow as cf
    from cdcflow.testing import ScriptedChangeStream

    S, T0 = 1_000_000_000, 1_700_000_000 * 1_000_000_000
    stream = ScriptedChangeStream("S", partitions=1, origin=T0)
    stream.write("A", 1, "INSERT", {"v": 1}, at=T0 + S)
    pipeline = cf.Pipeline("closed")
    (pipeline | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 3 * S, client=stream)
     | cf.ReadPartition() | cf.WriteTables("s3://outages/closed"))
''')


def _run(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "pipeline.py"
    path.write_text(_PIPELINE)
    return subprocess.run([sys.executable, "-m", "cdcflow", "run", str(path)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_storage_that_does_not_answer_at_start_is_one_line_and_exit_2(tmp_path: Path) -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    done = _run(tmp_path, {**env, **_AWS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("cdcflow: error: WriteTables cannot open s3://outages/closed")
    assert "Traceback" not in done.stderr
    # through the API: the same error, a SinkSetupError (a ConfigurationError)
    sink = WriteTables("s3://outages/closed",
                       storage_options={"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
                                        "key": "testing", "secret": "testing",
                                        "config_kwargs": {"retries": {"max_attempts": 1}}})
    with pytest.raises(SinkSetupError, match="check the URL, that the storage answers"):
        sink.setup(SinkContext("closed", "WriteTables", "/"))


def test_storage_that_takes_connections_and_never_answers_is_refused_in_bounded_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A storage that takes the connection and never answers (a paused server, a black
    hole): the run said nothing for minutes, in the storage client's timeouts and retries.
    Its first call now has a deadline: a SinkSetupError (exit 2) naming the fix."""
    from cdcflow.transforms import _tablestorage

    monkeypatch.setattr(_tablestorage, "FIRST_ANSWER_SECONDS", 1.0)
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)  # connections complete in the kernel; nothing ever reads or answers
    try:
        sink = WriteTables("s3://outages/hole", storage_options={
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{hole.getsockname()[1]}"},
            "key": "testing", "secret": "testing"})
        began = time.monotonic()
        with pytest.raises(SinkSetupError, match=r"the storage of s3://outages/hole did not "
                           r"answer in 1s; check that it is up"):
            sink.setup(SinkContext("hole", "WriteTables", "/"))
        assert time.monotonic() - began < 10
    finally:
        hole.close()


def test_no_credentials_is_one_line_and_exit_2(s3: tuple[str, Gate], tmp_path: Path) -> None:
    endpoint, _ = s3
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"HOME": str(tmp_path), "AWS_ENDPOINT_URL": endpoint,
                "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "1",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                "AWS_CONFIG_FILE": str(tmp_path / "none")})
    done = _run(tmp_path, env)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cdcflow: error: WriteTables cannot open s3://outages/closed")
    assert "credentials" in last.lower()
    assert "Traceback" not in done.stderr


def test_a_url_holding_another_pipelines_output_is_refused(tmp_path: Path) -> None:
    url = str(tmp_path / "lake")
    first = WriteTables(url)
    first.setup(SinkContext("orders", "WriteTables", "/"))
    assert first.last_committed_batch() == 0  # what claims the URL
    first.close()
    doc = orjson.loads((tmp_path / "lake" / "_cdcflow" / "durable.json").read_bytes())
    assert doc["pipeline"] == "orders" and doc["durable_batch"] == 0
    again = WriteTables(url)
    again.setup(SinkContext("orders", "WriteTables", "/"))  # the same pipeline goes on
    assert again.last_committed_batch() == 0
    again.close()
    other = WriteTables(url)
    other.setup(SinkContext("payments", "WriteTables", "/"))
    with pytest.raises(OutputConflictError, match="holds the output of pipeline 'orders'"):
        other.last_committed_batch()
    other.close()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_two_pipelines_claiming_an_empty_url_at_once_one_is_refused(
    where: str, s3: tuple[str, Gate], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both runs look at the URL before either claims it (a barrier holds each after its
    look): the claim is an exclusive create, so one wins and the other is refused."""
    url = str(tmp_path / "lake") if where == "local" else f"s3://outages/{uuid.uuid4().hex}"
    both_looked = threading.Barrier(2, timeout=20)
    looked: set[int] = set()
    real = TableStorage.read

    def read(self: TableStorage, path: str) -> bytes | None:
        data = real(self, path)
        if path.endswith("durable.json") and id(self) not in looked:
            looked.add(id(self))
            both_looked.wait()
        return data

    monkeypatch.setattr(TableStorage, "read", read)
    outcome: dict[str, str] = {}

    def claim(pipeline: str) -> None:
        sink = WriteTables(url)
        try:
            sink.setup(SinkContext(pipeline, "WriteTables", str(tmp_path)))
            sink.last_committed_batch()
            outcome[pipeline] = "claimed"
        except OutputConflictError:
            outcome[pipeline] = "refused"
        finally:
            sink.close()

    runs = [threading.Thread(target=claim, args=(name,)) for name in ("orders", "payments")]
    for t in runs:
        t.start()
    for t in runs:
        t.join(30)
    assert sorted(outcome.values()) == ["claimed", "refused"], outcome
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True)
    owner = orjson.loads(fs.cat_file(f"{root}/_cdcflow/durable.json"))["pipeline"]
    assert outcome[owner] == "claimed"
    assert not [f for f in fs.find(root) if f.endswith(".tmp")]


def test_output_written_before_pipelines_were_named_is_adopted(tmp_path: Path) -> None:
    mark = tmp_path / "lake" / "_cdcflow" / "durable.json"
    mark.parent.mkdir(parents=True)
    mark.write_bytes(orjson.dumps({"durable_batch": 7, "at": "2024-01-01T00:00:00Z"}))
    sink = WriteTables(str(tmp_path / "lake"))
    sink.setup(SinkContext("orders", "WriteTables", "/"))
    try:
        assert sink.durable_batch() == 7
    finally:
        sink.close()
    assert orjson.loads(mark.read_bytes())["pipeline"] == "orders"
    other = WriteTables(str(tmp_path / "lake"))
    other.setup(SinkContext("other", "WriteTables", "/"))
    with pytest.raises(OutputConflictError):
        other.durable_batch()


def test_a_pipeline_refused_at_start_leaves_no_claim(tmp_path: Path) -> None:
    """Two sinks on one URL are refused before the first batch, and the URL stays free: the
    corrected pipeline (under another name) then runs."""
    stream = _stream(10)
    url = str(tmp_path / "lake")
    bad = cf.Pipeline("lake-v1")
    read = (bad | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 3 * S, client=stream)
            | cf.ReadPartition())
    read | "a" >> WriteTables(url, format="jsonl")
    read | "b" >> WriteTables(url, format="jsonl")
    store = SQLiteStore(tmp_path / "s.db")
    try:
        with pytest.raises(PipelineDefinitionError, match="sinks 'a' and 'b' would write"):
            Engine(bad, store, InMemoryRunner(), RunOptions(batch_interval=0)).run()
        assert not (tmp_path / "lake" / "_cdcflow" / "durable.json").exists()
        good, _ = _pipeline("lake", stream, 10, url)
        summary = Engine(good, store, InMemoryRunner(),
                         RunOptions(batch_interval=0, max_batch_span=1.0)).run()
    finally:
        store.close()
    assert summary.reason == "end reached"
    mark = orjson.loads((tmp_path / "lake" / "_cdcflow" / "durable.json").read_bytes())
    assert mark["pipeline"] == "lake"


def test_a_bucket_that_does_not_exist_is_refused_not_made(
    s3: tuple[str, Gate], tmp_path: Path
) -> None:
    """On S3, making the URL's directories would create the bucket a typo names."""
    bucket = f"nosuch-{uuid.uuid4().hex[:12]}"
    sink = WriteTables(f"s3://{bucket}/cdc")
    with pytest.raises(SinkSetupError, match=f"the bucket '{bucket}' of s3://{bucket}/cdc does "
                                             "not exist.*create it, or fix the URL"):
        sink.setup(SinkContext("p", "WriteTables", str(tmp_path)))
    sink.close()
    assert not fsspec.filesystem("s3", skip_instance_cache=True).exists(bucket)
    existing = WriteTables(f"s3://outages/{uuid.uuid4().hex}")  # a bucket that exists
    existing.setup(SinkContext("p", "WriteTables", str(tmp_path)))
    assert existing.last_committed_batch() == 0
    existing.close()
