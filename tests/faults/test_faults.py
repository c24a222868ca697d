"""Network faults and SIGKILLs over a churning stream, through the public CLI.

`cdcflow run` (a subprocess, as in tests/test_e2e_emulator.py) reaches the emulator only
through a :class:`~tests.faults.proxy.FaultProxy`: its change-stream reads and, in the
Spanner-store case, every read and commit of its metadata store. The workload writes to
the emulator directly, so the ground truth does not depend on the faults. While the
workload commits and the emulator splits and merges partitions every 2-4 s, the proxy
resets, drops and stalls connections on a seeded random schedule, and the test SIGKILLs
the run a few times at random points and restarts it; a run that a fault made exit
non-zero is restarted too. At the end a run reaches ``end_at`` (after the workload's last
commit) and exits 0, and every committed change must be in the output exactly once, each
key's changes in commit order.

The seed is printed with the fault schedule and the account of every run; replay with
``FAULT_SEED=N .venv/bin/python -m pytest -q tests/faults/test_faults.py -k CASE -s``.
``FAULT_REPORT_DIR=DIR`` also writes that account as JSON (docs/reliability.md sums them).
To explore harsher schedules, ``FAULT_MEAN_INTERVAL=S``, ``FAULT_STALL=MIN,MAX`` and
``FAULT_DROP=MIN,MAX`` override the schedule below (the printed replay line names them).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

from cdcflow.metadata import MetadataStore, open_store
from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import Workload
from tests.e2e_helpers import Case, check_exactly_once, partitions_read
from tests.faults.proxy import FaultEvent, FaultProxy

pytestmark = pytest.mark.emulator

#: The change-stream query deadline of the faulted runs: a stall longer than this must
#: surface as DEADLINE_EXCEEDED (with the default, 10 minutes, it would hold the batch).
QUERY_TIMEOUT = 3.0
WORKLOAD_SECONDS = 12.0


def _env_range(name: str, default: tuple[float, float]) -> tuple[float, float]:
    text = os.environ.get(name)
    if not text:
        return default
    low, high = (float(x) for x in text.split(","))
    return low, high


#: The fault schedule: a fault every MEAN_INTERVAL s on average (uniform gaps), a third
#: each of resets, drops and stalls, of these lengths. Stalls reach past the query
#: deadline; together the faults hold the network down about half of the time.
MEAN_INTERVAL = float(os.environ.get("FAULT_MEAN_INTERVAL", 2.0))
STALL_SECONDS = _env_range("FAULT_STALL", (0.5, 4.5))
DROP_SECONDS = _env_range("FAULT_DROP", (0.2, 2.0))
#: Wall-time bound of one case's runs; past it the run is declared hung.
BUDGET = 75.0


@dataclass
class RunRecord:
    """One `cdcflow run` process: how it ended and what the network did meanwhile."""

    index: int
    began: float  # seconds after the case started
    ended: float = 0.0
    outcome: str = ""  # "killed", "exit N" or "hung"
    error: str = ""  # the last error line it printed, if it exited non-zero
    first_batch: int = 0  # the newest committed batch id when it started
    committed_batch: int = 0  # ... and when it ended
    faults: list[str] = field(default_factory=list)  # faults applied while it ran
    last_fault_before_exit: float | None = None  # seconds from the last fault's start

    def __str__(self) -> str:
        text = (
            f"run {self.index}: {self.began:6.2f}s-{self.ended:6.2f}s {self.outcome:<7} "
            f"batches {self.first_batch:3d}->{self.committed_batch:3d}, {len(self.faults)} faults"
        )
        if self.error:
            after = self.last_fault_before_exit
            since = f" ({after:.2f}s after the last fault began)" if after is not None else ""
            text += f"\n    {self.error}{since}"
        return text


def _sqlite_in_wal_mode(path: Path) -> bool:
    """True once the file is a SQLite database in WAL mode (header bytes 18-19 are 2)."""
    try:
        with path.open("rb") as f:
            header = f.read(20)
    except OSError:
        return False
    return header[:16] == b"SQLite format 3\x00" and header[18:20] == b"\x02\x02"


class _Progress:
    """The newest committed batch id, read from the store directly (not via the proxy).

    A SQLite store is opened only once the run has switched the new file to WAL mode:
    opening it while the run creates it can make the run's own open fail (see
    test_sqlite_open.py), and this reader must not disturb the run it watches."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self._store: MetadataStore | None = None

    def last(self) -> int:
        if self._store is None:
            sqlite = self.case.store_url.startswith("sqlite")
            if sqlite and not _sqlite_in_wal_mode(self.case.state_file):
                return 0
            self._store = open_store(self.case.store_url)
        batches = self._store.batches(self.case.name, limit=20)
        return max((b.batch_id for b in batches if b.committed_at), default=0)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a live process has used so far (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _error_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith("cdcflow: error:"):
            return line
    return lines[-1] if lines else ""


def _faults_between(events: list[FaultEvent], began: float, ended: float) -> list[FaultEvent]:
    return [e for e in events if began <= e.monotonic <= ended]


def _drive(
    case: Case, proxy: FaultProxy, rng: random.Random, *, kills: int, logs: Path
) -> list[RunRecord]:
    """Run, and SIGKILL the first ``kills`` runs at a random point: once 1-3 more batches
    have committed (plus up to 0.5 s), or 2-5 s after the start, whichever comes first.
    Restart after every kill or failed exit, until a run exits 0 or BUDGET passes (the
    last run is then killed and marked hung)."""
    origin = time.monotonic()
    deadline = origin + BUDGET
    progress = _Progress(case)
    runs: list[RunRecord] = []
    try:
        while True:
            index = len(runs)
            log = logs / f"run-{index}.log"
            first = progress.last()
            with log.open("w") as err:
                proc = subprocess.Popen(
                    case.command(), env=case.env, stdout=subprocess.DEVNULL, stderr=err,
                    start_new_session=True,
                )
            began = time.monotonic()
            run = RunRecord(index, began - origin, first_batch=first)
            killing = sum(r.outcome == "killed" for r in runs) < kills
            target = first + rng.randint(1, 3)
            kill_at = began + rng.uniform(2.0, 5.0) if killing else deadline
            try:
                while proc.poll() is None and time.monotonic() < min(kill_at, deadline):
                    if killing and progress.last() >= target:
                        time.sleep(rng.uniform(0, 0.5))
                        break
                    time.sleep(0.05)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    run.outcome = "killed" if time.monotonic() < deadline else "hung"
                proc.wait(30)
            ended = time.monotonic()
            run.ended = ended - origin
            run.outcome = run.outcome or f"exit {proc.returncode}"
            faults = _faults_between(proxy.events, began, ended)
            run.faults = [str(e) for e in faults]
            run.committed_batch = progress.last()
            if proc.returncode not in (0, -signal.SIGKILL):
                run.error = _error_line(log)
                if faults:
                    run.last_fault_before_exit = ended - faults[-1].monotonic
            runs.append(run)
            if run.outcome in ("exit 0", "hung"):
                return runs
    finally:
        progress.close()


def _report(
    label: str, seed: int, proxy: FaultProxy, runs: list[RunRecord], checked: int | None
) -> dict[str, Any]:
    summary = {
        "case": label,
        "seed": seed,
        "schedule": {"mean_interval": MEAN_INTERVAL, "stall": STALL_SECONDS,
                     "drop": DROP_SECONDS},
        "faults": [asdict(e) for e in proxy.events],
        "runs": [asdict(r) for r in runs],
        "killed": sum(r.outcome == "killed" for r in runs),
        "failed_exits": sum(r.outcome.startswith("exit") and r.outcome != "exit 0" for r in runs),
        "hung": sum(r.outcome == "hung" for r in runs),
        "checked": checked,
        "proxy": asdict(proxy.stats),
    }
    schedule = (f"FAULT_MEAN_INTERVAL={MEAN_INTERVAL} FAULT_STALL={STALL_SECONDS[0]},"
                f"{STALL_SECONDS[1]} FAULT_DROP={DROP_SECONDS[0]},{DROP_SECONDS[1]}")
    print(f"\n[{label}] fault seed {seed}: replay with FAULT_SEED={seed} {schedule} "
          f".venv/bin/python -m pytest tests/faults/test_faults.py -k 'kills and {label}' -s")
    print("faults applied:")
    for event in proxy.events:
        print(f"  {event}")
    print("runs:")
    for run in runs:
        print(f"  {run}")
    print(f"proxy: {proxy.stats}")
    out = os.environ.get("FAULT_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{label}-{seed}-{int(time.time())}.json").write_text(
            json.dumps(summary, indent=1)
        )
    return summary


@pytest.mark.parametrize(
    ("store", "default_seed", "kills"),
    [("spanner", 1, 3), ("sqlite", 2, 3)],
)
def test_faults_and_kills_keep_exactly_once(
    spanner_emulator: Emulator, tmp_path: Path, store: str, default_seed: int, kills: int
) -> None:
    seed = int(os.environ.get("FAULT_SEED", default_seed))
    rng = random.Random(seed)
    case = Case(spanner_emulator, tmp_path, store=store)
    logs = tmp_path / "logs"
    logs.mkdir()
    with FaultProxy(spanner_emulator.host, lifetime=BUDGET + 30) as proxy:
        case.env["SPANNER_EMULATOR_HOST"] = proxy.host  # the run's reads and store
        case.env["E2E_QUERY_TIMEOUT"] = f"{QUERY_TIMEOUT}s"
        start = Timestamp.now()
        workload = Workload(case.database, rate=15, seed=seed)  # direct to the emulator
        thread = workload.start(seconds=WORKLOAD_SECONDS)
        case.window(start, Timestamp.from_ns(start.ns + int((WORKLOAD_SECONDS + 2) * 1e9)))
        proxy.chaos(
            seed, mean_interval=MEAN_INTERVAL, duration=WORKLOAD_SECONDS + 4,
            stall_seconds=STALL_SECONDS, drop_seconds=DROP_SECONDS,
        )
        runs: list[RunRecord] = []
        try:
            runs = _drive(case, proxy, rng, kills=kills, logs=logs)
        finally:
            workload.stop()
            if not runs or runs[-1].outcome != "exit 0":
                _report(store, seed, proxy, runs, None)
    assert not thread.is_alive()
    assert runs[-1].outcome == "exit 0", f"seed {seed}: no run finished within {BUDGET}s"
    try:
        checked = check_exactly_once(case, workload)
    except AssertionError as e:
        _report(store, seed, proxy, runs, None)
        msg = f"seed {seed}: {e}"
        raise AssertionError(msg) from None
    summary = _report(store, seed, proxy, runs, checked)
    assert checked > 50
    assert summary["killed"] >= 2
    assert len(proxy.events) >= 4  # the schedule did fault the run
    assert partitions_read(case) >= 2


@contextlib.contextmanager
def _running_behind(
    proxy: FaultProxy, case: Case, progress: _Progress, *, seed: int, seconds: float,
    extra: tuple[str, ...] = (), query_timeout: float | None = QUERY_TIMEOUT,
) -> Iterator[tuple[Workload, threading.Thread, Path, subprocess.Popen[bytes]]]:
    """A workload of ``seconds`` straight to the emulator, and a run reading it through
    ``proxy`` (its reads and its store), its window ending 2 s after the workload's end:
    the workload, its thread, the run's log file and process. ``query_timeout`` None: the
    reader's own (a stalled stream is then seen after 60 s). Leaving the block kills the
    run if it still lives, stops the workload and closes ``progress``."""
    case.env["SPANNER_EMULATOR_HOST"] = proxy.host
    if query_timeout is not None:
        case.env["E2E_QUERY_TIMEOUT"] = f"{query_timeout}s"
    else:
        case.env.pop("E2E_QUERY_TIMEOUT", None)
    start = Timestamp.now()
    workload = Workload(case.database, rate=15, seed=seed)
    thread = workload.start(seconds=seconds)
    case.window(start, Timestamp.from_ns(start.ns + int((seconds + 2) * 1e9)))
    log = case.file.parent / "run-0.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            case.command(*extra), env=case.env, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True,
        )
    try:
        yield workload, thread, log, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        workload.stop()
        progress.close()


