"""A run stops acting once its lease may be another run's: the guard tasks check before
each side effect (Consume's calls) raises past the lease's local deadline, once the lease
is found lost, and once the run ends abnormally (a second Ctrl-C)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cdcflow.engine.guard import RunGuard, guard_for, guarding
from cdcflow.errors import FencedError, LeaseExpiredError, PipelineStopped, TransientError

T0 = 1_700_000_000 * 10**9


def test_the_guard_holds_until_its_deadline_then_raises_a_transient_error() -> None:
    guard = RunGuard("p")
    guard.check()  # nothing known yet: free
    guard.hold_until(time.monotonic() + 60, 30)
    guard.check()
    guard.hold_until(time.monotonic() - 2, 30)
    with pytest.raises(LeaseExpiredError, match=r"lease ran out 2\.\ds ago .*30s") as info:
        guard.check()
    assert isinstance(info.value, TransientError)  # the batch is retried once renewed
    guard.hold_until(time.monotonic() + 60, 30)  # renewed
    guard.check()
    lost = FencedError("taken over")
    guard.revoke(lost)
    guard.revoke(FencedError("a later reason"))
    with pytest.raises(FencedError, match="taken over"):
        guard.check()


def test_tasks_find_their_runs_guard_while_it_runs_and_a_failure_revokes_it() -> None:
    guard = RunGuard("orders")
    assert guard_for("orders")() is None  # no run here: a check that does nothing
    with pytest.raises(KeyError), guarding(guard):
        assert guard_for("orders") == guard.check
        guard_for("payments")()  # another pipeline's tasks are not held
        raise KeyError("the run failed")
    with pytest.raises(PipelineStopped, match=r"the run is ending \(KeyError\)"):
        guard.check()
    guard_for("orders")()  # unregistered


PIPELINE = f"""
import os, time
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

stream = ScriptedChangeStream("S", partitions=1, origin={T0})
for i in range(400):
    stream.write("T", i % 7, "UPDATE", {{"v": i}}, at={T0} + (i + 1) * 10_000_000)

def call(record):
    with open(os.environ["CALLS"], "a") as f:
        f.write(f"{{os.getpid()}} {{time.time():.3f}} {{record.mods[0].new_values['v']}}\\n")
    time.sleep(0.05)

pipeline = cf.Pipeline("paused")
(pipeline
 | cf.DetectPartitions(stream="S", start_at={T0}, end_at={T0} + 5 * 10**9, client=stream)
 | cf.ReadPartition() | cf.Consume(call, key=lambda r: r.mods[0].keys["id"], max_inflight=2))
"""


def _start(path: Path, calls: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "run", str(path), "--set", "max_batch_span=5s",
         "--set", "lease_ttl=2s", "--batch-interval", "0s", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=path.parent,
        stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "CALLS": str(calls)},
    )


def _calls(calls: Path) -> list[tuple[int, float, int]]:
    """(pid, time, value) of every call made."""
    if not calls.exists():
        return []
    lines = [line.split() for line in calls.read_text().splitlines()]
    return [(int(p), float(t), int(v)) for p, t, v in lines]


def _assert_fenced(run: subprocess.Popen[str], err: str) -> None:
    """The paused run ended in one line naming its lease, which another run holds now."""
    assert run.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("cdcflow: error: pipeline 'paused': this run's lease"), last
    assert "no longer current" in last and "Traceback" not in err


def test_a_run_paused_past_its_lease_makes_no_call_after_another_run_took_over(
    tmp_path: Path,
) -> None:
    path, calls = tmp_path / "pipeline.py", tmp_path / "calls.txt"
    path.write_text(textwrap.dedent(PIPELINE))
    first = _start(path, calls)
    try:
        deadline = time.monotonic() + 120
        while len(_calls(calls)) < 10:  # the first run is in the middle of its batch
            assert first.poll() is None and time.monotonic() < deadline, first.stderr
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGSTOP)
        time.sleep(3)  # past the lease's 2 s
        second = _start(path, calls)
        while not any(pid == second.pid for pid, _, _ in _calls(calls)):
            assert second.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        resumed = time.time()
        os.killpg(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=60)
        assert second.wait(timeout=120) == 0
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    _assert_fenced(first, err)
    late = [t for pid, t, _ in _calls(calls) if pid == first.pid and t > resumed]
    # A call its worker began just before the pause writes its line after it (at most one
    # per worker); before the guard, the paused run went on for the rest of its batch.
    assert len(late) <= 2, late
    assert {v for _, _, v in _calls(calls)} == set(range(400))  # at least once each


FILES_PIPELINE = f"""
import os, time
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

stream = ScriptedChangeStream("S", partitions=1, origin={T0})
for i in range(400):
    stream.write("T", i % 7, "UPDATE", {{"v": i}}, at={T0} + (i + 1) * 10_000_000)


class Kept:
    def __init__(self):
        self.items = []

    def write(self, element):
        self.items.append(element)

    def close(self):
        return self.items

    def abort(self):
        pass


class SlowCommit(cf.Sink):
    # commits a second and a half after it says so in COMMITS
    def open_writer(self, ctx):
        return Kept()

    def commit(self, batch_id, messages):
        with open(os.environ["CALLS"] + ".commits", "a") as f:
            f.write(f"{{os.getpid()}} {{batch_id}}\\n")
        time.sleep(1.5)


