"""The cdcflow command, run as users run it: ``python -m cdcflow ...`` in a subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from cdcflow.cli import BUS_ERROR
from cdcflow.compiled import speedups
from cdcflow.spanner.emulator import Emulator

T0 = 1_700_000_000 * 10**9
S = 10**9

SCRIPTED = f"""
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

T0 = {T0}
stream = ScriptedChangeStream("Orders", partitions=2, origin=T0)
for i in range(20):
    stream.write("Orders", {{"id": i}}, "INSERT", {{"total": i}}, at=T0 + (i + 1) * 100_000_000)
stream.split("p0", at=T0 + 700_000_000, into=["p0a", "p0b"])
stream.merge(["p0b", "p1"], at=T0 + 1_400_000_000, into="m")


def to_row(record):
    return {{"id": record.mods[0].keys["id"], "op": record.mod_type,
            "at": record.commit_timestamp.ns}}


pipeline = cf.Pipeline("scripted")
(pipeline
 | cf.DetectPartitions(stream="Orders", start_at=T0, end_at=T0 + 3 * 10**9, client=stream)
 | cf.ReadPartition(heartbeat="100ms")
 | "rows" >> cf.Map(to_row)
 | cf.WriteFiles("out", format="jsonl"))
"""

VALID = """
import cdcflow as cf
pipeline = cf.Pipeline("orders")
(pipeline
 | cf.DetectPartitions(database="projects/p/instances/i/databases/d", stream="Orders")
 | cf.ReadPartition()
 | "no deletes" >> cf.Filter(lambda r: r.mod_type != "DELETE")
 | cf.Print())
"""


def cdcflow(
    *args: str, cwd: Path | None = None, timeout: float = 120,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    extra = env or {}
    env = {**os.environ, "NO_COLOR": "1"}
    env.pop("CDCFLOW_DEBUG", None)
    env.update(extra)
    return subprocess.run(
        [sys.executable, "-m", "cdcflow", *args], capture_output=True, text=True,
        timeout=timeout, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
    )


def write(tmp_path: Path, body: str, name: str = "pipe.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def assert_usage_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    """Exit 2, one line `cdcflow: error: ...` on stderr, no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cdcflow: error: ")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


# -- bad input: exit 2, one line ----------------------------------------------------------


def test_a_sink_whose_commit_raises_stops_the_run_in_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import cdcflow as cf
        from cdcflow.testing import ScriptedChangeStream

        T0 = 1_700_000_000 * 10**9
        stream = ScriptedChangeStream("Orders", origin=T0)
        stream.write("Orders", {"id": 1}, "INSERT", {"v": 1}, at=T0 + 1000)

        class BadSink(cf.Collect):
            def commit(self, batch_id, messages):
                if messages:
                    raise RuntimeError("sink down")

        pipeline = cf.Pipeline("badsink")
        (pipeline | cf.ReadChangeStream(stream="Orders", start_at=T0, end_at=T0 + 5000,
                                        client=stream) | BadSink())
    """)
    done = cdcflow("run", str(path), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cdcflow: error: sink 'BadSink' failed to commit batch ")
    assert "RuntimeError: sink down" in last and "the next run replays it" in last


def test_a_function_that_cannot_be_pickled_is_named_in_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import threading
        import cdcflow as cf
        from cdcflow.testing import ScriptedChangeStream

        lock = threading.Lock()
        stream = ScriptedChangeStream("S", partitions=1, origin=10**18)

        def locked(r):
            with lock:
                return r

        pipeline = cf.Pipeline("unpicklable")
        (pipeline | cf.DetectPartitions(stream="S", start_at=10**18, end_at=10**18 + 10**9,
                                        client=stream)
         | cf.ReadPartition() | cf.Map(locked) | cf.Print())
    """)
    assert_usage_error(cdcflow("run", str(path), cwd=tmp_path),
                       "step 'Map(locked)' cannot be sent to its tasks",
                       "cannot pickle '_thread.lock' object", "setup()")


_USER_CODE = """
import threading
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

T0 = 1_700_000_000 * 10**9
stream = ScriptedChangeStream("Orders", origin=T0)
stream.write("Orders", {{"id": 1}}, "INSERT", {{"v": 1}}, at=T0 + 1000)


class NeedsRedis(cf.DoFn):
    def setup(self):
        raise ImportError("needs redis: pip install redis")

    def process(self, element):
        yield element


class LockWriter:
    def write(self, element):
        pass

    def close(self):
        return threading.Lock()

    def abort(self):
        pass


class LockSink(cf.Sink):
    def open_writer(self, ctx):
        return LockWriter()

    def commit(self, batch_id, messages):
        pass


class OldSink(cf.Sink):
    def open_writer(self):
        return LockWriter()

    def commit(self, batch_id, messages):
        pass


class NoCredentials(LockSink):
    def setup(self, ctx):
        raise PermissionError("no credentials")


class NoneWriter(LockWriter):
    def close(self):
        return None


class BadClose(LockSink):
    def open_writer(self, ctx):
        return NoneWriter()

    def close(self):
        raise RuntimeError("close failed")


class NoRecords(LockSink):
    def last_committed_batch(self):
        raise OSError("cannot list the output")


pipeline = cf.Pipeline("usercode")
(pipeline | cf.ReadChangeStream(stream="Orders", start_at=T0, end_at=T0 + 5000, client=stream)
 | {step})
"""