def _until_batch(progress: _Progress, proc: subprocess.Popen[bytes], batch: int) -> None:
    """Wait until the run committed ``batch`` (or ended), at most 30 s."""
    began = time.monotonic()
    while progress.last() < batch and proc.poll() is None:
        assert time.monotonic() - began < 30, f"batch {batch} not committed within 30 s"
        time.sleep(0.05)


#: An outage longer than every retry budget of the change-stream reads (6 attempts with
#: backoff, then 3 batch retries: at most about 20 s against refused connections).
OUTAGE = 25.0


@pytest.mark.parametrize("store", ["sqlite", "spanner"])
def test_outage_past_the_retry_budget_fails_the_run_then_a_restart_resumes(
    spanner_emulator: Emulator, tmp_path: Path, store: str
) -> None:
    """Connections are refused for OUTAGE seconds in the middle of a run. The run either
    rides it out or exits non-zero with one error line; either way, once the network is
    back, a restart finishes with every change exactly once."""
    case = Case(spanner_emulator, tmp_path, store=store)
    progress = _Progress(case)
    with FaultProxy(spanner_emulator.host, lifetime=BUDGET + OUTAGE) as proxy:
        with _running_behind(proxy, case, progress, seed=3, seconds=8) as (
                workload, thread, log, proc):
            _until_batch(progress, proc, 2)
            cpu = cpu_end = _cpu_seconds(proc.pid)
            proxy.drop(OUTAGE)
            dropped = time.monotonic()
            while proc.poll() is None and time.monotonic() - dropped < OUTAGE:
                cpu_end = _cpu_seconds(proc.pid)  # the last reading while it lived
                time.sleep(0.05)
            failed_after = time.monotonic() - dropped
            code = proc.poll()
            recovered = None
            if code is None:  # rode it out: it must now go on, and finish, by itself
                stuck_at = progress.last()
                proxy.heal()
                healed = time.monotonic()
                while proc.poll() is None and progress.last() <= stuck_at:
                    assert time.monotonic() - healed < BUDGET, "no progress after the outage"
                    time.sleep(0.05)
                recovered = time.monotonic() - healed
                code = proc.wait(BUDGET)
            proxy.heal()
        error = _error_line(log) if code else ""
        print(f"\n[{store}] {OUTAGE:.0f}s outage at batch 2: exit {code}"
              + (f" {failed_after:.2f}s into it: {error}" if code else " (rode it out)")
              + f"; the run used {cpu_end - cpu:.1f}s of CPU during the outage"
              + (f"; next batch committed {recovered:.2f}s after the network returned"
                 if recovered is not None else ""))
        if code:
            restart = case.run()  # the network is back: the restart resumes to the end
            assert "end reached" in restart.stderr
    assert not thread.is_alive()
    checked = check_exactly_once(case, workload)
    print(f"[{store}] {checked} changes exactly once after the outage")
    assert checked > 30
    if store == "sqlite":
        # Only the change-stream reads cross the network: they give up, with a clear line.
        assert code == 1
        assert failed_after < OUTAGE
        assert "UNAVAILABLE" in error and "batch" in error


