"""Kill a run (SIGKILL) at every stage of a batch, restart it, and check exactly-once output.

The memory runner is killed at every stage, three times each. A Spark driver takes ~10 s to
start in a new process, so Spark gets the two kills that matter most for exactly-once:
sinks committed but the store not (the replay must overwrite, not add), and a task in
flight (its staged output must never be committed).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import orjson
import pytest

from cdcflow.model import Timestamp

SCRIPT = Path(__file__).with_name("crash_pipeline.py")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("crash_pipeline", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(
    runner: str, state: Path, kill: str | None, *extra: str
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(SCRIPT), runner, str(state), kill or "none:0", *extra]
    # its own process group: a kill takes the driver and what it started (Spark's JVM)
    return subprocess.run(
        args, capture_output=True, text=True, timeout=180, check=False, start_new_session=True
    )


@pytest.mark.parametrize(
    ("runner", "kills", "mode"),
    [
        pytest.param("memory", ["planned:2", "planned:5", "planned:9"], "", id="memory-planned"),
        # committing:N kills as the sink begins to commit batch N: its plan is written
        pytest.param("memory", ["committing:2", "committing:5", "committing:9"], "",
                     id="memory-committing"),
        pytest.param("memory", ["sinks:2", "sinks:5", "sinks:9"], "", id="memory-sinks"),
        pytest.param("memory", ["batch:1", "batch:6", "batch:11"], "", id="memory-batch"),
        # task:N kills at the N-th record the process running the task reads
        pytest.param("memory", ["task:5", "task:80", "task:200"], "", id="memory-task"),
        # Pipelined batches (the default, as the run lags the clock): ahead:N kills inside
        # batch N's sink commit while batch N+1 reads (its plan not written); batch:N after
        # N's store commit, before N+1's plan; planned:N after N's plan, read ahead already.
        pytest.param("memory", ["ahead:2", "ahead:5", "ahead:9"], "", id="memory-ahead"),
        pytest.param("memory", ["ahead:3", "batch:6", "planned:8", "task:300"], "",
                     id="memory-mixed"),
        pytest.param("memory", ["planned:3", "committing:4", "sinks:5", "batch:8"], "serial",
                     id="memory-serial"),
        # On Spark: a kill inside an executor's task, and one of the driver while it reads
        # ahead (the driver's other kill points are the in-memory runner's own code).
        pytest.param(
            "spark", ["ahead:3", "task:60"], "", id="spark-ahead-task", marks=pytest.mark.spark
        ),
    ],
)
def test_killed_runs_resume_without_loss_or_duplicates(
    tmp_path: Path, runner: str, kills: list[str], mode: str
) -> None:
    extra = (mode,) if mode else ()
    for kill in kills:
        killed = _run(runner, tmp_path, kill, *extra)
        assert killed.returncode == -signal.SIGKILL, (kill, killed.stderr[-3000:])
        if kill.startswith("ahead:"):  # the next batch was reading while this one committed
            assert killed.stdout.strip().endswith("ahead"), (kill, killed.stderr[-3000:])
        stage, _, batch = kill.partition(":")
        if stage == "planned":  # its plan is written once its tasks return: not yet
            assert _pending(tmp_path) is None
        elif stage == "committing":  # written before the sink began to commit it
            assert _pending(tmp_path) == int(batch)
    done = _run(runner, tmp_path, None, *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("end reached")
    _assert_exactly_once(tmp_path)


def test_a_batch_no_run_lives_to_commit_is_planned_narrower_after_each_crash(
    tmp_path: Path,
) -> None:
    # Every run dies at the 150th record it reads: a batch of more records than that never
    # commits if it is read again as it was (its plan written before its tasks ran). It is
    # not: nothing is written before the tasks return, and each run after a crash halves
    # the span, so the runs commit smaller batches and get through the stream.
    runs = []
    for _ in range(12):
        ran = _run("memory", tmp_path, "task:150", "wide")
        runs.append(ran.returncode)
        if ran.returncode == 0:
            break
        assert ran.returncode == -signal.SIGKILL, ran.stderr[-3000:]
    assert runs[-1] == 0, runs  # the stream's 600 records, through runs that die at 150
    assert len(runs) > 3  # it took kills
    _assert_exactly_once(tmp_path)


def _pending(state: Path) -> int | None:
    """The id of the pipeline's pending plan, if any."""
    from cdcflow.metadata import open_store

    store = open_store(f"sqlite:///{state / 'state.db'}")
    try:
        plan = store.pending_plan("crash")
        return None if plan is None else plan.batch_id
    finally:
        store.close()


def _assert_exactly_once(tmp_path: Path) -> None:
    module = _script()
    expected = module.stream().expected_records(module.T0, module.END)
    out = tmp_path / "out"
    rows = []
    for name in sorted(os.listdir(out)):
        if name.startswith("part-"):
            rows += [orjson.loads(line) for line in (out / name).read_bytes().splitlines()]
    got = Counter(
        (Timestamp.parse(r["commit_timestamp"]).ns, r["server_transaction_id"],
         r["partition_token"], r["record_sequence"])
        for r in rows
    )
    want = Counter(
        (r.commit_timestamp.ns, r.server_transaction_id, r.partition_token, r.record_sequence)
        for r in expected
    )
    assert got == want  # nothing lost, nothing repeated
    # no task attempt's file is left, nor the directories of their batches
    assert not [f for _, _, files in os.walk(out) for f in files if ".tmp" in f]
    assert not os.listdir(os.path.join(out, "_cdcflow", "tmp"))


@pytest.mark.parametrize(
    "runner", ["memory", pytest.param("spark", marks=pytest.mark.spark)]
)
def test_sigterm_stops_after_the_current_batch(tmp_path: Path, runner: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), runner, str(tmp_path), "live"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("batch "), proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, err
    last = out.strip().splitlines()[-1]
    assert last.startswith("interrupted "), out
    from cdcflow.metadata import open_store

    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        assert store.pending_plan("live") is None  # the batch in progress was committed
        assert store.last_batch_id("live") == int(last.split()[1])
    finally:
        store.close()