class Append(cf.Sink):
    # appends the batch's values to OUT at commit: a sink that takes a batch as often as
    # it is given
    def open_writer(self, ctx):
        return Kept()

    def commit(self, batch_id, messages):
        with open(os.environ["CALLS"] + ".out", "a") as f:
            for items in messages:
                for row in items:
                    f.write(f"{{os.getpid()}} {{row['v']}}\\n")


pipeline = cf.Pipeline("paused")
rows = (pipeline
        | cf.DetectPartitions(stream="S", start_at={T0}, end_at={T0} + 5 * 10**9,
                              client=stream)
        | cf.ReadPartition() | cf.Map(lambda r: r.mods[0].new_values))
rows | "a-slow" >> SlowCommit()
rows | "append" >> Append()
"""


def test_a_run_paused_past_its_lease_commits_no_more_sinks_once_another_run_took_over(
    tmp_path: Path,
) -> None:
    # Paused while its first sink commits the batch, the run resumes after the run that
    # took over committed that batch to both sinks. It commits no other sink, and names its
    # lease (before: it committed the batch to the second sink again).
    path, calls = tmp_path / "pipeline.py", tmp_path / "calls"
    commits = tmp_path / "calls.commits"
    path.write_text(textwrap.dedent(FILES_PIPELINE))
    first = _start(path, calls)
    try:
        deadline = time.monotonic() + 120
        while not commits.exists() or " 2" not in commits.read_text():  # the data batch
            assert first.poll() is None and time.monotonic() < deadline, first.stderr
            time.sleep(0.02)
        os.killpg(first.pid, signal.SIGSTOP)
        time.sleep(3)  # past the lease's 2 s
        second = _start(path, calls)
        assert second.wait(timeout=120) == 0  # it replayed the batch and committed it
        os.killpg(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=60)
    finally:
        for proc in (first, locals().get("second")):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    _assert_fenced(first, err)
    taken = [line.split() for line in (tmp_path / "calls.out").read_text().splitlines()]
    assert {int(pid) for pid, _ in taken} == {second.pid}  # the batch came from it alone
    assert sorted(int(v) for _, v in taken) == list(range(400))  # once each


def test_a_second_ctrl_c_ends_the_run_without_more_calls(tmp_path: Path) -> None:
    path, calls = tmp_path / "pipeline.py", tmp_path / "calls.txt"
    path.write_text(textwrap.dedent(PIPELINE))
    run = _start(path, calls)
    try:
        deadline = time.monotonic() + 120
        while len(_calls(calls)) < 10:
            assert run.poll() is None and time.monotonic() < deadline, run.stderr
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGINT)  # stop after the batch (4 s of calls left)
        time.sleep(0.3)
        aborted = time.time()
        os.killpg(run.pid, signal.SIGINT)  # abort now
        _, err = run.communicate(timeout=60)
        ended = time.time()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 130, err
    assert "Traceback" not in err
    late = [t for _, t, _ in _calls(calls) if t > aborted + 0.01]
    assert len(late) <= 2, late  # before: every call of the batch, for about 4 s more
    assert ended - aborted < 10  # generous for a loaded machine; the calls above tell


ABORT_PIPELINE = f"""
import os, sys, threading, time
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

stream = ScriptedChangeStream("S", partitions=1, origin={T0})
for i in range(2000):
    stream.write("T", i, "INSERT", {{"v": i}}, at={T0} + (i + 1) * 1_000_000)

def slow(record):
    with open(os.environ["CALLS"], "a") as f:
        f.write(f"{{time.time():.3f}}\\n")
    time.sleep(0.02)
    return record

p = cf.Pipeline("aborted")
(p | cf.DetectPartitions(stream="S", start_at={T0}, end_at={T0} + 5 * 10**9, client=stream)
 | cf.ReadPartition() | cf.Map(slow) | cf.Collect())
try:
    p.run(metadata="memory://", workers=2)
except KeyboardInterrupt:
    print("aborted", time.time(), flush=True)
    time.sleep(3)  # a notebook's process lives on
    print("threads", *sorted(t.name for t in threading.enumerate()), flush=True)
"""


def test_an_aborted_api_run_calls_no_more_user_code_in_a_process_that_lives_on(
    tmp_path: Path,
) -> None:
    # pipeline.run() in a long-lived process (a notebook), aborted by a second Ctrl-C: it
    # raised KeyboardInterrupt, and its task threads went on pushing the rest of their
    # slices through the Map, for the whole batch.
    path, calls = tmp_path / "aborted.py", tmp_path / "calls"
    path.write_text(textwrap.dedent(ABORT_PIPELINE))
    proc = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
                            env={**os.environ, "CALLS": str(calls)})
    try:
        deadline = time.monotonic() + 120
        while not calls.exists() or len(calls.read_text().splitlines()) < 10:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)  # stop after the batch (40 s of calls)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)  # abort
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    aborted = float(lines[0].split()[1])
    late = [float(t) for t in calls.read_text().split() if float(t) > aborted + 0.05]
    assert len(late) <= 2 * 16, len(late)  # a guard check in every 16 records of a task
    assert lines[1].split()[1:] == ["MainThread"], lines[1]  # no thread of the run left