def _stop(proc: subprocess.Popen[bytes], log: Path, proxy: FaultProxy, during: str
          ) -> tuple[int, float, str]:
    """SIGTERM the run (alive) as a supervisor does ``during`` a fault, wait for it, then
    heal the network: its exit code, how long it took to stop, and its log."""
    assert proc.poll() is None, log.read_text()[-2000:]
    os.kill(proc.pid, signal.SIGTERM)
    signalled = time.monotonic()
    code = proc.wait(OUTAGE)
    stopped_after = time.monotonic() - signalled
    proxy.heal()
    print(f"\nSIGTERM during {during}: exit {code} after {stopped_after:.2f}s")
    return code, stopped_after, log.read_text()


@pytest.mark.parametrize("store", ["sqlite", "spanner"])
def test_sigterm_during_an_outage_stops_at_once_then_a_restart_resumes(
    spanner_emulator: Emulator, tmp_path: Path, store: str
) -> None:
    """A supervisor stops the run (SIGTERM) while Spanner refuses connections: the batch
    is being retried (SQLite store), or a store call is (Spanner store). The run stops
    within seconds as interrupted (exit 130), naming the batch the next run takes up,
    instead of spending its retries first (up to the store's 120 s) and exiting 1 with the
    outage's error; the restart finishes with every change exactly once."""
    case = Case(spanner_emulator, tmp_path, store=store)
    progress = _Progress(case)
    with (FaultProxy(spanner_emulator.host, lifetime=BUDGET + OUTAGE) as proxy,
          _running_behind(proxy, case, progress, seed=4, seconds=6,
                          extra=("--set", "retry_backoff=20s")) as (workload, thread, log,
                                                                   proc)):
        _until_batch(progress, proc, 2)
        proxy.drop(OUTAGE)
        dropped = time.monotonic()
        # in the batch's retries (a SQLite store), or 4 s into a store call's (Spanner)
        while ("retry 1/" not in log.read_text() and proc.poll() is None
               and (store == "sqlite" or time.monotonic() - dropped < 4)):
            assert time.monotonic() - dropped < OUTAGE, "no batch retry during the outage"
            time.sleep(0.05)
        code, stopped_after, text = _stop(proc, log, proxy, "the outage")
        assert code == 130, text[-2000:]
        assert stopped_after < 10  # the 20 s backoff and the other retries: not waited
        assert "stopping without retrying it" in text
        restart = case.run()  # the network is back: the restart resumes to the end
        assert "end reached" in restart.stderr
    assert not thread.is_alive()
    assert check_exactly_once(case, workload) > 20