@pytest.mark.parametrize(("step", "fragments"), [
    ('"enrich" >> cf.ParDo(NeedsRedis()) | cf.Collect()',
     ("ImportError: needs redis: pip install redis; in setup() of step 'enrich'",)),
    ('"out" >> OldSink()',
     ("TypeError: OldSink.open_writer() takes 1 positional argument but 2 were given; "
      "in open_writer() of sink 'out'",)),
    ('"out" >> LockSink()',
     ("TypeError: cannot pickle '_thread.lock' object; the value the writer of sink 'out' "
      "returned from close() cannot be pickled",)),
])
def test_an_error_in_the_pipeline_s_own_code_is_one_line_naming_where(
    tmp_path: Path, step: str, fragments: tuple[str, ...]
) -> None:
    path = write(tmp_path, _USER_CODE.format(step=step))
    done = cdcflow("run", str(path), "--metadata", "memory://", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cdcflow: error: ") and last.endswith("--debug shows the traceback")
    assert "was not committed" in last
    for fragment in fragments:
        assert fragment in last
    debug = cdcflow("run", str(path), "--metadata", "memory://", "--debug", cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


@pytest.mark.parametrize(("step", "fragment"), [
    ('"out" >> NoCredentials()',
     "PermissionError: no credentials; in setup() of sink 'out'; --debug"),
    ('"out" >> NoRecords()',
     "OSError: cannot list the output; in last_committed_batch() of sink 'out'; --debug"),
])
def test_an_error_of_a_sink_s_own_code_at_the_start_names_the_sink(
    tmp_path: Path, step: str, fragment: str
) -> None:
    """A sink (a plugin's, or the pipeline file's own) that fails as the run starts is
    named, with the method, as a step's setup() is."""
    path = write(tmp_path, _USER_CODE.format(step=step))
    done = cdcflow("run", str(path), "--metadata", "memory://", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cdcflow: error: ") and fragment in last, last


def test_a_sink_that_fails_to_close_is_one_line_and_its_output_stays(tmp_path: Path) -> None:
    """A failure that does not end the run (a sink's close(), abort(), an observer) is
    one line naming the sink and the error; its traceback only with --debug."""
    path = write(tmp_path, _USER_CODE.format(step='"out" >> BadClose()'))
    done = cdcflow("run", str(path), "--metadata", "memory://", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert ("close() of sink 'out' failed; what it committed is kept (RuntimeError: close "
            "failed)") in done.stderr
    debug = cdcflow("run", str(path), "--metadata", "memory://", "--debug", cwd=tmp_path)
    assert debug.returncode == 0 and "Traceback" in debug.stderr


_BUS = """
import mmap, tempfile, time

def fault(record):
    time.sleep(1.5)
    with tempfile.TemporaryFile() as f:
        f.write(b"x" * 4096)
        f.flush()
        mapped = mmap.mmap(f.fileno(), 4096)
        f.truncate(0)
        return mapped[0]  # the mapped page is gone: SIGBUS
"""


@pytest.mark.skipif(speedups() is None, reason="not compiled")
@pytest.mark.parametrize("log_format", ["plain", "json"])
def test_a_bus_error_ends_the_command_with_one_line(tmp_path: Path, log_format: str) -> None:
    """A memory-mapped file failing under the run (the SQLite store's -shm on a disk that
    filled up, say) ends it with the one line of an error and exit 1, in the format asked
    for, instead of the shell's "Bus error" and 135."""
    path = write(tmp_path, _BUS + _USER_CODE.format(step="cf.Map(fault) | cf.Collect()"))
    began = time.time()
    done = cdcflow("run", str(path), "--metadata", "memory://", "--log-format", log_format,
                   cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    if log_format == "plain":
        assert last == f"cdcflow: error: {BUS_ERROR}"
    else:
        doc = json.loads(last)
        assert (doc["level"], doc["message"]) == ("ERROR", BUS_ERROR)
        at = datetime.strptime(doc["time"], "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()
        assert began + 1.5 <= at <= time.time()  # the time of the error, not of the start


def test_missing_file(tmp_path: Path) -> None:
    assert_usage_error(cdcflow("run", str(tmp_path / "nope.py")), "not found")


def test_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path, "import cdcflow as cf\np = cf.Pipeline('x'\n")
    assert_usage_error(cdcflow("run", str(path)), "syntax error", f"{path}:2")


def test_import_error(tmp_path: Path) -> None:
    path = write(tmp_path, "import not_installed_anywhere_xyz\n")
    assert_usage_error(cdcflow("graph", str(path)), "not_installed_anywhere_xyz", "install")


def test_no_pipeline(tmp_path: Path) -> None:
    path = write(tmp_path, "x = 1\n")
    assert_usage_error(cdcflow("run", str(path)), "defines no Pipeline")


def test_duplicate_label(tmp_path: Path) -> None:
    path = write(tmp_path, """
        import cdcflow as cf
        p = cf.Pipeline("dup")
        reads = p | cf.DetectPartitions(database="projects/p/instances/i/databases/d",
                                        stream="S") | cf.ReadPartition()
        reads | "out" >> cf.Print()
        reads | "out" >> cf.Print()
    """)
    assert_usage_error(cdcflow("run", str(path)), "duplicate label 'out'")


def test_invalid_pipeline(tmp_path: Path) -> None:
    path = write(tmp_path, "import cdcflow as cf\np = cf.Pipeline('empty')\n")
    assert_usage_error(cdcflow("graph", str(path)), "is empty")


def test_malformed_store_url(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    assert_usage_error(cdcflow("run", str(path), "--metadata", "state.db"),
                       "not a metadata store URL")
    assert_usage_error(cdcflow("status", "--metadata", "nosuch://x"), "nosuch")


def test_unknown_runner(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    assert_usage_error(cdcflow("run", str(path), "--runner", "flink"), "'flink'", "memory")


def test_bad_duration(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    assert_usage_error(cdcflow("run", str(path), "--for", "10 parsecs"), "not a duration")
    assert_usage_error(cdcflow("run", str(path), "--for", "-5s"), "expected one argument",
                       "written --option=VALUE")
    assert_usage_error(cdcflow("run", str(path), "--for=-5s"), "not a duration: '-5s'")
    assert_usage_error(cdcflow("run", str(path), "--for", "nan"), "not a duration: 'nan'")
    assert_usage_error(cdcflow("run", str(path), "--set", "batch_interval=inf"),
                       "batch_interval takes a duration")


def test_unknown_set_key_lists_valid_ones(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    assert_usage_error(cdcflow("run", str(path), "--set", "speed=11"),
                       "--set speed", "max_batch_span", "workers")


def test_bad_set_value(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    assert_usage_error(cdcflow("run", str(path), "--set", "max_batch_span=soon"),
                       "max_batch_span takes a duration")
    assert_usage_error(cdcflow("run", str(path), "--set", "max_task_bytes=big"),
                       "max_task_bytes takes a size such as 64MiB or none")


def test_values_are_checked_where_pipeline_run_checks_them(tmp_path: Path) -> None:
    # The CLI and pipeline.run() share cdcflow.launch: its checks give the same one line.
    path = write(tmp_path, VALID)
    assert_usage_error(cdcflow("run", str(path), "--set", "gc_ttl=-1"),
                       "bad run option", "gc_ttl must be 0 or more")
    assert_usage_error(cdcflow("run", str(path), "--set", "workers=0"),
                       "memory runner refused its options", "use 1 or more")
    assert_usage_error(cdcflow("run", str(path), "--set", "master=local"), "--set master",
                       "valid keys:")
    assert not (tmp_path / ".cdcflow" / "state.db").exists()  # nothing ran


def test_spark_flags_need_spark(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    assert_usage_error(cdcflow("run", str(path), "--master", "local[2]"), "--runner spark")


def test_missing_argument() -> None:
    assert_usage_error(cdcflow("run"), "FILE")


# -- graph, plugins -----------------------------------------------------------------------


def test_graph_text(tmp_path: Path) -> None:
    result = cdcflow("graph", str(write(tmp_path, VALID)))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "pipeline 'orders'"
    assert [line.split("  (")[0].lstrip(" │├└─") for line in lines[1:]] == [
        "DetectPartitions", "ReadPartition", "no deletes", "Print"]


def test_graph_dot(tmp_path: Path) -> None:
    result = cdcflow("graph", str(write(tmp_path, VALID)), "--format", "dot")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith('digraph "orders" {')
    assert result.stdout.count("->") == 3


def test_plugins_lists_builtins() -> None:
    result = cdcflow("plugins")
    assert result.returncode == 0, result.stderr
    sections: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        if not line.startswith(" "):
            current = sections.setdefault(line, [])
        else:
            current.append(line.split()[0])
    assert {"memory", "spark"} <= set(sections["cdcflow.runners"])
    assert {"memory", "sqlite", "spanner"} <= set(sections["cdcflow.metadata"])


# -- run and status over a scripted change stream ------------------------------------------


@pytest.fixture
def scripted_run(tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess[str]]:
    path = write(tmp_path, SCRIPTED)
    return path, cdcflow("run", str(path), "--set", "max_batch_span=500ms",
                         "--batch-interval", "0s")


def test_run_reaches_end_and_writes_output(
    scripted_run: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    path, result = scripted_run
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "stopped (end reached)" in result.stderr
    assert sorted(r["id"] for r in _rows(path.parent / "out")) == list(range(20))
    assert (path.parent / ".cdcflow" / "state.db").is_file()


def _rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(out.glob("*.jsonl"))
            for line in f.read_text().splitlines()]


def test_second_run_resumes_and_reads_nothing_again(
    scripted_run: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    path, first = scripted_run
    assert first.returncode == 0, first.stderr
    files = sorted(p.name for p in (path.parent / "out").glob("*.jsonl"))
    again = cdcflow("run", str(path))
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (path.parent / "out").glob("*.jsonl")) == files


def test_a_deleted_state_file_is_refused_then_reset_starts_over(
    scripted_run: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    # The store lost the pipeline's progress while its WriteFiles directory holds its
    # output: starting over would deliver everything again, silently. Refused in one line
    # naming --reset; with it the run starts over above the output.
    path, first = scripted_run
    assert first.returncode == 0, first.stderr
    files = sorted(p.name for p in (path.parent / "out").glob("*.jsonl"))
    for leftover in (path.parent / ".cdcflow").glob("state.db*"):
        leftover.unlink()
    refused = cdcflow("run", str(path))
    assert_usage_error(refused, "pipeline 'scripted' has no progress in the store",
                       "sink 'WriteFiles' holds its output up to batch", "--reset")
    assert sorted(p.name for p in (path.parent / "out").glob("*.jsonl")) == files
    again = cdcflow("run", str(path), "--reset", "--set", "max_batch_span=500ms")
    assert again.returncode == 0, again.stderr
    assert sorted(r["id"] for r in _rows(path.parent / "out")) == sorted(list(range(20)) * 2)


def test_status_shows_partitions(
    scripted_run: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    path, result = scripted_run
    assert result.returncode == 0, result.stderr
    url = f"sqlite:///{path.parent / '.cdcflow' / 'state.db'}"
    status = cdcflow("status", "--metadata", url)
    assert status.returncode == 0, status.stderr
    out = status.stdout
    assert "pipeline scripted" in out
    assert "finished" in out  # every partition finished at end_at
    assert "recent batches:" in out
    by_file = cdcflow("status", str(path), "--pipeline", "scripted")
    assert by_file.returncode == 0, by_file.stderr
    assert "pipeline scripted" in by_file.stdout
    assert_usage_error(cdcflow("status", "--metadata", url, "--pipeline", "other"),
                       "no pipeline named 'other'", "scripted")


def test_status_of_missing_sqlite_file(tmp_path: Path) -> None:
    assert_usage_error(cdcflow("status", "--metadata", f"sqlite:///{tmp_path}/none.db"),
                       f"sqlite:///{tmp_path}/none.db holds no cdcflow metadata (no such file)")
    assert_usage_error(cdcflow("status", str(tmp_path / "nope.py")),
                       f"no pipeline file {tmp_path / 'nope.py'}: give the pipeline's file")
    pipe = write(tmp_path, VALID)  # never run: no .cdcflow/ beside it
    assert_usage_error(cdcflow("status", str(pipe)), "holds no cdcflow metadata (no such file)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe.py"]


def test_status_does_not_make_another_sqlite_database_a_store(tmp_path: Path) -> None:
    import sqlite3

    app = tmp_path / "app.db"
    with sqlite3.connect(app) as raw:
        raw.execute("CREATE TABLE users (id INTEGER PRIMARY KEY)")
    raw.close()
    before = app.read_bytes()
    assert_usage_error(cdcflow("status", "--metadata", f"sqlite:///{app}"),
                       "holds no cdcflow metadata (it has no cdcflow tables): check the URL",
                       f"`cdcflow metadata init sqlite:///{app}`")
    assert app.read_bytes() == before  # no tables, no switch to WAL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


@pytest.mark.emulator
def test_status_does_not_create_a_spanner_store(spanner_emulator: Emulator) -> None:
    # An application's database, a mistyped table prefix, an unknown instance or database:
    # one line, exit 2, and the emulator holds what it held.
    client = spanner_emulator.client()
    name, other = f"shop-{os.getpid()}", f"nope-{os.getpid()}"
    spanner_emulator.create_database(
        name, ["CREATE TABLE Orders (Id INT64 NOT NULL) PRIMARY KEY (Id)"])
    try:
        shop = f"spanner://{spanner_emulator.database_path(name)}"
        nodb = spanner_emulator.database_path(other)
        nope = spanner_emulator.database_path(other, other)
        for url, says in (
            (shop, "holds no cdcflow metadata (no table CdcflowPartitions): check the URL"),
            (f"{shop}?table=Typo", "holds no cdcflow metadata (no table Typo)"),
            (f"spanner://{nodb}", f"the Spanner database {nodb} does not exist"),
            (f"spanner://{nope}", f"the Spanner instance {nope.split('/databases/')[0]} "
                                  "does not exist"),
        ):
            assert_usage_error(cdcflow("status", "--metadata", url), says)
        db = client.instance("test-instance").database(name)
        db.reload()
        assert len(db.ddl_statements) == 1
        assert not client.instance("test-instance").database(other).exists()
        assert not client.instance(other).exists()
    finally:
        client.instance("test-instance").database(name).drop()


# -- emulator start ------------------------------------------------------------------------


@pytest.mark.emulator
def test_emulator_start_creates_database_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    from cdcflow.spanner.emulator import emulator_client

    ddl = tmp_path / "shop.sql"
    ddl.write_text("CREATE TABLE T (Id INT64 NOT NULL) PRIMARY KEY (Id);\n"
                   "CREATE CHANGE STREAM TStream FOR T;\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "emulator", "start", "--partition-alive-seconds",
         "2", "--database", "shop", "--ddl-file", str(ddl)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        export = proc.stdout.readline().strip()
        assert export.startswith("export SPANNER_EMULATOR_HOST=127.0.0.1:"), export
        created = proc.stdout.readline().strip()
        assert created == "# database projects/test-project/instances/test-instance/databases/shop"
        host = export.partition("=")[2]
        client = emulator_client(host)
        try:
            db = client.instance("test-instance").database("shop")
            with db.snapshot() as snap:
                rows = list(snap.execute_sql(
                    "SELECT change_stream_name FROM information_schema.change_streams"))
        finally:
            client.close()
        assert rows == [["TStream"]]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.emulator
@pytest.mark.parametrize("stop", ["SIGINT", "SIGHUP"])
def test_emulator_start_removes_its_log_when_stopped(stop: str) -> None:
    """It printed the log's path, which kept the log after a clean stop: test runs left
    about ten spanner-emulator-*.log files an hour in /tmp. Only a failed emulator's stays
    (tests/spanner/test_emulator.py). Its terminal closing (SIGHUP) stops it as Ctrl-C."""
    proc = subprocess.Popen([sys.executable, "-m", "cdcflow", "emulator", "start"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = next(ln for ln in proc.stderr if ln.startswith("# emulator log: "))
        log = Path(re.findall(r"# emulator log: (/\S+?\.log)", line)[0])
        assert log.name.startswith("spanner-emulator-") and log.exists()
    finally:
        proc.send_signal(getattr(signal, stop))
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert not log.exists()
    assert "removed when it stops" in line  # the line does not promise to keep the file


@pytest.mark.emulator
def test_emulator_start_speaks_json_under_log_format_json() -> None:
    """Its notes on stderr were plain text under --log-format json: every stderr line is
    now a JSON log object; the export line on stdout stays a shell line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "emulator", "start", "--log-format", "json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None and proc.stdout is not None
        first = json.loads(proc.stderr.readline())
        assert first["level"] == "INFO" and first["message"].startswith("emulator log: /")
        assert proc.stdout.readline().startswith("export SPANNER_EMULATOR_HOST=127.0.0.1:")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert [line["message"] for line in lines] == ["stopping the emulator"]


@pytest.mark.emulator
def test_a_ctrl_c_while_the_emulator_starts_stops_it_and_removes_its_log(
    tmp_path: Path,
) -> None:
    """A Ctrl-C between the emulator's spawn and its first answer left its log in /tmp
    (exit 130); it stops it as a later Ctrl-C does: the log removed, exit 0."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "cdcflow", "emulator", "start"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob("spanner-emulator-*.log")) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert list(tmp_path.glob("spanner-emulator-*.log")), "the emulator did not spawn"
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "stopping the emulator" in err and "Traceback" not in err
    assert list(tmp_path.glob("spanner-emulator-*.log")) == []


def test_a_signal_after_the_run_s_time_is_up_is_a_first_signal(tmp_path: Path) -> None:
    """--for passing during a long batch said nothing, and the user's one SIGTERM then
    aborted as a second signal ("signal 15 again: aborting", exit 130). The end of the
    time is said; the first signal says the run stops after the batch already, and the
    batch commits."""
    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent("""
        import time
        import cdcflow as cf
        from cdcflow.testing import ScriptedChangeStream

        T0 = time.time_ns() - 30 * 10**9
        stream = ScriptedChangeStream("S", partitions=1, origin=T0)
        for i in range(40):  # one commit timestamp: one batch
            stream.write("T", i, "INSERT", {"v": i}, at=T0 + 10**9)

        def slow(r):
            time.sleep(0.1)
            return r

        pipeline = cf.Pipeline("slow-batch")
        (pipeline | cf.DetectPartitions(stream="S", start_at=T0, client=stream)
         | cf.ReadPartition() | cf.Map(slow) | cf.Collect())
    """))
    proc = subprocess.Popen([sys.executable, "-m", "cdcflow", "run", str(path), "--for", "1s",
                             "--metadata", "memory://"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    said: list[str] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            said.append(line)
            if "the run's time is up (1s): stopping after the current batch" in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    said.append(rest)
    text = "".join(said)
    assert proc.returncode == 0, text
    assert "signal 15: the run stops after the current batch already (again to abort)" in text, text
    assert "again: aborting" not in text and "interrupted" not in text
    assert "40 records in" in text and "stopped (duration)" in text, text  # it committed


def test_emulator_ddl_file_needs_database(tmp_path: Path) -> None:
    assert_usage_error(cdcflow("emulator", "start", "--ddl-file", str(tmp_path / "x.sql")),
                       "--ddl-file needs --database")


FOREVER = """
import time
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

T0 = time.time_ns() - 5 * 10**9
stream = ScriptedChangeStream("Orders", partitions=2, origin=T0)
for i in range(20):
    stream.write("Orders", {"id": i}, "INSERT", {"total": i}, at=T0 + i * 100_000_000)

pipeline = cf.Pipeline("forever")
(pipeline
 | cf.DetectPartitions(stream="Orders", start_at=T0, client=stream)
 | cf.ReadPartition(heartbeat="100ms")
 | cf.WriteFiles("out"))
"""


def signal_run(args: list[str], signum: int, *, at: str, delay: float = 0.0,
               cwd: Path | None = None) -> tuple[int, str]:
    """``cdcflow run ARGS``, sent ``signum`` ``delay`` seconds after a stderr line holding
    ``at``: its exit code and stderr. A run that does not end is killed (nothing is left
    running) and the wait fails."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "run", *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=cwd, env={**os.environ, "NO_COLOR": "1"},
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if at in line:
                break
        time.sleep(delay)
        with contextlib.suppress(ProcessLookupError):  # (it may have ended meanwhile)
            proc.send_signal(signum)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, "".join(seen) + rest


@pytest.mark.parametrize("runner", ["memory", pytest.param("spark", marks=pytest.mark.spark)])
def test_ctrl_c_stops_after_the_current_batch(tmp_path: Path, runner: str) -> None:
    # On Spark too: PySpark's own SIGINT handler (cancel every job) must not replace ours.
    path = write(tmp_path, FOREVER)
    code, err = signal_run(  # once batches commit, press Ctrl-C
        [str(path), "--batch-interval", "100ms", "--runner", runner,
         *(["--master", "local[1]"] if runner == "spark" else [])],
        signal.SIGINT, at=" batch 3:")
    assert code == 130, err
    assert "stopping after the current batch" in err
    assert "stopped (interrupted)" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_after_the_summary_keeps_the_run_s_exit_code(
    tmp_path: Path, signum: int
) -> None:
    """A run that completed and printed its summary is ending: a SIGTERM (a supervisor
    stopping it just then) or a Ctrl-C does not turn its exit 0 into death by signal (143)
    or a traceback from the interpreter's teardown."""
    path = write(tmp_path, SCRIPTED)
    for delay in (0.0, 0.05, 0.15):
        code, err = signal_run([str(path), "--metadata", "memory://"], signum,
                               at="dead-lettered", delay=delay, cwd=tmp_path)  # its last line
        assert code == 0, (delay, code, err)
        assert "stopped (end reached)" in err and "Traceback" not in err, err


def test_sighup_stops_after_the_current_batch(tmp_path: Path) -> None:
    """SIGHUP (the terminal or the session closed) stops a run as SIGTERM does: the lease
    is released and the run says so, rather than dying at once with no word (exit 129)."""
    path = write(tmp_path, FOREVER)
    store = f"sqlite:///{tmp_path / 'state.db'}"
    code, err = signal_run([str(path), "--batch-interval", "100ms", "--metadata", store],
                           signal.SIGHUP, at=" batch 3:")
    assert code == 130, err
    assert "signal 1: stopping after the current batch" in err, err
    assert "stopped (interrupted)" in err and "Traceback" not in err, err
    status = cdcflow("status", "--metadata", store, "--json")
    assert json.loads(status.stdout)["pipelines"][0]["run"]["alive"] is False


SLOW_BATCH = """
import time
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

T0 = 1_700_000_000 * 10**9
stream = ScriptedChangeStream("Orders", partitions=1, origin=T0)
for i in range(200):
    stream.write("Orders", {"id": i}, "INSERT", {"total": i}, at=T0 + 10**9 + i)


def slow(record):
    print("reading", flush=True)
    time.sleep(0.2)  # the batch takes 40 s
    return record


pipeline = cf.Pipeline("slow")
(pipeline
 | cf.DetectPartitions(stream="Orders", start_at=T0, end_at=T0 + 3 * 10**9, client=stream)
 | cf.ReadPartition()
 | cf.Map(slow)
 | cf.WriteFiles("out"))
"""


@pytest.mark.parametrize("first,second", [(signal.SIGINT, signal.SIGTERM),
                                          (signal.SIGTERM, signal.SIGINT)])
def test_a_signal_of_the_other_kind_after_the_first_aborts(
    tmp_path: Path, first: int, second: int
) -> None:
    """Ctrl-C then SIGTERM (a supervisor escalating), or the other way round: the second
    aborts, as a second of the same kind does, instead of asking again to stop after a
    batch that takes 40 s."""
    path = write(tmp_path, SLOW_BATCH)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "run", str(path), "--metadata",
         f"sqlite:///{tmp_path / 'state.db'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "reading"
        proc.send_signal(first)
        time.sleep(0.5)
        began = time.monotonic()
        proc.send_signal(second)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - began
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert took < 10, (took, err)
    assert "stopping after the current batch" in err, err
    assert "interrupted" in err and "stopped (interrupted)" not in err, err  # aborted
    assert "Traceback" not in err, err


STUCK_TASK = """
import time
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

T0 = 1_700_000_000 * 10**9
stream = ScriptedChangeStream("Orders", partitions=2, origin=T0)
for i in range(4):
    stream.write("Orders", {"id": i}, "INSERT", {"total": i}, at=T0 + 10**9 + i)


def stuck(record):
    print("stuck", flush=True)
    time.sleep(3600)  # a read or call that never returns (a silent connection)
    return record


pipeline = cf.Pipeline("stuck")
(pipeline
 | cf.DetectPartitions(stream="Orders", start_at=T0, end_at=T0 + 3 * 10**9, client=stream)
 | cf.ReadPartition()
 | cf.Map(stuck)
 | cf.WriteFiles("out"))
"""


def test_a_second_ctrl_c_ends_a_run_whose_task_never_returns(tmp_path: Path) -> None:
    # The first asks to stop after the batch, which never ends; the second aborts, and the
    # process exits although a task's thread is still busy (the interpreter would wait).
    path = write(tmp_path, STUCK_TASK)
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "run", str(path), "--metadata",
         f"sqlite:///{tmp_path / 'state.db'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        assert "stuck" in proc.stdout.readline()  # (two tasks may print on one line)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        began = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert time.monotonic() - began < 10
    assert "interrupted" in err and "Traceback" not in err


HANGING_FLUSH = """
import sys
import time
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

T0 = 1_700_000_000 * 10**9
stream = ScriptedChangeStream("Orders", partitions=1, origin=T0)
stream.write("Orders", {"id": 1}, "INSERT", {"total": 1}, at=T0 + 10**9)


class _Writer:
    def write(self, element):
        pass

    def close(self):
        return 1

    def abort(self):
        pass


class Hanging(cf.Sink):
    \"\"\"Stages every batch; its flush waits for a storage that never answers.\"\"\"

    def open_writer(self, ctx):
        return _Writer()

    def durable_batch(self):
        return 0

    def commit(self, batch_id, messages):
        pass

    def flush(self):
        print("flushing", flush=True)
        while True:
            time.sleep(0.1)


pipeline = cf.Pipeline("hanging")
(pipeline
 | cf.DetectPartitions(stream="Orders", start_at=T0, end_at=T0 + 3 * 10**9, client=stream)
 | cf.ReadPartition()
 | Hanging())
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_final_flush_that_waits_on_its_storage(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The batches are over and a staging sink's flush hangs: one signal stops the run
    (exit 130, one warning), where SIGTERM used to kill it with no word (exit 143)."""
    path = write(tmp_path, HANGING_FLUSH)
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cdcflow", "run", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "flushing\n"
        time.sleep(0.3)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert f"signal {int(sig)} while the staged output was being made durable" in err
    assert "Traceback" not in err


def test_an_applications_own_signal_handler_stays_during_the_final_flush(
    tmp_path: Path,
) -> None:
    """pipeline.run() in an application that handles SIGTERM itself: its handler is called,
    not replaced by the engine's."""
    script = HANGING_FLUSH + textwrap.dedent('''
        import signal

        def mine(signum, frame):
            print("the application's handler", flush=True)

        signal.signal(signal.SIGTERM, mine)
        pipeline.run("memory", "memory://")
    ''')
    path = write(tmp_path, script, "app.py")
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "flushing\n"
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline() == "the application's handler\n"
        assert proc.poll() is None  # still flushing: the application decides
    finally:
        proc.kill()
        proc.communicate(timeout=30)


STORAGE_DOWN = """
import fsspec
from fsspec.implementations.memory import MemoryFileSystem
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream


class Down(MemoryFileSystem):
    \"\"\"Memory storage that refuses every data file (a storage outage).\"\"\"

    protocol = "down"

    def pipe_file(self, path, value, *args, **kw):
        if "/part-" in path:
            raise ConnectionRefusedError("injected: the storage is down")
        return super().pipe_file(path, value, *args, **kw)


fsspec.register_implementation("down", Down, clobber=True)
T0 = 1_700_000_000 * 10**9
stream = ScriptedChangeStream("Orders", partitions=1, origin=T0)
for i in range(50):
    stream.write("Orders", {"id": i}, "INSERT", {"total": i}, at=T0 + i * 10**8)
pipeline = cf.Pipeline("storage-down")
(pipeline
 | cf.DetectPartitions(stream="Orders", start_at=T0, client=stream)
 | cf.ReadPartition()
 | cf.WriteTables("down://lake", flush_interval="100ms"))
"""


def test_one_sigterm_stops_a_run_whose_uploads_fail(tmp_path: Path) -> None:
    """A supervisor's single SIGTERM during a storage outage: the run stops after the
    current batch and does not wait for the failing uploads at its end (exit 130)."""
    path = write(tmp_path, STORAGE_DOWN)
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cdcflow", "run", str(path),
                             "--batch-interval", "100ms"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr is not None
    seen = []
    try:
        for line in proc.stderr:  # once an upload failed
            seen.append(line)
            if "uploads to down://lake fail" in line:
                break
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        _, rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
    err = "".join(seen) + rest
    assert proc.returncode == 130, err
    assert time.monotonic() - began < 15
    assert "stopping without waiting for the staged output to become durable" in err
    assert "Traceback" not in err


CONSUME_DOWN = f"""
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

stream = ScriptedChangeStream("Orders", partitions=1, origin={T0})
for i in range(5):
    stream.write("Orders", {{"id": i}}, "INSERT", {{"total": i}}, at={T0} + (i + 1) * 10**8)


def send(record):
    print("sending", flush=True)
    raise ConnectionError("API down")


def on_error(error, element, partition, attempt):  # the README's handler
    return cf.Retry(after=2 ** attempt) if attempt <= 5 else cf.Stop()


pipeline = cf.Pipeline("notify")
(pipeline
 | cf.DetectPartitions(stream="Orders", start_at={T0}, client=stream)
 | cf.ReadPartition()
 | cf.Consume(send, on_error=cf.ErrorPolicy(handler=on_error)))
"""


def test_one_sigterm_stops_a_run_whose_consume_calls_are_being_retried(
    tmp_path: Path,
) -> None:
    """The downstream is down and Consume retries with growing delays (a minute in all):
    a supervisor's SIGTERM ends the run at once as stopped, and the batch is replayed."""
    path = write(tmp_path, CONSUME_DOWN)
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cdcflow", "run", str(path), "--metadata",
                             f"sqlite:///{tmp_path / 'm.db'}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().startswith("sending")  # the first call failed
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - began
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert took < 5, (took, err)
    assert "asked to stop while 5 element(s) of partition p0 were being retried" in err
    assert "the next run replays it" in err and "Traceback" not in err


def test_a_run_for_a_duration_ends_while_consume_calls_are_being_retried(
    tmp_path: Path,
) -> None:
    """--for ends the run like a stop: a batch whose calls are being retried is given up
    once the duration passes (it is replayed next run), not retried for a minute more."""
    path = write(tmp_path, CONSUME_DOWN)
    began = time.monotonic()
    result = cdcflow("run", str(path), "--metadata", f"sqlite:///{tmp_path / 'm.db'}",
                     "--for", "2s")
    took = time.monotonic() - began
    assert result.returncode == 0, result.stderr
    assert took < 10, (took, result.stderr)
    assert "were being retried; the batch is given up" in result.stderr
    assert "stopped (duration)" in result.stderr and "Traceback" not in result.stderr


def test_a_stop_while_consume_holds_its_reader_back_and_retries_is_a_stop(
    tmp_path: Path,
) -> None:
    """More changes than Consume's queue holds: the reader waits in write() for room while
    calls are retried. The stop gave the batch up there, and the pipeline's error policy
    took that for the element's failure: "failed ... after 4 attempt(s)", "fix the
    cause", exit 1 (or, with then='skip', hundreds of false "skipped" warnings)."""
    path = write(tmp_path, CONSUME_DOWN.replace("range(5)", "range(300)"))
    result = cdcflow("run", str(path), "--metadata", f"sqlite:///{tmp_path / 'm.db'}",
                     "--for", "2s")
    assert result.returncode == 0, result.stderr
    assert "were being retried; the batch is given up" in result.stderr
    assert "stopped (duration)" in result.stderr and "Traceback" not in result.stderr
    assert "failed on a change" not in result.stderr
    assert "skipped an element" not in result.stderr


def test_status_of_a_memory_store_says_status_cannot_see_it() -> None:
    """It said "no pipelines in memory:// yet: `cdcflow run FILE --metadata memory://`",
    exit 0: a memory:// store lives in the run's own process, so that never helps."""
    assert_usage_error(cdcflow("status", "--metadata", "memory://"),
                       "lives in the process running the pipeline")


def test_metadata_init_sqlite(tmp_path: Path) -> None:
    db = tmp_path / "meta.db"
    result = cdcflow("metadata", "init", f"sqlite:///{db}")
    assert result.returncode == 0, result.stderr
    assert db.is_file()
    status = cdcflow("status", "--metadata", f"sqlite:///{db}")
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith("no pipelines in sqlite:///")
    assert_usage_error(cdcflow("metadata", "init", "db.sqlite"), "not a metadata store URL")
    assert_usage_error(cdcflow("metadata", "init", "kafka://x"), "'kafka'")


@pytest.mark.parametrize("value", ["abc", "0", "10XB"])
def test_a_bad_quota_in_the_environment_exits_2_before_any_batch(
    tmp_path: Path, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, SCRIPTED)
    monkeypatch.setenv("CDCFLOW_MAX_INFLIGHT_BYTES", value)
    result = cdcflow("run", str(path), "--metadata", f"sqlite:///{tmp_path / 'm.db'}")
    assert_usage_error(result, f"CDCFLOW_MAX_INFLIGHT_BYTES={value!r}", "256MiB")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.jsonl"))
    monkeypatch.setenv("CDCFLOW_MAX_INFLIGHT_BYTES", "64MiB")  # fixed: the run goes through
    ran = cdcflow("run", str(path), "--metadata", f"sqlite:///{tmp_path / 'm.db'}")
    assert ran.returncode == 0, ran.stderr
    assert list((tmp_path / "out").glob("*.jsonl"))


def test_pipeline_stopped_exits_1_with_one_line(tmp_path: Path) -> None:
    body = SCRIPTED.replace(
        'pipeline = cf.Pipeline("scripted")',
        'pipeline = cf.Pipeline("scripted", error_policy=cf.ErrorPolicy(retries=0))',
    ).replace('"rows" >> cf.Map(to_row)', '"rows" >> cf.Map(lambda r: 1 / 0)')
    path = write(tmp_path, body)
    result = cdcflow("run", str(path))
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("cdcflow: error:")]
    assert len(errors) == 1
    assert "ZeroDivisionError" in errors[0]
    assert "Traceback" not in result.stderr
    assert not list((tmp_path / "out").glob("*.jsonl"))


# -- logs, --debug anywhere, metrics -------------------------------------------------------

_STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def test_plain_log_lines_carry_the_utc_date_and_the_summary_counts_errors(
    scripted_run: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    _, result = scripted_run
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines and all(re.match(_STAMP + r" (INFO|WARNING) cdcflow\.", line) for line in lines)
    assert any("elements   0 skipped, 0 retried, 0 dead-lettered" in line for line in lines)


def test_json_logs_one_object_per_line(tmp_path: Path) -> None:
    path = write(tmp_path, SCRIPTED)
    result = cdcflow("run", str(path), "--log-format", "json", "--batch-interval", "0s",
                     "--metrics-port", "0")
    assert result.returncode == 0, result.stderr
    docs = [json.loads(line) for line in result.stderr.splitlines()]
    assert len(docs) > 5
    for doc in docs:
        assert set(doc) == {"time", "level", "logger", "message", "pipeline"}
        assert re.fullmatch(_STAMP, doc["time"])
        assert doc["pipeline"] == "scripted"
    messages = [d["message"] for d in docs]
    assert any(re.fullmatch(r"metrics at http://127\.0\.0\.1:\d+/metrics", m) for m in messages)
    assert any(m.startswith("cdcflow: scripted stopped (end reached)") for m in messages)
    # before the command too, and errors come out as JSON as well
    failed = cdcflow("--log-format", "json", "run", str(tmp_path / "missing.py"))
    assert failed.returncode == 2
    (error,) = [json.loads(line) for line in failed.stderr.splitlines()]
    assert error["level"] == "ERROR" and "not found" in error["message"]
    assert error["pipeline"] is None  # no pipeline was loaded
    # an error that ends a run names its pipeline, as the run's lines do
    (tmp_path / "broken").mkdir()  # a store of its own
    broken = write(tmp_path / "broken",
                   SCRIPTED.replace('"id": record.mods[0].keys["id"]', '"id": 1 / 0'))
    failed = cdcflow("run", str(broken), "--log-format", "json", "--batch-interval", "0s")
    assert failed.returncode == 1, failed.stderr
    docs = [json.loads(line) for line in failed.stderr.splitlines()]
    assert docs[-1]["level"] == "ERROR" and "ZeroDivisionError" in docs[-1]["message"], docs
    assert {d["pipeline"] for d in docs} == {"scripted"}


def test_debug_goes_before_or_after_the_command(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.py")
    for argv in (["--debug", "run", missing], ["run", missing, "--debug"],
                 ["run", "--debug", missing]):
        result = cdcflow(*argv)
        assert result.returncode != 0
        assert "Traceback" in result.stderr, argv  # --debug shows the traceback
    path = write(tmp_path, VALID)
    assert cdcflow("graph", str(path), "--debug").returncode == 0


def test_debug_shows_the_traceback_and_keeps_the_exit_code_and_line(tmp_path: Path) -> None:
    """--debug (or CDCFLOW_DEBUG=1) adds the traceback; the exit code a script branches
    on (2: fix the input) and the last line stay what they are without it."""
    path = write(tmp_path, "def f(:\n")
    plain = cdcflow("graph", str(path))
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    for debugged in (cdcflow("--debug", "graph", str(path)),
                     cdcflow("graph", str(path), env={"CDCFLOW_DEBUG": "1"})):
        assert debugged.returncode == 2, debugged.stderr
        assert "Traceback" in debugged.stderr and "PipelineFileError" in debugged.stderr
        assert debugged.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1]
    bad = cdcflow("run", str(path), "--for", "banana", "--debug")
    assert bad.returncode == 2 and "not a duration" in bad.stderr.splitlines()[-1]


def test_metrics_port_in_use_is_one_line(tmp_path: Path) -> None:
    import socket

    path = write(tmp_path, SCRIPTED)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_usage_error(cdcflow("run", str(path), "--metrics-port", str(port)),
                           f"metrics port {port} is in use")
    assert_usage_error(cdcflow("run", str(path), "--metrics-port", "http"), "not a port")
    assert_usage_error(cdcflow("run", str(path), "--stuck-after", "soon"), "--stuck-after")


SLOW_TO_LOAD = """
import sys, time
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

print("loading", flush=True)
time.sleep(20)  # a pipeline module that takes long to import (or a runner that starts slowly)
pipeline = cf.Pipeline("slow")
pipeline | cf.DetectPartitions(stream="S", client=ScriptedChangeStream("S")) | cf.Print()
"""


def test_a_sigterm_before_the_run_starts_ends_it_in_one_line(tmp_path: Path) -> None:
    """A supervisor's SIGTERM while the pipeline loads (or Spark starts: 15-20 s) used to
    kill the process with no word (exit 143); it ends it as Ctrl-C does."""
    path = write(tmp_path, SLOW_TO_LOAD)
    proc = subprocess.Popen([sys.executable, "-m", "cdcflow", "run", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "loading\n"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


def test_a_set_value_for_a_runner_parameter_without_a_type_is_read_as_python() -> None:
    """A plugin runner's ``__init__(self, workers=None)``: ``--set workers=2`` gave it the
    text '2'. Numbers and true/false are read as such there; a typed parameter keeps its
    own conversion, and other text stays text."""
    from cdcflow.cli._options import convert
    from cdcflow.launch import OptionSpec

    untyped = OptionSpec("workers", "any", True, "runner")
    assert convert("workers", "2", untyped) == 2
    assert convert("workers", "1.5", untyped) == 1.5
    assert convert("workers", "true", untyped) is True
    assert convert("workers", "none", untyped) is None
    assert convert("workers", "two", untyped) == "two"
    assert convert("name", "2", OptionSpec("name", "text", False, "runner")) == "2"
