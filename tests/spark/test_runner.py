"""SparkRunner: same output as the in-memory runner, Spark retries, clusters, driver crashes.

What every runner must do alike (delivery, order, replay, error policies) is checked by the
engine suite under every runner (tests/engine/test_loop.py); this file keeps what is Spark's
own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner
from cdcflow.errors import SinkIOError
from cdcflow.metadata import open_store
from cdcflow.policy import ErrorPolicy
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.spark.runner import SparkRunner, SparkTaskError, _groups, local_master
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, DetectPartitions, Map, ReadPartition, WriteFiles

pytestmark = pytest.mark.spark

# The DoFns and functions below run in Spark's Python workers, which cannot import this
# test module by name: they travel by value, as a pipeline file's functions do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

S = 1_000_000_000
T0 = 1_700_000_000 * S
END = T0 + 30 * S


@pytest.fixture
def spark(spark_runner: SparkRunner) -> Any:
    """The test session's local[2] session; runners opened in tests use it and leave it."""
    return spark_runner.session


def churn_stream() -> ScriptedChangeStream:
    """Three partitions that split and merge while keys keep changing."""
    s = ScriptedChangeStream("S", partitions=3, buckets=32, origin=T0)
    s.split("p0", at=T0 + 6 * S, into=["a", "b"])
    s.merge(["b", "p1"], at=T0 + 12 * S, into="m")
    s.split("m", at=T0 + 20 * S, into=["m1", "m2"])
    for i in range(240):
        with s.transaction(at=T0 + 1 + i * (29 * S // 240)) as tx:
            tx.write("T", i % 17, "INSERT" if i < 17 else "UPDATE", {"i": i})
            if i % 5 == 0:
                tx.write("T", 100 + i % 7, "UPDATE", {"i": -i})
    return s


def to_row(record: cf.DataChangeRecord) -> dict[str, Any]:
    return {
        "ts": record.commit_timestamp.ns,
        "txn": record.server_transaction_id,
        "token": record.partition_token,
        "mods": [[m.keys, m.new_values] for m in record.mods],
    }


def build(stream: ScriptedChangeStream, out: Path, *steps: Any) -> tuple[cf.Pipeline, Collect]:
    pipeline = cf.Pipeline("spark-test", error_policy=ErrorPolicy(retries=0))
    rows = (
        pipeline
        | DetectPartitions(stream="S", start_at=T0, end_at=END - 1, client=stream)
        | ReadPartition(heartbeat="500ms")
    )
    for step in steps:
        rows = rows | step
    rows = rows | "row" >> Map(to_row)
    rows | "files" >> WriteFiles(out)
    collect = Collect()
    rows | "collect" >> collect
    return pipeline, collect


def run(pipeline: cf.Pipeline, runner: Runner) -> None:
    store = open_store("memory://")
    try:
        Engine(pipeline, store, runner, RunOptions(batch_interval=0, max_batch_span=4.0)).run()
    finally:
        store.close()


def committed_files(out: Path) -> dict[str, list[str]]:
    """Committed output: file name -> lines (hidden and underscore files are not output)."""
    return {
        p.name: p.read_text().splitlines()
        for p in sorted(out.iterdir())
        if not p.name.startswith((".", "_"))
    }


def expected_rows(stream: ScriptedChangeStream) -> list[tuple[int, str, str]]:
    return sorted(
        (r.commit_timestamp.ns, r.server_transaction_id, r.partition_token)
        for r in stream.expected_records(T0, END)
    )


def row_keys(rows: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    return sorted((r["ts"], r["txn"], r["token"]) for r in rows)


def test_same_output_as_in_memory_record_for_record(spark: Any, tmp_path: Path) -> None:
    stream = churn_stream()
    mem_pipeline, mem_collect = build(stream, tmp_path / "memory")
    run(mem_pipeline, InMemoryRunner(workers=2))
    spark_pipeline, spark_collect = build(stream, tmp_path / "spark")
    run(spark_pipeline, SparkRunner("local[2]"))

    assert spark_collect.items == mem_collect.items
    assert row_keys(spark_collect.items) == expected_rows(stream)
    spark_files = committed_files(tmp_path / "spark")
    assert spark_files == committed_files(tmp_path / "memory")
    assert len(spark_files) > 10  # many batches and partitions, splits and merges among them
    # the session belongs to the fixture: the runner used it and left it running
    assert not spark.sparkContext._jsc.sc().isStopped()


class CrashOnce(cf.DoFn):
    """Kills its Python worker on key 5 the first time (a marker file remembers)."""

    def __init__(self, marker: str, always: bool = False) -> None:
        self.marker = marker
        self.always = always

    def process(self, element: cf.DataChangeRecord) -> Iterator[cf.DataChangeRecord]:
        if element.mods[0].keys.get("id") == 5 and (
            self.always or not os.path.exists(self.marker)
        ):
            Path(self.marker).touch()
            os._exit(17)  # as if the worker died: no exception, no cleanup
        yield element


def test_a_task_whose_worker_dies_is_retried_without_duplicates(
    spark: Any, tmp_path: Path
) -> None:
    stream = churn_stream()
    marker = tmp_path / "crashed"
    pipeline, collect = build(stream, tmp_path / "out", "crash" >> cf.ParDo(CrashOnce(str(marker))))
    run(pipeline, SparkRunner())

    assert marker.exists()  # the first attempt did die
    assert row_keys(collect.items) == expected_rows(stream)
    rows = [line for lines in committed_files(tmp_path / "out").values() for line in lines]
    assert len(rows) == len(set(rows)) == len(expected_rows(stream))


def test_a_task_failing_on_every_attempt_is_named(spark: Any, tmp_path: Path) -> None:
    stream = churn_stream()
    crash = CrashOnce(str(tmp_path / "crashed"), always=True)
    pipeline, _ = build(stream, tmp_path / "out", "crash" >> cf.ParDo(crash))
    with pytest.raises(SparkTaskError) as info:
        run(pipeline, SparkRunner())
    text = str(info.value)
    assert "after 4 attempts" in text
    assert "partition " in text and "slice [" in text and "batch " in text
    assert "run again to replay it" in text


class FailAttempts(cf.DoFn):
    """Raises SinkIOError on key 5 until it has done so ``failures`` times (a counter file)."""

    def __init__(self, counter: str, failures: int) -> None:
        self.counter = counter
        self.failures = failures

    def process(self, element: cf.DataChangeRecord) -> Iterator[cf.DataChangeRecord]:
        if element.mods[0].keys.get("id") == 5:
            path = Path(self.counter)
            failed = int(path.read_text()) if path.exists() else 0
            if failed < self.failures:
                path.write_text(str(failed + 1))
                msg = f"disk full (attempt {failed + 1})"
                raise SinkIOError(msg)
        yield element


def test_a_transient_error_reaches_the_engine_as_itself_after_sparks_retries(
    spark: Any, tmp_path: Path
) -> None:
    # Spark tries the task 4 times (local[2,4]); every try fails. The driver must see a
    # SinkIOError, not only Spark's wrapper, so the engine retries the batch, which succeeds.
    stream = churn_stream()
    counter = tmp_path / "attempts"
    pipeline, collect = build(stream, tmp_path / "out", "fail" >> cf.ParDo(
        FailAttempts(str(counter), failures=4)))
    store = open_store("memory://")
    opts = RunOptions(batch_interval=0, max_batch_span=4.0, batch_retries=1, retry_backoff=0)
    Engine(pipeline, store, SparkRunner(), opts).run()
    # Spark gave up after its 4 attempts; the run still ended well: the engine retried
    assert int(counter.read_text()) == 4
    assert row_keys(collect.items) == expected_rows(stream)

    counter.unlink()
    pipeline, _ = build(stream, tmp_path / "out2", "fail" >> cf.ParDo(
        FailAttempts(str(counter), failures=100)))
    opts = RunOptions(batch_interval=0, max_batch_span=4.0, batch_retries=0)
    with pytest.raises(SinkIOError, match="disk full") as info:
        Engine(pipeline, open_store("memory://"), SparkRunner(), opts).run()
    notes = " ".join(getattr(info.value, "__notes__", []))
    # PySpark hands over the Python error's text alone here, without Spark's attempt count
    assert "in Spark task 0 (batch" in notes and "slice [" in notes
    assert "failed on every attempt Spark allowed" in notes


def test_session_settings_pass_the_emulator_host_to_executors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPANNER_EMULATOR_HOST", "127.0.0.1:1")
    settings = SparkRunner("local[2]")._settings("app")
    assert settings["spark.executorEnv.SPANNER_EMULATOR_HOST"] == "127.0.0.1:1"
    assert settings["spark.python.unix.domain.socket.enabled"] == "true"
    assert settings["spark.python.worker.reuse"] == "true"
    assert settings["spark.master"] == "local[2,4]"
    assert settings["spark.app.name"] == "app"
    # what the user sets wins
    assert SparkRunner(conf={"spark.ui.enabled": "true"})._settings("a")["spark.ui.enabled"] == (
        "true"
    )


def test_local_masters_get_task_retries() -> None:
    assert local_master(None) == "local[*,4]"
    assert local_master("local") == "local[1,4]"
    assert local_master("local[3]") == "local[3,4]"
    assert local_master("local[2,7]") == "local[2,7]"
    assert local_master("local-cluster[2,1,1024]") == "local-cluster[2,1,1024]"
    assert local_master("spark://h:7077") == "spark://h:7077"


def test_groups_cut_tasks_into_balanced_contiguous_runs() -> None:
    assert _groups(10, 4) == [range(0, 2), range(2, 5), range(5, 7), range(7, 10)]
    assert _groups(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert [i for g in _groups(997, 8) for i in g] == list(range(997))
    with pytest.raises(ValueError, match="tasks_per_core=0"):
        SparkRunner(tasks_per_core=0)


def test_a_batch_of_many_slices_runs_a_few_spark_tasks_per_core(
    spark: Any, tmp_path: Path
) -> None:
    stream = ScriptedChangeStream("S", partitions=12, buckets=48, origin=T0)
    for i in range(300):
        stream.write("T", i % 48, "UPDATE" if i >= 48 else "INSERT", {"i": i},
                     at=T0 + 1 + i * (29 * S // 300))
    pipeline, collect = build(stream, tmp_path / "out")
    sc = spark.sparkContext
    sc.setJobGroup("grouped", "grouped slices")
    try:
        runner = SparkRunner(tasks_per_core=2)
        run(pipeline, runner)  # pipelined: batches also run from a read-ahead thread
    finally:
        sc.setJobGroup(None, None)
    assert runner.job_group == "grouped"
    tracker = sc.statusTracker()
    jobs = tracker.getJobIdsForGroup("grouped")
    tasks = [
        tracker.getStageInfo(stage).numTasks
        for job in jobs
        for stage in tracker.getJobInfo(job).stageIds
    ]
    assert len(jobs) > 1  # jobs of the read-ahead thread are in the group too
    assert max(tasks) == 2 * sc.defaultParallelism < 12  # 12 slices, 4 Spark tasks
    assert row_keys(collect.items) == expected_rows(stream)
    rows = [line for lines in committed_files(tmp_path / "out").values() for line in lines]
    assert len(rows) == len(set(rows)) == len(expected_rows(stream))


def test_no_tasks_run_no_job(spark: Any) -> None:
    runner = SparkRunner()
    runner.open("x")
    assert runner.run_tasks(b"", []) == []
    runner.close()


# -- whole runs through the command line, in their own processes -------------------------------

PIPELINE_FILE = '''
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import DetectPartitions, Map, ReadPartition, WriteFiles

S = 1_000_000_000
T0 = 1_700_000_000 * S


def make_stream():
    s = ScriptedChangeStream("S", partitions=4, buckets=32, origin=T0)
    s.split("p0", at=T0 + 9 * S, into=["a", "b"])
    s.merge(["b", "p1"], at=T0 + 21 * S, into="m")
    for i in range(600):
        s.write("T", i % 23, "UPDATE", {{"i": i}}, at=T0 + 1 + i * (39 * S // 600))
    return s


def to_row(r):
    return {{"ts": r.commit_timestamp.ns, "token": r.partition_token,
            "mods": [[m.keys, m.new_values] for m in r.mods]}}


pipeline = cf.Pipeline("spark-cli")
(pipeline
 | DetectPartitions(stream="S", start_at=T0, end_at=T0 + 40 * S - 1, client=make_stream())
 | ReadPartition(heartbeat="500ms")
 | Map(to_row)
 | WriteFiles({out!r}))
'''


def write_pipeline(directory: Path) -> Path:
    directory.mkdir(parents=True)
    path = directory / "pipeline.py"
    path.write_text(textwrap.dedent(PIPELINE_FILE.format(out=str(directory / "out"))))
    return path


def cli(path: Path, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "cdcflow", "run", str(path),
        "--metadata", f"sqlite:///{path.parent / 'state.db'}",
        "--set", "max_batch_span=2s", "--batch-interval", "0s", *args,
    ]  # fmt: skip


def reference_output(tmp_path: Path) -> dict[str, list[str]]:
    path = write_pipeline(tmp_path / "memory")
    subprocess.run(cli(path), check=True, capture_output=True, timeout=120)
    return committed_files(path.parent / "out")


def test_a_local_cluster_run_killed_mid_run_then_resumed_gives_every_line_once(
    tmp_path: Path,
) -> None:
    """The first run's executors have their own JVMs and Python workers (local-cluster
    mode); it is SIGKILLed mid-run and a local[2] run finishes it: the files hold the
    in-memory runner's lines, each once (the batch the kill cut short is planned again,
    narrower after the crash, so its lines may fall in other files)."""
    expected = reference_output(tmp_path)
    path = write_pipeline(tmp_path / "spark")
    out = path.parent / "out"
    # its own session (process group): the kill takes the driver, its JVMs and Python workers
    first = subprocess.Popen(
        cli(path, "--runner", "spark", "--master", "local-cluster[2,1,1024]"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and first.poll() is None:
            if out.exists() and len(committed_files(out)) >= 12:
                break
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before it could be killed"
        time.sleep(0.15)  # somewhere inside a later batch
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(timeout=30)
    partial = committed_files(out)
    assert 0 < len(partial) < len(expected)

    second = subprocess.run(
        cli(path, "--runner", "spark", "--master", "local[2]"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    got = committed_files(out)
    assert Counter(line for lines in got.values() for line in lines) == Counter(
        line for lines in expected.values() for line in lines)
    # the files the first run committed are kept as they were
    assert {name: got[name] for name in partial} == partial
    assert len(expected) > 20


def test_a_jvm_launcher_that_dies_at_start_is_started_again(tmp_path: Path) -> None:
    """PySpark starts ``$SPARK_HOME/bin/spark-submit``; here it dies once (SIGABRT, as a
    forked launcher now and then does in a process running gRPC threads) before it execs
    the real one. The session starts all the same, with a warning."""
    real = Path(__import__("pyspark").__file__).parent
    home = tmp_path / "spark-home"
    home.mkdir()
    for entry in real.iterdir():
        if entry.name != "bin":
            (home / entry.name).symlink_to(entry)
    (home / "bin").mkdir()
    for entry in (real / "bin").iterdir():
        if entry.name != "spark-submit":
            (home / "bin" / entry.name).symlink_to(entry)
    flag = tmp_path / "died"
    launcher = home / "bin" / "spark-submit"
    # what gRPC prints in such a child before it dies: not the JVM's word, so no reason to
    # give up (it did, once: the launcher was not started again)
    grpc = ("E1128 00:48:39.661057    8427 ev_epoll1_linux.cc:373] (event_engine) "
            "Epoll1Poller:0x555d6bb00d60 encountered epoll_wait error: Bad file descriptor")
    launcher.write_text(f"#!/bin/sh\nif [ ! -e {flag} ]; then touch {flag}; echo '{grpc}' >&2; "
                        f"kill -ABRT $$; fi\n"
                        f'exec {real / "bin" / "spark-submit"} "$@"\n')
    launcher.chmod(0o755)
    script = ("import logging; logging.basicConfig(level=logging.INFO)\n"
              "from cdcflow.spark.runner import SparkRunner\n"
              "r = SparkRunner('local[1]'); r.open('relaunch')\n"
              "print('sum', r.session.sparkContext.parallelize(range(10)).sum())\n"
              "r.close()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "SPARK_HOME": str(home)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert flag.exists()  # the first launcher did die
    assert "sum 45" in done.stdout
    assert "the Spark JVM launcher exited at start (attempt 1 of 3)" in done.stderr
    assert "Epoll1Poller" not in done.stderr  # held back, said at DEBUG only


def test_a_master_spark_cannot_use_is_one_line_and_exit_2(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "p.py"
    path.write_text(textwrap.dedent("""
        import cdcflow as cf
        from cdcflow.testing import ScriptedChangeStream

        stream = ScriptedChangeStream("S", partitions=1, origin=10**18)
        pipeline = cf.Pipeline("masters")
        (pipeline | cf.DetectPartitions(stream="S", start_at=10**18, end_at=10**18 + 10**9,
                                        client=stream)
         | cf.ReadPartition() | cf.Print())
    """))
    env = {k: v for k, v in os.environ.items() if k != "CDCFLOW_DEBUG"}
    for master, says in (("local[abc]", "'local[abc]' is not a Spark master: use local[*]"),
                         ("bogus", "'bogus' is not a Spark master: use local[*]"),
                         (f"spark://127.0.0.1:{port}",
                          f"cannot reach the Spark master spark://127.0.0.1:{port}")):
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "cdcflow", "run", str(path), "--runner", "spark",
             "--master", master], capture_output=True, text=True, timeout=120, env=env,
            cwd=tmp_path,
        )
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.strip().splitlines()[-1].startswith(f"cdcflow: error: {says}")
        assert "Traceback" not in done.stderr and "Exception" not in done.stderr
        assert time.monotonic() - began < 30
    # Settings the JVM or Spark refuses: one line naming it, not Spark's usage text, the
    # JVM's error three times (the launcher retried) or a Java stack.
    for args, says in (
        (["--master", "local[0]"], "'local[0]' gives Spark no cores: use local[*]"),
        (["--conf", "spark.driver.extraJavaOptions=-XX:+UseG1GC -Xmx1g"],
         "spark.driver.extraJavaOptions may not set the heap size (-Xmx1g): use --conf "
         "spark.driver.memory=1g"),
        (["--conf", "spark.driver.memory=-5"],
         "Spark's JVM did not start: Invalid maximum heap size: -Xmx-5 (check --master"),
        (["--conf", "spark.executor.cores=abc"],
         "Spark's JVM did not start: Executor cores must be a positive number"),
        (["--conf", "spark.default.parallelism=abc"],
         "Spark did not start: Illegal value for config key spark.default.parallelism"),
        (["--master", "local[00,2]"],
         "Spark did not start: The number of cores per executor (=0) has to be >="),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "cdcflow", "run", str(path), "--runner", "spark", *args],
            capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path,
        )
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr[-3000:]
        assert done.stderr.startswith(f"cdcflow: error: {says}"), done.stderr
    # A JAVA_HOME that names no Java: the fix is JAVA_HOME, not --master or a --conf.
    done = subprocess.run(
        [sys.executable, "-m", "cdcflow", "run", str(path), "--runner", "spark"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**env, "JAVA_HOME": str(tmp_path / "nojava")},
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines() == [done.stderr.strip()], done.stderr[-3000:]
    assert f"JAVA_HOME={tmp_path / 'nojava'} holds no bin/java" in done.stderr, done.stderr


def test_a_failing_task_is_one_line_not_every_attempt_s_traceback(tmp_path: Path) -> None:
    """Spark's executor and scheduler printed the Python traceback of each of the four
    attempts (about 230 lines) above cdcflow's own line; --debug still shows them."""
    path = tmp_path / "p.py"
    path.write_text(textwrap.dedent("""
        import cdcflow as cf
        from cdcflow.testing import ScriptedChangeStream

        stream = ScriptedChangeStream("S", partitions=1, origin=10**18)
        stream.write("T", 1, "INSERT", {"v": 1}, at=10**18 + 1000)

        class NeedsRedis(cf.DoFn):
            def setup(self):
                raise ImportError("needs redis: pip install redis")

            def process(self, element):
                yield element

        pipeline = cf.Pipeline("failing")
        (pipeline | cf.DetectPartitions(stream="S", start_at=10**18, end_at=10**18 + 10**9,
                                        client=stream)
         | cf.ReadPartition() | "enrich" >> cf.ParDo(NeedsRedis()) | cf.Collect())
    """))
    env = {k: v for k, v in os.environ.items() if k != "CDCFLOW_DEBUG"}
    argv = [sys.executable, "-m", "cdcflow", "run", str(path), "--runner", "spark",
            "--master", "local[2]", "--metadata", "memory://"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env,
                          cwd=tmp_path)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cdcflow: error: Spark task 0 ") and "in setup() of step 'enrich'" \
        in last and "--debug prints it" in last
    assert "Traceback" not in done.stderr and "ERROR Executor" not in done.stderr
    assert len(done.stderr.splitlines()) < 20, done.stderr[-3000:]
    debug = subprocess.run([*argv[:3], "--debug", *argv[3:]], capture_output=True, text=True,
                           timeout=180, env=env, cwd=tmp_path)
    assert "ERROR Executor" in debug.stderr


def test_executors_log_in_the_drivers_format(tmp_path: Path) -> None:
    """With --log-format json, what the executors' Python workers log (an element skipped)
    comes out as JSON lines naming the pipeline, as the driver's lines do."""
    path = tmp_path / "p.py"
    path.write_text(textwrap.dedent("""
        import cdcflow as cf
        from cdcflow.testing import ScriptedChangeStream

        T0 = 10**18
        stream = ScriptedChangeStream("S", partitions=1, origin=T0)
        for i in range(6):
            stream.write("T", i, "INSERT", {"v": i}, at=T0 + (i + 1) * 10**8)

        def odd_fails(r):
            if r.mods[0].new_values["v"] % 2:
                raise ValueError("odd")
            return r

        pipeline = cf.Pipeline("logs", error_policy=cf.ErrorPolicy(retries=0, then="skip"))
        (pipeline | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 10**9,
                                        client=stream)
         | cf.ReadPartition() | cf.Map(odd_fails) | cf.Collect())
    """))
    env = {k: v for k, v in os.environ.items() if k != "CDCFLOW_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-m", "cdcflow", "run", str(path), "--runner", "spark",
         "--log-format", "json"], capture_output=True, text=True, timeout=180, env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    skipped = [line for line in done.stderr.splitlines() if "skipped an element" in line]
    assert len(skipped) == 3, done.stderr[-3000:]
    # every line, the JVM's too (its notice about an incubator module is dropped)
    assert all(json.loads(line) for line in done.stderr.splitlines())
    for line in skipped:
        doc = json.loads(line)
        assert doc["level"] == "WARNING" and doc["pipeline"] == "logs"
        assert doc["logger"].startswith("cdcflow.")


def test_a_killed_jvm_ends_the_run_in_one_line(tmp_path: Path) -> None:
    """Spark's JVM killed mid-run (an out-of-memory kill, say): one line saying so, exit 1,
    and none of py4j's connection tracebacks; the next run resumes."""
    path = tmp_path / "p.py"
    path.write_text(textwrap.dedent("""
        import time
        import cdcflow as cf
        from cdcflow.testing import ScriptedChangeStream

        T0 = 10**18
        stream = ScriptedChangeStream("S", partitions=2, origin=T0)
        for i in range(400):
            stream.write("T", i, "INSERT", {"v": i}, at=T0 + (i + 1) * 10**8)

        def slow(r):
            time.sleep(0.05)
            return r

        pipeline = cf.Pipeline("jvm")
        (pipeline | cf.DetectPartitions(stream="S", start_at=T0, end_at=T0 + 41 * 10**9,
                                        client=stream)
         | cf.ReadPartition() | cf.Map(slow) | cf.Collect())
    """))
    env = {k: v for k, v in os.environ.items() if k != "CDCFLOW_DEBUG"}
    run = subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "run", str(path), "--runner", "spark", "--set",
         "max_batch_span=2s"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
        env=env, cwd=tmp_path, start_new_session=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert run.stderr is not None
        lines.extend(run.stderr)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("batch 2:" in line for line in lines):  # the session runs batches
            assert run.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        (jvm, *_) = subprocess.run(
            ["pgrep", "-s", str(run.pid), "-f", "org.apache.spark.deploy.SparkSubmit"],
            capture_output=True, text=True).stdout.split()
        os.kill(int(jvm), signal.SIGKILL)
        run.wait(timeout=60)
        reader.join(10)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    err = "".join(lines)
    assert run.returncode == 1, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("cdcflow: error: Spark's JVM is gone")
    assert "py4j" not in err and "/cdcflow/" not in err, err[-3000:]  # no traceback of ours


CONSUME_DOWN = """
import os
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

T0 = 10**18
stream = ScriptedChangeStream("Orders", partitions=1, origin=T0)
for i in range(5):
    stream.write("Orders", {"id": i}, "INSERT", {"total": i}, at=T0 + (i + 1) * 10**8)
CALLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calls")


def send(record):
    with open(CALLS, "a") as f:
        f.write(f"{record.mods[0].keys['id']} {os.environ.get('DOWN', '')}\\n")
    if os.environ.get("DOWN"):
        raise ConnectionError("API down")


def on_error(error, element, partition, attempt):  # the README's handler
    return cf.Retry(after=2 ** attempt) if attempt <= 5 else cf.Stop()


pipeline = cf.Pipeline("notify")
(pipeline
 | cf.DetectPartitions(stream="Orders", start_at=T0, end_at=T0 + 10**9, client=stream)
 | cf.ReadPartition()
 | cf.Consume(send, on_error=cf.ErrorPolicy(handler=on_error)))
"""


def test_one_sigterm_cancels_a_spark_batch_whose_consume_calls_are_being_retried(
    tmp_path: Path,
) -> None:
    """Executors cannot see a stop: the batch still running stop_grace after a SIGTERM
    (Consume retrying a downstream that is down, a minute in all) is cancelled, the run
    exits 130 as stopped, and the next run delivers every change."""
    path = tmp_path / "notify.py"
    path.write_text(CONSUME_DOWN)
    calls = tmp_path / "calls"
    command = [sys.executable, "-m", "cdcflow", "run", str(path), "--runner", "spark",
               "--metadata", f"sqlite:///{tmp_path / 'm.db'}", "--set", "stop_grace=2"]
    first = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             text=True, env={**os.environ, "DOWN": "1"})
    try:
        deadline = time.monotonic() + 120
        while not calls.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert calls.exists()  # the first call failed
        first.send_signal(signal.SIGTERM)
        began = time.monotonic()
        _, err = first.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        first.kill()
    assert first.returncode == 130, err
    assert 2 <= took < 20, (took, err)
    assert "cancelling its Spark job" in err and "the next run replays it" in err
    assert "Traceback" not in err
    calls.unlink()
    second = subprocess.run(command, capture_output=True, text=True, timeout=180,
                            env={k: v for k, v in os.environ.items() if k != "DOWN"})
    assert second.returncode == 0, second.stderr
    assert sorted(calls.read_text().split()) == ["0", "1", "2", "3", "4"]


def test_a_killed_drivers_runner_directory_is_removed_by_the_next_start() -> None:
    from cdcflow.spark._session import sweep_log_dirs as _sweep_log_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    root = Path(tempfile.gettempdir())
    dead = root / f"cdcflow-spark-{gone.pid}-abc123"
    live = root / f"cdcflow-spark-{os.getpid()}-def456"
    for d in (dead, live):
        d.mkdir()
        (d / "log4j2.properties").write_text("")
    try:
        _sweep_log_dirs()
        assert not dead.exists() and live.exists()
    finally:
        shutil.rmtree(dead, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_spark_s_scratch_space_is_in_the_runner_s_directory(spark: Any) -> None:
    """blockmgr-* and spark-* directories went to the system's temporary directory, where
    every killed driver left its own (about 190 of them on this machine after a day of
    crash tests): inside the runner's directory the next start sweeps them."""
    local = spark.sparkContext.getConf().get("spark.local.dir")
    root = Path(tempfile.gettempdir())
    assert Path(local).parent.parent == root
    assert Path(local).parent.name.startswith(f"cdcflow-spark-{os.getpid()}-")
    assert any(p.name.startswith("blockmgr-") for p in Path(local).iterdir())
    # the user's own setting wins
    runner = SparkRunner("local[2]", conf={"spark.local.dir": "/var/tmp/mine"})
    assert runner._settings("x")["spark.local.dir"] == "/var/tmp/mine"


def test_the_jvm_s_temporary_files_are_in_a_runner_directory(spark: Any) -> None:
    """The JVM put its temporary files in /tmp (java.io.tmpdir): the liblz4-java-*.so it
    unpacks, empty spark-* directories, its Python workers' sockets. A JVM that was
    killed left them there (about ten liblz4-java-*.so and 300 sockets here): in a
    runner directory the next start sweeps them."""
    sc = spark.sparkContext
    # a shuffle: its blocks are lz4-compressed, so lz4-java's native library is unpacked
    sc.parallelize(range(100), 4).map(lambda x: (x % 3, x)).reduceByKey(max).collect()
    tmp = Path(sc._jvm.java.lang.System.getProperty("java.io.tmpdir"))
    assert tmp.parent == Path(tempfile.gettempdir())
    assert tmp.name.startswith(f"cdcflow-spark-{os.getpid()}-")
    assert any(p.name.startswith("liblz4-java-") for p in tmp.iterdir())


def test_a_java_io_tmpdir_of_the_user_s_own_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def driver_options(**conf: str) -> str:
        runner = SparkRunner("local[1]", conf=conf)
        try:
            return runner._settings("x")["spark.driver.extraJavaOptions"]
        finally:
            runner.close()

    assert "-Djava.io.tmpdir=" in driver_options()
    mine = "-Djava.io.tmpdir=/var/tmp/mine"
    given = driver_options(**{"spark.driver.extraJavaOptions": mine})
    assert given.endswith(mine) and given.count("java.io.tmpdir") == 1
    assert "java.io.tmpdir" not in driver_options(**{"spark.driver.defaultJavaOptions": mine})
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", mine)
    assert "java.io.tmpdir" not in driver_options()


def test_the_jvm_s_directory_outlives_the_session_and_a_killed_one_s_is_swept() -> None:
    """PySpark keeps the JVM after the session stops, so its directory stays until the
    process exits; when the process and its JVM are killed, the next start removes it."""
    from cdcflow.spark._session import sweep_log_dirs as _sweep_log_dirs

    script = ("import sys, time\n"
              "from cdcflow.spark.runner import SparkRunner\n"
              "r = SparkRunner('local[1]'); r.open('tmpdir')\n"
              "sc = r.session.sparkContext\n"
              "sc.parallelize(range(10), 2).map(lambda x: (x % 2, x)).reduceByKey(max).collect()\n"
              "tmp = sc._jvm.java.lang.System.getProperty('java.io.tmpdir')\n"
              "r.close()\n"
              "print('tmpdir', tmp, flush=True)\n"
              "time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        assert child.stdout is not None
        line = next(ln for ln in child.stdout if ln.startswith("tmpdir "))
        tmp = Path(line.split(" ", 1)[1].strip())
        assert tmp.name.startswith(f"cdcflow-spark-{child.pid}-")
        assert any(p.name.startswith("liblz4-java-") for p in tmp.iterdir())  # after close
        os.killpg(child.pid, signal.SIGKILL)  # the driver and its JVM
        child.wait(timeout=30)
        assert any(p.name.startswith("liblz4-java-") for p in tmp.iterdir())
        _sweep_log_dirs()
        assert not tmp.exists()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=30)


def test_java_options_of_the_user_s_own_are_added_to_the_runner_s() -> None:
    """A ``--conf spark.driver.extraJavaOptions`` replaced the runner's options: Spark's
    INFO lines (the quiet log4j2 settings) and its files in /tmp came back. The user's
    now follow the runner's, so theirs win for a property both set."""
    mine = "-Dmy.flag=1 -Dlog4j2.configurationFile=file:/etc/mine.properties"
    runner = SparkRunner("local[1]", conf={"spark.driver.extraJavaOptions": mine,
                                           "spark.executor.extraJavaOptions": "-Dx=2"})
    try:
        settings = runner._settings("x")
    finally:
        runner.close()
    driver = settings["spark.driver.extraJavaOptions"]
    assert driver.startswith("-Dlog4j2.configurationFile=file:") and driver.endswith(mine)
    assert "-Djava.io.tmpdir=" in driver
    executor = settings["spark.executor.extraJavaOptions"]
    assert executor.startswith("-Dlog4j2.configurationFile=file:") and executor.endswith(" -Dx=2")
    runner = SparkRunner("local[1]", conf={"spark.driver.extraJavaOptions": " "})  # empty
    try:
        driver = runner._settings("x")["spark.driver.extraJavaOptions"]
    finally:
        runner.close()
    assert driver.startswith("-Dlog4j2.configurationFile=file:") and "java.io.tmpdir" in driver


def test_a_ctrl_c_while_the_session_starts_is_the_run_s_not_pyspark_s() -> None:
    """PySpark's SparkContext takes SIGINT over when it is made on the main thread; a
    Ctrl-C while it was being made ran its handler on a half-made context (about 45 lines
    of py4j tracebacks). The session is made on a thread of its own: PySpark never sets a
    SIGINT handler, the run's own stays."""
    script = ("import signal, threading\n"
              "from cdcflow.spark.runner import SparkRunner\n"
              "seen = []\n"
              "real = signal.signal\n"
              "def noting(sig, handler):\n"
              "    seen.append(sig)\n"
              "    return real(sig, handler)\n"
              "signal.signal = noting\n"
              "r = SparkRunner('local[1]'); r.open('sigint')\n"
              "print('SIGINT set', seen.count(signal.SIGINT))\n"
              "from pyspark.sql import SparkSession\n"
              "active = SparkSession.getActiveSession()\n"
              "print('active here', active is not None and active._jsparkSession.equals("
              "r.session._jsparkSession))\n"
              "r.close()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SIGINT set 0" in done.stdout, done.stdout
    # made on a thread of its own, the session is still the active one of the caller's
    assert "active here True" in done.stdout, done.stdout


def test_a_jvm_setting_a_running_jvm_cannot_take_is_said() -> None:
    """PySpark keeps one JVM per process: a later session's spark.driver.memory was dropped
    without a word. The same value again is no news."""
    script = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
              "from cdcflow.spark.runner import SparkRunner\n"
              "for memory in ('1g', '1g', '2g'):\n"
              "    r = SparkRunner('local[1]', conf={'spark.driver.memory': memory})\n"
              "    r.open('jvm'); r.close()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [ln for ln in done.stderr.splitlines() if "will not apply" in ln]
    assert said == ["WARNING:cdcflow.spark:this process's Spark JVM is running already, so "
                    "spark.driver.memory=2g will not apply (PySpark keeps one JVM per "
                    "process): run the pipeline in a new process to change it"], done.stderr