def test_sigterm_while_spanner_stalls_gives_the_read_up_within_seconds(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    """A supervisor stops the run while Spanner holds its read without a word (a stall:
    the connection open, nothing on it), with the reader's own stall bound (60 s). The run
    gives the read up seconds after the stop instead of waiting out the stall and its
    retries, exits as interrupted, and the restart finishes with every change exactly
    once."""
    case = Case(spanner_emulator, tmp_path, store="sqlite")
    progress = _Progress(case)
    with (FaultProxy(spanner_emulator.host, lifetime=BUDGET + OUTAGE) as proxy,
          _running_behind(proxy, case, progress, seed=5, seconds=6,
                          query_timeout=None) as (workload, thread, log, proc)):
        _until_batch(progress, proc, 2)
        proxy.stall(OUTAGE + 20)
        time.sleep(3)  # batches run every second: one now waits in a stalled read
        code, stopped_after, text = _stop(proc, log, proxy, "a stall")
        assert code == 130, text[-2000:]
        assert stopped_after < 12, text[-2000:]  # 5 s of silence after the stop
        assert "and the run was asked to stop: the read is given up" in text
        restart = case.run()
        assert "end reached" in restart.stderr
    assert not thread.is_alive()
    assert check_exactly_once(case, workload) > 20


@pytest.mark.parametrize("store", ["sqlite", "spanner"])
def test_a_connection_that_dies_mid_run_is_replaced_and_the_run_finishes(
    spanner_emulator: Emulator, tmp_path: Path, store: str
) -> None:
    """At batch 2 every connection of the run goes dead for good (open, carrying nothing:
    a path that died without a word); new connections work. The run notices its calls
    passing their deadlines, opens new connections and finishes by itself (exit 0), every
    change exactly once; without that, every retry would go out on the dead connection."""
    case = Case(spanner_emulator, tmp_path, store=store)
    progress = _Progress(case)
    with FaultProxy(spanner_emulator.host, lifetime=BUDGET + 30) as proxy:
        with _running_behind(proxy, case, progress, seed=5, seconds=8) as (
                workload, thread, log, proc):
            _until_batch(progress, proc, 2)
            accepted = proxy.stats.accepted
            dead = proxy.blackhole()
            code = proc.wait(BUDGET)
        text = log.read_text()
        print(f"\n[{store}] {dead} connection(s) went dead at batch 2: exit {code}, "
              f"{proxy.stats.accepted - accepted} new connection(s), "
              f"{proxy.stats.blackholed_bytes} bytes into the void")
        assert code == 0, text[-3000:]
        assert dead >= 1
        assert proxy.stats.accepted > accepted
        assert "new connection" in text
    assert not thread.is_alive()
    assert check_exactly_once(case, workload) > 30
