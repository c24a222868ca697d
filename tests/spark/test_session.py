"""How the runner's Spark session starts: an abort while it starts ends the JVM too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark

PIPELINE = """
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream

T0 = 1_700_000_000 * 10**9
stream = ScriptedChangeStream("Orders", origin=T0)
pipeline = cf.Pipeline("aborted-start")
(pipeline
 | cf.DetectPartitions(stream="Orders", start_at=T0, end_at=T0 + 10**9, client=stream)
 | cf.ReadPartition() | cf.Collect())
"""


def _jvms_of(driver: int) -> list[int]:
    """The processes whose command line names the driver's Spark directories (its JVM)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == driver:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if f"cdcflow-spark-{driver}-".encode() in cmdline:
            found.append(int(name))
    return found


def test_a_second_signal_while_spark_starts_leaves_no_jvm(tmp_path: Path) -> None:
    """The second signal aborts while the JVM starts: the JVM it launched goes too (it
    was left running with no parent, for good, waiting for a Python side that was gone)."""
    path = tmp_path / "pipe.py"
    path.write_text(textwrap.dedent(PIPELINE))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "run", str(path), "--runner", "spark", "--master",
         "local[1]", "--metadata", "memory://"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _jvms_of(proc.pid):  # the JVM is launched: Spark is starting
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "again while the runner starts: aborting" in err, err
    deadline = time.monotonic() + 10
    while (left := _jvms_of(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:  # (leave nothing running, then fail)
        os.kill(pid, signal.SIGKILL)
    assert left == [], "the JVM outlived the aborted run"
