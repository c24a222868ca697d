"""Kill a run (SIGKILL) at every stage of a batch, restart it, and check exactly-once output."""

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


def _run(state: Path, kill: str | None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(SCRIPT), str(state), *([kill] if kill else [])]
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(
    ("stage", "points"),
    [
        ("planned", [2, 5, 9]),
        ("sinks", [2, 5, 9]),
        ("batch", [1, 6, 11]),
        ("task", [5, 80, 200]),  # the n-th record a restarted process reads
    ],
)
def test_killed_runs_resume_without_loss_or_duplicates(
    tmp_path: Path, stage: str, points: list[int]
) -> None:
    for point in points:
        killed = _run(tmp_path, f"{stage}:{point}")
        assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = _run(tmp_path, None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("end reached")

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
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_sigterm_stops_after_the_current_batch(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path), "live"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("batch "), proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
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
